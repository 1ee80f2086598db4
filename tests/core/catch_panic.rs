//! A handler that panics, over real sockets, in transactional mode on
//! SQLite: without a panic catcher the client gets no answer at all (the
//! connection closes), and with tower-http's `CatchPanicLayer`, inside the
//! idempotency layer or outside it, a 500 `application/problem+json`. In
//! every case the panicking request's write is rolled back and its key is
//! free: the retry runs once and is then replayed (the configuration
//! guide's "Panics").

use crate::common;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, Response, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::post;
use common::{Harness, Raw, send, serve};
use tower_http::catch_panic::CatchPanicLayer;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::{SqliteTransaction, TransactionError};
use tower_idempotency::{IdempotencyLayer, SqliteStore};

/// The 500 a panic answers: a problem, as every error of the service is.
fn panicked(_: Box<dyn std::any::Any + Send + 'static>) -> Response<String> {
    let mut response = Response::new(
        r#"{"type":"about:blank","title":"Internal Server Error","status":500,"detail":"the server failed while processing this request"}"#
            .to_owned(),
    );
    *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        "application/problem+json".parse().unwrap(),
    );
    response
}

/// Writes an item through the request's transaction, counts its run, then
/// panics when asked (`x-panic`); else answers 201 with the run's number.
async fn write(
    State(h): State<Harness>,
    tx: SqliteTransaction,
    headers: HeaderMap,
) -> Result<impl IntoResponse, TransactionError> {
    tx.run(|t| t.execute("INSERT INTO items DEFAULT VALUES", []))
        .await?;
    let n = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
    assert!(!headers.contains_key("x-panic"), "a bug in the handler");
    Ok((StatusCode::CREATED, format!("run {n}")))
}

#[derive(Clone, Copy)]
enum Catcher {
    None,
    Inside,
    Outside,
}

struct App {
    addr: SocketAddr,
    h: Harness,
    path: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

async fn start(catcher: Catcher) -> App {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.sqlite3");
    tower_idempotency::rusqlite::Connection::open(&path)
        .unwrap()
        .execute_batch("CREATE TABLE items (id INTEGER PRIMARY KEY)")
        .unwrap();
    let store = SqliteStore::open(&path).await.unwrap();
    let h = Harness::default();
    let layer = IdempotencyLayer::new(store, GlobalScope)
        .require_key(true)
        .transactional();
    let routes = Router::new().route("/items", post(write));
    // In axum the layer added last runs first.
    let app = match catcher {
        Catcher::None => routes.route_layer(layer),
        Catcher::Inside => routes
            .route_layer(CatchPanicLayer::custom(panicked))
            .route_layer(layer),
        Catcher::Outside => routes
            .route_layer(layer)
            .layer(CatchPanicLayer::custom(panicked)),
    };
    let addr = serve(app.with_state(h.clone())).await;
    App {
        addr,
        h,
        path,
        _dir: dir,
    }
}

impl App {
    async fn post(&self, key: &[u8], panic: bool) -> Raw {
        let mut headers: Vec<(&str, &[u8])> = vec![("idempotency-key", key)];
        if panic {
            headers.push(("x-panic", b"1"));
        }
        send(self.addr, "POST", "/items", &headers, b"{}").await
    }

    fn items(&self) -> i64 {
        tower_idempotency::rusqlite::Connection::open(&self.path)
            .unwrap()
            .query_row("SELECT count(*) FROM items", [], |r| r.get(0))
            .unwrap()
    }
}

/// After the panicking request: the key is free, so the retry runs (run 2)
/// and commits its one item, and its repeat is replayed.
async fn the_key_is_free_and_the_retry_runs_once(app: &App) {
    assert_eq!(
        app.items(),
        0,
        "the panicking request's item was rolled back"
    );
    let retry = common::until_not_in_flight(|| app.post(b"k", false), |r| r.status).await;
    assert_eq!((retry.status, retry.replayed()), (201, false), "{retry:?}");
    assert_eq!(retry.body, b"run 2");
    let again = app.post(b"k", false).await;
    assert_eq!(
        (again.status, again.replayed(), again.body),
        (201, true, b"run 2".to_vec())
    );
    assert_eq!((app.items(), app.h.runs()), (1, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_catcher_the_client_gets_no_answer_and_the_key_is_free() {
    let app = start(Catcher::None).await;
    let mut conn = tokio::net::TcpStream::connect(app.addr).await.unwrap();
    let request = common::request_bytes(
        "POST",
        "/items",
        &[("idempotency-key", b"k"), ("x-panic", b"1")],
        b"{}",
    );
    tokio::io::AsyncWriteExt::write_all(&mut conn, &request)
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut conn, &mut answer)
        .await
        .unwrap();
    assert_eq!(answer, b"", "a panic closes the connection unanswered");
    assert_eq!(app.h.runs(), 1);
    the_key_is_free_and_the_retry_runs_once(&app).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catcher_inside_the_layer_answers_a_problem_and_the_key_is_free() {
    let app = start(Catcher::Inside).await;
    let boom = app.post(b"k", true).await;
    assert_eq!(boom.assert_problem(500), "about:blank");
    assert_eq!(boom.header("idempotent-replayed"), None);
    // Not stored: a repeat of the same request runs it again.
    the_key_is_free_and_the_retry_runs_once(&app).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catcher_outside_the_layer_answers_a_problem_and_the_key_is_free() {
    let app = start(Catcher::Outside).await;
    let boom = app.post(b"k", true).await;
    assert_eq!(boom.assert_problem(500), "about:blank");
    assert_eq!(boom.header("idempotent-replayed"), None);
    the_key_is_free_and_the_retry_runs_once(&app).await;
}
