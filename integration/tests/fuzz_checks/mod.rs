//! The properties the fuzz targets check, one `check_*` function per target.
//!
//! Shared by two builds: the libFuzzer targets in `fuzz/fuzz_targets/`
//! include this file with `#[path]`, and `integration/tests/stores/fuzz_corpus.rs` replays every
//! committed corpus input through it in the normal `cargo test`. Each check
//! takes the raw input bytes and panics when a property does not hold.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::fmt::Write as _;

use arbitrary::Unstructured;
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, Uri, header};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tower_idempotency::fingerprint::{
    DefaultFingerprinter, Fingerprint, Fingerprinter, Hasher, JsonFingerprinter, canonical_json,
};
use tower_idempotency::key::{KeyError, MAX_KEY_LEN, parse_key, parse_value};
use tower_idempotency::{StoredBody, StoredResponse};

// ---------------------------------------------------------------------------
// Allocation accounting

/// The global allocator of every binary that runs these checks: the system
/// allocator, recording per thread the largest single request (allocation or
/// reallocation) made while [`largest_allocation_during`] measures.
///
/// A single request above [`HARD_LIMIT`] aborts the process. On stable Rust
/// there is no sanitizer runtime, so libFuzzer's `-malloc_limit_mb` has no
/// malloc hooks to act on; this is the check that stands in for it.
pub struct CountingAlloc;

/// The largest single allocation any check may request: 64 MiB.
pub const HARD_LIMIT: usize = 64 << 20;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    if size > HARD_LIMIT {
        std::process::abort();
    }
    // `try_with`: the slot may be gone while the thread is being torn down.
    let _ = LARGEST.try_with(|largest| {
        if size > largest.get() {
            largest.set(size);
        }
    });
}

// SAFETY: every call is forwarded unchanged to `System`; `note` only reads a
// size and touches a const-initialised thread-local `Cell`, which does not
// allocate.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's contract for `alloc` is passed on as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Runs `f` and returns its result with the largest single allocation, in
/// bytes, that it requested on this thread.
pub fn largest_allocation_during<R>(f: impl FnOnce() -> R) -> (R, usize) {
    LARGEST.with(|largest| largest.set(0));
    let result = f();
    (result, LARGEST.with(Cell::get))
}

/// Fails unless [`CountingAlloc`] is this binary's global allocator, so that
/// an allocation bound can never pass for want of measuring.
fn assert_allocations_are_counted() {
    let (boxed, largest) = largest_allocation_during(|| std::hint::black_box(vec![0u8; 4096]));
    drop(boxed);
    assert!(
        largest >= 4096,
        "CountingAlloc is not the #[global_allocator] of this binary"
    );
}

// ---------------------------------------------------------------------------
// Target `key`: the Idempotency-Key field (src/key.rs)

/// `key` as an RFC 9651 sf-string (§4.1.6): quoted, `"` and `\` escaped.
fn sf_string(key: &[u8]) -> Vec<u8> {
    let mut out = vec![b'"'];
    for &b in key {
        if b == b'"' || b == b'\\' {
            out.push(b'\\');
        }
        out.push(b);
    }
    out.push(b'"');
    out
}

/// Whether a bare value is an RFC 9651 bare item that src/key.rs refuses
/// (`KeyError::NotAString`): a Date (§3.3.7), a Display String (§3.3.8), a
/// Byte Sequence (§3.3.5) or a Boolean (§3.3.6). Written apart from the
/// parser's own test, over text.
fn refused_bare_item(value: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(value) else {
        return false;
    };
    if let Some(date) = text.strip_prefix('@') {
        let digits = date.strip_prefix('-').unwrap_or(date);
        return !digits.is_empty()
            && digits.len() <= 15
            && digits.chars().all(|c| c.is_ascii_digit());
    }
    if let Some(bytes) = text.strip_prefix(':').and_then(|t| t.strip_suffix(':')) {
        return bytes
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+/=".contains(c));
    }
    text.starts_with("%\"") || text == "?0" || text == "?1"
}

