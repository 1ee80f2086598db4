//! Request fingerprints: what makes two requests "the same request".
//!
//! # Example
//!
//! ```
//! use bytes::Bytes;
//! use tower_idempotency::fingerprint::{DefaultFingerprinter, Fingerprinter, JsonFingerprinter};
//!
//! let (parts, ()) = http::Request::post("/payments?currency=eur").body(()).unwrap().into_parts();
//! let default = DefaultFingerprinter::new();
//! let a = default.fingerprint(&parts, &Bytes::from_static(br#"{"amount":5,"to":"bob"}"#)).unwrap();
//! let b = default.fingerprint(&parts, &Bytes::from_static(br#"{ "to": "bob", "amount": 5 }"#)).unwrap();
//! assert_ne!(a, b, "the default fingerprint is over the exact bytes");
//!
//! let json = JsonFingerprinter::new();
//! let a = json.fingerprint(&parts, &Bytes::from_static(br#"{"amount":5,"to":"bob"}"#)).unwrap();
//! let b = json.fingerprint(&parts, &Bytes::from_static(br#"{ "to": "bob", "amount": 5 }"#)).unwrap();
//! assert_eq!(a, b, "canonical JSON ignores key order and whitespace");
//! ```
//!
//! A key reused with a different fingerprint is answered with 422 (IETF draft
//! `draft-ietf-httpapi-idempotency-key-header` §2.7). Every fingerprinter here
//! covers the method and the path with its query, so a key reused on another
//! endpoint or with another query string is a mismatch too.
//!
//! The hash is SHA-256 over length-prefixed parts, so no two different
//! requests frame to the same input (`/a` + body `b/c` never collides with
//! `/ab` + body `/c`). It is computed over the whole buffered body, so it does
//! not depend on how the body arrived in frames.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use http::HeaderName;
use http::request::Parts;
use sha2::{Digest, Sha256};

/// A request's fingerprint: a SHA-256 digest (32 bytes).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

/// Why a fingerprint could not be computed. The layer answers 400.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FingerprintError(pub String);

impl fmt::Display for FingerprintError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for FingerprintError {}

/// Computes a request's [`Fingerprint`] from its head and its buffered body.
///
/// Implemented by [`DefaultFingerprinter`], [`JsonFingerprinter`] and by every
/// `Fn(&Parts, &Bytes) -> Result<Fingerprint, FingerprintError>` closure (use
/// [`Hasher`] inside it for framing that cannot collide).
pub trait Fingerprinter: Send + Sync + 'static {
    /// The fingerprint of one request.
    fn fingerprint(&self, parts: &Parts, body: &Bytes) -> Result<Fingerprint, FingerprintError>;
}

impl<F> Fingerprinter for F
where
    F: Fn(&Parts, &Bytes) -> Result<Fingerprint, FingerprintError> + Send + Sync + 'static,
{
    fn fingerprint(&self, parts: &Parts, body: &Bytes) -> Result<Fingerprint, FingerprintError> {
        self(parts, body)
    }
}

/// SHA-256 with unambiguous framing: every part is preceded by its length.
#[derive(Clone)]
pub struct Hasher(Sha256);

impl Hasher {
    /// A hasher whose input starts with `domain` (a name and version for the
    /// scheme, so that two schemes never produce the same digest).
    pub fn new(domain: &str) -> Self {
        let mut hasher = Hasher(Sha256::new());
        hasher.part(domain.as_bytes());
        hasher
    }

    /// Adds one part: its length (8 bytes, big-endian), then its bytes.
    pub fn part(&mut self, bytes: &[u8]) -> &mut Self {
        self.0.update((bytes.len() as u64).to_be_bytes());
        self.0.update(bytes);
        self
    }

    /// Adds the method and the path with its query.
    pub fn request_target(&mut self, parts: &Parts) -> &mut Self {
        self.part(parts.method.as_str().as_bytes());
        let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
        self.part(target.as_bytes())
    }

    /// The digest.
    pub fn finish(self) -> Fingerprint {
        Fingerprint(self.0.finalize().into())
    }
}

/// The default: SHA-256 over the method, the path and query, the named request
/// headers (none unless you add some) and the exact body bytes.
#[derive(Debug, Clone, Default)]
pub struct DefaultFingerprinter {
    headers: Arc<[HeaderName]>,
}

impl DefaultFingerprinter {
    /// Method, path and query, and body.
    pub fn new() -> Self {
        Self::default()
    }

    /// Also covers these request headers (every value of each, in order); a
    /// header that is absent counts as absent, not as empty.
    #[must_use]
    pub fn with_headers<I: IntoIterator<Item = HeaderName>>(headers: I) -> Self {
        DefaultFingerprinter {
            headers: headers.into_iter().collect(),
        }
    }
}

