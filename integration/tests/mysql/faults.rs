//! `MySqlStore` under faults on a real MySQL/MariaDB server: corrupt
//! records, connections the server kills mid-request (separate and
//! transactional mode), and a database cut off behind a TCP proxy that
//! stops forwarding without closing. Needs the server at
//! `TOWER_IDEMPOTENCY_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`);
//! an unreachable server fails every test.

#![cfg(feature = "mysql")]

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::{Harness, Raw, send, serve};
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::problem::types;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::FencingToken;
use tower_idempotency_sqlx::MySqlStore;
use tower_idempotency_sqlx::MySqlTransaction;
use tower_idempotency_sqlx::sqlx::{self, AssertSqlSafe};

fn url() -> String {
    crate::common::services::mysql_url()
}

/// A store on tables of its own (records and `_credits`), dropped at the end.
struct Db {
    store: MySqlStore,
    /// The layer's max hold.
    hold: Duration,
    table: String,
    admin: sqlx::MySqlPool,
}

impl Db {
    async fn new(url: &str, admin_url: &str, hold: Duration) -> Db {
        let table = format!("idem_faults_{:016x}", FencingToken::random().0);
        let store = MySqlStore::builder(url)
            .table(table.clone())
            .wait_timeout(Duration::from_secs(2))
            .open()
            .await
            .unwrap_or_else(|e| panic!("MySQL/MariaDB at {url} is required: {e}"));
        let admin = sqlx::MySqlPool::connect(admin_url).await.unwrap();
        sqlx::query(AssertSqlSafe(format!(
            "CREATE TABLE {table}_credits (id BIGINT AUTO_INCREMENT PRIMARY KEY, amount BIGINT NOT NULL) ENGINE=InnoDB"
        )))
        .execute(&admin)
        .await
        .unwrap();
        Db {
            store,
            table,
            hold,
            admin,
        }
    }

    async fn i64(&self, sql: String) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(&self.admin)
            .await
            .unwrap()
    }

    async fn credits(&self) -> i64 {
        self.i64(format!("SELECT COUNT(*) FROM {}_credits", self.table))
            .await
    }

    async fn kill(&self, connection_id: u64) {
        sqlx::query(AssertSqlSafe(format!("KILL CONNECTION {connection_id}")))
            .execute(&self.admin)
            .await
            .unwrap();
    }

    async fn drop_tables(self) {
        sqlx::query(AssertSqlSafe(format!(
            "DROP TABLE {0}, {0}_credits",
            self.table
        )))
        .execute(&self.admin)
        .await
        .unwrap();
    }
}

#[derive(Clone)]
struct App {
    h: Harness,
    table: String,
    /// The connection id of the last transaction a handler wrote in.
    connection: Arc<AtomicU64>,
}

fn answer(n: usize) -> Response {
    (StatusCode::CREATED, format!("run {n}")).into_response()
}

/// Separate mode: counts its run, waits at its gate.
async fn charge(State(app): State<App>, headers: HeaderMap) -> Response {
    let n = app.h.runs.fetch_add(1, Ordering::SeqCst) + 1;
    app.h.wait_at_gate(&headers).await;
    answer(n)
}

/// Transactional mode: credits in the request's transaction and notes its
/// connection, then as [`charge`].
async fn charge_tx(State(app): State<App>, tx: MySqlTransaction, headers: HeaderMap) -> Response {
    {
        let mut conn = tx.connection().await.unwrap();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {}_credits (amount) VALUES (5)",
            app.table
        )))
        .execute(&mut *conn)
        .await
        .unwrap();
        let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        app.connection.store(id, Ordering::SeqCst);
    }
    charge(State(app), headers).await
}

async fn start(db: &Db, transactional: bool) -> (SocketAddr, App) {
    let app = App {
        h: Harness::default(),
        table: db.table.clone(),
        connection: Arc::default(),
    };
    let layer = IdempotencyLayer::new(db.store.clone(), GlobalScope).max_hold(db.hold);
    let router = if transactional {
        Router::new()
            .route("/charge", post(charge_tx))
            .route_layer(layer.transactional())
    } else {
        Router::new()
            .route("/charge", post(charge))
            .route_layer(layer)
    };
    (serve(router.with_state(app.clone())).await, app)
}

async fn request(addr: SocketAddr, key: &str, extra: &[(&str, &[u8])]) -> Raw {
    let mut headers: Vec<(&str, &[u8])> = vec![("idempotency-key", key.as_bytes())];
    headers.extend_from_slice(extra);
    send(addr, "POST", "/charge", &headers, b"{}").await
}

