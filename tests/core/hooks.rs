//! `namespace`, `on_replay` and `on_event`: two layers that share a store
//! keep their keys apart under their namespaces; the replay hook adds a
//! field to replays only; the event hook hears every replay and rejection
//! with its status, problem type, scope and the client's key.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::routing::post;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::hooks::Event;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::MemoryStore;
use tower_idempotency::{IdempotencyLayer, problem};

async fn count(State(runs): State<Arc<AtomicUsize>>) -> (StatusCode, String) {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::CREATED, format!("run {n}"))
}

/// An app whose `/orders` and `/refunds` share one store under two
/// namespaces, and `/plain` uses it with none.
fn app(store: &MemoryStore, events: &Arc<Mutex<Vec<String>>>) -> (Router, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let log = events.clone();
    let layer = || IdempotencyLayer::new(store.clone(), GlobalScope).require_key(true);
    let router = Router::new()
        .route(
            "/orders",
            post(count).route_layer(
                layer()
                    .namespace("orders")
                    .on_replay(|_: &Event<'_>, headers: &mut HeaderMap| {
                        headers.insert("cache-status", "tower-idempotency; hit".parse().unwrap());
                    })
                    .on_event(move |e: &Event<'_>| {
                        log.lock()
                            .unwrap()
                            .push(format!("{:?} {:?} {:?}", e.kind, e.scope, e.key));
                    }),
            ),
        )
        .route(
            "/refunds",
            post(count).route_layer(layer().namespace("refunds")),
        )
        .route("/plain", post(count).route_layer(layer()))
        .with_state(runs.clone());
    (router, runs)
}

async fn post_key(
    app: &Router,
    path: &str,
    key: Option<&str>,
    body: &str,
) -> (u16, Option<String>, String) {
    let mut request = Request::post(path);
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::from(body.to_owned())).unwrap())
        .await
        .unwrap();
    let status = response.status().as_u16();
    let cache = response
        .headers()
        .get("cache-status")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, cache, String::from_utf8(body.to_vec()).unwrap())
}

#[tokio::test]
async fn namespaces_keep_one_stores_keys_apart() {
    let store = MemoryStore::new();
    let events = Arc::default();
    let (app, runs) = app(&store, &events);
    for path in ["/orders", "/refunds", "/plain"] {
        let (status, _, body) = post_key(&app, path, Some("k"), "{}").await;
        assert_eq!(
            (status, body.as_str()),
            (201, format!("run {}", runs.load(Ordering::SeqCst)).as_str())
        );
    }
    // Three records for one key: each path ran once and replays its own.
    assert_eq!(runs.load(Ordering::SeqCst), 3);
    assert_eq!(post_key(&app, "/orders", Some("k"), "{}").await.2, "run 1");
    assert_eq!(post_key(&app, "/refunds", Some("k"), "{}").await.2, "run 2");
    assert_eq!(post_key(&app, "/plain", Some("k"), "{}").await.2, "run 3");
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn the_replay_hook_marks_replays_only_and_events_name_the_clients_key() {
    let store = MemoryStore::new();
    let events = Arc::new(Mutex::new(Vec::new()));
    let (app, runs) = app(&store, &events);
    let first = post_key(&app, "/orders", Some("k"), "{}").await;
    assert_eq!(first, (201, None, "run 1".to_owned()));
    let replay = post_key(&app, "/orders", Some("k"), "{}").await;
    assert_eq!(
        replay,
        (
            201,
            Some("tower-idempotency; hit".to_owned()),
            "run 1".to_owned()
        )
    );
    let mismatch = post_key(&app, "/orders", Some("k"), "{\"other\":1}").await;
    assert_eq!(mismatch.0, 422);
    assert_eq!(post_key(&app, "/orders", None, "{}").await.0, 400);
    assert_eq!(post_key(&app, "/orders", Some("\"a"), "{}").await.0, 400);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let t = problem::types::MISMATCH;
    let missing = problem::types::MISSING_KEY;
    let invalid = problem::types::INVALID_KEY;
    assert_eq!(
        *events.lock().unwrap(),
        [
            "Replayed { status: 201 } Some(\"\") Some(\"k\")".to_owned(),
            format!("Rejected {{ status: 422, problem_type: {t:?} }} Some(\"\") Some(\"k\")"),
            format!("Rejected {{ status: 400, problem_type: {missing:?} }} None None"),
            format!("Rejected {{ status: 400, problem_type: {invalid:?} }} None None"),
        ]
    );
}

#[test]
#[should_panic(expected = "a namespace is printable ASCII")]
fn a_namespace_outside_printable_ascii_is_a_configuration_error() {
    let _ = IdempotencyLayer::new(MemoryStore::new(), GlobalScope).namespace("caf\u{e9}");
}
