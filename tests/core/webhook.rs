//! `examples/webhook.rs`, a Standard Webhooks receiver, over real sockets:
//! redeliveries make one order, and nothing that fails verification ever
//! occupies a `webhook-id`.

use crate::common;

use crate::webhook_example as webhook;

use std::net::SocketAddr;

use axum::body::Bytes;
use axum::http::{HeaderValue, Request};
use common::{Raw, send, serve};
use tower_idempotency::fingerprint::{DefaultFingerprinter, Fingerprinter};
use tower_idempotency::problem::types;
use tower_idempotency::{MemoryStore, SqliteStore, Store};
use webhook::{Order, Orders, Secret, Senders, problem, sign, unix_now};

/// Two senders, each with its own secret (24 random bytes each).
const ACME_SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
const GLOBEX_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
/// A secret nobody configured: what a forger might sign with.
const FORGER_SECRET: &str = "whsec_p4rOGHQqh0HAzZ8dVvn7QSjEg79Eo2Wk";

const ORDER: &[u8] = br#"{"type":"order.created","data":{"sku":"tea-01","qty":2}}"#;

fn secret(whsec: &str) -> Secret {
    Secret::parse(whsec).unwrap()
}

async fn start<St: Store>(store: St) -> (SocketAddr, Orders) {
    let senders = Senders::new()
        .with("acme", secret(ACME_SECRET))
        .with("globex", secret(GLOBEX_SECRET));
    let orders = Orders::new();
    let addr = serve(webhook::router(store, senders, orders.clone())).await;
    (addr, orders)
}

/// One delivery attempt with the given header values, exactly as written.
async fn post(
    addr: SocketAddr,
    sender: &str,
    id: &str,
    timestamp: &str,
    signature: &str,
    payload: &[u8],
) -> Raw {
    send(
        addr,
        "POST",
        &format!("/webhooks/{sender}"),
        &[
            ("content-type", b"application/json"),
            ("webhook-id", id.as_bytes()),
            ("webhook-timestamp", timestamp.as_bytes()),
            ("webhook-signature", signature.as_bytes()),
        ],
        payload,
    )
    .await
}

/// One attempt as a sender makes it: signed with `whsec` at `timestamp`.
async fn deliver(
    addr: SocketAddr,
    sender: &str,
    whsec: &str,
    id: &str,
    timestamp: i64,
    payload: &[u8],
) -> Raw {
    let signature = sign(&secret(whsec), id, timestamp, payload);
    post(
        addr,
        sender,
        id,
        &timestamp.to_string(),
        &signature,
        payload,
    )
    .await
}

fn order(id: u64, sender: &str, webhook_id: &str) -> Order {
    Order {
        id,
        sender: sender.into(),
        webhook_id: webhook_id.into(),
        sku: "tea-01".into(),
        qty: 2,
    }
}

fn created_body(id: u64, sender: &str, webhook_id: &str) -> Vec<u8> {
    format!(
        r#"{{"order":{id},"qty":2,"sender":"{sender}","sku":"tea-01","webhook_id":"{webhook_id}"}}"#
    )
    .into_bytes()
}

// ------------------------------------------------------------ 1. redelivery

/// A sender's retry: the same id and payload, a new timestamp and so a new
/// signature. One order; the retry gets the first answer, marked replayed.
async fn redelivery_creates_one_order<St: Store>(store: St) {
    let (addr, orders) = start(store).await;
    let now = unix_now();
    let first_signature = sign(&secret(ACME_SECRET), "msg_1", now - 20, ORDER);
    let retry_signature = sign(&secret(ACME_SECRET), "msg_1", now, ORDER);
    assert_ne!(
        first_signature, retry_signature,
        "the signature covers the timestamp"
    );

    let first = post(
        addr,
        "acme",
        "msg_1",
        &(now - 20).to_string(),
        &first_signature,
        ORDER,
    )
    .await;
    let retry = post(
        addr,
        "acme",
        "msg_1",
        &now.to_string(),
        &retry_signature,
        ORDER,
    )
    .await;

    assert_eq!(first.status, 201, "{first:?}");
    assert!(!first.replayed());
    assert_eq!(first.body, created_body(1, "acme", "msg_1"));
    assert_eq!(first.header_str("content-type"), Some("application/json"));

    assert_eq!(retry.status, 201, "{retry:?}");
    assert_eq!(retry.header_str("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.stable_headers(), first.stable_headers());

    assert_eq!(orders.count(), 1);
    assert_eq!(orders.all(), [order(1, "acme", "msg_1")]);
}

#[tokio::test]
async fn redelivery_with_a_fresh_signature_creates_one_order_and_is_replayed() {
    redelivery_creates_one_order(MemoryStore::new()).await;
}

#[tokio::test]
async fn redelivery_creates_one_order_on_sqlite_too() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("webhooks.sqlite3"))
        .await
        .unwrap();
    redelivery_creates_one_order(store).await;
}

