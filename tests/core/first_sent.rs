//! No second run after a key expired, end to end: the crate's client layer
//! stamps `Repeatability-First-Sent` on its first attempt, the server's
//! layer refuses a retry that outlived its record. The store, the layer and
//! the client share one `ManualClock`, so nothing sleeps.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Request, StatusCode};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use tower::retry::RetryLayer;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_idempotency::client::{BoxError, IdempotencyKeyLayer, RetryPolicy};
use tower_idempotency::first_sent::IDEMPOTENCY_TTL;
use tower_idempotency::problem::types;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::test_util::{ManualClock, START_MS};
use tower_idempotency::{IdempotencyLayer, MemoryStore};

const TTL: Duration = Duration::from_secs(60);

/// The server: a handler that counts its runs, behind the guarded layer.
fn server(clock: &ManualClock, runs: &Arc<AtomicUsize>) -> Router {
    let counter = runs.clone();
    Router::new()
        .route(
            "/charges",
            post(move || async move {
                let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
                (StatusCode::CREATED, format!("charge {n}"))
            }),
        )
        .route_layer(
            IdempotencyLayer::new(MemoryStore::with_clock(clock.clone()), GlobalScope)
                .ttl(TTL)
                .refuse_expired_retries()
                .advertise_retention(IDEMPOTENCY_TTL)
                .clock(clock.clone()),
        )
}

/// What the transport saw of each attempt: its key and first-sent fields.
type Attempts = Arc<Mutex<Vec<(HeaderValue, Option<HeaderValue>)>>>;

/// One call through the client stack (key layer, retries, a transport to
/// the server). The transport loses the first attempt's answer after the
/// server handled it (a dropped connection), then moves the clock on by
/// `pause`: the retry comes that much later.
async fn call(
    app: Router,
    clock: &ManualClock,
    pause: Duration,
    send_first_sent: bool,
) -> (StatusCode, HeaderMap, Bytes, Attempts) {
    let attempts: Attempts = Arc::default();
    let log = attempts.clone();
    let transport_clock = clock.clone();
    let transport = tower::service_fn(move |req: Request<Full<Bytes>>| {
        let (app, log, clock) = (app.clone(), log.clone(), transport_clock.clone());
        async move {
            let first = {
                let mut log = log.lock().unwrap();
                let key = req.headers()["idempotency-key"].clone();
                log.push((key, req.headers().get("repeatability-first-sent").cloned()));
                log.len() == 1
            };
            let response = app.oneshot(req.map(Body::new)).await.unwrap();
            if first {
                clock.advance(pause);
                return Err::<_, BoxError>("connection reset before the answer".into());
            }
            Ok(response)
        }
    });
    let mut client = ServiceBuilder::new()
        .layer(
            IdempotencyKeyLayer::new()
                .send_first_sent(send_first_sent)
                .clock(clock.clone()),
        )
        .layer(RetryLayer::new(
            RetryPolicy::new().retries(1).base_delay(Duration::ZERO),
        ))
        .service(transport);
    let request = Request::post("/charges")
        .body(Full::new(Bytes::from_static(b"amount=5")))
        .unwrap();
    let response = client.ready().await.unwrap().call(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (parts.status, parts.headers, body, attempts)
}

fn assert_one_call(attempts: &Attempts, first_sent: Option<&str>) {
    let attempts = attempts.lock().unwrap();
    assert_eq!(attempts.len(), 2, "the first attempt and one retry");
    assert_eq!(attempts[0].0, attempts[1].0, "one key for both attempts");
    for (_, sent) in attempts.iter() {
        assert_eq!(sent.as_ref().map(|v| v.to_str().unwrap()), first_sent);
    }
}

#[tokio::test]
async fn a_retry_after_the_record_expired_is_refused_not_run() {
    let clock = ManualClock::new(START_MS);
    let runs = Arc::new(AtomicUsize::new(0));
    let app = server(&clock, &runs);
    let (status, headers, body, attempts) =
        call(app, &clock, TTL + Duration::from_secs(1), true).await;
    assert_eq!(status, StatusCode::PRECONDITION_FAILED);
    assert_eq!(headers["content-type"], "application/problem+json");
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["type"], types::EXPIRED_RETRY);
    assert_eq!(problem["status"], 412);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
    // 2027-01-15T08:00:00Z: the manual clock when the call began.
    assert_one_call(&attempts, Some("Fri, 15 Jan 2027 08:00:00 GMT"));
}

