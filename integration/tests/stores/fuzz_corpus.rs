//! Replays every input of the committed fuzz corpus (`fuzz/corpus/<target>/`)
//! through the checks the fuzz targets run (`integration/tests/fuzz_checks`),
//! without instrumentation. An input that once crashed a target, added to
//! its corpus directory, stays a regression test here. The binary's global
//! allocator is the checks' counting one (`main.rs`); it counts per thread.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

use crate::fuzz_checks;

/// Runs `check` over every file of `fuzz/corpus/<target>` and names each
/// input that fails. Returns how many inputs ran.
fn replay(target: &str, check: fn(&[u8])) -> usize {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(target);
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .collect();
    paths.sort();
    let mut failed = Vec::new();
    for path in &paths {
        let input = std::fs::read(path).unwrap();
        if catch_unwind(AssertUnwindSafe(|| check(&input))).is_err() {
            failed.push(path.display().to_string());
        }
    }
    assert!(failed.is_empty(), "failing corpus inputs: {failed:#?}");
    paths.len()
}

#[test]
fn key_corpus() {
    let n = replay("key", fuzz_checks::check_key);
    assert!(n >= 20, "{n} inputs");
}

#[test]
fn fingerprint_corpus() {
    let n = replay("fingerprint", fuzz_checks::check_fingerprint);
    assert!(n >= 20, "{n} inputs");
}

#[test]
fn response_corpus() {
    let n = replay("response", fuzz_checks::check_response);
    assert!(n >= 20, "{n} inputs");
}

/// Writes the hand-made seeds of `fuzz/corpus/response`: records produced by
/// `StoredResponse::encode`. Run once, by hand, when the format changes:
/// `cargo test --test fuzz_corpus -- --ignored write_response_seeds`.
#[test]
#[ignore = "writes seed files into fuzz/corpus/response"]
fn write_response_seeds() {
    use bytes::Bytes;
    use http::{HeaderMap, HeaderValue, StatusCode};
    use tower_idempotency::{StoredBody, StoredResponse};

    let mut headers = HeaderMap::new();
    headers.append("content-type", HeaderValue::from_static("application/json"));
    headers.append("link", HeaderValue::from_static("</a>; rel=next"));
    headers.append("link", HeaderValue::from_static("</b>; rel=prev"));
    headers.append("x-raw", HeaderValue::from_bytes(b"caf\xe9").unwrap());
    let mut trailers = HeaderMap::new();
    trailers.append("grpc-status", HeaderValue::from_static("0"));
    trailers.append("grpc-message", HeaderValue::from_static("ok"));
    let created = StoredResponse::capture(
        StatusCode::CREATED,
        &headers,
        Bytes::from_static(br#"{"id":"ch_1","amount":5}"#),
        None,
    );
    let mut omitted = created.clone();
    omitted.body = StoredBody::Omitted;
    let grpc = StoredResponse::capture(
        StatusCode::OK,
        &HeaderMap::new(),
        Bytes::from_static(b"\x00\x00\x00\x00\x02\x08\x01"),
        Some(&trailers),
    );
    let empty = StoredResponse::capture(
        StatusCode::NO_CONTENT,
        &HeaderMap::new(),
        Bytes::new(),
        None,
    );
    // Sealed at rest (`seal`): the status, and the rest as opaque bytes.
    use tower_idempotency::seal::{Keyring, SealingKey};
    let keyring = Keyring::new([SealingKey::new(1, [7; 32])]).unwrap();
    let id = tower_idempotency::store::RecordId::new("alice", "order-1");
    let fingerprint = tower_idempotency::fingerprint::Fingerprint([3; 32]);
    let sealed = keyring.seal(&id, &fingerprint, &created).unwrap();
    let seeds = [
        ("created", created),
        ("sealed", sealed),
        ("omitted", omitted),
        ("grpc-trailers", grpc),
        ("no-content", empty),
    ];
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/response");
    std::fs::create_dir_all(&dir).unwrap();
    for (name, response) in seeds {
        let encoded = response.encode();
        assert_eq!(StoredResponse::decode(&encoded).unwrap(), response);
        std::fs::write(dir.join(format!("seed-{name}")), &encoded).unwrap();
        // A hostile count and a hostile body length on a valid record.
        let mut count = encoded.clone();
        count[7..11].copy_from_slice(&u32::MAX.to_be_bytes());
        std::fs::write(dir.join(format!("seed-{name}-huge-count")), count).unwrap();
        let body_at = encoded.len() - response_tail_len(&response);
        let mut length = encoded;
        length[body_at..body_at + 8].copy_from_slice(&(u64::from(u32::MAX) + 1).to_be_bytes());
        std::fs::write(dir.join(format!("seed-{name}-huge-body")), length).unwrap();
    }

    /// The bytes from the body's length field to the end.
    fn response_tail_len(response: &StoredResponse) -> usize {
        let body = match &response.body {
            StoredBody::Complete(b) | StoredBody::Sealed(b) => b.len(),
            StoredBody::Omitted => 0,
        };
        let fields = |f: &[(http::HeaderName, HeaderValue)]| {
            4 + f
                .iter()
                .map(|(n, v)| 8 + n.as_str().len() + v.len())
                .sum::<usize>()
        };
        8 + body + response.trailers.as_deref().map_or(0, fields)
    }
}

/// The bound `check_response` asserts is met, not just above what decoding
/// needs: a record of 100 one-letter fields reserves exactly 100 entries.
#[test]
fn decode_reserves_one_entry_per_field() {
    use http::{HeaderName, HeaderValue};

    let mut record = b"TIR1\x00\xc8\x00".to_vec();
    record.extend_from_slice(&100u32.to_be_bytes());
    for _ in 0..100 {
        record.extend_from_slice(b"\x00\x00\x00\x01a\x00\x00\x00\x00");
    }
    record.extend_from_slice(&0u64.to_be_bytes());
    let (decoded, largest) = fuzz_checks::largest_allocation_during(|| {
        tower_idempotency::StoredResponse::decode(&record)
    });
    assert_eq!(decoded.unwrap().headers.len(), 100);
    let entry = std::mem::size_of::<(HeaderName, HeaderValue)>();
    assert_eq!(entry, 72);
    assert_eq!(largest, 100 * entry);
    assert_eq!(record.len(), 919);
    assert!(largest <= fuzz_checks::decode_allocation_bound(record.len()));
}
