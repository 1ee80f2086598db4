//! The outbox's relay on SQLite: which answers are retried and which make
//! dead letters, requeueing, attempts limits, two relays on one database,
//! the absence of an ordering promise, and the admin router.

#![cfg(all(feature = "sqlite", feature = "outbox"))]

use crate::outbox_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use outbox_support::{
    Answer, Downstream, WAIT, enqueue_direct, http_sink, rusqlite_conn, script, until, until_async,
};
use tower_idempotency_outbox::{
    self as outbox, Delivery, HttpSink, Message, Outbox, Outcome, View,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retryable_statuses_are_retried_others_dead_letter_until_requeued() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.sqlite3");
    let accept_all = Arc::new(AtomicBool::new(false));
    let flag = accept_all.clone();
    // The body is the status of the first attempt (a retryable one) or of
    // every attempt (a refusal), until `accept_all`.
    let ds = Downstream::start(
        script(move |_, body, n| {
            let status: u16 = std::str::from_utf8(body).unwrap().parse().unwrap();
            let retryable = [408, 409, 425, 429, 500, 503].contains(&status);
            if flag.load(Ordering::SeqCst) || (retryable && n > 0) {
                Answer::Pass
            } else {
                Answer::FailBefore(status)
            }
        }),
        Duration::ZERO,
    )
    .await;
    let outbox = Outbox::sqlite(&db).await.unwrap();
    let statuses = [
        "408", "409", "425", "429", "500", "503", "400", "404", "422",
    ];
    let messages: Vec<(&str, &str)> = statuses.iter().map(|s| (*s, *s)).collect();
    enqueue_direct(&db, &ds.url(), &messages);
    // A duplicate key is refused: a key names one message.
    let dup = Message::with_key("408", ds.url(), "application/json", b"x".to_vec()).unwrap();
    assert!(!outbox::sqlite::enqueue(&rusqlite_conn(&db), &dup).unwrap());
    let _relay = outbox
        .relay(http_sink())
        .backoff(Duration::from_millis(5), Duration::from_millis(20))
        .poll_interval(Duration::from_millis(10))
        .spawn();
    until_async(WAIT, "6 done, 3 dead", || async {
        let c = outbox.counts().await.unwrap();
        (c.done, c.dead) == (6, 3)
    })
    .await;
    for s in &statuses[..6] {
        assert_eq!(ds.attempts_of(s), 2, "{s}: one failure, one delivery");
        assert_eq!(ds.effects().get(*s), Some(&1));
    }
    let dead = outbox.list(View::Dead, 100).await.unwrap();
    let mut seen: Vec<(String, u32, Option<String>)> = dead
        .iter()
        .map(|e| (e.key.clone(), e.attempts, e.last_error.clone()))
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        ["400", "404", "422"]
            .map(|s| (s.to_owned(), 1, Some(format!("HTTP {s}"))))
            .to_vec()
    );
    for s in &statuses[6..] {
        assert_eq!(ds.attempts_of(s), 1, "{s}: a refusal is not retried");
        assert_eq!(ds.effects().get(*s), None);
    }
    assert!(outbox.list(View::Pending, 100).await.unwrap().is_empty());
    // The operator fixes the receiver and requeues the dead letters.
    accept_all.store(true, Ordering::SeqCst);
    for e in &dead {
        assert!(outbox.requeue(e.id).await.unwrap());
        assert!(
            !outbox.requeue(e.id).await.unwrap(),
            "no longer a dead letter"
        );
    }
    until_async(WAIT, "9 done", || async {
        outbox.counts().await.unwrap().done == 9
    })
    .await;
    for s in &statuses[6..] {
        assert_eq!(ds.attempts_of(s), 2, "{s}");
        assert_eq!(ds.effects().get(*s), Some(&1));
    }
    assert!(
        !outbox.requeue(dead[0].id).await.unwrap(),
        "a delivered message is not a dead letter"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_out_of_attempts_is_a_dead_letter() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.sqlite3");
    let outbox = Outbox::sqlite(&db).await.unwrap();
    enqueue_direct(&db, "queue://jobs", &[("job-1", "{}")]);
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let sink = outbox::from_fn(move |d: Delivery| {
        let counter = counter.clone();
        async move {
            counter.fetch_add(1, Ordering::SeqCst);
            assert_eq!(
                (d.key.as_str(), d.payload.as_ref()),
                ("job-1", b"{}".as_slice())
            );
            Outcome::Retry(format!("busy on attempt {}", d.attempt))
        }
    });
    let _relay = outbox
        .relay(sink)
        .max_attempts(Some(3))
        .backoff(Duration::from_millis(1), Duration::from_millis(5))
        .poll_interval(Duration::from_millis(10))
        .spawn();
    until_async(WAIT, "a dead letter", || async {
        outbox.counts().await.unwrap().dead == 1
    })
    .await;
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    let dead = outbox.list(View::Dead, 10).await.unwrap();
    assert_eq!(dead[0].attempts, 3);
    assert_eq!(
        dead[0].last_error.as_deref(),
        Some("busy on attempt 3 (attempt 3, the last allowed)")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_on_one_database_never_hold_one_message_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.sqlite3");
    // Each attempt takes 30 ms; the first of each key fails.
    let ds = Downstream::start(
        script(|_, _, n| {
            if n == 0 {
                Answer::FailBefore(503)
            } else {
                Answer::Pass
            }
        }),
        Duration::from_millis(30),
    )
    .await;
    let keys: Vec<String> = (0..40).map(|i| format!("m-{i}")).collect();
    let messages: Vec<(&str, &str)> = keys.iter().map(|k| (k.as_str(), "{}")).collect();
    let (a, b) = (
        Outbox::sqlite(&db).await.unwrap(),
        Outbox::sqlite(&db).await.unwrap(),
    );
    enqueue_direct(&db, &ds.url(), &messages);
    let tagged = |name: &'static str| {
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        HttpSink::new(
            tower::ServiceBuilder::new()
                .map_request(move |mut r: http::Request<Full<Bytes>>| {
                    r.headers_mut()
                        .insert("x-relay", http::HeaderValue::from_static(name));
                    r
                })
                .service(client),
        )
    };
    for (outbox, name) in [(&a, "a"), (&b, "b")] {
        outbox
            .relay(tagged(name))
            .batch_size(4)
            .max_in_flight(8)
            .backoff(Duration::from_millis(1), Duration::from_millis(10))
            .poll_interval(Duration::from_millis(10))
            .spawn();
    }
    until_async(WAIT, "40 done", || async {
        a.counts().await.unwrap().done == 40
    })
    .await;
    assert_eq!(
        ds.max_overlap(),
        1,
        "a message was in flight at two relays at once"
    );
    for key in &keys {
        assert_eq!(ds.attempts_of(key), 2, "{key}: one 503, one delivery");
        assert_eq!(ds.effects().get(key), Some(&1), "{key}");
    }
    let by = |name: &str| {
        ds.attempts()
            .iter()
            .filter(|x| x.relay.as_deref() == Some(name))
            .count()
    };
    assert_eq!(by("a") + by("b"), 80);
    assert!(
        by("a") > 0 && by("b") > 0,
        "both relays delivered: a {} b {}",
        by("a"),
        by("b")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_order_a_failing_message_does_not_hold_back_later_ones() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.sqlite3");
    let release = Arc::new(AtomicBool::new(false));
    let flag = release.clone();
    let ds = Downstream::start(
        script(move |key, _, _| {
            if key == "first" && !flag.load(Ordering::SeqCst) {
                Answer::FailBefore(503)
            } else {
                Answer::Pass
            }
        }),
        Duration::ZERO,
    )
    .await;
    let outbox = Outbox::sqlite(&db).await.unwrap();
    enqueue_direct(&db, &ds.url(), &[("first", "1")]);
    let _relay = outbox
        .relay(http_sink())
        .backoff(Duration::from_millis(20), Duration::from_millis(50))
        .poll_interval(Duration::from_millis(10))
        .spawn();
    until(WAIT, "first attempted twice", || {
        ds.attempts_of("first") >= 2
    })
    .await;
    enqueue_direct(&db, &ds.url(), &[("second", "2")]);
    until(WAIT, "second delivered", || {
        ds.effects().get("second") == Some(&1)
    })
    .await;
    assert_eq!(
        ds.effects().get("first"),
        None,
        "the earlier message is still failing"
    );
    release.store(true, Ordering::SeqCst);
    until(WAIT, "first delivered", || {
        ds.effects().get("first") == Some(&1)
    })
    .await;
}

#[cfg(feature = "admin")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_router_lists_and_requeues_dead_letters() {
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.sqlite3");
    let outbox = Outbox::sqlite(&db).await.unwrap();
    enqueue_direct(&db, "queue://jobs", &[("job-\"1\"", "{}")]);
    let relay = outbox
        .relay(outbox::from_fn(|_: Delivery| async {
            Outcome::Reject("no such queue".into())
        }))
        .poll_interval(Duration::from_millis(10))
        .spawn();
    until_async(WAIT, "a dead letter", || async {
        outbox.counts().await.unwrap().dead == 1
    })
    .await;
    relay.shutdown().await;
    let app = outbox::admin::router(outbox.clone());
    let call = |method: &str, uri: &str| {
        let req = http::Request::builder()
            .method(method)
            .uri(uri)
            .body(axum::body::Body::empty())
            .unwrap();
        let app = app.clone();
        async move {
            let res = app.oneshot(req).await.unwrap();
            let status = res.status().as_u16();
            let ctype = res.headers()["content-type"].to_str().unwrap().to_owned();
            (
                status,
                ctype,
                res.into_body().collect().await.unwrap().to_bytes(),
            )
        }
    };
    let (status, ctype, body) = call("GET", "/outbox/dead").await;
    assert_eq!((status, ctype.as_str()), (200, "application/json"));
    let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let id = doc[0]["id"].as_i64().unwrap();
    assert_eq!(doc.as_array().unwrap().len(), 1);
    assert_eq!(doc[0]["key"], "job-\"1\"");
    assert_eq!(doc[0]["attempts"], 1);
    assert_eq!(doc[0]["last_error"], "no such queue");
    assert_eq!(doc[0]["lease_remaining_ms"], serde_json::Value::Null);
    let (_, _, body) = call("GET", "/outbox/counts").await;
    assert_eq!(
        &body[..],
        br#"{"pending":0,"in_flight":0,"dead":1,"done":0,"oldest_pending_age_ms":null}"#
    );
    let (status, _, body) = call("POST", &format!("/outbox/dead/{id}/requeue")).await;
    assert_eq!(
        (status, body),
        (200, Bytes::from(format!("{{\"requeued\":{id}}}")))
    );
    let (status, ctype, _) = call("POST", &format!("/outbox/dead/{id}/requeue")).await;
    assert_eq!((status, ctype.as_str()), (404, "application/problem+json"));
    let (status, ctype, _) = call("POST", "/outbox/dead/x/requeue").await;
    assert_eq!((status, ctype.as_str()), (400, "application/problem+json"));
    let (status, ctype, _) = call("GET", "/outbox/pending?limit=0").await;
    assert_eq!((status, ctype.as_str()), (400, "application/problem+json"));
    let (_, _, body) = call("GET", "/outbox/pending").await;
    let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        (doc[0]["id"].as_i64(), doc[0]["attempts"].as_u64()),
        (Some(id), Some(0))
    );
}