/// Optional whitespace around a field value (RFC 9110 §5.5): spaces and tabs.
fn trim_ows(mut raw: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = raw {
        raw = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = raw {
        raw = rest;
    }
    raw
}

/// The whole input is one field value; split at `\n` it is also the lines of
/// a repeated field.
pub fn check_key(data: &[u8]) {
    let parsed = parse_value(data);

    // The rules of src/key.rs, checked from outside.
    if let Ok(key) = &parsed {
        assert!((1..=MAX_KEY_LEN).contains(&key.len()), "{key:?}");
        assert!(key.bytes().all(|b| (0x20..=0x7e).contains(&b)), "{key:?}");
        // An sf-string of the key names the same key.
        assert_eq!(parse_value(&sf_string(key.as_bytes())).as_ref(), Ok(key));
    }
    if data
        .iter()
        .any(|&b| !(0x20..=0x7e).contains(&b) && b != b'\t')
    {
        assert_eq!(parsed, Err(KeyError::NotPrintableAscii));
    }
    let value = trim_ows(data);
    match value.first() {
        None => assert_eq!(parsed, Err(KeyError::Empty)),
        // Only `\"` and `\\` are escapes, so a key has exactly one sf-string:
        // an accepted quoted value is that string, byte for byte.
        Some(b'"') => {
            if let Ok(key) = &parsed {
                assert_eq!(sf_string(key.as_bytes()), value);
            }
        }
        // A bare key of token-safe printable ASCII is the key itself, unless
        // it is a structured item of a type that is refused.
        Some(_) => {
            let bare = value
                .iter()
                .all(|&b| (0x21..=0x7e).contains(&b) && !matches!(b, b'"' | b'\\' | b',' | b';'));
            if bare {
                let expected = if refused_bare_item(value) {
                    Err(KeyError::NotAString)
                } else if value.len() <= MAX_KEY_LEN {
                    Ok(String::from_utf8(value.to_vec()).unwrap())
                } else {
                    Err(KeyError::TooLong)
                };
                assert_eq!(parsed, expected);
            }
            let printable = data
                .iter()
                .all(|&b| (0x20..=0x7e).contains(&b) || b == b'\t');
            if printable && value.starts_with(b"%\"") {
                assert_eq!(parsed, Err(KeyError::NotAString));
            }
        }
    }
    // Whitespace around the value is never key material.
    let mut padded = b" \t".to_vec();
    padded.extend_from_slice(data);
    padded.extend_from_slice(b"\t ");
    assert_eq!(parse_value(&padded), parsed);

    // The input taken as a key: if it is one, its sf-string parses back to it.
    if (1..=MAX_KEY_LEN).contains(&data.len()) && data.iter().all(|b| (0x20..=0x7e).contains(b)) {
        let key = String::from_utf8(data.to_vec()).unwrap();
        assert_eq!(parse_value(&sf_string(data)), Ok(key));
    }

    // The field over a HeaderMap: absent, once, or repeated.
    let mut headers = HeaderMap::new();
    let mut lines = Vec::new();
    for line in data.split(|&b| b == b'\n') {
        if let Ok(value) = HeaderValue::from_bytes(line) {
            headers.append("x-unrelated", value.clone());
            headers.append("idempotency-key", value.clone());
            lines.push(value);
        }
    }
    let expected = match lines.as_slice() {
        [] => Ok(None),
        [one] => parse_value(one.as_bytes()).map(Some),
        _ => Err(KeyError::Repeated),
    };
    assert_eq!(parse_key(&headers, "idempotency-key"), expected);
    // Field names are case-insensitive (RFC 9110 §5.1).
    assert_eq!(parse_key(&headers, "Idempotency-Key"), expected);
    assert_eq!(parse_key(&HeaderMap::new(), "idempotency-key"), Ok(None));
}

// ---------------------------------------------------------------------------
// Target `fingerprint`: framing and canonical JSON (src/fingerprint.rs)

/// The input is `control 0xFF target 0xFF body`: the control bytes drive the
/// choices below (through `arbitrary`), `target` is the request's URI and the
/// body is the rest (it may hold 0xFF). The framing check splits the whole
/// input into parts.
pub fn check_fingerprint(data: &[u8]) {
    let mut sections = data.splitn(3, |&b| b == 0xff);
    let control = sections.next().unwrap_or_default();
    let target = sections.next().unwrap_or_default();
    let body = sections.next().unwrap_or_default();
    let mut u = Unstructured::new(control);
    check_framing(&mut u, data);
    let parts = request_parts(&mut u, target);
    check_default_fingerprint(&parts, body);
    check_json_fingerprint(&mut u, &parts, body);
}

/// Up to 6 cut points in `0..=len`, sorted; a repeated point is an empty part.
fn cut_points(u: &mut Unstructured, len: usize) -> Vec<usize> {
    let n = u.int_in_range(0..=6).unwrap_or(0);
    let mut cuts: Vec<usize> = (0..n)
        .map(|_| u.int_in_range(0..=len).unwrap_or(0))
        .collect();
    cuts.sort_unstable();
    cuts
}

fn split_at_points<'a>(whole: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut parts = Vec::with_capacity(cuts.len() + 1);
    let mut start = 0;
    for &cut in cuts {
        parts.push(&whole[start..cut]);
        start = cut;
    }
    parts.push(&whole[start..]);
    parts
}