fn assert_ran(r: &Raw, n: usize) {
    assert_eq!((r.status, r.replayed()), (201, false), "{r:?}");
    assert_eq!(r.body, format!("run {n}").as_bytes());
}

fn assert_replay_of(r: &Raw, first: &Raw) {
    assert!(r.replayed(), "{r:?}");
    assert_eq!((r.status, &r.body), (first.status, &first.body));
}

/// A completed record whose response is garbage: 503, no replay, no second
/// run; a fingerprint of the wrong length: 422. Repaired, it replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_record() {
    let db = Db::new(&url(), &url(), Duration::from_secs(30)).await;
    let (addr, app) = start(&db, false).await;
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
        let good: Vec<u8> =
            sqlx::query_scalar(AssertSqlSafe(format!("SELECT {column} FROM {}", db.table)))
                .fetch_one(&db.admin)
                .await
                .unwrap();
        let set = format!("UPDATE {} SET {column} = ?", db.table);
        let done = sqlx::query(AssertSqlSafe(set.clone()))
            .bind(garbage)
            .execute(&db.admin)
            .await
            .unwrap();
        assert_eq!(done.rows_affected(), 1);
        for _ in 0..2 {
            let r = request(addr, "k", &[]).await;
            assert_eq!(r.assert_problem(status), problem, "{column}: {r:?}");
            assert_eq!(r.header("idempotent-replayed"), None);
        }
        sqlx::query(AssertSqlSafe(set))
            .bind(good)
            .execute(&db.admin)
            .await
            .unwrap();
        assert_replay_of(&request(addr, "k", &[]).await, &first);
    }
    assert_eq!(app.h.runs(), 1);
    db.drop_tables().await;
}

/// Separate mode: while the handler is held, the server kills every idle
/// connection of the store's pool (the claim's among them). The pool notices and opens new ones: the
/// answer is stored and replayed, the handler ran once, the next key works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_killed_separate() {
    let db = Db::new(&url(), &url(), Duration::from_secs(30)).await;
    let (addr, app) = start(&db, false).await;
    let mut entered = app.h.watch();
    let held = tokio::spawn(async move { request(addr, "k", &[("x-gate", b"g")]).await });
    assert_eq!(entered.recv().await.as_deref(), Some("g"));
    // Every idle connection of the store's pool (the claim's among them),
    // held at once so that each is a different one, then killed.
    let pool = db.store.pool();
    // sqlx hands a dropped connection back to its pool on a task of its
    // own, so the claim's may still be on its way when the handler starts.
    common::eventually(Duration::from_secs(5), || pool.num_idle() >= 1).await;
    let idle = pool.num_idle();
    let mut held_connections = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..idle {
        let mut conn = pool.acquire().await.unwrap();
        let id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        ids.push(id);
        held_connections.push(conn);
    }
    drop(held_connections);
    for id in ids {
        db.kill(id).await;
    }
    app.h.open("g");
    let first = held.await.unwrap();
    assert_ran(&first, 1);
    assert_replay_of(&request(addr, "k", &[]).await, &first);
    assert_ran(&request(addr, "next", &[]).await, 2);
    assert_eq!(app.h.runs(), 2);
    db.drop_tables().await;
}

/// Transactional mode: while the handler is held, the server kills the
/// transaction's connection. The commit fails: 503, the credit was rolled
/// back with it and the key given back, so the retry runs once and commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_connection_killed() {
    let db = Db::new(&url(), &url(), Duration::from_secs(30)).await;
    let (addr, app) = start(&db, true).await;
    let mut entered = app.h.watch();
    let held = tokio::spawn(async move { request(addr, "k", &[("x-gate", b"g")]).await });
    assert_eq!(entered.recv().await.as_deref(), Some("g"));
    db.kill(app.connection.load(Ordering::SeqCst)).await;
    app.h.open("g");
    let r = held.await.unwrap();
    assert_eq!(r.assert_problem(503), types::STORE_UNAVAILABLE);
    assert_eq!((app.h.runs(), db.credits().await), (1, 0));
    let retry = request(addr, "k", &[]).await;
    assert_ran(&retry, 2);
    assert_replay_of(&request(addr, "k", &[]).await, &retry);
    assert_eq!((app.h.runs(), db.credits().await), (2, 1));
    db.drop_tables().await;
}

/// A TCP proxy to the database that can stop forwarding without closing
/// anything (a network partition), and heal.
struct Proxy {
    addr: SocketAddr,
    open: tokio::sync::watch::Sender<bool>,
}