impl Fingerprinter for DefaultFingerprinter {
    fn fingerprint(&self, parts: &Parts, body: &Bytes) -> Result<Fingerprint, FingerprintError> {
        let mut hasher = Hasher::new("tower-idempotency/default/v1");
        hasher.request_target(parts);
        hasher.part(&(self.headers.len() as u64).to_be_bytes());
        for name in self.headers.iter() {
            hasher.part(name.as_str().as_bytes());
            let values = parts.headers.get_all(name);
            hasher.part(&(values.iter().count() as u64).to_be_bytes());
            for value in values {
                hasher.part(value.as_bytes());
            }
        }
        hasher.part(body);
        Ok(hasher.finish())
    }
}

/// SHA-256 over the method, the path and query, and the body as canonical JSON:
/// object keys sorted, no insignificant whitespace. Two bodies that differ only
/// in key order or spacing are one request.
///
/// Numbers keep their written form's value as `serde_json` reads it, so `1`
/// and `1.0` differ. Floats are read with correct rounding (serde_json's
/// `float_roundtrip`), so two spellings of one double are one request and the
/// canonical form reads back to itself. A body that is not JSON is answered
/// with 400.
///
/// [`JsonFingerprinter::fields`] narrows the fingerprint to selected values,
/// in the manner of AWS Lambda Powertools' `payload_validation_jmespath`.
#[derive(Debug, Clone, Default)]
pub struct JsonFingerprinter {
    pointers: Option<Arc<[String]>>,
}

impl JsonFingerprinter {
    /// The whole body.
    pub fn new() -> Self {
        Self::default()
    }

    /// Only the values at these JSON Pointers (RFC 6901), e.g.
    /// `["/amount", "/currency"]`. A missing value counts as absent, which
    /// differs from `null`.
    #[must_use]
    pub fn fields<I, P>(pointers: I) -> Self
    where
        I: IntoIterator<Item = P>,
        P: Into<String>,
    {
        JsonFingerprinter {
            pointers: Some(pointers.into_iter().map(Into::into).collect()),
        }
    }
}

impl Fingerprinter for JsonFingerprinter {
    fn fingerprint(&self, parts: &Parts, body: &Bytes) -> Result<Fingerprint, FingerprintError> {
        let value: serde_json::Value = serde_json::from_slice(body)
            .map_err(|e| FingerprintError(format!("the request body is not JSON: {e}")))?;
        let mut hasher = Hasher::new("tower-idempotency/json/v1");
        hasher.request_target(parts);
        match &self.pointers {
            None => {
                hasher.part(&canonical_json(&value));
            }
            Some(pointers) => {
                for pointer in pointers.iter() {
                    hasher.part(pointer.as_bytes());
                    match value.pointer(pointer) {
                        Some(v) => hasher.part(b"present").part(&canonical_json(v)),
                        None => hasher.part(b"absent"),
                    };
                }
            }
        }
        Ok(hasher.finish())
    }
}

