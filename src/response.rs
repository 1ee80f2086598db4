//! Stored responses: what is kept of a first response, and how it is replayed.
//!
//! # Example
//!
//! ```
//! use bytes::Bytes;
//! use http::{HeaderMap, HeaderName, StatusCode};
//! use tower_idempotency::StoredResponse;
//!
//! let mut headers = HeaderMap::new();
//! headers.append("link", "</a>; rel=next".parse().unwrap());
//! headers.append("link", "</b>; rel=prev".parse().unwrap());
//! headers.append("set-cookie", "session=secret".parse().unwrap());
//! let stored = StoredResponse::capture(StatusCode::CREATED, &headers, Bytes::from_static(b"\xff\x00"), None);
//!
//! let decoded = StoredResponse::decode(&stored.encode()).unwrap();
//! assert_eq!(decoded, stored);
//!
//! let replay = decoded.replay(&HeaderName::from_static("idempotent-replayed"));
//! assert_eq!(replay.status(), StatusCode::CREATED);
//! assert_eq!(replay.headers().get_all("link").iter().count(), 2);
//! assert!(replay.headers().get("set-cookie").is_none());
//! assert_eq!(replay.headers()["content-length"], "2");
//! assert_eq!(replay.headers()["idempotent-replayed"], "true");
//! ```
//!
//! # What a replay holds
//!
//! The first response's status, every header field in order with its raw
//! bytes (a multi-valued field stays several fields), the body bytes and the
//! trailers. Not kept, so never replayed: the hop-by-hop fields of RFC 9110
//! §7.6.1 (`Connection`, `Keep-Alive`, `Transfer-Encoding`, `TE`, `Upgrade`,
//! `Proxy-*`), `Set-Cookie` (a session handed to the first caller is not handed
//! out again, and is not written to the store), `Content-Length` (recomputed
//! from the stored body) and the replay marker itself (so an inner service
//! cannot make a first response look like a replay).

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode, header};

/// A response as the store keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The first response's status.
    pub status: StatusCode,
    /// Header fields in the order they were sent, one entry per field line.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The body, or why it was not kept.
    pub body: StoredBody,
    /// Trailer fields, when the first response had any.
    pub trailers: Option<Vec<(HeaderName, HeaderValue)>>,
}

/// The body of a [`StoredResponse`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoredBody {
    /// The exact bytes.
    Complete(Bytes),
    /// The body was larger than the layer's response limit; only the status
    /// and headers were kept. A repeat is answered with the 410 problem
    /// [`crate::problem::Rejection::ResponseNotStored`], never by running the
    /// handler again.
    Omitted,
    /// The header fields, body and trailers of a record sealed at rest
    /// ([`crate::seal`]): the layer opens it before a replay. Its
    /// [`StoredResponse`] keeps the status and has no header or trailer
    /// fields of its own.
    Sealed(Bytes),
}

impl StoredBody {
    /// Whether this is a sealed record's body ([`StoredBody::Sealed`]).
    pub fn is_sealed(&self) -> bool {
        matches!(self, StoredBody::Sealed(_))
    }
}

/// A stored record could not be decoded: it is corrupt, or was written by an
/// incompatible version. The layer answers 503 and never replays it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError(&'static str);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stored response is corrupt: {}", self.0)
    }
}

impl std::error::Error for DecodeError {}

/// Whether a field of the first response is kept for replays.
fn is_kept(name: &HeaderName, marker: Option<&HeaderName>) -> bool {
    let hop_by_hop = matches!(
        name.as_str(),
        "connection" | "keep-alive" | "transfer-encoding" | "te" | "upgrade"
    ) || name.as_str().starts_with("proxy-");
    !hop_by_hop
        && name != header::SET_COOKIE
        && name != header::CONTENT_LENGTH
        && Some(name) != marker
}

fn fields(map: &HeaderMap, marker: Option<&HeaderName>) -> Vec<(HeaderName, HeaderValue)> {
    map.iter()
        .filter(|(name, _)| is_kept(name, marker))
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect()
}

const MAGIC: &[u8; 4] = b"TIR1";
const FLAG_OMITTED: u8 = 1;
const FLAG_TRAILERS: u8 = 2;
const FLAG_SEALED: u8 = 4;

impl StoredResponse {
    /// Keeps what a replay needs of a first response (see the module docs for
    /// what is left out).
    pub fn capture(
        status: StatusCode,
        headers: &HeaderMap,
        body: Bytes,
        trailers: Option<&HeaderMap>,
    ) -> Self {
        Self::capture_with_marker(status, headers, StoredBody::Complete(body), trailers, None)
    }

    pub(crate) fn capture_with_marker(
        status: StatusCode,
        headers: &HeaderMap,
        body: StoredBody,
        trailers: Option<&HeaderMap>,
        marker: Option<&HeaderName>,
    ) -> Self {
        StoredResponse {
            status,
            headers: fields(headers, marker),
            body,
            trailers: trailers.map(|t| fields(t, marker)),
        }
    }

