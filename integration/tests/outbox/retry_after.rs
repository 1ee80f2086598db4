//! The relay honours a receiver's `Retry-After` (seconds or an HTTP date),
//! capped by `Relay::retry_after_max` (on SQLite: the delay is the relay's,
//! one rule for every queue). The receiver answers each
//! message's first attempt with a retried status and a `Retry-After`, and
//! the second with 201; it timestamps every attempt. The relay's own backoff
//! is 10 to 50 ms, so a second attempt sooner than the `Retry-After` means
//! the field was ignored (as it was: 0.2 to 0.8 s after 3 to 5 s).

#![cfg(all(feature = "sqlite", feature = "outbox"))]

use crate::common::logs;
use crate::outbox_support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use outbox_support::{WAIT, enqueue_direct, http_sink, until_async};
use tower_idempotency_outbox::{Outbox, View};

/// Per key (the body): the first answer's status and `Retry-After`.
type Plan = HashMap<String, (u16, String)>;

#[derive(Clone, Default)]
struct Receiver {
    plan: Arc<Plan>,
    /// Each key's attempts, with the time each arrived.
    seen: Arc<Mutex<HashMap<String, Vec<Instant>>>>,
}

async fn hook(State(r): State<Receiver>, body: String) -> impl IntoResponse {
    let n = {
        let mut seen = r.seen.lock().unwrap();
        let times = seen.entry(body.clone()).or_default();
        times.push(Instant::now());
        times.len()
    };
    let mut headers = HeaderMap::new();
    match r.plan.get(&body) {
        Some((status, retry_after)) if n == 1 => {
            headers.insert("retry-after", retry_after.parse().unwrap());
            (StatusCode::from_u16(*status).unwrap(), headers)
        }
        _ => (StatusCode::CREATED, headers),
    }
}

async fn receiver(plan: Plan) -> (Receiver, String) {
    let r = Receiver {
        plan: Arc::new(plan),
        ..Receiver::default()
    };
    let app = Router::new()
        .route("/hook", post(hook))
        .with_state(r.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (r, url)
}

/// Seconds from now as an HTTP date, rounded up to the next whole second so
/// that the wait it asks is at least `secs`.
fn date_in(secs: u64) -> String {
    let at = SystemTime::now() + Duration::from_secs(secs + 1);
    httpdate::fmt_http_date(at)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_relay_waits_as_long_as_retry_after_asks() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.sqlite3");
    let plan: Plan = [
        ("429", (429, "5".to_owned())),
        ("503", (503, "4".to_owned())),
        ("409", (409, "3".to_owned())),
        ("date", (503, date_in(3))),
        ("capped", (429, "3600".to_owned())),
        ("garbage", (503, "soon".to_owned())),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    let (r, url) = receiver(plan.clone()).await;
    let messages: Vec<(&str, &str)> = plan.keys().map(|k| (k.as_str(), k.as_str())).collect();
    let outbox = Outbox::sqlite(&db).await.unwrap();
    enqueue_direct(&db, &url, &messages);
    let _relay = outbox
        .relay(http_sink())
        .backoff(Duration::from_millis(10), Duration::from_millis(50))
        .retry_after_max(Duration::from_secs(2))
        .poll_interval(Duration::from_millis(10))
        .spawn();
    until_async(WAIT, "every message delivered", || async {
        outbox.counts().await.unwrap().done == 6
    })
    .await;
    assert_eq!(outbox.list(View::Dead, 10).await.unwrap().len(), 0);
    let seen = r.seen.lock().unwrap().clone();
    let gap = |key: &str| {
        let times = &seen[key];
        assert_eq!(times.len(), 2, "{key}: one refusal, one delivery");
        times[1] - times[0]
    };
    // The cap is 2 s, so each wait is at least min(asked, 2 s).
    for key in ["429", "503", "409", "date", "capped"] {
        assert!(
            gap(key) >= Duration::from_secs(2),
            "{key}: retried after {:?}",
            gap(key)
        );
    }
    // A value that is neither seconds nor a date: the backoff alone.
    assert!(
        gap("garbage") < Duration::from_secs(2),
        "{:?}",
        gap("garbage")
    );
}

/// A retry is logged at INFO with the status, the wait and the next
/// attempt's time. (On a current-thread runtime, so the relay's task logs
/// to this test's thread: `common::logs`.)
#[tokio::test]
async fn retry_after_below_the_cap_is_waited_in_full_and_logged() {
    let retries =
        logs::capture(|level, text| *level == tracing::Level::INFO && text.contains("retrying"));
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.sqlite3");
    let plan: Plan = [("429".to_owned(), (429, "3".to_owned()))].into();
    let (r, url) = receiver(plan).await;
    let outbox = Outbox::sqlite(&db).await.unwrap();
    enqueue_direct(&db, &url, &[("429", "429")]);
    let started = std::time::SystemTime::now();
    let _relay = outbox
        .relay(http_sink())
        .backoff(Duration::from_millis(10), Duration::from_millis(50))
        .poll_interval(Duration::from_millis(10))
        .spawn();
    until_async(WAIT, "delivered", || async {
        outbox.counts().await.unwrap().done == 1
    })
    .await;
    let times = r.seen.lock().unwrap()["429"].clone();
    assert_eq!(times.len(), 2);
    assert!(
        times[1] - times[0] >= Duration::from_secs(3),
        "{:?}",
        times[1] - times[0]
    );
    let logged = retries.kept();
    assert_eq!(logged.len(), 1, "{logged:?}");
    let (fields, next) = logged[0].split_once("next_attempt=").unwrap();
    assert_eq!(
        fields,
        "message=outbox: attempt failed; retrying;id=1;attempt=1;\
         error=HTTP 429, Retry-After 3 s;retry_in_ms=3000;"
    );
    // An HTTP date 3 s after the first attempt (whole seconds).
    let next = httpdate::parse_http_date(next.trim_end_matches(';')).unwrap();
    let after = next
        .duration_since(started - Duration::from_secs(1))
        .unwrap();
    assert!(after >= Duration::from_secs(3), "{after:?}");
    assert!(after <= Duration::from_secs(6), "{after:?}");
}
