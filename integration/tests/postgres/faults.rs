//! `PostgresStore` (tokio-postgres) fails closed and recovers: a corrupt
//! record, a connection killed mid-request in either mode, and a server
//! stopped and started again. Each fault is injected while the layer serves
//! real HTTP, with a handler that counts its runs:
//!
//! * every request the sick store cannot decide is answered with the 503
//!   `store-unavailable` problem and `Retry-After: 1`, and runs nothing;
//! * nothing is ever replayed while the store is sick;
//! * once the fault is gone, the SAME key runs exactly once and its repeat
//!   is replayed byte for byte, without restarting the app.
//!
//! Runs on the shared server (`TOWER_IDEMPOTENCY_POSTGRES_URL`) and, for the
//! restart, on a private cluster the test starts and stops itself
//! (`initdb`/`pg_ctl` under `/usr/lib/postgresql/*/bin`, run as the
//! `postgres` user). A missing server or tool fails.

#![cfg(feature = "postgres")]

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
use common::{Harness, free_port, run, serve};
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::problem::types;
use tower_idempotency::store::FencingToken;
use tower_idempotency_postgres::PostgresStore;
use tower_idempotency_postgres::PostgresTransaction;

fn url() -> String {
    crate::common::services::postgres_url()
}

/// A store on a table of its own, with an items table beside it.
async fn store(url: &str) -> (PostgresStore, String) {
    let table = format!("idem_faults_{:016x}", FencingToken::random().0);
    let store = PostgresStore::builder(url)
        .table(table.clone())
        .open()
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {url} is required: {e}"));
    store
        .pool()
        .get()
        .await
        .unwrap()
        .batch_execute(&format!(
            "CREATE TABLE {table}_items (id BIGSERIAL PRIMARY KEY, note TEXT)"
        ))
        .await
        .unwrap();
    (store, table)
}

async fn query_i64(store: &PostgresStore, sql: &str) -> i64 {
    let client = store.pool().get().await.unwrap();
    client.query_one(sql, &[]).await.unwrap().get(0)
}

async fn drop_tables(store: &PostgresStore, table: &str) {
    let client = store.pool().get().await.unwrap();
    client
        .batch_execute(&format!("DROP TABLE {table}; DROP TABLE {table}_items"))
        .await
        .unwrap();
}

/// Terminates one backend from a connection of the test's own.
async fn terminate(pid: i32) {
    let (admin, connection) = tokio_postgres::connect(&url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let row = admin
        .query_one(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = $1",
            &[&pid],
        )
        .await
        .unwrap();
    assert!(row.get::<_, bool>(0), "backend {pid} not terminated");
}

/// A completed record whose response is garbage: 503, no replay, no
/// second run; a garbage fingerprint: 422. Repaired, it replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_corrupt_record() {
    let (store, table) = store(&url()).await;
    let h = Harness::default();
    let addr = serve_separate(store.clone(), &h).await;
    let first = request(addr, "k", &[]).await;
    assert_ran(&first, 1);
    let client = store.pool().get().await.unwrap();
    for (column, garbage, status, problem) in [
        (
            "response",
            &b"\x00garbage"[..],
            503,
            types::STORE_UNAVAILABLE,
        ),
        ("fingerprint", &b"\x01"[..], 422, types::MISMATCH),
    ] {
        let good: Vec<u8> = client
            .query_one(
                &format!("SELECT {column} FROM {table} WHERE key = 'k'"),
                &[],
            )
            .await
            .unwrap()
            .get(0);
        let set = format!("UPDATE {table} SET {column} = $1 WHERE key = 'k'");
        assert_eq!(client.execute(&set, &[&garbage]).await.unwrap(), 1);
        for _ in 0..2 {
            let r = request(addr, "k", &[]).await;
            assert_eq!(r.assert_problem(status), problem, "{column}: {r:?}");
            assert_eq!(r.header("idempotent-replayed"), None);
        }
        assert_eq!(client.execute(&set, &[&good]).await.unwrap(), 1);
        assert_replay_of(&request(addr, "k", &[]).await, &first);
    }
    assert_eq!(h.runs(), 1);
    drop(client);
    drop_tables(&store, &table).await;
}

