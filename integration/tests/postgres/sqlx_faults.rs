//! A sick PostgreSQL under `SqlxPostgresStore` fails closed and recovers,
//! while the layer serves real HTTP with a handler that counts its runs:
//! every request the store cannot decide gets the 503 `store-unavailable`
//! problem with `Retry-After: 1` and runs nothing, nothing is replayed while
//! it is sick, and once the fault is gone the same key runs exactly once and
//! its repeat is replayed byte for byte, without restarting the app.
//!
//! The shared server is `TOWER_IDEMPOTENCY_POSTGRES_URL` (or the local
//! `test` database); the restart test starts a private cluster of its own
//! (`initdb`/`pg_ctl` under `/usr/lib/postgresql/*/bin`, run as the
//! `postgres` user). A missing server or tool fails.

use crate::common;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, request::Parts};
use axum::response::Response;
use axum::routing::post;
use common::charge::{
    assert_ran, assert_replay_of, assert_unavailable, charge, request, serve_separate, user,
};
use common::{Harness, run, serve};
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgPool};
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::problem::types;
use tower_idempotency::store::FencingToken;
use tower_idempotency_sqlx::{SqlxPostgresStore, SqlxPostgresTransaction};

fn url() -> String {
    crate::common::services::postgres_url()
}

/// A pool of `size` on `url`. sqlx retries a refused connection until the
/// acquire timeout, so a call to a stopped server answers only then.
async fn pool_waiting(url: &str, size: u32, acquire: Duration) -> PgPool {
    PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(acquire)
        .connect(url)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {url} is required: {e}"))
}

/// A pool on the shared server, patient enough for a loaded CI machine.
async fn pool(url: &str, size: u32) -> PgPool {
    pool_waiting(url, size, Duration::from_secs(10)).await
}

/// A store on a table of its own, with an items table beside it.
async fn store(pool: PgPool) -> (SqlxPostgresStore, String) {
    let table = format!("idem_sqlxf_{:016x}", FencingToken::random().0);
    let store = SqlxPostgresStore::builder(pool.clone())
        .table(table.clone())
        .open()
        .await
        .unwrap();
    sqlx::raw_sql(AssertSqlSafe(format!(
        "CREATE TABLE {table}_items (id BIGSERIAL PRIMARY KEY, note TEXT)"
    )))
    .execute(&pool)
    .await
    .unwrap();
    (store, table)
}

async fn query_i64(pool: &PgPool, sql: String) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(sql))
        .fetch_one(pool)
        .await
        .unwrap()
}

async fn drop_tables(pool: &PgPool, table: &str) {
    sqlx::raw_sql(AssertSqlSafe(format!(
        "DROP TABLE {table}; DROP TABLE {table}_items"
    )))
    .execute(pool)
    .await
    .unwrap();
}

/// Terminates one backend from a connection outside the store's pool.
async fn terminate(pid: i32) {
    let admin = pool(&url(), 1).await;
    let done: bool =
        sqlx::query_scalar("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = $1")
            .bind(pid)
            .fetch_one(&admin)
            .await
            .unwrap();
    assert!(done, "backend {pid} not terminated");
    admin.close().await;
}

