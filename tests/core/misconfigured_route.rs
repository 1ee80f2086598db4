//! A route whose handler takes the transaction extractor, behind a layer
//! that is not `.transactional()`: each request gets a 500 problem saying
//! so, and the process logs it once. (The only test of this binary that
//! meets the mistake: the log is once per process.)

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::routing::post;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::{SqliteStore, SqliteTransaction};

use crate::common;

#[tokio::test]
async fn a_transaction_extractor_without_a_transactional_layer_is_a_500_logged_once() {
    let errors = common::logs::capture(|level, _| *level == tracing::Level::ERROR);
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("app.sqlite3"))
        .await
        .unwrap();
    let handler = |_tx: SqliteTransaction| async { "ran" };
    // Forgot `.transactional()`.
    let app = Router::new()
        .route("/credits", post(handler))
        .route_layer(IdempotencyLayer::new(store, GlobalScope).require_key(true));
    let detail = "this handler takes a SqliteTransaction, and the request has none: put the route behind IdempotencyLayer::transactional() with require_key(true)";
    for key in ["k-1", "k-2"] {
        let request = Request::post("/credits")
            .header("idempotency-key", key)
            .body(Body::empty())
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(
            body,
            format!(
                r#"{{"type":"about:blank","title":"Internal Server Error","status":500,"detail":"{detail}"}}"#
            )
        );
    }
    assert_eq!(
        errors.kept(),
        vec![format!(
            "message=a handler's extractor found nothing in the request: the route is configured wrong; answering 500 (logged once per process);detail={detail:?};"
        )]
    );
}