    /// The replay: the stored response with `Content-Length` set to the body's
    /// length and `marker: true` added. Trailers, if any, follow the body.
    ///
    /// A record whose body was [`StoredBody::Omitted`] has no replay; this
    /// returns its status and headers with an empty body, and the layer answers
    /// with a problem instead. So does a [`StoredBody::Sealed`] one, which
    /// the layer opens first.
    pub fn replay(&self, marker: &HeaderName) -> Response<Bytes> {
        let body = match &self.body {
            StoredBody::Complete(bytes) => bytes.clone(),
            StoredBody::Omitted | StoredBody::Sealed(_) => Bytes::new(),
        };
        let len = body.len();
        let mut response = Response::new(body);
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        for (name, value) in &self.headers {
            headers.append(name.clone(), value.clone());
        }
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
        headers.insert(marker.clone(), HeaderValue::from_static("true"));
        response
    }

    /// The trailers as a map, for replay.
    pub fn trailer_map(&self) -> Option<HeaderMap> {
        self.trailers.as_ref().map(|t| {
            let mut map = HeaderMap::with_capacity(t.len());
            for (name, value) in t {
                map.append(name.clone(), value.clone());
            }
            map
        })
    }

    /// A compact, versioned binary encoding for stores that keep one blob.
    ///
    /// Layout: `TIR1`, status (u16), flags (u8: 1 the body was omitted, 2
    /// trailers follow, 4 the body is [`StoredBody::Sealed`]), the header
    /// fields, the body (u64 length and bytes), then the trailer fields if
    /// flagged. A field list is a u32 count and, per field, u32-length-prefixed
    /// name and value. All integers are big-endian.
    pub fn encode(&self) -> Vec<u8> {
        let body: &[u8] = match &self.body {
            StoredBody::Complete(b) | StoredBody::Sealed(b) => b,
            StoredBody::Omitted => &[],
        };
        let mut out = Vec::with_capacity(64 + body.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.status.as_u16().to_be_bytes());
        let mut flags = 0;
        if self.body == StoredBody::Omitted {
            flags |= FLAG_OMITTED;
        }
        if self.trailers.is_some() {
            flags |= FLAG_TRAILERS;
        }
        if self.body.is_sealed() {
            flags |= FLAG_SEALED;
        }
        out.push(flags);
        encode_fields(&mut out, &self.headers);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
        out.extend_from_slice(body);
        if let Some(trailers) = &self.trailers {
            encode_fields(&mut out, trailers);
        }
        out
    }

    /// Decodes [`StoredResponse::encode`]'s output. Never panics, whatever
    /// the input, and allocates in proportion to it: a field count is checked
    /// against the bytes left (a field takes at least 8) before its list is
    /// reserved, and a length before its bytes are copied, so a hostile count
    /// or length is an error, not a large allocation. The largest single
    /// allocation is one list entry (a `(HeaderName, HeaderValue)`, 72 bytes
    /// on 64-bit targets) per 8 input bytes, and the body's copy.
    pub fn decode(input: &[u8]) -> Result<Self, DecodeError> {
        Self::decode_with(input, |body| Bytes::copy_from_slice(&input[body]))
    }

    /// [`StoredResponse::decode`] of an encoding already in a [`Bytes`]: the
    /// body is a slice of `input`, not a copy, so a large replay costs no
    /// second copy of its body (it keeps `input`'s buffer alive while it is
    /// held).
    pub fn decode_bytes(input: Bytes) -> Result<Self, DecodeError> {
        Self::decode_with(&input, |body| input.slice(body))
    }

    fn decode_with(
        input: &[u8],
        body: impl FnOnce(std::ops::Range<usize>) -> Bytes,
    ) -> Result<Self, DecodeError> {
        let mut r = Reader(input);
        if r.take(4)? != MAGIC {
            return Err(DecodeError("unknown format"));
        }
        let status = StatusCode::from_u16(u16::from_be_bytes(r.array()?))
            .map_err(|_| DecodeError("invalid status"))?;
        let flags = r.take(1)?[0];
        if flags & !(FLAG_OMITTED | FLAG_TRAILERS | FLAG_SEALED) != 0 {
            return Err(DecodeError("unknown flags"));
        }
        if flags & FLAG_OMITTED != 0 && flags & FLAG_SEALED != 0 {
            return Err(DecodeError("a sealed body cannot be omitted"));
        }
        let headers = decode_fields(&mut r)?;
        let len = u64::from_be_bytes(r.array()?);
        let len = usize::try_from(len).map_err(|_| DecodeError("body length"))?;
        let start = input.len() - r.0.len();
        r.take(len)?;
        let trailers = if flags & FLAG_TRAILERS != 0 {
            Some(decode_fields(&mut r)?)
        } else {
            None
        };
        if !r.0.is_empty() {
            return Err(DecodeError("trailing bytes"));
        }
        let bytes = body(start..start + len);
        let body = if flags & FLAG_OMITTED != 0 {
            StoredBody::Omitted
        } else if flags & FLAG_SEALED != 0 {
            StoredBody::Sealed(bytes)
        } else {
            StoredBody::Complete(bytes)
        };
        Ok(StoredResponse {
            status,
            headers,
            body,
            trailers,
        })
    }
}

