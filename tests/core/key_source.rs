//! Keys from the body (`key_from_json`, `key_from_fn`) through the layer:
//! what passes through, what is refused, and in which order.

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode, request::Parts};
use axum::routing::post;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::key::KeyError;
use tower_idempotency::problem::types;
use tower_idempotency::{IdempotencyLayer, MemoryStore, scope};

type Seen = Arc<Mutex<Vec<Bytes>>>;

/// A handler that records the bodies it got.
fn app(layer: IdempotencyLayer<MemoryStore, scope::Header>) -> (Router, Seen) {
    let seen: Seen = Arc::default();
    let log = seen.clone();
    let router = Router::new()
        .route(
            "/events",
            post(move |body: Bytes| async move {
                log.lock().unwrap().push(body);
                StatusCode::OK
            }),
        )
        .route_layer(layer);
    (router, seen)
}

fn layer() -> IdempotencyLayer<MemoryStore, scope::Header> {
    IdempotencyLayer::new(MemoryStore::new(), scope::header("x-account"))
}

async fn post_json(app: &Router, account: Option<&str>, body: &'static str) -> (u16, String) {
    let mut request = Request::post("/events");
    if let Some(account) = account {
        request = request.header("x-account", account);
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::from(body)).unwrap())
        .await
        .unwrap();
    let status = response.status().as_u16();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let doc: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    (status, doc["type"].as_str().unwrap_or("").to_owned())
}

#[tokio::test]
async fn without_a_key_an_optional_key_passes_through_with_its_body() {
    let (app, seen) = app(layer().key_from_json("/id").require_key(false));
    for _ in 0..2 {
        assert_eq!(
            post_json(&app, None, r#"{"type":"ping"}"#).await,
            (200, String::new())
        );
    }
    assert_eq!(
        *seen.lock().unwrap(),
        [const { Bytes::from_static(br#"{"type":"ping"}"#) }; 2]
    );
    // A body that is not JSON is refused even when the key is optional.
    let (status, kind) = post_json(&app, None, "not json").await;
    assert_eq!((status, kind.as_str()), (400, types::INVALID_KEY));
    assert_eq!(seen.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn the_key_is_found_before_the_scope_is_asked() {
    let (app, seen) = app(layer().key_from_json("/id").require_key(true));
    // No key: 400, whatever the scope; a key without a principal: 401.
    let (status, kind) = post_json(&app, None, r#"{"type":"ping"}"#).await;
    assert_eq!((status, kind.as_str()), (400, types::MISSING_KEY));
    let (status, kind) = post_json(&app, None, r#"{"id":7}"#).await;
    assert_eq!((status, kind.as_str()), (401, types::UNAUTHENTICATED));
    // Integer keys; scopes keep accounts apart.
    assert_eq!(post_json(&app, Some("a"), r#"{"id":7}"#).await.0, 200);
    assert_eq!(post_json(&app, Some("a"), r#"{"id":7}"#).await.0, 200);
    assert_eq!(post_json(&app, Some("b"), r#"{"id":7}"#).await.0, 200);
    assert_eq!(seen.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn a_body_over_the_limit_is_413_before_any_key() {
    let (app, seen) = app(layer().key_from_json("/id").max_request_body(8));
    let (status, kind) = post_json(&app, Some("a"), r#"{"id":"evt_1"}"#).await;
    assert_eq!((status, kind.as_str()), (413, types::BODY_TOO_LARGE));
    assert_eq!(seen.lock().unwrap().len(), 0);
}

#[tokio::test]
async fn a_function_source_is_checked_like_any_key() {
    let source = |parts: &Parts, body: &[u8]| -> Result<Option<String>, KeyError> {
        if parts.headers.contains_key("x-broken") {
            return Err(KeyError::UnsupportedType);
        }
        Ok(std::str::from_utf8(body)
            .ok()
            .map(|text| text.trim().to_owned()))
    };
    let (app, seen) = app(layer().key_from_fn(source).require_key(true));
    assert_eq!(post_json(&app, Some("a"), "order-1\n").await.0, 200);
    assert_eq!(post_json(&app, Some("a"), "order-1\n").await.0, 200);
    let (status, kind) = post_json(&app, Some("a"), "   ").await;
    assert_eq!((status, kind.as_str()), (400, types::INVALID_KEY));
    let request = Request::post("/events")
        .header("x-account", "a")
        .header("x-broken", "1")
        .body(Body::from("order-2"))
        .unwrap();
    assert_eq!(app.clone().oneshot(request).await.unwrap().status(), 400);
    // The header is not read at all when the key comes from the body.
    let request = Request::post("/events")
        .header("x-account", "a")
        .header("idempotency-key", "\"a\", \"b\"")
        .body(Body::from("order-3"))
        .unwrap();
    assert_eq!(app.clone().oneshot(request).await.unwrap().status(), 200);
    assert_eq!(seen.lock().unwrap().len(), 2);
}
