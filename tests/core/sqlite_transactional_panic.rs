//! A panic inside `SqliteTransaction::run` is the handler's panic, not the
//! store's: the request is rolled back and the store's single writer thread
//! goes on serving every other request.

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use tower::ServiceExt;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::SqliteTransaction;
use tower_idempotency::{IdempotencyLayer, SqliteStore};

fn post_with(key: &str, panic: bool) -> Request<Body> {
    let mut request = Request::post("/").header("idempotency-key", key);
    if panic {
        request = request.header("x-panic", "1");
    }
    request.body(Body::empty()).unwrap()
}

/// Inserts one row; with `x-panic` its closure panics after the insert.
async fn write(tx: SqliteTransaction, headers: HeaderMap) -> Response {
    let panic = headers.contains_key("x-panic");
    let result = tx
        .run(move |t| {
            let n = t.execute("INSERT INTO items DEFAULT VALUES", [])?;
            assert!(!panic, "a bug in the handler's SQL closure");
            Ok(n)
        })
        .await;
    match result {
        Ok(_) => (StatusCode::CREATED, "written").into_response(),
        Err(e) => e.into_response(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_inside_run_rolls_back_its_request_and_the_store_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sqlite3");
    tower_idempotency::rusqlite::Connection::open(&path)
        .unwrap()
        .execute_batch("CREATE TABLE items (id INTEGER PRIMARY KEY)")
        .unwrap();
    let store = SqliteStore::open(&path).await.unwrap();
    let app = Router::new()
        .route("/", post(write))
        .route_layer(IdempotencyLayer::new(store, GlobalScope).transactional());

    let before = app
        .clone()
        .oneshot(post_with("before", false))
        .await
        .unwrap();
    assert_eq!(before.status(), StatusCode::CREATED);

    // The closure's panic reaches the handler, as if it had run inline.
    let boom = tokio::spawn(app.clone().oneshot(post_with("boom", true))).await;
    assert!(boom.expect_err("the handler panicked").is_panic());

    // The writer lives on: a new key is served, and the panicked key is
    // free (its claim was rolled back with its row).
    let after = app
        .clone()
        .oneshot(post_with("after", false))
        .await
        .unwrap();
    assert_eq!(after.status(), StatusCode::CREATED);
    let retry = app.clone().oneshot(post_with("boom", false)).await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers().get("idempotent-replayed"), None);

    let rows: i64 = tower_idempotency::rusqlite::Connection::open(&path)
        .unwrap()
        .query_row("SELECT COUNT(*) FROM items", [], |r| r.get(0))
        .unwrap();
    assert_eq!(
        rows, 3,
        "before, after and the retried boom; not the panicked insert"
    );
}