/// The framing `Hasher` documents: each part preceded by its length as 8
/// bytes, big-endian.
fn frame(parts: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    for part in parts {
        out.extend_from_slice(&(part.len() as u64).to_be_bytes());
        out.extend_from_slice(part);
    }
    out
}

/// The inverse of [`frame`]: it exists, so the framing is injective.
fn unframe(mut framed: &[u8]) -> Vec<&[u8]> {
    let mut parts = Vec::new();
    while !framed.is_empty() {
        let (len, rest) = framed.split_at(8);
        let len = usize::try_from(u64::from_be_bytes(len.try_into().unwrap())).unwrap();
        let (part, rest) = rest.split_at(len);
        parts.push(part);
        framed = rest;
    }
    parts
}

fn hash(domain: &str, parts: &[&[u8]]) -> Fingerprint {
    let mut hasher = Hasher::new(domain);
    for part in parts {
        hasher.part(part);
    }
    hasher.finish()
}

/// Two splits of the same bytes (`["ab", "c"]` against `["a", "bc"]`) hash
/// alike exactly when they are the same sequence of parts.
fn check_framing(u: &mut Unstructured, whole: &[u8]) {
    const DOMAINS: [&str; 3] = ["", "d", "tower-idempotency/default/v1"];
    let mut sides = Vec::new();
    for _ in 0..2 {
        let domain = *u.choose(&DOMAINS).unwrap_or(&"");
        let parts = split_at_points(whole, &cut_points(u, whole.len()));
        let fingerprint = hash(domain, &parts);
        let mut all = vec![domain.as_bytes()];
        all.extend_from_slice(&parts);
        let framed = frame(&all);
        assert_eq!(
            fingerprint,
            Fingerprint(Sha256::digest(&framed).into()),
            "Hasher is SHA-256 over the length-prefixed domain and parts"
        );
        assert_eq!(unframe(&framed), all);
        sides.push((all, fingerprint));
    }
    let [(a, fa), (b, fb)] = [sides.remove(0), sides.remove(0)];
    assert_eq!(fa == fb, a == b, "{a:?} against {b:?}");
}

fn request_parts(u: &mut Unstructured, target: &[u8]) -> Parts {
    let methods = [
        Method::POST,
        Method::PATCH,
        Method::PUT,
        Method::GET,
        Method::from_bytes(b"PURGE").unwrap(),
    ];
    let (mut parts, ()) = Request::new(()).into_parts();
    parts.method = u.choose(&methods).cloned().unwrap_or(Method::POST);
    parts.uri = Uri::try_from(target).unwrap_or_else(|_| Uri::from_static("/"));
    for _ in 0..u.int_in_range(0..=3).unwrap_or(0) {
        let raw: &[u8] = u.arbitrary().unwrap_or_default();
        if let Ok(value) = HeaderValue::from_bytes(raw) {
            parts.headers.append("x-a", value);
        }
    }
    parts
}

