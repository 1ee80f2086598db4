//! The Stripe-shaped route of `examples/webhook.rs` over real sockets: the
//! key is the event's `id` in the JSON body.

use crate::common;

use crate::webhook_example as webhook;

use std::net::SocketAddr;
use std::sync::Arc;

use common::{Raw, send, serve};
use tokio::sync::Barrier;
use tower_idempotency::problem::types;
use tower_idempotency::{MemoryStore, SqliteStore, Store};
use webhook::stripe::{self, Handled};

const EVENT: &[u8] =
    br#"{"id":"evt_1NG8Du2eZvKYlo2C","type":"charge.succeeded","data":{"object":{"amount":500}}}"#;

async fn start<St: Store>(store: St) -> (SocketAddr, Handled) {
    let handled = Handled::default();
    (serve(stripe::router(store, handled.clone())).await, handled)
}

async fn deliver(addr: SocketAddr, body: &[u8]) -> Raw {
    let headers: &[(&str, &[u8])] = &[("content-type", b"application/json")];
    send(addr, "POST", "/stripe/events", headers, body).await
}

/// The same event twice at once, on two connections released together:
/// the handler runs once; the other delivery gets the first answer byte for
/// byte, or 409 while the first is still being handled.
async fn concurrent_redelivery_runs_once<St: Store>(store: St) {
    let (addr, handled) = start(store).await;
    let barrier = Arc::new(Barrier::new(2));
    let deliveries: Vec<_> = (0..2)
        .map(|_| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                deliver(addr, EVENT).await
            })
        })
        .collect();
    let mut answers = Vec::new();
    for delivery in deliveries {
        answers.push(delivery.await.unwrap());
    }
    assert_eq!(
        handled.all(),
        [(
            "evt_1NG8Du2eZvKYlo2C".to_owned(),
            "charge.succeeded".to_owned()
        )]
    );
    let (firsts, others): (Vec<&Raw>, Vec<&Raw>) = answers
        .iter()
        .partition(|a| a.status == 200 && !a.replayed());
    assert_eq!(firsts.len(), 1, "{answers:?}");
    let first = firsts[0];
    assert_eq!(
        first.json(),
        serde_json::json!({"received": "evt_1NG8Du2eZvKYlo2C", "type": "charge.succeeded", "handled": 1})
    );
    let other = others[0];
    if other.status == 409 {
        assert_eq!(other.assert_problem(409), types::IN_FLIGHT);
    } else {
        assert_eq!(other.status, 200, "{other:?}");
        assert!(other.replayed());
        assert_eq!(other.body, first.body);
        assert_eq!(other.stable_headers(), first.stable_headers());
    }

    // A later redelivery: the stored answer, byte for byte.
    let later = deliver(addr, EVENT).await;
    assert_eq!(later.status, 200);
    assert!(later.replayed());
    assert_eq!(later.body, first.body);
    assert_eq!(handled.all().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_redelivery_runs_the_handler_once() {
    concurrent_redelivery_runs_once(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_redelivery_runs_the_handler_once_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("stripe.sqlite3"))
        .await
        .unwrap();
    concurrent_redelivery_runs_once(store).await;
}

#[tokio::test]
async fn the_same_id_with_another_body_is_a_mismatch() {
    let (addr, handled) = start(MemoryStore::new()).await;
    assert_eq!(deliver(addr, EVENT).await.status, 200);
    let altered =
        br#"{"id":"evt_1NG8Du2eZvKYlo2C","type":"charge.refunded","data":{"object":{"amount":500}}}"#;
    let answer = deliver(addr, altered).await;
    assert_eq!(answer.assert_problem(422), types::MISMATCH);
    assert_eq!(handled.all().len(), 1);
}

#[tokio::test]
async fn events_without_a_usable_id_are_refused_before_the_handler() {
    let (addr, handled) = start(MemoryStore::new()).await;
    let no_id = deliver(addr, br#"{"type":"charge.succeeded","data":{}}"#).await;
    assert_eq!(no_id.assert_problem(400), types::MISSING_KEY);
    let null_id = deliver(addr, br#"{"id":null,"type":"charge.succeeded"}"#).await;
    assert_eq!(null_id.assert_problem(400), types::MISSING_KEY);

    let not_json = deliver(addr, b"id=evt_1&type=charge.succeeded").await;
    assert_eq!(not_json.assert_problem(400), types::INVALID_KEY);
    assert_eq!(
        not_json.json()["detail"],
        "this endpoint reads the idempotency key from the JSON body, and the body is not JSON"
    );
    let object_id = deliver(addr, br#"{"id":{"nested":1}}"#).await;
    assert_eq!(object_id.assert_problem(400), types::INVALID_KEY);
    let control = deliver(addr, br#"{"id":"evt\u0000x"}"#).await;
    assert_eq!(control.assert_problem(400), types::INVALID_KEY);
    let long = format!(r#"{{"id":"{}"}}"#, "e".repeat(256));
    assert_eq!(
        deliver(addr, long.as_bytes()).await.assert_problem(400),
        types::INVALID_KEY
    );
    assert_eq!(handled.all(), []);
}
