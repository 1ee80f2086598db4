//! `SqlxSqliteStore` (feature `sqlx-sqlite`): the store contract suite on
//! it, two stores (and a rusqlite `SqliteStore`) on one file, schema
//! migration, and what SQLite alone does behind the layer: a write around
//! the transaction fails with SQLITE_BUSY named as such, a misconfigured
//! route answers 500, separate mode. Transactional mode's shared rules are
//! `sqlx_transactional.rs`'s suite.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, to_bytes};
use axum::extract::State;
use axum::http::{Request, StatusCode, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use tower::ServiceExt;
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::problem::types;
use tower_idempotency::store::{Inspect, Purge, RecordCounts};
use tower_idempotency::test_util::suite::{
    inspect_is_exact_on_a_manual_clock, two_handles_one_winner,
};
use tower_idempotency::test_util::{ManualClock, START_MS, store_suite};
use tower_idempotency_sqlx::{SqlxSqliteError, SqlxSqliteStore, SqlxSqliteTransaction};

/// A WAL pool on `path` with this busy timeout.
async fn pool(path: &Path, busy: Duration) -> SqlitePool {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(busy);
    SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .unwrap()
}

async fn make(clock: ManualClock) -> (SqlxSqliteStore, tempfile::TempDir) {
    purging(clock, Purge::default()).await
}

async fn purging(clock: ManualClock, purge: Purge) -> (SqlxSqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let pool = pool(&dir.path().join("records.sqlite3"), Duration::from_secs(5)).await;
    let store = SqlxSqliteStore::builder(pool)
        .clock(clock)
        .purge(purge)
        .open()
        .await
        .unwrap();
    (store, dir)
}

store_suite!(sqlx_sqlite_store, make, inspect);
store_suite!(sqlx_sqlite_purge, purging, purge);

#[tokio::test]
async fn inspect_is_exact() {
    let clock = ManualClock::new(START_MS);
    let (store, _dir) = make(clock.clone()).await;
    inspect_is_exact_on_a_manual_clock(store, clock).await;
}

/// Two pools on one file, and a rusqlite store beside them: the schema is
/// the same, and the file's unique key picks one winner across them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pools_one_file_one_winner() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shared.sqlite3");
    let one = SqlxSqliteStore::from_pool(pool(&path, Duration::from_secs(5)).await)
        .await
        .unwrap();
    let two = SqlxSqliteStore::from_pool(pool(&path, Duration::from_secs(5)).await)
        .await
        .unwrap();
    two_handles_one_winner(one.clone(), two).await;
    // The rusqlite store opens the same schema (version 2) and sees the
    // 10 records the rounds' winners hold.
    let rusqlite = tower_idempotency::SqliteStore::open(&path).await.unwrap();
    let counts = rusqlite.counts().await.unwrap();
    assert_eq!(counts, one.counts().await.unwrap());
    assert_eq!(counts.in_flight, 10, "{counts:?}");
}

/// A newer schema than this build knows is refused, not overwritten.
#[tokio::test]
async fn newer_schema_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pool = pool(&dir.path().join("s.sqlite3"), Duration::from_secs(5)).await;
    sqlx::raw_sql("PRAGMA user_version = 99")
        .execute(&pool)
        .await
        .unwrap();
    let err = SqlxSqliteStore::from_pool(pool).await.unwrap_err();
    assert!(err.to_string().contains("schema version 99"), "{err}");
}

/// Version 1 of the schema: the records in a `WITHOUT ROWID` table.
const SCHEMA_V1: &str = "
CREATE TABLE idempotency_records (
    scope TEXT NOT NULL, key TEXT NOT NULL, fingerprint BLOB NOT NULL,
    token INTEGER NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('in_flight', 'completed')),
    lease_until INTEGER NOT NULL, expires_at INTEGER NOT NULL, response BLOB,
    PRIMARY KEY (scope, key)
) WITHOUT ROWID;
CREATE INDEX idempotency_records_expires_at ON idempotency_records (expires_at);
INSERT INTO idempotency_records VALUES
    ('s', 'done', x'01', 7, 'completed', 0, 9000000000000, randomblob(200000)),
    ('s', 'open', x'02', 8, 'in_flight', 5, 9000000000000, NULL),
    ('t', 'done', x'03', 9, 'completed', 0, 1, x'00ff');
PRAGMA user_version = 1;
";

/// One record's columns, in the table's order.
type Record = (
    String,
    String,
    Vec<u8>,
    i64,
    String,
    i64,
    i64,
    Option<Vec<u8>>,
);