fn check_default_fingerprint(parts: &Parts, body: &[u8]) {
    let body = Bytes::copy_from_slice(body);
    let named = DefaultFingerprinter::with_headers([
        HeaderName::from_static("x-a"),
        HeaderName::from_static("x-b"),
    ]);
    let of = |parts: &Parts, body: &Bytes| named.fingerprint(parts, body).unwrap();
    let fingerprint = of(parts, &body);
    assert_eq!(of(parts, &body), fingerprint, "deterministic");

    // A field it does not name does not matter.
    let mut other = parts.clone();
    other
        .headers
        .append("x-unnamed", HeaderValue::from_static("1"));
    assert_eq!(of(&other, &body), fingerprint);
    // A named field that is absent is not an empty one.
    let mut empty = parts.clone();
    empty.headers.append("x-b", HeaderValue::from_static(""));
    assert_ne!(of(&empty, &body), fingerprint);
    // Two field lines are not their concatenation.
    let values: Vec<&[u8]> = parts
        .headers
        .get_all("x-a")
        .iter()
        .map(HeaderValue::as_bytes)
        .collect();
    if let [first, second, rest @ ..] = values.as_slice() {
        let mut merged = parts.clone();
        merged.headers.remove("x-a");
        let joined = [*first, *second].concat();
        merged
            .headers
            .append("x-a", HeaderValue::from_bytes(&joined).unwrap());
        for value in rest {
            merged
                .headers
                .append("x-a", HeaderValue::from_bytes(value).unwrap());
        }
        assert_ne!(of(&merged, &body), fingerprint);
    }
    // A byte moved from the end of the target to the body is another request.
    // (Bytes, not chars: http's Uri lets non-ASCII through in the path.)
    let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    if target.len() > 1 {
        let (head, last) = target.as_bytes().split_at(target.len() - 1);
        if let Ok(uri) = Uri::try_from(head)
            && uri.path_and_query().map(|pq| pq.as_str().as_bytes()) == Some(head)
        {
            let mut moved = parts.clone();
            moved.uri = uri;
            let moved_body = Bytes::from([last, &body[..]].concat());
            assert_ne!(of(&moved, &moved_body), fingerprint);
        }
    }
    // Without named fields, x-a is not covered.
    let plain = DefaultFingerprinter::new();
    let mut without = parts.clone();
    without.headers.remove("x-a");
    assert_eq!(
        plain.fingerprint(parts, &body).unwrap(),
        plain.fingerprint(&without, &body).unwrap()
    );
}

fn check_json_fingerprint(u: &mut Unstructured, parts: &Parts, body: &[u8]) {
    let whole = JsonFingerprinter::new();
    let fingerprint = whole.fingerprint(parts, &Bytes::copy_from_slice(body));
    let Ok(value) = serde_json::from_slice::<Value>(body) else {
        assert!(fingerprint.is_err(), "a body that is not JSON is refused");
        return;
    };
    let fingerprint = fingerprint.expect("a JSON body is accepted");

    // Canonical JSON is JSON of the same value, and a fixed point.
    let canonical = canonical_json(&value);
    let reread: Value = serde_json::from_slice(&canonical).expect("canonical JSON parses");
    assert_eq!(reread, value);
    assert_eq!(canonical_json(&reread), canonical, "canonicalising twice");
    assert_eq!(
        whole.fingerprint(parts, &canonical.into()).unwrap(),
        fingerprint
    );

    // The same value in another key order, spacing and string escaping is
    // the same request.
    let mut rewritten = Vec::new();
    rewrite(u, &value, &mut rewritten);
    assert_eq!(
        serde_json::from_slice::<Value>(&rewritten).unwrap(),
        value,
        "{}",
        String::from_utf8_lossy(&rewritten)
    );
    let rewritten = Bytes::from(rewritten);
    assert_eq!(whole.fingerprint(parts, &rewritten).unwrap(), fingerprint);

    // Selected fields: never a panic, and the same invariance.
    let fields = JsonFingerprinter::fields(pointers(u, &value));
    let selected = fields
        .fingerprint(parts, &Bytes::copy_from_slice(body))
        .expect("a JSON body is accepted");
    assert_eq!(fields.fingerprint(parts, &rewritten).unwrap(), selected);
}

/// JSON whitespace (RFC 8259 §2): 0 to 2 of space, tab, LF, CR.
fn whitespace(u: &mut Unstructured, out: &mut Vec<u8>) {
    for _ in 0..u.int_in_range(0..=2).unwrap_or(0) {
        out.push(*u.choose(b" \t\n\r").unwrap_or(&b' '));
    }
}

/// A JSON string, either as serde_json writes it or with every UTF-16 code
/// unit escaped as `\uXXXX` (RFC 8259 §7).
fn string(u: &mut Unstructured, s: &str, out: &mut Vec<u8>) {
    if u.arbitrary().unwrap_or(false) {
        let mut escaped = String::from("\"");
        for unit in s.encode_utf16() {
            write!(escaped, "\\u{unit:04x}").unwrap();
        }
        escaped.push('"');
        out.extend_from_slice(escaped.as_bytes());
    } else {
        out.extend_from_slice(&serde_json::to_vec(s).unwrap());
    }
}

/// `value` written with object members in an order the input picks.
fn rewrite(u: &mut Unstructured, value: &Value, out: &mut Vec<u8>) {
    whitespace(u, out);
    match value {
        Value::Object(map) => {
            let mut members: Vec<_> = map.iter().collect();
            for i in (1..members.len()).rev() {
                members.swap(i, u.int_in_range(0..=i).unwrap_or(0));
            }
            out.push(b'{');
            for (i, (key, item)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                whitespace(u, out);
                string(u, key, out);
                whitespace(u, out);
                out.push(b':');
                rewrite(u, item, out);
            }
            whitespace(u, out);
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                rewrite(u, item, out);
            }
            whitespace(u, out);
            out.push(b']');
        }
        Value::String(s) => string(u, s, out),
        scalar => out.extend_from_slice(&serde_json::to_vec(scalar).unwrap()),
    }
    whitespace(u, out);
}

