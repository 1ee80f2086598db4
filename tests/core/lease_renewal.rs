//! `IdempotencyLayer::max_hold`: a handler slower than its lease keeps
//! its key while it runs (a repeat gets 409, never a second run); past its
//! max hold the same repeat takes the key over and runs again. A renewal that
//! finds the key taken over, or the max hold passing, fires
//! `ClaimedKey::lease_lost`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use http_body_util::BodyExt;
use tokio::sync::Semaphore;
use tower::ServiceExt;
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::hooks::{Event, EventKind};
use tower_idempotency::key::ClaimedKey;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::{Claim, MemoryStore};
use tower_idempotency::test_util::{ManualClock, WatchClaims};

/// Runs, and the gate the first run waits at.
#[derive(Clone)]
struct Handler {
    runs: Arc<AtomicUsize>,
    gate: Arc<Semaphore>,
}

/// The first run waits at the gate, or until its lease is lost; each run
/// answers with its number.
async fn slow(State(h): State<Handler>, claimed: ClaimedKey) -> impl IntoResponse {
    let n = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
    if n == 1 {
        tokio::select! {
            permit = h.gate.acquire() => drop(permit),
            () = claimed.lease_lost() => {
                return (StatusCode::SERVICE_UNAVAILABLE, "run 1: lease lost".to_owned());
            }
        }
    }
    (StatusCode::CREATED, format!("run {n}"))
}

fn app(layer: IdempotencyLayer<MemoryStore, GlobalScope>) -> (Router, Handler) {
    let h = Handler {
        runs: Arc::default(),
        gate: Arc::new(Semaphore::new(0)),
    };
    let router = Router::new()
        .route("/", post(slow))
        .route_layer(layer.require_key(true))
        .with_state(h.clone());
    (router, h)
}

