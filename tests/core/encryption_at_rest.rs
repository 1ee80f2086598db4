//! `IdempotencyLayer::encrypt_at_rest` on the memory store and SQLite: the
//! first request runs once and its repeat is replayed byte for byte; the
//! store holds no plaintext of the response; a layer whose keys do not open
//! the record answers the 503 problem of a corrupt record (docs/contract.md
//! §3), runs nothing and counts it; rotation and plain records still replay.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::fingerprint::{DefaultFingerprinter, Fingerprinter};
use tower_idempotency::problem::types;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::seal::{Keyring, SealingKey};
use tower_idempotency::store::{
    Claim, ClaimRequest, FencingToken, MemoryStore, RecordId, Refusal, SqliteStore, Store,
};
use tower_idempotency::{IdempotencyLayer, StoredBody};

/// What the handler answers: a card number, the secret that must not be
/// stored in the clear.
const CARD: &str = "4111-1111-1111-1111";
const REQUEST_BODY: &str = "amount=5";

type Runs = Arc<AtomicUsize>;

async fn save_card(State(runs): State<Runs>) -> (StatusCode, [(&'static str, String); 1], String) {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    let body = format!("{{\"card\":\"{CARD}\",\"run\":{n}}}");
    (
        StatusCode::CREATED,
        [("x-account", format!("acct-{n}"))],
        body,
    )
}

fn app<St: Store>(store: St, keys: Option<Keyring>, runs: &Runs) -> Router {
    let layer = IdempotencyLayer::new(store, GlobalScope);
    let layer = match keys {
        Some(keys) => layer.encrypt_at_rest(keys),
        None => layer,
    };
    Router::new()
        .route("/cards", post(save_card))
        .route_layer(layer)
        .with_state(runs.clone())
}

fn request(key: &str) -> Request<Body> {
    Request::post("/cards")
        .header("idempotency-key", key)
        .body(Body::from(REQUEST_BODY))
        .unwrap()
}

/// Status, header fields (name, value) in order, body.
type Answer = (u16, Vec<(String, String)>, String);

async fn call(app: &Router, key: &str) -> Answer {
    let response = app.clone().oneshot(request(key)).await.unwrap();
    let status = response.status().as_u16();
    let headers = response
        .headers()
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_owned()))
        .collect();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, headers, String::from_utf8(body.to_vec()).unwrap())
}

fn header<'a>(answer: &'a Answer, name: &str) -> Option<&'a str> {
    let found = answer.1.iter().find(|(n, _)| n == name);
    found.map(|(_, v)| v.as_str())
}

fn key(id: u32, fill: u8) -> SealingKey {
    SealingKey::new(id, [fill; 32])
}