/// JSON Pointers (RFC 6901) for `fields`: the whole document, one path that
/// exists in `value`, and one string taken from the input.
fn pointers(u: &mut Unstructured, value: &Value) -> Vec<String> {
    let mut path = String::new();
    let mut at = value;
    while u.arbitrary().unwrap_or(false) {
        match at {
            Value::Object(map) if !map.is_empty() => {
                let keys: Vec<&String> = map.keys().collect();
                let key = *u.choose(&keys).unwrap();
                path.push('/');
                path.push_str(&key.replace('~', "~0").replace('/', "~1"));
                at = &map[key.as_str()];
            }
            Value::Array(items) if !items.is_empty() => {
                let i = u.choose_index(items.len()).unwrap_or(0);
                write!(path, "/{i}").unwrap();
                at = &items[i];
            }
            _ => break,
        }
    }
    assert!(value.pointer(&path).is_some(), "{path:?}");
    let mut pointers = vec![String::new(), path];
    if let Ok(raw) = u.arbitrary::<&str>() {
        pointers.push(raw.to_owned());
    }
    pointers
}

// ---------------------------------------------------------------------------
// Target `response`: the stored-response codec (src/response.rs)

/// How many bytes `StoredResponse::decode` may request in one allocation per
/// input byte. A field list of `n` fields reserves `n` entries of
/// `(HeaderName, HeaderValue)` after checking that the input holds at least
/// 8 bytes per field, so one entry per 8 input bytes.
pub fn decode_allocation_bound(input_len: usize) -> usize {
    let entry = std::mem::size_of::<(HeaderName, HeaderValue)>();
    (input_len / 8) * entry + input_len
}

/// The input is decoded as a stored record, and also read (through
/// `arbitrary`) as the parts of a response that must round-trip.
pub fn check_response(data: &[u8]) {
    assert_allocations_are_counted();
    let (decoded, largest) = largest_allocation_during(|| StoredResponse::decode(data));
    assert!(
        largest <= decode_allocation_bound(data.len()),
        "decode of {} bytes requested {largest} bytes at once",
        data.len()
    );
    if let Ok(record) = &decoded {
        let again = record.encode();
        assert_eq!(StoredResponse::decode(&again).as_ref(), Ok(record));
        match record.body {
            // Name case aside, the encoding is the input.
            StoredBody::Complete(_) | StoredBody::Sealed(_) => {
                assert_eq!(again.len(), data.len())
            }
            // The bytes an omitted body was stored with are not kept.
            StoredBody::Omitted => assert!(again.len() <= data.len()),
        }
        check_replay(record);
    }

    let mut u = Unstructured::new(data);
    if let Ok(response) = arbitrary_response(&mut u) {
        let encoded = response.encode();
        assert_eq!(StoredResponse::decode(&encoded).as_ref(), Ok(&response));
        let cut = u.int_in_range(0..=encoded.len() - 1).unwrap_or(0);
        assert!(
            StoredResponse::decode(&encoded[..cut]).is_err(),
            "cut at {cut}"
        );
        let mut longer = encoded.clone();
        longer.push(0);
        assert!(StoredResponse::decode(&longer).is_err(), "a trailing byte");
        check_replay(&response);
        check_capture(&response);
    }
}

const NAMES: [HeaderName; 10] = [
    header::CONTENT_TYPE,
    header::LINK,
    header::LOCATION,
    header::SET_COOKIE,
    header::CONTENT_LENGTH,
    header::CONNECTION,
    header::TRANSFER_ENCODING,
    header::TE,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
];

fn arbitrary_fields(u: &mut Unstructured) -> arbitrary::Result<Vec<(HeaderName, HeaderValue)>> {
    let mut fields = Vec::new();
    for _ in 0..u.int_in_range(0..=8)? {
        let name = if u.arbitrary()? {
            u.choose(&NAMES)?.clone()
        } else {
            HeaderName::from_bytes(u.arbitrary()?)
                .unwrap_or_else(|_| HeaderName::from_static("x-field"))
        };
        let value = HeaderValue::from_bytes(u.arbitrary()?)
            .unwrap_or_else(|_| HeaderValue::from_static(""));
        fields.push((name, value));
    }
    Ok(fields)
}

