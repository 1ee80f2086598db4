//! `MemoryStore`'s capacity: expired records make room first; a store full
//! of live records refuses new keys with `StoreError::Full`, which the layer
//! answers with 503, `Retry-After` and a problem document.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::response::{StoredBody, StoredResponse};
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::{
    Claim, ClaimRequest, Completion, FencingToken, Inspect, MemoryStore, RecordCounts, RecordId,
    Refusal, Store, StoreError,
};
use tower_idempotency::test_util::ManualClock;

fn claim(key: &str, ttl_secs: u64, token: FencingToken) -> ClaimRequest {
    ClaimRequest::new(RecordId::new("alice", key), Fingerprint([7; 32]), token)
        .with_lease(Duration::from_secs(5))
        .with_ttl(Duration::from_secs(ttl_secs))
}

const ACQUIRED: Claim = Claim::Acquired { taken_over: false };

/// The capacity and the hint of a `Full` error; panics on anything else.
fn full(result: Result<Claim, StoreError>) -> (usize, Duration, String) {
    match result {
        Err(e @ StoreError::Full { .. }) => {
            let text = e.to_string();
            let StoreError::Full {
                capacity,
                retry_after,
            } = e
            else {
                unreachable!()
            };
            (capacity, retry_after, text)
        }
        other => panic!("expected StoreError::Full, got {other:?}"),
    }
}

fn counts(in_flight: u64, stuck: u64, completed: u64, expired: u64) -> RecordCounts {
    RecordCounts {
        in_flight,
        stuck,
        completed,
        expired,
    }
}

#[tokio::test]
async fn a_full_store_evicts_expired_records_first_then_refuses() {
    let clock = ManualClock::new(1_000_000);
    let store = MemoryStore::with_clock(clock.clone()).max_records(3);
    assert_eq!(store.capacity(), 3);
    let t1 = FencingToken::random();
    let t2 = FencingToken::random();
    assert_eq!(store.claim(claim("k1", 10, t1)).await.unwrap(), ACQUIRED);
    assert_eq!(store.claim(claim("k2", 100, t2)).await.unwrap(), ACQUIRED);
    assert_eq!(
        store
            .claim(claim("k3", 100, FencingToken::random()))
            .await
            .unwrap(),
        ACQUIRED
    );

    // Full of live records: refused, with the time until k1's TTL ends.
    let refused = store.claim(claim("k4", 100, FencingToken::random())).await;
    assert_eq!(
        full(refused),
        (
            3,
            Duration::from_secs(10),
            "idempotency store full: 3 live records".to_owned()
        )
    );
    clock.advance(Duration::from_millis(5_500));
    let refused = store.claim(claim("k4", 100, FencingToken::random())).await;
    assert_eq!(full(refused).1, Duration::from_millis(4_500));
    assert_eq!(store.len(), 3);
    assert_eq!(store.counts().await.unwrap(), counts(0, 3, 0, 0));

    // k1's TTL ends: the next new key takes its place.
    clock.advance(Duration::from_millis(4_500));
    assert_eq!(store.counts().await.unwrap(), counts(0, 2, 0, 1));
    let t4 = FencingToken::random();
    assert_eq!(store.claim(claim("k4", 100, t4)).await.unwrap(), ACQUIRED);
    assert_eq!(store.len(), 3);
    assert_eq!(store.counts().await.unwrap(), counts(1, 2, 0, 0));

    // Full again; the earliest TTL end is 90 s away, the hint at most 60 s.
    let refused = store.claim(claim("k5", 100, FencingToken::random())).await;
    assert_eq!(full(refused).1, Duration::from_secs(60));

    // Keys the store holds are answered as usual when full.
    let response = StoredResponse {
        status: http::StatusCode::CREATED,
        headers: Vec::new(),
        body: StoredBody::Complete(Bytes::from_static(b"done")),
        trailers: None,
    };
    assert_eq!(
        store
            .complete(RecordId::new("alice", "k2"), t2, response.clone())
            .await
            .unwrap(),
        Completion::Stored
    );
    assert_eq!(
        store
            .claim(claim("k2", 100, FencingToken::random()))
            .await
            .unwrap(),
        Claim::Refused(Refusal::Completed(response))
    );
    assert_eq!(
        store
            .claim(claim("k4", 100, FencingToken::random()))
            .await
            .unwrap(),
        Claim::Refused(Refusal::InFlight {
            lease_remaining: Duration::from_secs(5)
        })
    );
    assert_eq!(store.counts().await.unwrap(), counts(1, 1, 1, 0));

    // A release makes room at once.
    assert!(
        store
            .release(RecordId::new("alice", "k4"), t4)
            .await
            .unwrap()
    );
    assert_eq!(
        store
            .claim(claim("k5", 100, FencingToken::random()))
            .await
            .unwrap(),
        ACQUIRED
    );
    assert_eq!(store.len(), 3);
    assert_eq!(store.counts().await.unwrap(), counts(1, 1, 1, 0));
}