fn encode_fields(out: &mut Vec<u8>, fields: &[(HeaderName, HeaderValue)]) {
    out.extend_from_slice(&(fields.len() as u32).to_be_bytes());
    for (name, value) in fields {
        for part in [name.as_str().as_bytes(), value.as_bytes()] {
            out.extend_from_slice(&(part.len() as u32).to_be_bytes());
            out.extend_from_slice(part);
        }
    }
}

fn decode_fields(r: &mut Reader<'_>) -> Result<Vec<(HeaderName, HeaderValue)>, DecodeError> {
    let count = u32::from_be_bytes(r.array()?) as usize;
    // Every field takes at least 8 bytes: a count larger than that is corrupt,
    // and checking it first keeps the allocation bounded by the input.
    if count > r.0.len() / 8 {
        return Err(DecodeError("field count"));
    }
    let mut fields = Vec::with_capacity(count);
    for _ in 0..count {
        let name = r.chunk()?;
        let value = r.chunk()?;
        let name = HeaderName::from_bytes(name).map_err(|_| DecodeError("field name"))?;
        let value = HeaderValue::from_bytes(value).map_err(|_| DecodeError("field value"))?;
        fields.push((name, value));
    }
    Ok(fields)
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if n > self.0.len() {
            return Err(DecodeError("truncated"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn chunk(&mut self) -> Result<&'a [u8], DecodeError> {
        let len = u32::from_be_bytes(self.array()?) as usize;
        self.take(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> StoredResponse {
        let mut headers = HeaderMap::new();
        headers.append("link", "</a>; rel=next".parse().unwrap());
        headers.append("link", "</b>; rel=prev".parse().unwrap());
        headers.append(
            "content-disposition",
            r#"attachment; filename="a,b.txt""#.parse().unwrap(),
        );
        headers.append("x-raw", HeaderValue::from_bytes(b"caf\xe9").unwrap());
        headers.append("connection", "close".parse().unwrap());
        headers.append("content-length", "3".parse().unwrap());
        headers.append("idempotent-replayed", "true".parse().unwrap());
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", "0".parse().unwrap());
        StoredResponse::capture_with_marker(
            StatusCode::CREATED,
            &headers,
            StoredBody::Complete(Bytes::from_static(b"\xff\x00\xfe")),
            Some(&trailers),
            Some(&HeaderName::from_static("idempotent-replayed")),
        )
    }

    #[test]
    fn capture_keeps_order_and_drops_hop_by_hop() {
        let s = sample();
        let names: Vec<_> = s.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["link", "link", "content-disposition", "x-raw"]);
        assert_eq!(s.headers[3].1.as_bytes(), b"caf\xe9");
    }

    #[test]
    fn encoding_round_trips() {
        let s = sample();
        assert_eq!(StoredResponse::decode(&s.encode()).unwrap(), s);
        let mut omitted = s.clone();
        omitted.body = StoredBody::Omitted;
        omitted.trailers = None;
        assert_eq!(StoredResponse::decode(&omitted.encode()).unwrap(), omitted);
        let mut sealed = s.clone();
        sealed.body = StoredBody::Sealed(Bytes::from_static(b"\x01opaque"));
        let bytes = sealed.encode();
        assert_eq!(bytes[6], FLAG_TRAILERS | FLAG_SEALED);
        assert_eq!(StoredResponse::decode(&bytes).unwrap(), sealed);
        let mut both = bytes.clone();
        both[6] |= FLAG_OMITTED;
        assert_eq!(
            StoredResponse::decode(&both),
            Err(DecodeError("a sealed body cannot be omitted"))
        );
    }

    #[test]
    fn every_truncation_and_corruption_is_an_error() {
        let bytes = sample().encode();
        for n in 0..bytes.len() {
            assert!(StoredResponse::decode(&bytes[..n]).is_err(), "prefix {n}");
        }
        let mut extra = bytes.clone();
        extra.push(0);
        assert!(StoredResponse::decode(&extra).is_err());
        let mut huge_count = bytes.clone();
        huge_count[7..11].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(StoredResponse::decode(&huge_count).is_err());
        for n in 0..bytes.len() {
            let prefix = Bytes::copy_from_slice(&bytes[..n]);
            assert!(StoredResponse::decode_bytes(prefix).is_err(), "prefix {n}");
        }
        assert!(StoredResponse::decode_bytes(Bytes::from(huge_count)).is_err());
    }

    #[test]
    fn decode_bytes_slices_the_body_out_of_its_input() {
        let s = sample();
        let encoded = Bytes::from(s.encode());
        let decoded = StoredResponse::decode_bytes(encoded.clone()).unwrap();
        assert_eq!(decoded, s);
        let StoredBody::Complete(body) = &decoded.body else {
            panic!("{:?}", decoded.body)
        };
        let within = encoded.as_ptr_range();
        assert!(within.contains(&body.as_ptr()), "the body was copied");
        assert_eq!(&body[..], b"\xff\x00\xfe");
    }
}