async fn call(app: &Router) -> (u16, String) {
    let request = Request::post("/")
        .header("idempotency-key", "\"k\"")
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

/// Waits until the first run has started (real time, bounded).
async fn until_running(h: &Handler) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while h.runs.load(Ordering::SeqCst) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the handler never ran"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// 1 s leases; the repeat comes 2.5 s (two and a half leases) into the
/// first request.
async fn repeat_after_two_leases(renew: bool) -> (u16, u16, usize) {
    let layer =
        IdempotencyLayer::new(MemoryStore::new(), GlobalScope).lease(Duration::from_secs(1));
    // Without renewal past the first lease: a max hold of one lease.
    let layer = layer.max_hold(Duration::from_secs(if renew { 60 } else { 1 }));
    let (app, h) = app(layer);
    let first = tokio::spawn({
        let app = app.clone();
        async move { call(&app).await }
    });
    until_running(&h).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let repeat = call(&app).await;
    h.gate.add_permits(1);
    let first = first.await.unwrap();
    (first.0, repeat.0, h.runs.load(Ordering::SeqCst))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_lease_outlives_a_slow_handler() {
    // Renewed: the repeat meets the first request in flight; one run.
    assert_eq!(repeat_after_two_leases(true).await, (201, 409, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_max_hold_the_repeat_takes_the_key_over_and_runs_again() {
    // The contrast: the same timing, renewed only up to a max hold of one
    // lease: the first run hears that its lease is lost at the max hold
    // (503 from the handler), the repeat takes the key over, and the
    // handler runs twice.
    assert_eq!(repeat_after_two_leases(false).await, (503, 201, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_that_finds_the_key_taken_over_signals_lease_lost() {
    let clock = ManualClock::new(1_700_000_000_000);
    let store = MemoryStore::with_clock(clock.clone());
    let events = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = events.clone();
    let layer = IdempotencyLayer::new(store, GlobalScope)
        .lease(Duration::from_millis(600))
        .max_hold(Duration::from_secs(60))
        .on_event(move |e: &Event<'_>| {
            if matches!(e.kind, EventKind::TakenOver | EventKind::LeaseLost) {
                log.lock().unwrap().push((e.kind, e.key.map(str::to_owned)));
            }
        });
    let (app, h) = app(layer);
    let first = tokio::spawn({
        let app = app.clone();
        async move { call(&app).await }
    });
    until_running(&h).await;
    // The store's clock jumps past the lease before the next renewal (a
    // holder stalled for longer than its lease): the repeat takes over.
    // (Should a renewal land between the jump and the repeat, it extends
    // the lease on the new clock, and the next jump passes it.)
    let mut repeat = (0, String::new());
    for _ in 0..10 {
        clock.advance(Duration::from_secs(10));
        repeat = call(&app).await;
        if repeat.0 != 409 {
            break;
        }
    }
    assert_eq!(repeat, (201, "run 2".to_owned()));
    // The first holder's next renewal is refused: its handler learns it.
    let first = tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .expect("lease_lost fired")
        .unwrap();
    assert_eq!(first, (503, "run 1: lease lost".to_owned()));
    // The 503 was not stored and released nothing: the replay is run 2's.
    assert_eq!(call(&app).await, (201, "run 2".to_owned()));
    assert_eq!(h.runs.load(Ordering::SeqCst), 2);
    // The event hook heard both, once each, in order.
    let key = Some("k".to_owned());
    assert_eq!(
        *events.lock().unwrap(),
        [
            (EventKind::TakenOver, key.clone()),
            (EventKind::LeaseLost, key)
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_stop_at_the_max_hold() {
    let layer = IdempotencyLayer::new(MemoryStore::new(), GlobalScope)
        .lease(Duration::from_millis(300))
        .max_hold(Duration::from_secs(1));
    let (app, h) = app(layer);
    let first = tokio::spawn({
        let app = app.clone();
        async move { call(&app).await }
    });
    // Past the max hold and its last lease the first run hears of it.
    let first = tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .expect("lease_lost fired after the max hold")
        .unwrap();
    assert_eq!(first, (503, "run 1: lease lost".to_owned()));
    assert_eq!(h.runs.load(Ordering::SeqCst), 1);
}

mod confirm_and_unknown {
    //! `ClaimedKey::confirm`, `ClaimedKey::taken_over` and
    //! `policy::OutcomeUnknown` (issue 36, items 3 and 5), separate mode on
    //! a store judged by a manual clock.

    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use axum::extract::State;
    use axum::http::StatusCode;
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;
    use axum::{Extension, Router};
    use tokio::sync::Semaphore;
    use tower_idempotency::IdempotencyLayer;
    use tower_idempotency::key::{ClaimedKey, NotConfirmed};
    use tower_idempotency::policy::OutcomeUnknown;
    use tower_idempotency::problem::types;
    use tower_idempotency::scope::GlobalScope;
    use tower_idempotency::store::MemoryStore;
    use tower_idempotency::test_util::ManualClock;

    #[derive(Clone)]
    struct Effects {
        runs: Arc<AtomicUsize>,
        effects: Arc<AtomicUsize>,
        gate: Arc<Semaphore>,
    }

    /// The first run waits at the gate; every run confirms its claim right
    /// before its effect, and answers what it saw.
    async fn confirming(State(e): State<Effects>, claimed: ClaimedKey) -> Response {
        let n = e.runs.fetch_add(1, Ordering::SeqCst) + 1;
        if n == 1 {
            drop(e.gate.acquire().await.unwrap());
        }
        match claimed.confirm().await {
            Ok(_) => {
                e.effects.fetch_add(1, Ordering::SeqCst);
                let body = format!("run {n}, taken over: {}", claimed.taken_over());
                (StatusCode::CREATED, body).into_response()
            }
            Err(NotConfirmed::Lost) => {
                (StatusCode::SERVICE_UNAVAILABLE, format!("run {n}: lost")).into_response()
            }
            Err(e) => panic!("{e}"),
        }
    }

    /// The first run cannot tell whether its effect happened.
    async fn unsure(State(e): State<Effects>, claimed: ClaimedKey) -> Response {
        let n = e.runs.fetch_add(1, Ordering::SeqCst) + 1;
        if n == 1 {
            let answer = (StatusCode::SERVICE_UNAVAILABLE, "commit lost");
            return (Extension(OutcomeUnknown), answer).into_response();
        }
        let body = format!("run {n}, taken over: {}", claimed.taken_over());
        (StatusCode::CREATED, body).into_response()
    }

    fn app(
        handler: axum::routing::MethodRouter<Effects>,
        clock: &ManualClock,
    ) -> (Router, Effects) {
        let store = MemoryStore::with_clock(clock.clone());
        // A max hold that ends before the first renewal (a third of a
        // lease in): as a paused process renews nothing, no renewal keeps
        // the key past its first lease.
        let layer = IdempotencyLayer::new(store, GlobalScope)
            .lease(Duration::from_secs(1))
            .max_hold(Duration::from_millis(100))
            .require_key(true);
        let e = Effects {
            runs: Arc::default(),
            effects: Arc::default(),
            gate: Arc::new(Semaphore::new(0)),
        };
        let router = Router::new()
            .route("/", handler)
            .route_layer(layer)
            .with_state(e.clone());
        (router, e)
    }

    async fn call(app: &Router) -> (u16, String, Option<String>) {
        use http_body_util::BodyExt;
        use tower::ServiceExt;
        let request = axum::extract::Request::post("/")
            .header("idempotency-key", "\"k\"")
            .body(axum::body::Body::empty())
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        let status = response.status().as_u16();
        let retry_after = response
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_owned());
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (
            status,
            String::from_utf8(body.to_vec()).unwrap(),
            retry_after,
        )
    }

    /// A holder paused past its lease resumes after a repeat took its key
    /// over and made the effect: its confirmation fails, so it makes no
    /// second effect. The repeat saw it took over.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_paused_holder_is_not_confirmed_after_a_takeover() {
        let clock = ManualClock::new(1_700_000_000_000);
        let (app, e) = app(post(confirming), &clock);
        let first = tokio::spawn({
            let app = app.clone();
            async move { call(&app).await }
        });
        while e.runs.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        // The holder is paused past its 1 s lease: on the store's clock,
        // and on its own (its confirmation of the first lease runs out).
        clock.advance(Duration::from_secs(2));
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let repeat = call(&app).await;
        assert_eq!(
            (repeat.0, repeat.1.as_str()),
            (201, "run 2, taken over: true")
        );
        e.gate.add_permits(1);
        let first = first.await.unwrap();
        assert_eq!((first.0, first.1.as_str()), (503, "run 1: lost"));
        assert_eq!(e.effects.load(Ordering::SeqCst), 1);
        // The replay is the effect's answer.
        assert_eq!(call(&app).await.1, "run 2, taken over: true");
    }

    /// A holder that still holds its key is confirmed, and was no takeover.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_live_holder_is_confirmed() {
        let clock = ManualClock::new(1_700_000_000_000);
        let (app, e) = app(post(confirming), &clock);
        e.gate.add_permits(1);
        let first = call(&app).await;
        assert_eq!(
            (first.0, first.1.as_str()),
            (201, "run 1, taken over: false")
        );
        assert_eq!(e.effects.load(Ordering::SeqCst), 1);
    }

    /// An unknown outcome is answered 503 `outcome-unknown` (Retry-After:
    /// the 1 s lease) and keeps the key: a repeat gets 409 until the lease
    /// ends, then takes it over and runs, told so.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_unknown_outcome_keeps_the_key_until_its_lease_ends() {
        let clock = ManualClock::new(1_700_000_000_000);
        let (app, e) = app(post(unsure), &clock);
        let (status, body, retry_after) = call(&app).await;
        assert_eq!((status, retry_after.as_deref()), (503, Some("1")));
        let problem: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(problem["type"], types::OUTCOME_UNKNOWN, "{problem}");
        let repeat = call(&app).await;
        assert_eq!(repeat.0, 409, "{repeat:?}");
        clock.advance(Duration::from_secs(2));
        let retry = call(&app).await;
        assert_eq!(
            (retry.0, retry.1.as_str()),
            (201, "run 2, taken over: true")
        );
        assert_eq!(e.runs.load(Ordering::SeqCst), 2);
    }
}

/// The layer's one renewal task renews the claims due together in one call
/// to `Store::renew_all`: three requests claimed 20 ms apart (a 3 s lease:
/// a renewal every second, and claims due within 250 ms of the first go
/// with it) are renewed in calls of all three, never one by one, while
/// they run 2.5 s; each keeps its key (a repeat gets 409).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_due_together_are_renewed_in_one_call() {
    let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = calls.clone();
    let store = WatchClaims::new(MemoryStore::new(), |_: &Claim| {})
        .on_renew_all(move |n| seen.lock().unwrap().push(n));
    let layer = IdempotencyLayer::new(store.clone(), GlobalScope).lease(Duration::from_secs(3));
    let app = Router::new()
        .route(
            "/",
            post(|| async {
                tokio::time::sleep(Duration::from_millis(2500)).await;
                StatusCode::CREATED
            }),
        )
        .route_layer(layer.require_key(true));
    let call = |key: &'static str| {
        let app = app.clone();
        async move {
            let request = Request::post("/")
                .header("idempotency-key", format!("\"{key}\""))
                .body(Body::empty())
                .unwrap();
            app.oneshot(request).await.unwrap().status().as_u16()
        }
    };
    let mut running = Vec::new();
    for key in ["a", "b", "c"] {
        running.push(tokio::spawn(call(key)));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(1400)).await;
    assert_eq!(call("a").await, 409);
    for request in running {
        assert_eq!(request.await.unwrap(), 201);
    }
    let calls = calls.lock().unwrap().clone();
    assert!(!calls.is_empty(), "no renewal in 2.5 s of a 3 s lease");
    assert!(calls.iter().all(|&n| n == 3), "claims per call: {calls:?}");
}