impl Proxy {
    async fn start(target: SocketAddr) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (open, watch) = tokio::sync::watch::channel(true);
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(pipe(cr, sw, watch.clone()));
                tokio::spawn(pipe(sr, cw, watch.clone()));
            }
        });
        Proxy { addr, open }
    }

    fn cut(&self) {
        self.open.send_replace(false);
    }

    fn heal(&self) {
        self.open.send_replace(true);
    }
}

/// Copies `from` to `to` while the proxy is open; while it is cut, holds
/// what it read (nothing is delivered, nothing is closed).
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut open: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if open.wait_for(|open| *open).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Transactional mode, two app servers: server A (through the proxy) has
/// credited inside its transaction when the network to the database is cut.
/// The database ends A's idle transaction at its `wait_timeout` (the hold,
/// rounded up, plus 1 s), which frees its locks; after the lease, server B's
/// retry of the same key takes the key over and credits once, within
/// lease + 5 s of the cut. Healed, A's request ends in 503 and nothing of it
/// committed: exactly one credit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partitioned_server_never_causes_a_second_effect() {
    let direct = url();
    let (host_port, db_name) = {
        let rest = direct.split_once("@").map_or(direct.as_str(), |(_, r)| r);
        rest.split_once('/').unwrap()
    };
    let target: SocketAddr = tokio::net::lookup_host(host_port)
        .await
        .unwrap()
        .next()
        .unwrap();
    let proxy = Proxy::start(target).await;
    let user = direct
        .strip_prefix("mysql://")
        .and_then(|r| r.split_once('@'))
        .map_or("root", |(u, _)| u);
    let through = format!("mysql://{user}@{}/{db_name}", proxy.addr);
    let lease = Duration::from_secs(3);
    let db = Db::new(&through, &direct, Duration::from_secs(2)).await;
    let hold = db.hold;
    let b_store = MySqlStore::builder(&direct)
        .table(db.table.clone())
        .open()
        .await
        .unwrap();
    let serve_on = |store: MySqlStore, app: App| async move {
        let router = Router::new().route("/charge", post(charge_tx)).route_layer(
            IdempotencyLayer::new(store, GlobalScope)
                .lease(lease)
                .max_hold(hold)
                .transactional(),
        );
        serve(router.with_state(app)).await
    };
    let app_a = App {
        h: Harness::default(),
        table: db.table.clone(),
        connection: Arc::default(),
    };
    let app_b = App {
        connection: Arc::default(),
        ..app_a.clone()
    };
    let a = serve_on(db.store.clone(), app_a.clone()).await;
    let b = serve_on(b_store, app_b.clone()).await;

    let mut entered = app_a.h.watch();
    let held = tokio::spawn(async move { request(a, "k", &[("x-gate", b"g")]).await });
    assert_eq!(entered.recv().await.as_deref(), Some("g"));
    proxy.cut();
    let cut = tokio::time::Instant::now();
    app_a.h.open("g");
    // B retries until it is not answered 409 (A's lease), with a bound.
    let retry = common::until_not_in_flight(|| request(b, "k", &[]), |r| r.status).await;
    let recovered = cut.elapsed();
    assert_eq!((retry.status, retry.replayed()), (201, false), "{retry:?}");
    assert!(recovered <= lease + Duration::from_secs(5), "{recovered:?}");
    assert_eq!(db.credits().await, 1);
    // The database itself ends A's transaction (its session's wait_timeout:
    // 2 s hold + 1 s), while A is still cut off.
    let a_connection = app_a.connection.load(Ordering::SeqCst);
    let deadline = cut + Duration::from_secs(10);
    let ended = loop {
        let alive = db
            .i64(format!(
                "SELECT COUNT(*) FROM information_schema.processlist WHERE id = {a_connection}"
            ))
            .await;
        if alive == 0 {
            break cut.elapsed();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the database never ended the cut-off session"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(ended < lease + Duration::from_secs(5), "{ended:?}");
    proxy.heal();
    let late = held.await.unwrap();
    assert_eq!(late.assert_problem(503), types::STORE_UNAVAILABLE);
    assert_eq!(db.credits().await, 1);
    assert_replay_of(&request(b, "k", &[]).await, &retry);
    assert_eq!(
        app_a.h.runs(),
        2,
        "A ran once, B once (they share the counter)"
    );
    println!(
        "partition: retry on B completed {recovered:?} after the cut, the database ended A's session {ended:?} after it (lease {lease:?})"
    );
    db.drop_tables().await;
}