/// The relay's counters through the `metrics` facade: one delivery, one
/// retry and one dead letter, for a message delivered at its second attempt
/// and one refused at its first. The relay runs on this test's
/// current-thread runtime, so the thread's local recorder sees it.
#[cfg(feature = "metrics")]
#[tokio::test(flavor = "current_thread")]
async fn metrics_count_deliveries_retries_and_dead_letters() {
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    use metrics::{
        Counter, CounterFn, Gauge, GaugeFn, Histogram, Key, KeyName, Metadata, Recorder,
        SharedString, Unit,
    };

    /// Counter totals and the last gauge value, by name.
    #[derive(Clone, Default)]
    struct Recorded(Arc<Mutex<BTreeMap<String, f64>>>);
    struct Cell(String, Recorded);
    impl CounterFn for Cell {
        fn increment(&self, value: u64) {
            *self.1.0.lock().unwrap().entry(self.0.clone()).or_default() += value as f64;
        }
        fn absolute(&self, value: u64) {
            self.1
                .0
                .lock()
                .unwrap()
                .insert(self.0.clone(), value as f64);
        }
    }
    impl GaugeFn for Cell {
        fn increment(&self, value: f64) {
            *self.1.0.lock().unwrap().entry(self.0.clone()).or_default() += value;
        }
        fn decrement(&self, value: f64) {
            *self.1.0.lock().unwrap().entry(self.0.clone()).or_default() -= value;
        }
        fn set(&self, value: f64) {
            self.1.0.lock().unwrap().insert(self.0.clone(), value);
        }
    }
    impl Recorder for Recorded {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            Counter::from_arc(Arc::new(Cell(key.name().to_owned(), self.clone())))
        }
        fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::from_arc(Arc::new(Cell(key.name().to_owned(), self.clone())))
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    let recorded = Recorded::default();
    let _guard = metrics::set_default_local_recorder(&recorded);
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.sqlite3");
    let outbox = Outbox::sqlite(&db).await.unwrap();
    enqueue_direct(&db, "local:", &[("retried", "{}"), ("refused", "{}")]);
    let attempts = Arc::new(AtomicUsize::new(0));
    let seen = attempts.clone();
    let sink = outbox::from_fn(move |d: Delivery| {
        let n = seen.fetch_add(1, Ordering::SeqCst);
        async move {
            match d.key.as_str() {
                "refused" => Outcome::Reject("HTTP 400".into()),
                _ if n < 2 => Outcome::Retry("HTTP 503".into()),
                _ => Outcome::Delivered,
            }
        }
    });
    let relay = outbox
        .relay(sink)
        .backoff(Duration::from_millis(5), Duration::from_millis(20))
        .poll_interval(Duration::from_millis(10))
        .spawn();
    until_async(WAIT, "1 done, 1 dead", || async {
        let c = outbox.counts().await.unwrap();
        (c.done, c.dead) == (1, 1)
    })
    .await;
    relay.shutdown().await;
    let counters: BTreeMap<String, f64> = recorded
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|(name, _)| name.ends_with("_total"))
        .map(|(name, value)| (name.clone(), *value))
        .collect();
    let expected: BTreeMap<String, f64> = [
        ("tower_idempotency_outbox_dead_letters_total", 1.0),
        ("tower_idempotency_outbox_deliveries_total", 1.0),
        ("tower_idempotency_outbox_retries_total", 1.0),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    assert_eq!(counters, expected);
}