fn arbitrary_response(u: &mut Unstructured) -> arbitrary::Result<StoredResponse> {
    let status = StatusCode::from_u16(u.int_in_range(100..=999)?).unwrap();
    let headers = arbitrary_fields(u)?;
    let body = match u.int_in_range(0..=2u8)? {
        0 => StoredBody::Complete(Bytes::copy_from_slice(u.arbitrary()?)),
        1 => StoredBody::Omitted,
        // A sealed record's bytes, opaque to the codec.
        _ => StoredBody::Sealed(Bytes::copy_from_slice(u.arbitrary()?)),
    };
    let trailers = if u.arbitrary()? {
        Some(arbitrary_fields(u)?)
    } else {
        None
    };
    Ok(StoredResponse {
        status,
        headers,
        body,
        trailers,
    })
}

/// The values of each name, in order: what a `HeaderMap` keeps of a list.
fn by_name<'a>(
    fields: impl IntoIterator<Item = (&'a HeaderName, &'a HeaderValue)>,
) -> BTreeMap<&'a str, Vec<&'a [u8]>> {
    let mut map = BTreeMap::<_, Vec<_>>::new();
    for (name, value) in fields {
        map.entry(name.as_str()).or_default().push(value.as_bytes());
    }
    map
}

fn check_replay(record: &StoredResponse) {
    let marker = HeaderName::from_static("idempotent-replayed");
    let replay = record.replay(&marker);
    let body: &[u8] = match &record.body {
        StoredBody::Complete(bytes) => bytes,
        StoredBody::Omitted | StoredBody::Sealed(_) => b"",
    };
    assert_eq!(replay.status(), record.status);
    assert_eq!(replay.body().as_ref(), body);
    let only = |name: &HeaderName| -> Vec<&[u8]> {
        replay
            .headers()
            .get_all(name)
            .iter()
            .map(HeaderValue::as_bytes)
            .collect()
    };
    assert_eq!(
        only(&header::CONTENT_LENGTH),
        [body.len().to_string().as_bytes()]
    );
    assert_eq!(only(&marker), [b"true"]);
    let replaced = |name: &HeaderName| name == header::CONTENT_LENGTH || name == marker;
    let stored = by_name(
        record
            .headers
            .iter()
            .filter(|(name, _)| !replaced(name))
            .map(|(n, v)| (n, v)),
    );
    let replayed = by_name(replay.headers().iter().filter(|(name, _)| !replaced(name)));
    assert_eq!(replayed, stored);
    match (&record.trailers, record.trailer_map()) {
        (None, None) => {}
        (Some(fields), Some(map)) => {
            assert_eq!(by_name(&map), by_name(fields.iter().map(|(n, v)| (n, v))));
        }
        (fields, map) => panic!("trailers {fields:?} became {map:?}"),
    }
}

/// What `capture` drops (src/response.rs module docs).
fn is_dropped(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection" | "keep-alive" | "transfer-encoding" | "te" | "upgrade"
    ) || name.as_str().starts_with("proxy-")
        || name == header::SET_COOKIE
        || name == header::CONTENT_LENGTH
}

fn check_capture(response: &StoredResponse) {
    let to_map = |fields: &[(HeaderName, HeaderValue)]| {
        let mut map = HeaderMap::new();
        for (name, value) in fields {
            map.append(name.clone(), value.clone());
        }
        map
    };
    let body = Bytes::from_static(b"body");
    let trailers = response.trailers.as_deref().map(to_map);
    let captured = StoredResponse::capture(
        response.status,
        &to_map(&response.headers),
        body.clone(),
        trailers.as_ref(),
    );
    fn kept(fields: &[(HeaderName, HeaderValue)]) -> BTreeMap<&str, Vec<&[u8]>> {
        by_name(
            fields
                .iter()
                .filter(|(name, _)| !is_dropped(name))
                .map(|(n, v)| (n, v)),
        )
    }
    assert!(captured.headers.iter().all(|(name, _)| !is_dropped(name)));
    assert_eq!(
        by_name(captured.headers.iter().map(|(n, v)| (n, v))),
        kept(&response.headers)
    );
    assert_eq!(captured.body, StoredBody::Complete(body));
    assert_eq!(
        captured
            .trailers
            .as_deref()
            .map(|t| by_name(t.iter().map(|(n, v)| (n, v)))),
        response.trailers.as_deref().map(kept)
    );
}
