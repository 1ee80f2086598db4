use bytes::Bytes;
use http::{HeaderMap, StatusCode};

use super::*;

const BODY: &[u8] = b"{\"card\":\"4111111111111111\"}";

fn response() -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.append("x-account", "acct-77".parse().unwrap());
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", "0".parse().unwrap());
    StoredResponse::capture(
        StatusCode::CREATED,
        &headers,
        Bytes::from_static(BODY),
        Some(&trailers),
    )
}

fn record() -> (RecordId, Fingerprint) {
    (RecordId::new("alice", "order-1"), Fingerprint([3; 32]))
}

fn keyring(keys: &[(u32, u8)]) -> Keyring {
    Keyring::new(
        keys.iter()
            .map(|&(id, fill)| SealingKey::new(id, [fill; 32])),
    )
    .unwrap()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn round_trip_keeps_the_status_and_hides_the_rest() {
    let ring = keyring(&[(1, 7)]);
    let (id, fingerprint) = record();
    let sealed = ring.seal(&id, &fingerprint, &response()).unwrap();
    assert_eq!(sealed.status, StatusCode::CREATED);
    assert_eq!((sealed.headers.len(), sealed.trailers.is_none()), (0, true));
    let StoredBody::Sealed(bytes) = &sealed.body else {
        panic!("not sealed: {sealed:?}");
    };
    // Format byte, key id 1, nonce, ciphertext of the encoding, tag.
    assert_eq!(bytes[..5], [1, 0, 0, 0, 1]);
    assert_eq!(bytes.len(), 1 + 4 + 24 + response().encode().len() + 16);
    let encoded = sealed.encode();
    assert!(!contains(&encoded, b"4111111111111111"));
    assert!(!contains(&encoded, b"acct-77"));
    assert!(!contains(&encoded, b"grpc-status"));
    // Through the store's encoding and back, then opened.
    let stored = StoredResponse::decode(&encoded).unwrap();
    assert_eq!(ring.open(&id, &fingerprint, stored).unwrap(), response());
    // Two seals of one response differ (a fresh nonce each).
    let again = ring.seal(&id, &fingerprint, &response()).unwrap();
    assert_ne!(again.body, sealed.body);
}

#[test]
fn a_record_opens_only_where_it_was_sealed() {
    let ring = keyring(&[(1, 7)]);
    let (id, fingerprint) = record();
    let sealed = ring.seal(&id, &fingerprint, &response()).unwrap();
    let elsewhere = [
        (RecordId::new("alice", "order-2"), fingerprint),
        (RecordId::new("bob", "order-1"), fingerprint),
        // The same bytes framed differently: the length prefixes tell them apart.
        (RecordId::new("aliceo", "rder-1"), fingerprint),
        (id.clone(), Fingerprint([4; 32])),
    ];
    for (other, print) in elsewhere {
        assert_eq!(
            ring.open(&other, &print, sealed.clone()),
            Err(OpenError::Rejected(1)),
            "{other:?}"
        );
    }
    let mut status = sealed.clone();
    status.status = StatusCode::OK;
    assert_eq!(
        ring.open(&id, &fingerprint, status),
        Err(OpenError::Rejected(1))
    );
    assert_eq!(ring.open(&id, &fingerprint, sealed).unwrap(), response());
}

#[test]
fn rotation_opens_with_an_older_key_and_seals_with_the_first() {
    let (id, fingerprint) = record();
    let old = keyring(&[(1, 7)]);
    let sealed_old = old.seal(&id, &fingerprint, &response()).unwrap();
    let rotated = keyring(&[(2, 9), (1, 7)]);
    assert_eq!(rotated.sealing_id(), 2);
    assert_eq!(
        rotated.open(&id, &fingerprint, sealed_old).unwrap(),
        response()
    );
    let sealed_new = rotated.seal(&id, &fingerprint, &response()).unwrap();
    let StoredBody::Sealed(bytes) = &sealed_new.body else {
        panic!("not sealed");
    };
    assert_eq!(bytes[1..5], 2u32.to_be_bytes());
    // The old keyring alone does not know key 2.
    assert_eq!(
        old.open(&id, &fingerprint, sealed_new),
        Err(OpenError::UnknownKey(2))
    );
}

#[test]
fn every_changed_byte_fails_to_open() {
    let ring = keyring(&[(1, 7)]);
    let (id, fingerprint) = record();
    let sealed = ring.seal(&id, &fingerprint, &response()).unwrap();
    let StoredBody::Sealed(bytes) = &sealed.body else {
        panic!("not sealed");
    };
    for i in 0..bytes.len() {
        let mut changed = bytes.to_vec();
        changed[i] ^= 0x01;
        let mut record = sealed.clone();
        record.body = StoredBody::Sealed(changed.into());
        let expected = match i {
            0 => OpenError::Malformed,
            1..=4 => OpenError::UnknownKey(u32::from_be_bytes([
                bytes[1] ^ u8::from(i == 1),
                bytes[2] ^ u8::from(i == 2),
                bytes[3] ^ u8::from(i == 3),
                bytes[4] ^ u8::from(i == 4),
            ])),
            _ => OpenError::Rejected(1),
        };
        assert_eq!(
            ring.open(&id, &fingerprint, record),
            Err(expected),
            "byte {i}"
        );
    }
    for len in [0, 5, 44] {
        let mut record = sealed.clone();
        record.body = StoredBody::Sealed(bytes.slice(..len));
        assert_eq!(
            ring.open(&id, &fingerprint, record),
            Err(OpenError::Malformed)
        );
    }
}

#[test]
fn unknown_or_wrong_keys_and_no_keys_fail() {
    let (id, fingerprint) = record();
    let sealed = keyring(&[(1, 7)])
        .seal(&id, &fingerprint, &response())
        .unwrap();
    assert_eq!(
        keyring(&[(5, 7)]).open(&id, &fingerprint, sealed.clone()),
        Err(OpenError::UnknownKey(1))
    );
    // The same id with other bytes.
    assert_eq!(
        keyring(&[(1, 8)]).open(&id, &fingerprint, sealed.clone()),
        Err(OpenError::Rejected(1))
    );
    assert_eq!(
        open(None, &id, &fingerprint, sealed),
        Err(OpenError::NoKeys)
    );
    // A plain record opens as it is, with or without keys.
    assert_eq!(open(None, &id, &fingerprint, response()), Ok(response()));
    assert_eq!(
        keyring(&[(1, 7)]).open(&id, &fingerprint, response()),
        Ok(response())
    );
}

#[test]
fn keys_from_files_and_keyring_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let good = dir.join("good.key");
    std::fs::write(&good, [7u8; 32]).unwrap();
    let a = SealingKey::from_file(&good).unwrap();
    let b = SealingKey::from_file(&good).unwrap();
    assert_eq!(a.id(), b.id());
    // The id is derived from the bytes: another key, another id.
    std::fs::write(dir.join("other.key"), [8u8; 32]).unwrap();
    assert_ne!(
        SealingKey::from_file(dir.join("other.key")).unwrap().id(),
        a.id()
    );
    // Debug shows the id, not the bytes.
    let shown = format!("{:?}", SealingKey::new(3, [0xab; 32]));
    assert_eq!(shown, "SealingKey { id: 3, .. }");
    for (name, bytes) in [("short.key", &[7u8; 31][..]), ("long.key", &[7u8; 33][..])] {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        let err = SealingKey::from_file(&path).unwrap_err();
        assert!(matches!(err, SealingKeyError::Length { len, .. } if len == bytes.len()));
        assert!(err.to_string().contains("exactly 32 random bytes"), "{err}");
    }
    let missing = SealingKey::from_file(dir.join("missing.key")).unwrap_err();
    assert!(matches!(missing, SealingKeyError::Read { .. }), "{missing}");
    assert!(matches!(Keyring::new([]), Err(SealingKeyError::NoKeys)));
    let twice = Keyring::new([a, b]);
    assert!(matches!(twice, Err(SealingKeyError::DuplicateId(_))));
}