/// Why the redelivery above matches: the default fingerprint covers the
/// method, the path and query and the body, not the header fields that change
/// from one attempt to the next. Had it covered `webhook-signature`, every
/// redelivery would be a 422.
#[test]
fn default_fingerprint_ignores_the_per_attempt_header_fields() {
    let attempt = |timestamp: i64| {
        let signature = sign(&secret(ACME_SECRET), "msg_1", timestamp, ORDER);
        let request = Request::post("/webhooks/acme")
            .header("webhook-id", "msg_1")
            .header("webhook-timestamp", timestamp.to_string())
            .header(
                "webhook-signature",
                HeaderValue::from_str(&signature).unwrap(),
            )
            .body(())
            .unwrap();
        request.into_parts().0
    };
    let (first, retry) = (attempt(1_800_000_000), attempt(1_800_000_300));
    let body = Bytes::from_static(ORDER);

    let default = DefaultFingerprinter::new();
    assert_eq!(
        default.fingerprint(&first, &body).unwrap(),
        default.fingerprint(&retry, &body).unwrap()
    );
    let other_body =
        Bytes::from_static(br#"{"type":"order.created","data":{"sku":"tea-01","qty":3}}"#);
    assert_ne!(
        default.fingerprint(&first, &body).unwrap(),
        default.fingerprint(&first, &other_body).unwrap()
    );
    // The counterexample: a fingerprint over the signature sees two requests.
    let with_signature = DefaultFingerprinter::with_headers([webhook::WEBHOOK_SIGNATURE]);
    assert_ne!(
        with_signature.fingerprint(&first, &body).unwrap(),
        with_signature.fingerprint(&retry, &body).unwrap()
    );
}

// ------------------------------------------------------------ 2. forgery

/// A forged message is refused before the idempotency layer: it leaves no
/// record, so the genuine message with the same id (and another payload) is
/// processed fresh, neither replayed nor refused as a mismatch.
#[tokio::test]
async fn forged_signature_is_rejected_and_leaves_no_record() {
    let (addr, orders) = start(MemoryStore::new()).await;
    let now = unix_now();
    let forged_payload = br#"{"type":"order.created","data":{"sku":"gold-bar","qty":1000}}"#;

    // Signed with a secret the receiver does not know.
    let forged = deliver(addr, "acme", FORGER_SECRET, "msg_1", now, forged_payload).await;
    assert_eq!(forged.assert_problem(401), problem::INVALID_SIGNATURE);
    assert!(forged.header("www-authenticate").is_some());
    assert!(!forged.replayed());
    // Signed with another sender's real secret: still not acme's.
    let borrowed = deliver(addr, "acme", GLOBEX_SECRET, "msg_1", now, forged_payload).await;
    assert_eq!(borrowed.assert_problem(401), problem::INVALID_SIGNATURE);
    // A genuine signature, but over another payload than the one sent.
    let acme_signature = sign(&secret(ACME_SECRET), "msg_1", now, ORDER);
    let tampered = post(
        addr,
        "acme",
        "msg_1",
        &now.to_string(),
        &acme_signature,
        forged_payload,
    )
    .await;
    assert_eq!(tampered.assert_problem(401), problem::INVALID_SIGNATURE);
    // No signature at all, and a signature of another version only.
    let unsigned = send(
        addr,
        "POST",
        "/webhooks/acme",
        &[
            ("webhook-id", b"msg_1"),
            ("webhook-timestamp", now.to_string().as_bytes()),
        ],
        forged_payload,
    )
    .await;
    assert_eq!(unsigned.assert_problem(401), problem::INVALID_SIGNATURE);
    let other_version = acme_signature.replacen("v1,", "v1a,", 1);
    let v1a = post(
        addr,
        "acme",
        "msg_1",
        &now.to_string(),
        &other_version,
        ORDER,
    )
    .await;
    assert_eq!(v1a.assert_problem(401), problem::INVALID_SIGNATURE);
    assert_eq!(orders.count(), 0);

    let genuine = deliver(addr, "acme", ACME_SECRET, "msg_1", now, ORDER).await;
    assert_eq!(genuine.status, 201, "{genuine:?}");
    assert!(!genuine.replayed());
    assert_eq!(genuine.body, created_body(1, "acme", "msg_1"));
    assert_eq!(orders.count(), 1);
    assert_eq!(orders.all(), [order(1, "acme", "msg_1")]);
}

// ------------------------------------------------------------ 3. two senders

/// The same id from two senders is two events: the scope is the verified
/// sender.
#[tokio::test]
async fn same_id_from_two_senders_is_two_events() {
    let (addr, orders) = start(MemoryStore::new()).await;
    let now = unix_now();

    let from_acme = deliver(addr, "acme", ACME_SECRET, "msg_1", now, ORDER).await;
    let from_globex = deliver(addr, "globex", GLOBEX_SECRET, "msg_1", now, ORDER).await;

    assert_eq!((from_acme.status, from_globex.status), (201, 201));
    assert!(!from_acme.replayed());
    assert!(!from_globex.replayed());
    assert_eq!(from_acme.body, created_body(1, "acme", "msg_1"));
    assert_eq!(from_globex.body, created_body(2, "globex", "msg_1"));
    assert_eq!(orders.count(), 2);
    assert_eq!(
        orders.all(),
        [order(1, "acme", "msg_1"), order(2, "globex", "msg_1")]
    );

    // Each sender's retry gets its own answer back.
    let acme_retry = deliver(addr, "acme", ACME_SECRET, "msg_1", now + 1, ORDER).await;
    let globex_retry = deliver(addr, "globex", GLOBEX_SECRET, "msg_1", now + 1, ORDER).await;
    assert!(acme_retry.replayed() && globex_retry.replayed());
    assert_eq!(acme_retry.body, from_acme.body);
    assert_eq!(globex_retry.body, from_globex.body);
    assert_eq!(orders.count(), 2);
}

// ------------------------------------------------------------ 4. stale timestamp

/// A genuinely signed message whose timestamp is more than five minutes old
/// (or ahead) is refused and leaves no record: the same id sent now is new.
#[tokio::test]
async fn stale_timestamp_is_rejected_and_leaves_no_record() {
    let (addr, orders) = start(MemoryStore::new()).await;
    let now = unix_now();

    let old = deliver(addr, "acme", ACME_SECRET, "msg_1", now - 6 * 60, ORDER).await;
    assert_eq!(old.assert_problem(400), problem::STALE_TIMESTAMP);
    assert!(old.json()["detail"].as_str().unwrap().contains("older"));
    let ahead = deliver(addr, "acme", ACME_SECRET, "msg_1", now + 6 * 60, ORDER).await;
    assert_eq!(ahead.assert_problem(400), problem::STALE_TIMESTAMP);
    assert!(ahead.json()["detail"].as_str().unwrap().contains("newer"));
    assert_eq!(orders.count(), 0);

    // Four minutes either way is within the tolerance.
    let fresh = deliver(addr, "acme", ACME_SECRET, "msg_1", now - 4 * 60, ORDER).await;
    assert_eq!(fresh.status, 201, "{fresh:?}");
    assert!(!fresh.replayed());
    assert_eq!(fresh.body, created_body(1, "acme", "msg_1"));
    let early = deliver(addr, "acme", ACME_SECRET, "msg_2", now + 4 * 60, ORDER).await;
    assert_eq!(early.status, 201, "{early:?}");
    assert!(!early.replayed());
    assert_eq!(orders.count(), 2);
}

// ------------------------------------------------------------ 5. mismatch

/// A genuine message reusing an id with another payload gets the layer's
/// 422, and makes no order.
#[tokio::test]
async fn used_id_with_another_payload_is_a_mismatch() {
    let (addr, orders) = start(MemoryStore::new()).await;
    let now = unix_now();
    let first = deliver(addr, "acme", ACME_SECRET, "msg_1", now, ORDER).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(orders.count(), 1);

    let other = br#"{"type":"order.created","data":{"sku":"tea-01","qty":3}}"#;
    let reused = deliver(addr, "acme", ACME_SECRET, "msg_1", now + 1, other).await;
    assert_eq!(reused.assert_problem(422), types::MISMATCH);
    assert!(!reused.replayed());
    assert_eq!(orders.count(), 1);
    assert_eq!(orders.all(), [order(1, "acme", "msg_1")]);

    // The first payload is still replayed.
    let retry = deliver(addr, "acme", ACME_SECRET, "msg_1", now + 2, ORDER).await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
}

// ------------------------------------------------------------ the rest

/// The signing helper against the Standard Webhooks reference libraries'
/// test vector, and a rotation: any one matching `v1` entry is enough.
#[tokio::test]
async fn signing_matches_the_reference_and_any_v1_entry_verifies() {
    assert_eq!(
        sign(
            &secret("whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"),
            "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk",
            1_649_367_553,
            br#"{"email":"test@example.com","username":"test_user"}"#,
        ),
        "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw="
    );
    assert!(Secret::parse("C2FVsBQIhrscChlQIMV+b5sSYspob7oD").is_err());
    assert!(Secret::parse("whsec_not base64!").is_err());
    assert!(Secret::parse("whsec_").is_err());

    let (addr, orders) = start(MemoryStore::new()).await;
    let now = unix_now();
    let old = sign(&secret(FORGER_SECRET), "msg_1", now, ORDER);
    let new = sign(&secret(ACME_SECRET), "msg_1", now, ORDER);
    let rotating = format!("v1a,bm90IGFuIGVkMjU1MTkgc2lnbmF0dXJl {old} v1,%%% {new}");
    let answer = post(addr, "acme", "msg_1", &now.to_string(), &rotating, ORDER).await;
    assert_eq!(answer.status, 201, "{answer:?}");
    assert_eq!(orders.count(), 1);
}

/// What the verifier refuses before the layer sees it; none of it makes an
/// order or a record.
#[tokio::test]
async fn malformed_deliveries_are_refused_before_the_layer() {
    let (addr, orders) = start(MemoryStore::new()).await;
    let now = unix_now();
    let ts = now.to_string();
    let signature = sign(&secret(ACME_SECRET), "msg_1", now, ORDER);

    let no_id = send(
        addr,
        "POST",
        "/webhooks/acme",
        &[
            ("webhook-timestamp", ts.as_bytes()),
            ("webhook-signature", signature.as_bytes()),
        ],
        ORDER,
    )
    .await;
    assert_eq!(no_id.assert_problem(400), problem::MISSING_HEADER);
    assert!(
        no_id.json()["detail"]
            .as_str()
            .unwrap()
            .contains("webhook-id")
    );

    let no_timestamp = send(
        addr,
        "POST",
        "/webhooks/acme",
        &[
            ("webhook-id", b"msg_1"),
            ("webhook-signature", signature.as_bytes()),
        ],
        ORDER,
    )
    .await;
    assert_eq!(no_timestamp.assert_problem(400), problem::MISSING_HEADER);

    // The signed content holds the field as sent, so only digits are a time.
    let signed_plus = post(addr, "acme", "msg_1", &format!("+{now}"), &signature, ORDER).await;
    assert_eq!(signed_plus.assert_problem(400), problem::MALFORMED_HEADER);

    let two_ids = send(
        addr,
        "POST",
        "/webhooks/acme",
        &[
            ("webhook-id", b"msg_1"),
            ("webhook-id", b"msg_2"),
            ("webhook-timestamp", ts.as_bytes()),
            ("webhook-signature", signature.as_bytes()),
        ],
        ORDER,
    )
    .await;
    assert_eq!(two_ids.assert_problem(400), problem::MALFORMED_HEADER);

    let nobody = deliver(addr, "nobody", ACME_SECRET, "msg_1", now, ORDER).await;
    assert_eq!(nobody.assert_problem(404), problem::UNKNOWN_SENDER);

    let big = vec![b' '; webhook::MAX_BODY + 1];
    let too_large = deliver(addr, "acme", ACME_SECRET, "msg_1", now, &big).await;
    assert_eq!(too_large.assert_problem(413), problem::BODY_TOO_LARGE);

    assert_eq!(orders.count(), 0);
    // After all of that, msg_1 is still free.
    let genuine = deliver(addr, "acme", ACME_SECRET, "msg_1", now, ORDER).await;
    assert_eq!(genuine.status, 201, "{genuine:?}");
    assert!(!genuine.replayed());
    assert_eq!(orders.count(), 1);
}

/// Events of other types are acknowledged (so the sender stops retrying)
/// and make no order; a verified `order.created` the receiver cannot read is
/// a 400 that is stored and replayed like any answer.
#[tokio::test]
async fn other_events_are_acknowledged_and_bad_orders_refused() {
    let (addr, orders) = start(MemoryStore::new()).await;
    let now = unix_now();

    let ping = br#"{"type":"ping","data":{}}"#;
    let acked = deliver(addr, "acme", ACME_SECRET, "msg_ping", now, ping).await;
    assert_eq!(acked.status, 200, "{acked:?}");
    assert_eq!(acked.body, br#"{"ignored":"ping"}"#);

    let bad = br#"{"type":"order.created","data":{"sku":"tea-01"}}"#;
    let refused = deliver(addr, "acme", ACME_SECRET, "msg_bad", now, bad).await;
    assert_eq!(refused.assert_problem(400), problem::INVALID_PAYLOAD);
    let again = deliver(addr, "acme", ACME_SECRET, "msg_bad", now + 1, bad).await;
    assert!(again.replayed());
    assert_eq!(again.body, refused.body);

    assert_eq!(orders.count(), 0);
}