/// A completed record whose response is garbage: 503, no replay, no second
/// run; a garbage fingerprint: 422. Repaired, it replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_record() {
    let pool = pool(&url(), 4).await;
    let (store, table) = store(pool.clone()).await;
    let h = Harness::default();
    let addr = serve_separate(store, &h).await;
    let first = request(addr, "k", &[]).await;
    assert_ran(&first, 1);
    for (column, garbage, status, problem) in [
        (
            "response",
            &b"\x00garbage"[..],
            503,
            types::STORE_UNAVAILABLE,
        ),
        ("fingerprint", &b"\x01"[..], 422, types::MISMATCH),
    ] {
        let good: Vec<u8> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT {column} FROM {table} WHERE key = 'k'"
        )))
        .fetch_one(&pool)
        .await
        .unwrap();
        let set = format!("UPDATE {table} SET {column} = $1 WHERE key = 'k'");
        let set = |value: Vec<u8>| {
            let (set, pool) = (set.clone(), pool.clone());
            async move {
                let done = sqlx::query(AssertSqlSafe(set))
                    .bind(value)
                    .execute(&pool)
                    .await
                    .unwrap();
                assert_eq!(done.rows_affected(), 1);
            }
        };
        set(garbage.to_vec()).await;
        for _ in 0..2 {
            let r = request(addr, "k", &[]).await;
            assert_eq!(r.assert_problem(status), problem, "{column}: {r:?}");
            assert_eq!(r.header("idempotent-replayed"), None);
        }
        set(good).await;
        assert_replay_of(&request(addr, "k", &[]).await, &first);
    }
    assert_eq!(h.runs(), 1);
    drop_tables(&pool, &table).await;
}

/// Separate mode: while the handler is held, the server terminates the
/// pool's only connection, idle, which the completion will use. The pool
/// finds it dead when it hands it out and opens a new one: the answer is
/// stored and replayed, the handler ran once, and the next keys work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_killed_separate() {
    let pool = pool(&url(), 1).await;
    let (store, table) = store(pool.clone()).await;
    let h = Harness::default();
    let addr = serve_separate(store, &h).await;
    let mut entered = h.watch();
    let held = tokio::spawn(async move { request(addr, "k", &[("x-gate", b"g")]).await });
    assert_eq!(entered.recv().await.as_deref(), Some("g"));
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .unwrap();
    terminate(pid).await;
    h.open("g");
    let first = held.await.unwrap();
    assert_ran(&first, 1);
    assert_replay_of(&request(addr, "k", &[]).await, &first);
    assert_ran(&request(addr, "next", &[]).await, 2);
    assert_eq!(h.runs(), 2);
    let other: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_ne!(other, pid, "the pool replaced the terminated connection");
    drop_tables(&pool, &table).await;
}

#[derive(Clone)]
struct TxState {
    h: Harness,
    items: String,
    pid: Arc<AtomicI32>,
}

/// Writes an item in the request's transaction and notes its backend, then
/// as [`charge`].
async fn charge_in_transaction(
    State(s): State<TxState>,
    tx: SqlxPostgresTransaction,
    headers: HeaderMap,
) -> Response {
    let mut conn = tx.connection().await.unwrap();
    let pid: i32 = sqlx::query_scalar(AssertSqlSafe(format!(
        "INSERT INTO {} (note) VALUES ('charged') RETURNING pg_backend_pid()",
        s.items
    )))
    .fetch_one(&mut *conn)
    .await
    .unwrap();
    drop(conn);
    s.pid.store(pid, Ordering::SeqCst);
    charge(State(s.h), headers).await
}

/// Transactional mode: while the handler is held, the server terminates the
/// transaction's connection. The completion fails: 503, the item went with
/// the transaction and the key was given back, so the retry runs once and
/// commits; its repeat replays. The pool works on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_killed_transactional() {
    let pool = pool(&url(), 4).await;
    let (store, table) = store(pool.clone()).await;
    let state = TxState {
        h: Harness::default(),
        items: format!("{table}_items"),
        pid: Arc::new(AtomicI32::new(0)),
    };
    let app = Router::new()
        .route("/charge", post(charge_in_transaction))
        .route_layer(IdempotencyLayer::new(store, |p: &Parts| user(p)).transactional())
        .with_state(state.clone());
    let addr = serve(app).await;
    let h = state.h.clone();
    let mut entered = h.watch();
    let held = tokio::spawn(async move { request(addr, "k", &[("x-gate", b"g")]).await });
    assert_eq!(entered.recv().await.as_deref(), Some("g"));
    terminate(state.pid.load(Ordering::SeqCst)).await;
    h.open("g");
    assert_unavailable(&held.await.unwrap());
    assert_eq!(h.runs(), 1);
    let items = format!("SELECT count(*) FROM {table}_items");
    assert_eq!(query_i64(&pool, items.clone()).await, 0);

    let first = request(addr, "k", &[]).await;
    assert_ran(&first, 2);
    assert_replay_of(&request(addr, "k", &[]).await, &first);
    assert_ran(&request(addr, "next", &[]).await, 3);
    assert_eq!(h.runs(), 3);
    assert_eq!(query_i64(&pool, items).await, 2);
    drop_tables(&pool, &table).await;
}

