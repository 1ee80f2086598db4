//! `IdempotencyLayer::namespace` with the outbox: two layers that share one
//! store under their own namespaces run the same client key once each (two
//! records), so each run's outbox messages must be kept apart too. The
//! stable message key (`outbox::message_key`) is derived from the claimed
//! key: if it ignored the namespace, the second layer's message would meet
//! the first's key and be dropped by the outbox's insert-if-absent.

#![cfg(all(feature = "sqlite", feature = "outbox"))]

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use tower::ServiceExt;
use tower_idempotency::key::ClaimedKey;
use tower_idempotency::store::SqliteTransaction;
use tower_idempotency::{IdempotencyLayer, SqliteStore};
use tower_idempotency_outbox::{self as outbox, Message, Outbox};

#[tokio::test]
async fn two_namespaces_with_one_key_enqueue_two_messages() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.sqlite3");
    let outbox = Outbox::sqlite(&db).await.unwrap();
    let store = SqliteStore::open(&db).await.unwrap();
    // (route, message key, whether the outbox took the message)
    let enqueued = Arc::new(Mutex::new(Vec::new()));
    let route = |name: &'static str| {
        let enqueued = enqueued.clone();
        let handler = move |tx: SqliteTransaction, claimed: ClaimedKey| {
            let enqueued = enqueued.clone();
            async move {
                let message = Message::new(
                    &claimed,
                    0,
                    format!("http://downstream/{name}"),
                    "application/json",
                    format!("{{\"from\":\"{name}\"}}"),
                )
                .unwrap();
                let key = message.key().to_owned();
                let taken = tx
                    .run(move |tx| outbox::sqlite::enqueue(tx, &message))
                    .await
                    .unwrap();
                enqueued.lock().unwrap().push((name, key, taken));
                StatusCode::CREATED
            }
        };
        let layer = IdempotencyLayer::new(store.clone(), |_: &axum::http::request::Parts| {
            "alice".to_owned()
        })
        .namespace(name)
        .transactional();
        Router::new()
            .route(&format!("/{name}"), post(handler))
            .route_layer(layer)
    };
    let app = route("orders").merge(route("refunds"));
    for name in ["orders", "refunds"] {
        let request = Request::post(format!("/{name}"))
            .header("idempotency-key", "\"k-1\"")
            .body(Body::empty())
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::CREATED, "{name}");
        assert!(!response.headers().contains_key("idempotent-replayed"));
    }
    let enqueued = enqueued.lock().unwrap().clone();
    assert_eq!(enqueued.len(), 2, "each namespace ran its handler once");
    assert_ne!(
        enqueued[0].1, enqueued[1].1,
        "two runs, two message keys: {enqueued:?}"
    );
    assert_eq!(
        (enqueued[0].2, enqueued[1].2),
        (true, true),
        "the outbox took both messages"
    );
    assert_eq!(outbox.counts().await.unwrap().pending, 2);
}