#[tokio::test]
async fn the_layer_answers_a_full_store_with_503_and_retry_after() {
    let clock = ManualClock::new(1_000_000);
    let store = MemoryStore::with_clock(clock.clone()).max_records(1);
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let app = Router::new()
        .route(
            "/orders",
            post(move || {
                counter.fetch_add(1, Ordering::SeqCst);
                async { (StatusCode::CREATED, "created") }
            }),
        )
        .route_layer(
            IdempotencyLayer::new(store.clone(), GlobalScope).ttl(Duration::from_secs(30)),
        );
    let order = |key: &str| {
        Request::post("/orders")
            .header("idempotency-key", key)
            .body(Body::from("amount=5"))
            .unwrap()
    };

    let first = app.clone().oneshot(order("\"a\"")).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    clock.advance(Duration::from_millis(12_500));
    let refused = app.clone().oneshot(order("\"b\"")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.headers()["retry-after"], "18");
    assert_eq!(
        refused.headers()["content-type"],
        "application/problem+json"
    );
    let body = refused.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        body,
        Bytes::from_static(concat!(
            r#"{"type":"https://docs.rs/tower-idempotency/latest/tower_idempotency/problem/#store-full","#,
            r#""title":"Idempotency store full","status":503,"#,
            r#""detail":"the idempotency store has no room for a new key; the request was not processed; retry in 18 s"}"#
        ).as_bytes())
    );
    // The key already recorded is replayed as usual.
    let replay = app.clone().oneshot(order("\"a\"")).await.unwrap();
    assert_eq!(replay.status(), StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "only the first request ran");

    // 18 s later the first record's TTL has ended: the refused key runs.
    clock.advance(Duration::from_secs(18));
    let later = app.clone().oneshot(order("\"b\"")).await.unwrap();
    assert_eq!(later.status(), StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(store.len(), 1);
    assert_eq!(store.counts().await.unwrap(), counts(0, 0, 1, 0));
}

#[test]
fn the_default_capacity_is_100_000_records() {
    assert_eq!(MemoryStore::DEFAULT_CAPACITY, 100_000);
    assert_eq!(MemoryStore::new().capacity(), 100_000);
    assert_eq!(MemoryStore::with_max_records(7).capacity(), 7);
}

#[tokio::test]
async fn expired_records_are_evicted_only_when_the_store_is_full() {
    let clock = ManualClock::new(1_000_000);
    let store = MemoryStore::with_clock(clock.clone()).max_records(2);
    assert_eq!(
        store
            .claim(claim("k1", 1, FencingToken::random()))
            .await
            .unwrap(),
        ACQUIRED
    );
    clock.advance(Duration::from_secs(2));
    // Below capacity: the expired k1 stays until a purge or a full store.
    assert_eq!(
        store
            .claim(claim("k2", 100, FencingToken::random()))
            .await
            .unwrap(),
        ACQUIRED
    );
    assert_eq!(store.len(), 2);
    assert_eq!(store.counts().await.unwrap(), counts(1, 0, 0, 1));
    // Full: k1 makes room for k3.
    assert_eq!(
        store
            .claim(claim("k3", 100, FencingToken::random()))
            .await
            .unwrap(),
        ACQUIRED
    );
    assert_eq!(store.len(), 2);
    assert_eq!(store.counts().await.unwrap(), counts(2, 0, 0, 0));
    assert_eq!(store.purge_expired().await.unwrap(), 0);
    let refused = store.claim(claim("k4", 100, FencingToken::random())).await;
    assert_eq!(full(refused).1, Duration::from_secs(60));
}