#[tokio::test]
async fn without_the_field_the_expired_retry_runs_again() {
    let clock = ManualClock::new(START_MS);
    let runs = Arc::new(AtomicUsize::new(0));
    let app = server(&clock, &runs);
    let (status, headers, body, attempts) =
        call(app, &clock, TTL + Duration::from_secs(1), false).await;
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.get("idempotent-replayed").is_none());
    assert_eq!(body, "charge 2");
    assert_eq!(runs.load(Ordering::SeqCst), 2, "the guard needs the field");
    assert_one_call(&attempts, None);
}

#[tokio::test]
async fn a_retry_within_the_ttl_is_replayed_with_the_retention() {
    let clock = ManualClock::new(START_MS);
    let runs = Arc::new(AtomicUsize::new(0));
    let app = server(&clock, &runs);
    let (status, headers, body, attempts) =
        call(app, &clock, TTL - Duration::from_secs(1), true).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(headers["idempotency-ttl"], "60");
    assert_eq!(body, "charge 1");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_one_call(&attempts, Some("Fri, 15 Jan 2027 08:00:00 GMT"));
}

async fn send(app: &Router, first_sent: &str) -> (StatusCode, serde_json::Value) {
    let request = Request::post("/charges")
        .header("idempotency-key", "\"k\"")
        .header("repeatability-first-sent", first_sent)
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or_default())
}

#[tokio::test]
async fn unusable_first_sent_fields_are_400_before_the_handler() {
    let clock = ManualClock::new(START_MS);
    let runs = Arc::new(AtomicUsize::new(0));
    let app = server(&clock, &runs);
    for value in ["yesterday", "1800000000", "Fri, 15 Jan 2027 08:01:01 GMT"] {
        let (status, problem) = send(&app, value).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{value}");
        assert_eq!(problem["type"], types::INVALID_FIRST_SENT, "{value}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    // Within the skew (60 s ahead) it is accepted.
    let (status, _) = send(&app, "Fri, 15 Jan 2027 08:01:00 GMT").await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_live_record_answers_however_old_the_first_attempt() {
    let clock = ManualClock::new(START_MS);
    let runs = Arc::new(AtomicUsize::new(0));
    let app = server(&clock, &runs);
    let (status, _) = send(&app, "Fri, 15 Jan 2027 08:00:00 GMT").await;
    assert_eq!(status, StatusCode::CREATED);
    // A first-sent time older than the TTL, but the record is live: replayed.
    let (status, _) = send(&app, "Fri, 15 Jan 2027 07:00:00 GMT").await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn the_refused_claim_is_given_back() {
    let clock = ManualClock::new(START_MS);
    let runs = Arc::new(AtomicUsize::new(0));
    let app = server(&clock, &runs);
    let (status, _) = send(&app, "Fri, 15 Jan 2027 08:00:00 GMT").await;
    assert_eq!(status, StatusCode::CREATED);
    clock.advance(TTL * 2);
    let (status, problem) = send(&app, "Fri, 15 Jan 2027 08:00:00 GMT").await;
    assert_eq!(status, StatusCode::PRECONDITION_FAILED);
    assert_eq!(
        problem["detail"],
        "this request was first sent more than 60 s ago, longer than idempotency keys are kept, and its key has no record left; it may have been processed already, so it was not processed again; check the operation's outcome before sending it anew with a new key"
    );
    // The key is free again (not held in flight: no 409): a fresh first
    // attempt with it runs.
    let (status, _) = send(&app, "Fri, 15 Jan 2027 08:02:00 GMT").await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}
