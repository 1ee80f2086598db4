//! What operators see: the `idempotency` span's fields and, with the
//! `metrics` feature, the counters and histogram (names in `telemetry`).
//!
//! The subscriber (`common::logs`) and the recorder collect for this
//! thread only, and each test runs on a current-thread runtime, so the
//! layer's spawned tasks report here too and tests do not see each other.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, request::Parts};
use axum::routing::post;
use tower::ServiceExt;
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::store::{MemoryStore, RecordId};
use tower_idempotency::test_util::ManualClock;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};

use crate::common;

/// The raw key: it must never reach a span or an event.
const KEY: &str = "order-secret-4711";

/// Every `idempotency` span, closed, with its fields as text; and every
/// event's fields, to check that the raw key appears nowhere.
#[derive(Clone, Default)]
struct Spans {
    open: Arc<Mutex<HashMap<u64, BTreeMap<String, String>>>>,
    closed: Arc<Mutex<Vec<BTreeMap<String, String>>>>,
    everything: Arc<Mutex<Vec<String>>>,
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(
            field.name().to_owned(),
            format!("{value:?}").trim_matches('"').to_owned(),
        );
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl common::logs::Sink for Spans {
    fn new_span(&self, attrs: &Attributes<'_>, id: &Id) {
        let mut fields = BTreeMap::new();
        attrs.record(&mut Fields(&mut fields));
        self.everything
            .lock()
            .unwrap()
            .extend(fields.values().cloned());
        if attrs.metadata().name() == "idempotency" {
            self.open.lock().unwrap().insert(id.into_u64(), fields);
        }
    }

    fn record(&self, id: &Id, values: &Record<'_>) {
        let mut fields = BTreeMap::new();
        values.record(&mut Fields(&mut fields));
        self.everything
            .lock()
            .unwrap()
            .extend(fields.values().cloned());
        if let Some(span) = self.open.lock().unwrap().get_mut(&id.into_u64()) {
            span.extend(fields);
        }
    }

    fn event(&self, event: &tracing::Event<'_>) {
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        self.everything.lock().unwrap().extend(fields.into_values());
    }

    fn close(&self, id: Id) {
        if let Some(span) = self.open.lock().unwrap().remove(&id.into_u64()) {
            self.closed.lock().unwrap().push(span);
        }
    }
}

impl Spans {
    /// Collects what happens on this thread from now on.
    fn install(&self) {
        common::logs::route_here(Arc::new(self.clone()));
    }