/// `value` as compact JSON with every object's keys sorted by their bytes.
///
/// The sorting is done here rather than left to `serde_json::Map`, whose
/// order depends on whether any crate in the build enables serde_json's
/// `preserve_order` feature.
///
/// Public but hidden, and not part of the API: the fuzz checks
/// (`integration/tests/fuzz_checks`) assert that it is a fixed point.
#[doc(hidden)]
pub fn canonical_json(value: &serde_json::Value) -> Vec<u8> {
    fn write(value: &serde_json::Value, out: &mut Vec<u8>) {
        match value {
            serde_json::Value::Object(map) => {
                let mut entries: Vec<_> = map.iter().collect();
                entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
                out.push(b'{');
                for (i, (key, value)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    write_scalar(&serde_json::Value::String(key.clone()), out);
                    out.push(b':');
                    write(value, out);
                }
                out.push(b'}');
            }
            serde_json::Value::Array(items) => {
                out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    write(item, out);
                }
                out.push(b']');
            }
            scalar => write_scalar(scalar, out),
        }
    }
    fn write_scalar(value: &serde_json::Value, out: &mut Vec<u8>) {
        // Writing a scalar to a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, value);
    }
    let mut out = Vec::new();
    write(value, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(method: &str, uri: &str) -> Parts {
        http::Request::builder()
            .method(method)
            .uri(uri)
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    fn fp(f: &impl Fingerprinter, method: &str, uri: &str, body: &'static [u8]) -> Fingerprint {
        f.fingerprint(&parts(method, uri), &Bytes::from_static(body))
            .unwrap()
    }

    #[test]
    fn default_covers_method_path_query_and_body() {
        let f = DefaultFingerprinter::new();
        let base = fp(&f, "POST", "/a?x=1", b"body");
        assert_eq!(base, fp(&f, "POST", "/a?x=1", b"body"));
        assert_ne!(base, fp(&f, "PATCH", "/a?x=1", b"body"));
        assert_ne!(base, fp(&f, "POST", "/b?x=1", b"body"));
        assert_ne!(base, fp(&f, "POST", "/a?x=2", b"body"));
        assert_ne!(base, fp(&f, "POST", "/a?x=1", b"bodY"));
    }

    #[test]
    fn framing_is_unambiguous() {
        let f = DefaultFingerprinter::new();
        assert_ne!(fp(&f, "POST", "/a", b"b/c"), fp(&f, "POST", "/ab", b"/c"));
    }

    #[test]
    fn named_headers_are_covered() {
        let f = DefaultFingerprinter::with_headers([HeaderName::from_static("x-tenant")]);
        let mut one = parts("POST", "/a");
        one.headers.insert("x-tenant", "t1".parse().unwrap());
        let mut two = parts("POST", "/a");
        two.headers.insert("x-tenant", "t2".parse().unwrap());
        let body = Bytes::from_static(b"{}");
        assert_ne!(
            f.fingerprint(&one, &body).unwrap(),
            f.fingerprint(&two, &body).unwrap()
        );
        // Headers not named do not matter.
        let mut three = one.clone();
        three.headers.insert("x-other", "1".parse().unwrap());
        assert_eq!(
            f.fingerprint(&one, &body).unwrap(),
            f.fingerprint(&three, &body).unwrap()
        );
    }

    #[test]
    fn json_ignores_order_and_whitespace_but_not_values() {
        let f = JsonFingerprinter::new();
        let a = fp(&f, "POST", "/p", br#"{"a":1,"b":[1,2]}"#);
        assert_eq!(a, fp(&f, "POST", "/p", b"{ \"b\" : [1, 2],\n \"a\": 1 }"));
        assert_ne!(a, fp(&f, "POST", "/p", br#"{"a":2,"b":[1,2]}"#));
        assert_ne!(a, fp(&f, "POST", "/p", br#"{"a":1,"b":[2,1]}"#));
        assert_ne!(a, fp(&f, "POST", "/q", br#"{"a":1,"b":[1,2]}"#));
        assert!(
            f.fingerprint(&parts("POST", "/p"), &Bytes::from_static(b"{no"))
                .is_err()
        );
    }

    #[test]
    fn canonical_json_sorts_keys_at_every_depth() {
        let v: serde_json::Value =
            serde_json::from_str(r#"{"b":{"y":1,"x":[{"d":1,"c":2}]},"a":"\u00e9\"q"}"#).unwrap();
        assert_eq!(
            String::from_utf8(canonical_json(&v)).unwrap(),
            r#"{"a":"é\"q","b":{"x":[{"c":2,"d":1}],"y":1}}"#
        );
    }

    #[test]
    fn canonical_json_is_a_fixed_point_for_floats() {
        // Found by fuzz/run (target fingerprint): without serde_json's
        // float_roundtrip, the canonical text of this number read back as
        // 1.844674420737095e20, so canonicalising twice changed the bytes.
        let v: serde_json::Value = serde_json::from_str("184467442073709551615").unwrap();
        let once = canonical_json(&v);
        assert_eq!(once, b"1.8446744207370954e+20");
        let again: serde_json::Value = serde_json::from_slice(&once).unwrap();
        assert_eq!(canonical_json(&again), once);
        let f = JsonFingerprinter::new();
        assert_eq!(
            fp(&f, "POST", "/n", b"184467442073709551615"),
            fp(&f, "POST", "/n", b"1.8446744207370954e20")
        );
    }

    #[test]
    fn json_fields_select_what_matters() {
        let f = JsonFingerprinter::fields(["/amount"]);
        let a = fp(&f, "POST", "/p", br#"{"amount":5,"note":"x"}"#);
        assert_eq!(a, fp(&f, "POST", "/p", br#"{"note":"y","amount":5}"#));
        assert_ne!(a, fp(&f, "POST", "/p", br#"{"amount":6,"note":"x"}"#));
        assert_ne!(
            fp(&f, "POST", "/p", br#"{"amount":null}"#),
            fp(&f, "POST", "/p", br#"{}"#)
        );
    }

    #[test]
    fn closures_are_fingerprinters() {
        let f = |parts: &Parts, _body: &Bytes| {
            let mut h = Hasher::new("mine");
            h.request_target(parts);
            Ok(h.finish())
        };
        assert_eq!(fp(&f, "POST", "/a", b"1"), fp(&f, "POST", "/a", b"2"));
    }
}