/// The relay deletes delivered messages past their retention on the
/// stores' `Purge` schedule, in bounded batches: 7 delivered messages with
/// a zero retention and batches of 2 are all deleted (four statements in
/// one round), while a dead letter stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_relay_purges_delivered_messages_in_batches_on_its_schedule() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.sqlite3");
    let ds = Downstream::start(
        script(|key, _, _| {
            if key == "refused" {
                Answer::FailBefore(400)
            } else {
                Answer::Pass
            }
        }),
        Duration::ZERO,
    )
    .await;
    let outbox = Outbox::sqlite(&db).await.unwrap();
    let keys = ["a", "b", "c", "d", "e", "f", "g", "refused"];
    let messages: Vec<(&str, &str)> = keys.iter().map(|k| (*k, "{}")).collect();
    enqueue_direct(&db, &ds.url(), &messages);
    let purge = tower_idempotency::store::Purge::every(Duration::from_millis(50)).batch(2);
    let _relay = outbox
        .relay(http_sink())
        .poll_interval(Duration::from_millis(10))
        .retention(Duration::ZERO)
        .purge(purge)
        .spawn();
    until_async(WAIT, "7 delivered and purged, 1 dead letter", || async {
        let c = outbox.counts().await.unwrap();
        (c.pending, c.in_flight, c.done, c.dead) == (0, 0, 0, 1)
    })
    .await;
    assert_eq!(ds.effects().len(), 7);
    let dead = outbox.list(View::Dead, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].key, "refused");
}