#[test]
fn sealed_bytes_open_only_under_their_context_and_never_as_a_record() {
    let ring = keyring(&[(1, 3)]);
    let context: [&[u8]; 2] = [b"outbox", b"obx1-abc"];
    let secret = b"{\"amount\":4111}";
    let sealed = ring.seal_bytes(&context, secret).unwrap();
    assert_eq!(sealed.len(), secret.len() + 45);
    assert!(!contains(&sealed, b"4111"));
    assert_eq!(ring.open_bytes(&context, &sealed).unwrap(), secret);
    // Another context, a changed byte, another key: refused.
    let other: [&[u8]; 2] = [b"outbox", b"obx1-abd"];
    assert_eq!(
        ring.open_bytes(&other, &sealed),
        Err(OpenError::Rejected(1))
    );
    let mut changed = sealed.to_vec();
    *changed.last_mut().unwrap() ^= 1;
    assert_eq!(
        ring.open_bytes(&context, &changed),
        Err(OpenError::Rejected(1))
    );
    assert_eq!(
        keyring(&[(2, 3)]).open_bytes(&context, &sealed),
        Err(OpenError::UnknownKey(1))
    );
    // Rotation: sealed with the first key, opened by a ring that holds it.
    let rotated = keyring(&[(9, 4), (1, 3)]);
    assert_eq!(rotated.open_bytes(&context, &sealed).unwrap(), secret);
    // Sealed bytes are no sealed record, and a sealed record no sealed bytes.
    let (id, fingerprint) = record();
    let as_record = StoredResponse {
        status: http::StatusCode::OK,
        headers: Vec::new(),
        body: StoredBody::Sealed(sealed.clone()),
        trailers: None,
    };
    assert_eq!(
        ring.open(&id, &fingerprint, as_record),
        Err(OpenError::Malformed)
    );
    let record_bytes = match ring.seal(&id, &fingerprint, &response()).unwrap().body {
        StoredBody::Sealed(bytes) => bytes,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        ring.open_bytes(&context, &record_bytes),
        Err(OpenError::Malformed)
    );
}
