//! Browsers that send an `Idempotency-Key` of their own on form POSTs
//! (Firefox, behind `network.http.idempotencyKey.enabled`; see
//! docs/guide/configuration.md): which routes deduplicate them, and how a
//! route opts out.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::routing::post;
use http::HeaderName;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, MemoryStore, scope};

/// The shape of Firefox's automatic key: a decimal 64-bit number, quoted.
const BROWSER_KEY: &str = "\"12297829382473034410\"";

/// A POST of a form with `key` in `header`, from one browser session.
fn form_post(path: &str, header: &str, key: &str, body: &'static str) -> Request {
    Request::post(path)
        .header("x-session", "s-1")
        .header("content-type", "application/x-www-form-urlencoded")
        .header(header, key)
        .body(Body::from(body))
        .unwrap()
}

/// The status, the `Idempotent-Replayed` field and the body of `request`'s answer.
async fn call(app: &Router, request: Request) -> (StatusCode, Option<String>, String) {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, replayed, String::from_utf8(body.to_vec()).unwrap())
}

/// A handler that counts its runs and says which run answered.
fn counted(name: &'static str, runs: &Arc<AtomicUsize>) -> axum::routing::MethodRouter {
    let runs = runs.clone();
    post(move || async move {
        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
        (StatusCode::CREATED, format!("{name} run {n}"))
    })
}

fn layer() -> IdempotencyLayer<MemoryStore, scope::Header> {
    IdempotencyLayer::new(MemoryStore::new(), scope::header("x-session"))
}

#[tokio::test]
async fn a_route_without_the_layer_runs_every_post_of_one_browser_key() {
    let (orders, comments) = (Arc::default(), Arc::default());
    // `route_layer` wraps the routes added before it: /orders only.
    let app = Router::new()
        .route("/orders", counted("orders", &orders))
        .route_layer(layer())
        .route("/comments", counted("comments", &comments));

    let order = || form_post("/orders", "idempotency-key", BROWSER_KEY, "item=7");
    assert_eq!(
        call(&app, order()).await,
        (StatusCode::CREATED, None, "orders run 1".to_owned())
    );
    // The browser resubmits the same form: the same key, a replay.
    assert_eq!(
        call(&app, order()).await,
        (
            StatusCode::CREATED,
            Some("true".to_owned()),
            "orders run 1".to_owned()
        )
    );
    assert_eq!(orders.load(Ordering::SeqCst), 1);

    let comment = || form_post("/comments", "idempotency-key", BROWSER_KEY, "text=hi");
    assert_eq!(
        call(&app, comment()).await,
        (StatusCode::CREATED, None, "comments run 1".to_owned())
    );
    assert_eq!(
        call(&app, comment()).await,
        (StatusCode::CREATED, None, "comments run 2".to_owned())
    );
    assert_eq!(comments.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_new_submission_carries_a_new_key_and_runs() {
    let runs = Arc::default();
    let app = Router::new()
        .route("/orders", counted("orders", &runs))
        .route_layer(layer());

    let first = form_post("/orders", "idempotency-key", BROWSER_KEY, "item=7");
    assert_eq!(call(&app, first).await.2, "orders run 1");
    // The user fills the form in again: a new POST, a new browser key.
    let second = form_post(
        "/orders",
        "idempotency-key",
        "\"9838263505978427528\"",
        "item=7",
    );
    assert_eq!(
        call(&app, second).await,
        (StatusCode::CREATED, None, "orders run 2".to_owned())
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_layer_on_another_field_ignores_the_browsers_key() {
    let runs = Arc::default();
    // One layer over every route, keyed by the application's own field: the
    // browser's `Idempotency-Key` is not read at all.
    let app = Router::new()
        .route("/orders", counted("orders", &runs))
        .route_layer(layer().header_name(HeaderName::from_static("x-app-idempotency-key")));

    let browser = || form_post("/orders", "idempotency-key", BROWSER_KEY, "item=7");
    assert_eq!(
        call(&app, browser()).await,
        (StatusCode::CREATED, None, "orders run 1".to_owned())
    );
    assert_eq!(
        call(&app, browser()).await,
        (StatusCode::CREATED, None, "orders run 2".to_owned())
    );

    // The application's own client still deduplicates with its field.
    let app_client = || form_post("/orders", "x-app-idempotency-key", "\"o-1\"", "item=7");
    assert_eq!(call(&app, app_client()).await.2, "orders run 3");
    assert_eq!(
        call(&app, app_client()).await,
        (
            StatusCode::CREATED,
            Some("true".to_owned()),
            "orders run 3".to_owned()
        )
    );
    assert_eq!(runs.load(Ordering::SeqCst), 3);
}
