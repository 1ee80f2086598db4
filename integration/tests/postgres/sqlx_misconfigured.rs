//! A route whose handler takes the transaction extractor, behind a layer
//! that is not `.transactional()`: each request gets a 500 problem saying
//! so, and the process logs it once for each database's transaction. (The
//! only test of this binary that meets the mistake: the log is once per
//! process.) The test reads its own thread's log (`common::logs`). Here for
//! `SqlxPostgresTransaction`, on PostgreSQL (`TOWER_IDEMPOTENCY_POSTGRES_URL`,
//! or the local `test` database), then `SqlxSqliteTransaction`.

use crate::common;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::routing::post;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency_sqlx::{
    SqlxPostgresStore, SqlxPostgresTransaction, SqlxSqliteStore, SqlxSqliteTransaction,
};

/// Two requests to a misconfigured route: each a 500 problem naming the
/// transaction type `name`.
async fn misconfigured(app: Router, name: &str) -> String {
    let detail = format!(
        "this handler takes a {name}, and the request has none: put the route behind IdempotencyLayer::transactional() with require_key(true)"
    );
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
    format!(
        "message=a handler's extractor found nothing in the request: the route is configured wrong; answering 500 (logged once per process);detail={detail:?};"
    )
}

#[tokio::test]
async fn a_transaction_extractor_without_a_transactional_layer_is_a_500_logged_once_per_database() {
    let errors = common::logs::capture(|level, _| *level == tracing::Level::ERROR);
    let url = crate::common::services::postgres_url();
    let pool = sqlx::PgPool::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {url} is required: {e}"));
    let store = SqlxPostgresStore::from_pool(pool).await.unwrap();
    let handler = |_tx: SqlxPostgresTransaction| async { "ran" };
    // Forgot `.transactional()`.
    let app = Router::new()
        .route("/credits", post(handler))
        .route_layer(IdempotencyLayer::new(store, GlobalScope).require_key(true));
    let pg = misconfigured(app, "SqlxPostgresTransaction").await;
    assert_eq!(errors.kept(), vec![pg.clone()]);

    // The same mistake on another database is logged once too: the
    // extractor is one generic impl, its log one per database.
    let dir = tempfile::tempdir().unwrap();
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.path().join("app.sqlite3"))
        .create_if_missing(true);
    let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
    let store = SqlxSqliteStore::from_pool(pool).await.unwrap();
    let handler = |_tx: SqlxSqliteTransaction| async { "ran" };
    let app = Router::new()
        .route("/credits", post(handler))
        .route_layer(IdempotencyLayer::new(store, GlobalScope).require_key(true));
    let lite = misconfigured(app, "SqlxSqliteTransaction").await;
    assert_eq!(errors.kept(), vec![pg, lite]);
}