/// A PostgreSQL cluster of the test's own in a temporary directory, run as
/// the `postgres` user (initdb refuses root), on a free loopback port.
struct PrivatePostgres {
    dir: tempfile::TempDir,
    port: u16,
    bin: PathBuf,
}

impl PrivatePostgres {
    fn init() -> PrivatePostgres {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .expect("PostgreSQL server binaries under /usr/lib/postgresql are required")
            .map(|e| e.unwrap().path().join("bin"))
            .find(|bin| bin.join("initdb").exists())
            .expect("initdb under /usr/lib/postgresql/*/bin is required");
        let dir = tempfile::tempdir().unwrap();
        run("chown", &["postgres:", dir.path().to_str().unwrap()]);
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let pg = PrivatePostgres { dir, port, bin };
        let data = pg.data();
        pg.as_postgres(
            "initdb",
            &["-D", &data, "-U", "postgres", "-A", "trust", "--no-sync"],
        );
        pg
    }

    fn data(&self) -> String {
        self.dir.path().join("data").to_str().unwrap().to_owned()
    }

    fn as_postgres(&self, tool: &str, args: &[&str]) {
        let tool = self.bin.join(tool);
        let mut all = vec!["-u", "postgres", "--", tool.to_str().unwrap()];
        all.extend_from_slice(args);
        run("runuser", &all);
    }

    fn start(&self) {
        let options = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} -c fsync=off",
            self.port,
            self.dir.path().display()
        );
        let log = self.dir.path().join("log");
        let data = self.data();
        self.as_postgres(
            "pg_ctl",
            &[
                "-D",
                &data,
                "-o",
                &options,
                "-l",
                log.to_str().unwrap(),
                "-w",
                "start",
            ],
        );
    }

    /// `-m immediate`: the server dies without a clean shutdown, as in a
    /// crash; its WAL brings back every commit on the next start.
    fn stop(&self) {
        let data = self.data();
        self.as_postgres("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"]);
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let _ = std::process::Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(self.bin.join("pg_ctl"))
            .args(["-D", &self.data(), "-m", "immediate", "stop"])
            .output();
    }
}

/// The server goes down: every request gets 503 and runs nothing, also the
/// repeat of a completed key (the store cannot confirm it). Back up, the
/// same app (the same pool) serves again: the pending key runs once, the
/// completed key replays (PostgreSQL kept it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restarted() {
    let pg = PrivatePostgres::init();
    pg.start();
    // A private, idle server: a short wait keeps the stopped phase short.
    let pool = pool_waiting(&pg.url(), 4, Duration::from_secs(2)).await;
    let (store, _) = store(pool).await;
    let h = Harness::default();
    let addr = serve_separate(store, &h).await;
    let done = request(addr, "done", &[]).await;
    assert_ran(&done, 1);

    pg.stop();
    for key in ["done", "k", "k"] {
        assert_unavailable(&request(addr, key, &[]).await);
    }
    assert_eq!(h.runs(), 1);

    pg.start();
    let first = request(addr, "k", &[]).await;
    assert_ran(&first, 2);
    assert_replay_of(&request(addr, "k", &[]).await, &first);
    assert_replay_of(&request(addr, "done", &[]).await, &done);
    assert_eq!(h.runs(), 2);
}