/// Every column of every record, in key order.
async fn rows(pool: &SqlitePool) -> Vec<Record> {
    sqlx::query_as(
        "SELECT scope, key, fingerprint, token, state, lease_until, expires_at, response
         FROM idempotency_records ORDER BY scope, key",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// What the file says of the table: its version and whether it is still
/// `WITHOUT ROWID`.
async fn schema(pool: &SqlitePool) -> (i64, bool) {
    let version: i64 = sqlx::query_scalar("PRAGMA user_version")
        .fetch_one(pool)
        .await
        .unwrap();
    let sql: String = sqlx::query_scalar(
        "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'idempotency_records'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    (version, sql.contains("WITHOUT ROWID"))
}

/// A version 1 file (a `WITHOUT ROWID` table, whose large rows made every
/// lookup that met them read their overflow pages) becomes version 2, a
/// rowid table, with every record kept byte for byte: opened by either
/// SQLite store.
#[tokio::test]
async fn a_version_1_table_becomes_a_rowid_table_with_every_record_kept() {
    let dir = tempfile::tempdir().unwrap();
    for store in ["sqlx", "rusqlite"] {
        let path = dir.path().join(format!("{store}.sqlite3"));
        let pool = pool(&path, Duration::from_secs(5)).await;
        sqlx::raw_sql(SCHEMA_V1).execute(&pool).await.unwrap();
        let before = rows(&pool).await;
        assert_eq!(before.len(), 3);
        assert_eq!(schema(&pool).await, (1, true));
        match store {
            "sqlx" => drop(SqlxSqliteStore::from_pool(pool.clone()).await.unwrap()),
            _ => drop(tower_idempotency::SqliteStore::open(&path).await.unwrap()),
        }
        assert_eq!(schema(&pool).await, (2, false), "{store}");
        assert_eq!(rows(&pool).await, before, "{store}");
        let index: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM sqlite_master WHERE name = 'idempotency_records_expires_at'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(index, 1, "{store}");
    }
}

// ----------------------------------------------------------- behind a layer

/// The app: an account table beside the records, and a handler that counts
/// its runs.
#[derive(Clone)]
struct App {
    pool: SqlitePool,
    runs: Arc<AtomicUsize>,
}

impl App {
    async fn new(path: &Path, busy: Duration) -> App {
        let pool = pool(path, busy).await;
        sqlx::raw_sql(
            "CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL);
             CREATE TABLE credits (id INTEGER PRIMARY KEY, account_id INTEGER NOT NULL REFERENCES accounts (id), amount INTEGER NOT NULL);
             INSERT INTO accounts (id, balance) VALUES (1, 0);",
        )
        .execute(&pool)
        .await
        .unwrap();
        App {
            pool,
            runs: Arc::default(),
        }
    }

    async fn scalar(&self, sql: &'static str) -> i64 {
        sqlx::query_scalar(sql).fetch_one(&self.pool).await.unwrap()
    }

    async fn balance(&self) -> i64 {
        self.scalar("SELECT balance FROM accounts WHERE id = 1")
            .await
    }

    async fn credits(&self) -> i64 {
        self.scalar("SELECT count(*) FROM credits").await
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

fn user(parts: &Parts) -> String {
    parts
        .headers
        .get("x-user")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("anonymous")
        .to_owned()
}

/// Credits 5 through the request's transaction. `x-fail: after-effect`
/// answers 500 after the write; `x-fail: around` writes through the pool
/// instead (the one-writer rule broken); `x-wait: closed` waits until the
/// store ends the transaction, then tries to write.
async fn credit(
    State(app): State<App>,
    tx: SqlxSqliteTransaction,
    headers: axum::http::HeaderMap,
) -> Result<Response, SqlxSqliteError> {
    let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let header = |name: &str| headers.get(name).map(|v| v.as_bytes().to_vec());
    if header("x-wait").as_deref() == Some(b"closed") {
        tx.closed().await;
    }
    if header("x-fail").as_deref() == Some(b"around") {
        sqlx::query("UPDATE accounts SET balance = balance + 5 WHERE id = 1")
            .execute(&app.pool)
            .await?;
    }
    let mut conn = tx.connection().await?;
    let balance: i64 = sqlx::query_scalar(
        "UPDATE accounts SET balance = balance + 5 WHERE id = 1 RETURNING balance",
    )
    .fetch_one(&mut *conn)
    .await?;
    sqlx::query("INSERT INTO credits (account_id, amount) VALUES (1, 5)")
        .execute(&mut *conn)
        .await?;
    if header("x-fail").as_deref() == Some(b"after-effect") {
        return Ok(StatusCode::INTERNAL_SERVER_ERROR.into_response());
    }
    Ok((StatusCode::CREATED, format!("run {n}, balance {balance}")).into_response())
}

fn transactional(app: &App, store: SqlxSqliteStore) -> Router {
    Router::new()
        .route("/credit", post(credit))
        .route_layer(
            IdempotencyLayer::new(store, user as fn(&Parts) -> String)
                .require_key(true)
                .transactional(),
        )
        .with_state(app.clone())
}

async fn send(router: &Router, key: &str, extra: &[(&str, &str)]) -> (StatusCode, bool, Vec<u8>) {
    let mut request = Request::post("/credit")
        .header("idempotency-key", format!("\"{key}\""))
        .header("x-user", "alice");
    for (name, value) in extra {
        request = request.header(*name, *value);
    }
    let response = router
        .clone()
        .oneshot(request.body(Body::from("amount=5")).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let replayed = response.headers().get("idempotent-replayed").is_some();
    let body = to_bytes(response.into_body(), 1 << 20).await.unwrap();
    (status, replayed, body.to_vec())
}

/// A handler that writes through the pool while its request holds the
/// write lock waits the busy timeout for itself, gets SQLITE_BUSY, and is
/// answered 503 (not stored): nothing of it commits, the key is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_around_the_transaction_fails_busy_and_rolls_back() {
    let dir = tempfile::tempdir().unwrap();
    let app = App::new(&dir.path().join("app.sqlite3"), Duration::from_millis(200)).await;
    let store = SqlxSqliteStore::from_pool(app.pool.clone()).await.unwrap();
    let router = transactional(&app, store.clone());
    let (status, replayed, body) = send(&router, "k", &[("x-fail", "around")]).await;
    assert_eq!((status, replayed), (StatusCode::SERVICE_UNAVAILABLE, false));
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["type"], types::STORE_UNAVAILABLE, "{problem}");
    assert_eq!(
        (app.runs(), app.credits().await, app.balance().await),
        (1, 0, 0)
    );
    assert_eq!(store.counts().await.unwrap(), RecordCounts::default());
    // The error names the cause.
    let mut conn = app.pool.acquire().await.unwrap();
    sqlx::raw_sql("BEGIN IMMEDIATE")
        .execute(&mut *conn)
        .await
        .unwrap();
    let err = sqlx::query("DELETE FROM credits")
        .execute(&app.pool)
        .await
        .unwrap_err();
    let explained = SqlxSqliteStore::explain_busy(&err)
        .expect("SQLITE_BUSY")
        .to_string();
    assert!(
        explained.contains("only through its SqlxSqliteTransaction"),
        "{explained}"
    );
    assert!(SqlxSqliteStore::explain_busy(&sqlx::Error::RowNotFound).is_none());
    sqlx::raw_sql("ROLLBACK").execute(&mut *conn).await.unwrap();
}

/// The extractor on a route whose layer is not transactional: a 500 problem
/// that says so, and the handler does not run.
#[tokio::test]
async fn the_extractor_without_transactional_mode_is_a_500() {
    let dir = tempfile::tempdir().unwrap();
    let app = App::new(&dir.path().join("app.sqlite3"), Duration::from_secs(5)).await;
    let store = SqlxSqliteStore::from_pool(app.pool.clone()).await.unwrap();
    let router = Router::new()
        .route("/credit", post(credit))
        .route_layer(IdempotencyLayer::new(store, user as fn(&Parts) -> String))
        .with_state(app.clone());
    let (status, _, body) = send(&router, "k", &[]).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("SqlxSqliteTransaction"),
        "{problem}"
    );
    assert_eq!((app.runs(), app.credits().await), (0, 0));
}

/// Separate mode: the handler commits on its own through the pool; the
/// record completes after it, and the repeat replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_mode_runs_once_and_replays() {
    async fn plain(State(app): State<App>) -> Response {
        let n = app.runs.fetch_add(1, Ordering::SeqCst) + 1;
        sqlx::query("INSERT INTO credits (account_id, amount) VALUES (1, 5)")
            .execute(&app.pool)
            .await
            .unwrap();
        (StatusCode::CREATED, format!("run {n}")).into_response()
    }
    let dir = tempfile::tempdir().unwrap();
    let app = App::new(&dir.path().join("app.sqlite3"), Duration::from_secs(5)).await;
    let store = SqlxSqliteStore::from_pool(app.pool.clone()).await.unwrap();
    let router = Router::new()
        .route("/credit", post(plain))
        .route_layer(IdempotencyLayer::new(store, user as fn(&Parts) -> String))
        .with_state(app.clone());
    assert_eq!(
        send(&router, "k", &[]).await,
        (StatusCode::CREATED, false, b"run 1".to_vec())
    );
    assert_eq!(
        send(&router, "k", &[]).await,
        (StatusCode::CREATED, true, b"run 1".to_vec())
    );
    assert_eq!((app.runs(), app.credits().await), (1, 1));
}