/// The stored record as the store hands it out (a claim of the completed key).
async fn stored<St: Store>(store: &St, key: &str) -> tower_idempotency::StoredResponse {
    let (parts, ()) = request(key).map(|_| ()).into_parts();
    let body = bytes::Bytes::from_static(REQUEST_BODY.as_bytes());
    let fingerprint = DefaultFingerprinter::new()
        .fingerprint(&parts, &body)
        .unwrap();
    let claim = ClaimRequest::new(RecordId::new("", key), fingerprint, FencingToken::random());
    match store.claim(claim).await.unwrap() {
        Claim::Refused(Refusal::Completed(stored)) => stored,
        other => panic!("not a completed record: {other:?}"),
    }
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

/// The whole scenario on `store`; `raw` reads every byte the store wrote.
async fn sealed_records<St: Store>(store: St, raw: impl AsyncFn() -> Vec<u8>) {
    let runs = Runs::default();
    let sealing = app(store.clone(), Keyring::new([key(1, 7)]).ok(), &runs);
    let first = call(&sealing, "k-1").await;
    assert_eq!(first.0, 201);
    assert_eq!(first.2, format!("{{\"card\":\"{CARD}\",\"run\":1}}"));
    assert_eq!(header(&first, "idempotent-replayed"), None);
    let again = call(&sealing, "k-1").await;
    assert_eq!(header(&again, "idempotent-replayed"), Some("true"));
    let unmarked = again.1.iter().filter(|(n, _)| n != "idempotent-replayed");
    let unmarked: Vec<_> = unmarked.cloned().collect();
    assert_eq!(
        (again.0, unmarked, &again.2),
        (first.0, first.1.clone(), &first.2)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // The store keeps the status and the ciphertext, no plaintext.
    let record = stored(&store, "k-1").await;
    assert_eq!(record.status, StatusCode::CREATED);
    assert!(record.headers.is_empty() && record.trailers.is_none());
    assert!(matches!(record.body, StoredBody::Sealed(_)), "{record:?}");
    let encoded = record.encode();
    assert!(!contains(&encoded, CARD) && !contains(&encoded, "acct-1"));
    let raw = raw().await;
    assert!(!contains(&raw, CARD), "the store's bytes hold the card");
    assert!(
        !contains(&raw, "acct-1"),
        "the store's bytes hold the header"
    );

    // Another key, and no key at all: never replayed, the handler not run.
    for keys in [Keyring::new([key(2, 9)]).ok(), None] {
        let other = app(store.clone(), keys, &runs);
        for _ in 0..2 {
            let refused = call(&other, "k-1").await;
            assert_eq!(refused.0, 503, "{refused:?}");
            assert_eq!(
                header(&refused, "content-type"),
                Some("application/problem+json")
            );
            assert_eq!(header(&refused, "retry-after"), Some("1"));
            assert_eq!(header(&refused, "idempotent-replayed"), None);
            assert!(refused.2.contains(types::RECORD_SEALED), "{refused:?}");
            assert!(!refused.2.contains(CARD));
        }
    }
    // The same id with other bytes: does not open either.
    let impostor = app(store.clone(), Keyring::new([key(1, 8)]).ok(), &runs);
    assert_eq!(call(&impostor, "k-1").await.0, 503);
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // Rotation: [new, old] opens the old key's record, seals with the new.
    let rotated = app(
        store.clone(),
        Keyring::new([key(2, 9), key(1, 7)]).ok(),
        &runs,
    );
    assert_eq!(call(&rotated, "k-1").await.2, first.2);
    let second = call(&rotated, "k-2").await;
    assert_eq!((second.0, runs.load(Ordering::SeqCst)), (201, 2));
    assert_eq!(call(&rotated, "k-2").await.2, second.2);
    assert_eq!(call(&sealing, "k-2").await.0, 503, "key 2 is unknown there");

    // A plain record (stored before encryption was on) is still replayed.
    let plain = app(store.clone(), None, &runs);
    let before = call(&plain, "k-3").await;
    assert_eq!(call(&sealing, "k-3").await.2, before.2);
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

#[tokio::test(flavor = "current_thread")]
async fn memory_store_keeps_sealed_records() {
    let store = MemoryStore::new();
    // The memory store's bytes are its records: their encodings.
    let reader = store.clone();
    let raw = async move || stored(&reader, "k-1").await.encode();
    sealed_records(store, raw).await;
}

#[tokio::test(flavor = "current_thread")]
async fn sqlite_store_keeps_sealed_records() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("records.sqlite3");
    let store = SqliteStore::open(&path).await.unwrap();
    let file = path.clone();
    let raw = async move || {
        // The database file, its write-ahead log, and every response column.
        let mut bytes = Vec::new();
        for suffix in ["", "-wal"] {
            let name = format!("{}{suffix}", file.display());
            bytes.extend(std::fs::read(name).unwrap_or_default());
        }
        let db = tower_idempotency::rusqlite::Connection::open(&file).unwrap();
        let mut rows = db
            .prepare("SELECT response FROM idempotency_records")
            .unwrap();
        let responses = rows
            .query_map([], |r| r.get::<_, Option<Vec<u8>>>(0))
            .unwrap();
        for response in responses {
            bytes.extend(response.unwrap().unwrap_or_default());
        }
        assert!(!bytes.is_empty());
        bytes
    };
    sealed_records(store, raw).await;
}

#[cfg(feature = "metrics")]
#[tokio::test(flavor = "current_thread")]
async fn records_that_do_not_open_are_counted() {
    use metrics::{Counter, CounterFn, Gauge, Histogram, Key, KeyName, Metadata, Recorder};
    use metrics::{SharedString, Unit};
    use std::sync::atomic::AtomicU64;

    /// Counts `tower_idempotency_records_unopened_total` only.
    #[derive(Default)]
    struct Unopened(Arc<AtomicU64>);
    impl CounterFn for Unopened {
        fn increment(&self, value: u64) {
            self.0.fetch_add(value, Ordering::SeqCst);
        }
        fn absolute(&self, _: u64) {}
    }
    impl Recorder for Unopened {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            if key.name() == "tower_idempotency_records_unopened_total" {
                Counter::from_arc(Arc::new(Unopened(self.0.clone())))
            } else {
                Counter::noop()
            }
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    let recorder = Unopened::default();
    let count = recorder.0.clone();
    let _guard = metrics::set_default_local_recorder(&recorder);
    let (store, runs) = (MemoryStore::new(), Runs::default());
    let sealing = app(store.clone(), Keyring::new([key(1, 7)]).ok(), &runs);
    assert_eq!(call(&sealing, "k-1").await.0, 201);
    assert_eq!(call(&sealing, "k-1").await.0, 201);
    assert_eq!(count.load(Ordering::SeqCst), 0);
    let other = app(store.clone(), Keyring::new([key(2, 9)]).ok(), &runs);
    assert_eq!(call(&other, "k-1").await.0, 503);
    assert_eq!(call(&app(store, None, &runs), "k-1").await.0, 503);
    assert_eq!(count.load(Ordering::SeqCst), 2);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