    /// The closed spans' `claim` and `outcome`, in order.
    fn outcomes(&self) -> Vec<(String, String)> {
        self.closed
            .lock()
            .unwrap()
            .iter()
            .map(|s| {
                let get = |f: &str| s.get(f).cloned().unwrap_or_default();
                (get("claim"), get("outcome"))
            })
            .collect()
    }
}

fn app(store: MemoryStore) -> Router {
    Router::new()
        .route(
            "/charges",
            post(|body: String| async move {
                if body == "fail" {
                    (StatusCode::SERVICE_UNAVAILABLE, "try later")
                } else {
                    (StatusCode::CREATED, "charged")
                }
            }),
        )
        .route_layer(
            IdempotencyLayer::new(store, |_: &Parts| "alice".to_owned())
                .lease(Duration::from_secs(10)),
        )
}

fn charge(key: Option<&str>, body: &'static str) -> Request<Body> {
    let mut request = Request::post("/charges");
    if let Some(key) = key {
        request = request.header("idempotency-key", format!("\"{key}\""));
    }
    request.body(Body::from(body)).unwrap()
}

async fn status(app: &Router, request: Request<Body>) -> u16 {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status().as_u16();
    // Drain the body so the request's work is over.
    axum::body::to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap();
    status
}

#[tokio::test(flavor = "current_thread")]
async fn one_span_per_request_with_claim_and_outcome() {
    let spans = Spans::default();
    spans.install();
    let app = app(MemoryStore::new());

    assert_eq!(status(&app, charge(Some(KEY), "amount=5")).await, 201);
    assert_eq!(status(&app, charge(Some(KEY), "amount=5")).await, 201);
    assert_eq!(status(&app, charge(Some(KEY), "amount=6")).await, 422);
    assert_eq!(status(&app, charge(Some("other"), "fail")).await, 503);
    // Requests without a key pass through without a span.
    assert_eq!(status(&app, charge(None, "amount=5")).await, 201);

    let pairs = |v: &[(&str, &str)]| -> Vec<(String, String)> {
        v.iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect()
    };
    assert_eq!(
        spans.outcomes(),
        pairs(&[
            ("acquired", "completed"),
            ("replayed", "replayed"),
            ("mismatch", "mismatch"),
            ("acquired", "released"),
        ])
    );

    let closed = spans.closed.lock().unwrap().clone();
    // Store latency, in whole microseconds, on the calls each request made.
    let has = |i: usize, f: &str| closed[i].get(f).is_some_and(|v| v.parse::<u64>().is_ok());
    assert!(has(0, "claim_us") && has(0, "complete_us") && !has(0, "release_us"));
    assert!(has(1, "claim_us") && !has(1, "complete_us"));
    assert!(has(3, "claim_us") && has(3, "release_us") && !has(3, "complete_us"));
    // The scope, and a 16-hex-digit tag instead of the key.
    assert_eq!(closed[0]["scope"], "alice");
    let tag = &closed[0]["key"];
    assert_eq!(tag.len(), 16, "{tag}");
    assert!(tag.chars().all(|c| c.is_ascii_hexdigit()), "{tag}");
    assert_eq!(closed[1]["key"], *tag, "the same key gets the same tag");
    assert_ne!(closed[3]["key"], *tag);
    // Keyed with the process's secret: not the unsalted hash anyone could
    // recompute from a guessed key.
    let mut unsalted = tower_idempotency::fingerprint::Hasher::new("tower-idempotency/log/v1");
    unsalted.part(b"alice").part(KEY.as_bytes());
    let unsalted: String = unsalted.finish().0[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_ne!(*tag, unsalted);
    let everything = spans.everything.lock().unwrap();
    assert!(
        everything.iter().all(|v| !v.contains(KEY)),
        "the raw key reached a span or an event: {everything:?}"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_take_over_is_visible_on_the_span() {
    let spans = Spans::default();
    spans.install();
    let clock = ManualClock::new(1_800_000_000_000);
    let store = MemoryStore::with_clock(clock.clone());
    // A holder that never comes back: claimed directly in the store.
    use tower_idempotency::store::{ClaimRequest, FencingToken, Store};
    let fingerprint = {
        use tower_idempotency::fingerprint::{DefaultFingerprinter, Fingerprinter};
        let (parts, _) = charge(Some(KEY), "").into_parts();
        DefaultFingerprinter::new()
            .fingerprint(&parts, &axum::body::Bytes::from_static(b"amount=5"))
            .unwrap()
    };
    store
        .claim(
            ClaimRequest::new(
                RecordId::new("alice", KEY),
                fingerprint,
                FencingToken::random(),
            )
            .with_lease(Duration::from_secs(10))
            .with_ttl(Duration::from_secs(86_400)),
        )
        .await
        .unwrap();
    let app = app(store);
    assert_eq!(status(&app, charge(Some(KEY), "amount=5")).await, 409);
    clock.advance(Duration::from_secs(10));
    assert_eq!(status(&app, charge(Some(KEY), "amount=5")).await, 201);
    assert_eq!(
        spans.outcomes(),
        vec![
            ("in_flight".to_owned(), "in_flight".to_owned()),
            ("taken_over".to_owned(), "completed".to_owned()),
        ]
    );
}

#[cfg(feature = "metrics")]
mod metrics_feature {
    use super::*;
    use metrics::{
        Counter, CounterFn, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
        SharedString, Unit,
    };

    /// Counter totals and histogram sample counts, by `name{label=value}`.
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

    impl HistogramFn for Cell {
        fn record(&self, value: f64) {
            assert!(
                (0.0..60.0).contains(&value),
                "seconds, not another unit: {value}"
            );
            *self.1.0.lock().unwrap().entry(self.0.clone()).or_default() += 1.0;
        }
    }

    fn name(key: &Key) -> String {
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        if labels.is_empty() {
            key.name().to_owned()
        } else {
            format!("{}{{{}}}", key.name(), labels.join(","))
        }
    }

    impl Recorder for Recorded {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            Counter::from_arc(Arc::new(Cell(name(key), self.clone())))
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::from_arc(Arc::new(Cell(name(key), self.clone())))
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn counters_per_outcome_and_store_latency() {
        let recorded = Recorded::default();
        let _guard = metrics::set_default_local_recorder(&recorded);
        let app = app(MemoryStore::new());

        assert_eq!(status(&app, charge(Some(KEY), "amount=5")).await, 201);
        for _ in 0..3 {
            assert_eq!(status(&app, charge(Some(KEY), "amount=5")).await, 201);
        }
        assert_eq!(status(&app, charge(Some(KEY), "amount=6")).await, 422);
        assert_eq!(status(&app, charge(Some("other"), "fail")).await, 503);
        assert_eq!(status(&app, charge(Some("a\"b"), "x")).await, 400);
        assert_eq!(status(&app, charge(None, "amount=5")).await, 201);

        let expected: BTreeMap<String, f64> = [
            ("tower_idempotency_requests_total{outcome=completed}", 1.0),
            ("tower_idempotency_requests_total{outcome=replayed}", 3.0),
            ("tower_idempotency_requests_total{outcome=mismatch}", 1.0),
            ("tower_idempotency_requests_total{outcome=released}", 1.0),
            ("tower_idempotency_requests_total{outcome=rejected}", 1.0),
            // One claim per request that reached the store: 6.
            (
                "tower_idempotency_store_duration_seconds{operation=claim}",
                6.0,
            ),
            (
                "tower_idempotency_store_duration_seconds{operation=complete}",
                1.0,
            ),
            (
                "tower_idempotency_store_duration_seconds{operation=release}",
                1.0,
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        assert_eq!(*recorded.0.lock().unwrap(), expected);
    }
}