/// Separate mode: while the handler is held, the server terminates the
/// pooled connection the completion would use. The pool notices it
/// closed and opens a new one: the answer is stored and replayed, the
/// handler ran once, and the next keys work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_connection_killed_separate() {
    let (store, table) = store(&url()).await;
    let h = Harness::default();
    let addr = serve_separate(store.clone(), &h).await;
    let mut entered = h.watch();
    let held = tokio::spawn(async move { request(addr, "k", &[("x-gate", b"g")]).await });
    assert_eq!(entered.recv().await.as_deref(), Some("g"));
    // The claim's connection is the pool's only one, idle again.
    assert_eq!(store.pool().status().size, 1);
    let pooled = store.pool().get().await.unwrap();
    let pid: i32 = pooled
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    terminate(pid).await;
    common::eventually(Duration::from_secs(5), || pooled.is_closed()).await;
    drop(pooled);
    h.open("g");
    let first = held.await.unwrap();
    assert_ran(&first, 1);
    assert_replay_of(&request(addr, "k", &[]).await, &first);
    assert_ran(&request(addr, "next", &[]).await, 2);
    assert_eq!(h.runs(), 2);
    drop_tables(&store, &table).await;
}

#[derive(Clone)]
struct TxState {
    h: Harness,
    items: String,
    pid: Arc<AtomicI32>,
}

/// Writes an item in the request's transaction and notes its backend,
/// then as [`charge`].
async fn charge_pg(
    State(s): State<TxState>,
    tx: PostgresTransaction,
    headers: HeaderMap,
) -> Response {
    let client = tx.client().await.unwrap();
    let pid: i32 = client
        .query_one(
            &format!(
                "INSERT INTO {} (note) VALUES ('charged') RETURNING pg_backend_pid()",
                s.items
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    drop(client);
    s.pid.store(pid, Ordering::SeqCst);
    charge(State(s.h), headers).await
}

/// Transactional mode: while the handler is held, the server terminates
/// the transaction's connection. The commit fails: 503, the item was
/// rolled back with it and the key given back, so the retry runs once
/// and commits; its repeat replays. The pool works on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_connection_killed_transactional() {
    let (store, table) = store(&url()).await;
    let state = TxState {
        h: Harness::default(),
        items: format!("{table}_items"),
        pid: Arc::new(AtomicI32::new(0)),
    };
    let app = Router::new()
        .route("/charge", post(charge_pg))
        .route_layer(IdempotencyLayer::new(store.clone(), |p: &Parts| user(p)).transactional())
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
    assert_eq!(query_i64(&store, &items).await, 0);

    let first = request(addr, "k", &[]).await;
    assert_ran(&first, 2);
    assert_replay_of(&request(addr, "k", &[]).await, &first);
    assert_ran(&request(addr, "next", &[]).await, 3);
    assert_eq!(h.runs(), 3);
    assert_eq!(query_i64(&store, &items).await, 2);
    drop_tables(&store, &table).await;
}

/// A PostgreSQL cluster of the test's own in a temporary directory, run
/// as the `postgres` user (initdb refuses root), on a free port.
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
        let pg = PrivatePostgres {
            dir,
            port: free_port(),
            bin,
        };
        pg.as_postgres(
            "initdb",
            &[
                "-D",
                &pg.data(),
                "-U",
                "postgres",
                "-A",
                "trust",
                "--no-sync",
            ],
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
        self.as_postgres(
            "pg_ctl",
            &[
                "-D",
                &self.data(),
                "-o",
                &options,
                "-l",
                log.to_str().unwrap(),
                "-w",
                "start",
            ],
        );
    }

    /// `-m immediate`: the server dies without a clean shutdown, as in
    /// a crash; its WAL brings back every commit on the next start.
    fn stop(&self) {
        self.as_postgres(
            "pg_ctl",
            &["-D", &self.data(), "-m", "immediate", "-w", "stop"],
        );
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

/// The server goes down: every request gets 503 and runs nothing, also
/// the repeat of a completed key (the store cannot confirm it). Back up,
/// the same app (the same pool) serves again: the pending key runs once,
/// the completed key replays (PostgreSQL kept it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_server_restarted() {
    let pg = PrivatePostgres::init();
    pg.start();
    let (store, _) = store(&pg.url()).await;
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
