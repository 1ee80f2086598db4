//! `wait_in_flight`: a waiter whose client goes away never runs the handler,
//! even when its client leaves while the claim that wins it the key is on
//! its way to the store (a store call takes time: a network round trip).
//! The claim it won is given back, so the key is free for the client's
//! retry.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::routing::post;
use tokio::sync::Notify;
use tower::ServiceExt;
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::response::StoredResponse;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::{
    Claim, ClaimRequest, Completion, FencingToken, MemoryStore, RecordId, Refusal, Store,
    StoreError,
};

/// A memory store whose claims answer 300 ms late once `slow` is set, and
/// which counts the claims it answered "in flight".
#[derive(Clone, Default)]
struct SlowClaims {
    inner: MemoryStore,
    slow: Arc<AtomicBool>,
    in_flight: Arc<AtomicUsize>,
}

impl Store for SlowClaims {
    async fn claim(&self, request: ClaimRequest) -> Result<Claim, StoreError> {
        let claim = self.inner.claim(request).await?;
        if let Claim::Refused(Refusal::InFlight { .. }) = claim {
            self.in_flight.fetch_add(1, Ordering::SeqCst);
        }
        if self.slow.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        Ok(claim)
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        self.inner.complete(id, token, response).await
    }

    async fn release(&self, id: RecordId, token: FencingToken) -> Result<bool, StoreError> {
        self.inner.release(id, token).await
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.inner.purge_expired().await
    }

    async fn renew(
        &self,
        id: RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.inner.renew(id, token, lease).await
    }
}

fn request(fail: bool) -> Request<Body> {
    let mut request = Request::post("/credit").header("idempotency-key", "\"k\"");
    if fail {
        request = request.header("x-fail", "1");
    }
    request.body(Body::empty()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_client_left_during_its_winning_claim_does_not_run() {
    let store = SlowClaims::default();
    let runs = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(Notify::new());
    let (counter, opened) = (runs.clone(), gate.clone());
    // The first request (x-fail) waits at the gate, then answers 500: its
    // key is given back.
    let handler = move |headers: HeaderMap| {
        let (counter, opened) = (counter.clone(), opened.clone());
        async move {
            counter.fetch_add(1, Ordering::SeqCst);
            if headers.contains_key("x-fail") {
                opened.notified().await;
                return StatusCode::INTERNAL_SERVER_ERROR;
            }
            StatusCode::CREATED
        }
    };
    let app = Router::new().route("/credit", post(handler)).route_layer(
        IdempotencyLayer::new(store.clone(), GlobalScope).wait_in_flight(Duration::from_secs(10)),
    );
    let first = tokio::spawn(app.clone().oneshot(request(true)));
    while runs.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let waiter = tokio::spawn(app.clone().oneshot(request(false)));
    while store.in_flight.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // From now on each claim takes 300 ms. The first gives its key back;
    // the waiter is woken and claims; its client leaves mid-claim.
    store.slow.store(true, Ordering::SeqCst);
    gate.notify_one();
    assert_eq!(
        first.await.unwrap().unwrap().status(),
        StatusCode::INTERNAL_SERVER_ERROR
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the waiter's handler ran");
    // Its claim was given back: the client's retry runs at once.
    store.slow.store(false, Ordering::SeqCst);
    let retry = app.oneshot(request(false)).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(!retry.headers().contains_key("idempotent-replayed"));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}
