//! PostgreSQL beyond the store suite: several app servers on one database,
//! and transactional mode over real sockets. Needs a PostgreSQL server:
//! `TOWER_IDEMPOTENCY_POSTGRES_URL`, or the local `test` database.

#![cfg(feature = "postgres")]

use crate::common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::{Harness, send, serve};
use tokio::sync::Barrier;
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::problem::types;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::{Claim, ClaimRequest, FencingToken, RecordId, Refusal, Store};
use tower_idempotency_postgres::PostgresStore;
use tower_idempotency_postgres::PostgresTransaction;

fn url() -> String {
    crate::common::services::postgres_url()
}

/// A store on a table of its own, and the items table its handlers write.
struct Db {
    store: PostgresStore,
    table: String,
}

impl Db {
    async fn new() -> Db {
        Db::open(false).await
    }

    /// Transactional claims that commit first (two phases).
    async fn two_phase() -> Db {
        Db::open(true).await
    }

    async fn open(commit_claims_first: bool) -> Db {
        let id = format!("{:016x}", FencingToken::random().0);
        let table = format!("idem_pg_{id}");
        let store = PostgresStore::builder(&url())
            .table(table.clone())
            .commit_claims_first(commit_claims_first)
            .open()
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {} is required: {e}", url()));
        let client = store.pool().get().await.unwrap();
        client
            .batch_execute(&format!(
                "CREATE TABLE {table}_items (id BIGSERIAL PRIMARY KEY, note TEXT)"
            ))
            .await
            .unwrap();
        Db { store, table }
    }

    async fn count(&self, what: &str) -> i64 {
        let client = self.store.pool().get().await.unwrap();
        let table = if what == "items" {
            format!("{}_items", self.table)
        } else {
            self.table.clone()
        };
        client
            .query_one(&format!("SELECT count(*) FROM {table}"), &[])
            .await
            .unwrap()
            .get(0)
    }

    async fn drop_tables(self) {
        let client = self.store.pool().get().await.unwrap();
        client
            .batch_execute(&format!("DROP TABLE {0}; DROP TABLE {0}_items", self.table))
            .await
            .unwrap();
    }
}

fn claim(key: &str) -> ClaimRequest {
    ClaimRequest::new(
        RecordId::new("s", key),
        tower_idempotency::fingerprint::Fingerprint([1; 32]),
        FencingToken::random(),
    )
    .with_lease(Duration::from_secs(60))
    .with_ttl(Duration::from_secs(3600))
}

/// Two app servers' stores (two pools) on one table, racing each key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_one_database_one_winner() {
    let db = Db::new().await;
    let other = PostgresStore::builder(&url())
        .table(db.table.clone())
        .open()
        .await
        .unwrap();
    for round in 0..10 {
        let key = format!("k{round}");
        let barrier = Arc::new(Barrier::new(16));
        let tasks: Vec<_> = (0..16)
            .map(|i| {
                let store = if i % 2 == 0 {
                    db.store.clone()
                } else {
                    other.clone()
                };
                let (barrier, key) = (barrier.clone(), key.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    store.claim(claim(&key)).await.unwrap()
                })
            })
            .collect();
        let mut acquired = 0;
        for task in tasks {
            match task.await.unwrap() {
                Claim::Acquired { .. } => acquired += 1,
                Claim::Refused(Refusal::InFlight { .. }) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(acquired, 1, "round {round}");
    }
    db.drop_tables().await;
}

async fn item(
    State((h, table)): State<(Harness, String)>,
    tx: PostgresTransaction,
    headers: HeaderMap,
) -> Response {
    {
        let client = tx.client().await.unwrap();
        client
            .execute(
                &format!("INSERT INTO {table}_items (note) VALUES ('x')"),
                &[],
            )
            .await
            .unwrap();
    }
    let n = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
    h.wait_at_gate(&headers).await;
    let status = headers
        .get("x-status")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(201);
    (
        StatusCode::from_u16(status).unwrap(),
        format!("item run {n}"),
    )
        .into_response()
}

async fn start(db: &Db) -> (std::net::SocketAddr, Harness) {
    let h = Harness::default();
    let app = Router::new()
        .route("/items", post(item))
        .route_layer(IdempotencyLayer::new(db.store.clone(), GlobalScope).transactional())
        .with_state((h.clone(), db.table.clone()));
    (serve(app).await, h)
}

#[tokio::test]
async fn transactional_effect_record_and_response_commit_together() {
    let db = Db::new().await;
    let (addr, h) = start(&db).await;
    let first = send(addr, "POST", "/items", &[("idempotency-key", b"k")], b"{}").await;
    assert_eq!(first.status, 201);
    let again = send(addr, "POST", "/items", &[("idempotency-key", b"k")], b"{}").await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(
        (db.count("items").await, db.count("records").await, h.runs()),
        (1, 1, 1)
    );

    let failed = send(
        addr,
        "POST",
        "/items",
        &[("idempotency-key", b"f"), ("x-status", b"500")],
        b"{}",
    )
    .await;
    assert_eq!(failed.status, 500);
    assert_eq!(
        (db.count("items").await, db.count("records").await),
        (1, 1),
        "rolled back"
    );
    let retry = send(addr, "POST", "/items", &[("idempotency-key", b"f")], b"{}").await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!(db.count("items").await, 2);
    db.drop_tables().await;
}

/// A duplicate never waits on the first one's uncommitted row: it gets 409
/// at once, and the replay once the first has committed.
#[tokio::test]
async fn transactional_duplicate_gets_409_without_blocking() {
    let db = Db::new().await;
    let (addr, h) = start(&db).await;
    let mut entered = h.watch();
    let first = tokio::spawn(async move {
        send(
            addr,
            "POST",
            "/items",
            &[("idempotency-key", b"k"), ("x-gate", b"g")],
            b"{}",
        )
        .await
    });
    assert_eq!(entered.recv().await.unwrap(), "g");
    let busy = send(addr, "POST", "/items", &[("idempotency-key", b"k")], b"{}").await;
    assert_eq!(busy.assert_problem(409), types::IN_FLIGHT);
    let retry_after: u64 = busy.header_str("retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    // The claim is visible with its fingerprint: another body is a 422 at once.
    let other = send(
        addr,
        "POST",
        "/items",
        &[("idempotency-key", b"k")],
        b"{\"other\":1}",
    )
    .await;
    assert_eq!(other.assert_problem(422), types::MISMATCH);
    h.open("g");
    assert_eq!(first.await.unwrap().status, 201);
    assert!(
        send(addr, "POST", "/items", &[("idempotency-key", b"k")], b"{}")
            .await
            .replayed()
    );
    assert_eq!((db.count("items").await, h.runs()), (1, 1));
    db.drop_tables().await;
}

#[tokio::test]
async fn transactional_dropped_request_rolls_back() {
    let db = Db::new().await;
    let (addr, h) = start(&db).await;
    let mut entered = h.watch();
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = common::request_bytes(
        "POST",
        "/items",
        &[("idempotency-key", b"k"), ("x-gate", b"g")],
        b"{}",
    );
    tokio::io::AsyncWriteExt::write_all(&mut conn, &req)
        .await
        .unwrap();
    assert_eq!(entered.recv().await.unwrap(), "g");
    drop(conn);
    // The rollback is sent from a spawned task; the retry then runs once.
    let post = || send(addr, "POST", "/items", &[("idempotency-key", b"k")], b"{}");
    let retry = common::until_not_in_flight(post, |r| r.status).await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!(
        (db.count("items").await, db.count("records").await, h.runs()),
        (1, 1, 2)
    );
    db.drop_tables().await;
}

/// A commit cancelled while its completion waits on a lock (the client went
/// away) must not hand the pool a connection still inside the transaction:
/// the next request to borrow it would commit the orphaned writes. The
/// completion and `COMMIT` go out together (`finish.rs`), so the cancelled
/// request's outcome is the server's: its item and its record committed
/// together, or neither. Every later request gets a clean connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_commit_never_leaks_its_transaction() {
    use tower::ServiceExt;
    // Two phases: the completion's UPDATE must meet a committed record that
    // another session can lock.
    let db = Db::two_phase().await;
    let h = Harness::default();
    let app = Router::new()
        .route("/items", post(item))
        .route_layer(IdempotencyLayer::new(db.store.clone(), GlobalScope).transactional())
        .with_state((h.clone(), db.table.clone()));
    let request = |key: &str| {
        http::Request::post("/items")
            .header("idempotency-key", key)
            .header("x-gate", key)
            .body(axum::body::Body::from("{}"))
            .unwrap()
    };
    let mut entered = h.watch();
    let first = tokio::spawn(app.clone().oneshot(request("k")));
    assert_eq!(entered.recv().await.unwrap(), "k");
    // Lock the claimed record, so that the layer's completion UPDATE waits.
    let (mut locker, connection) = tokio_postgres::connect(&url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let lock = locker.transaction().await.unwrap();
    let locked = lock
        .execute(
            &format!("SELECT 1 FROM {} WHERE key = 'k' FOR UPDATE", db.table),
            &[],
        )
        .await
        .unwrap();
    assert_eq!(locked, 1);
    h.open("k");
    // Wait until the completion is blocked on the lock, then cancel.
    let watcher = db.store.pool().get().await.unwrap();
    let blocked = format!("%UPDATE {} SET state = 'completed'%", db.table);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let backend: i32 = loop {
        let row = watcher
            .query_opt(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1",
                &[&blocked],
            )
            .await
            .unwrap();
        if let Some(row) = row {
            break row.get(0);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the completion never blocked"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    lock.rollback().await.unwrap();
    // The cancelled request's session ends (its client closed it).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let row = watcher
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
                &[&backend],
            )
            .await
            .unwrap();
        if row.get::<_, i64>(0) == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the session never ended"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let items = db.count("items").await;
    let state: String = watcher
        .query_one(
            &format!("SELECT state FROM {} WHERE key = 'k'", db.table),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        matches!((items, state.as_str()), (1, "completed") | (0, "in_flight")),
        "the cancelled request's item and record commit together or not at all: {items} items, record {state}"
    );
    // Every later request gets a clean connection: 20 requests, 20 items.
    for n in 0..20 {
        let key = format!("n{n}");
        h.open(&key);
        let r = app.clone().oneshot(request(&key)).await.unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
    }
    assert_eq!(db.count("items").await, items + 20);
    db.drop_tables().await;
}

/// A handler whose statement failed (PostgreSQL aborted the transaction)
/// answers 503, and the key is given back: the retry runs at once.
#[tokio::test]
async fn a_failed_commit_gives_the_key_back() {
    let db = Db::new().await;
    let table = db.table.clone();
    let h = Harness::default();
    let app = Router::new()
        .route(
            "/fails",
            post(|tx: PostgresTransaction| async move {
                let client = tx.client().await.unwrap();
                client
                    .execute(
                        &format!("INSERT INTO {table}_items (note) VALUES ('x')"),
                        &[],
                    )
                    .await
                    .unwrap();
                assert!(client.execute("SELECT 1/0", &[]).await.is_err());
                (StatusCode::CREATED, "swallowed the error")
            }),
        )
        .route_layer(IdempotencyLayer::new(db.store.clone(), GlobalScope).transactional())
        .with_state((h, db.table.clone()));
    let addr = serve(app).await;
    for _ in 0..2 {
        let r = send(addr, "POST", "/fails", &[("idempotency-key", b"k")], b"{}").await;
        assert_eq!(r.assert_problem(503), types::STORE_UNAVAILABLE);
    }
    assert_eq!((db.count("items").await, db.count("records").await), (0, 0));
    db.drop_tables().await;
}

/// A handler that holds its transaction past the store's max hold time
/// (200 ms, shorter than the 60 s lease): the store rolls it back, gives
/// the key and the connection back, the handler's later `client()` fails,
/// and the request gets 503 with `Retry-After`; the retry runs afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_held_past_its_max_hold_is_rolled_back_and_answered_503() {
    let db = Db::new().await;
    let store = PostgresStore::builder(&url())
        .table(db.table.clone())
        .open()
        .await
        .unwrap();
    let table = db.table.clone();
    let (handed, mut handed_rx) = tokio::sync::mpsc::channel(1);
    let (late, mut late_rx) = tokio::sync::mpsc::channel(1);
    let go_on = Arc::new(tokio::sync::Notify::new());
    let wake = go_on.clone();
    let h = Harness::default();
    let app = Router::new()
        .route(
            "/held",
            post(
                move |State((h, _)): State<(Harness, String)>,
                      tx: PostgresTransaction,
                      headers: HeaderMap| async move {
                    let insert = format!("INSERT INTO {table}_items (note) VALUES ('x')");
                    tx.client()
                        .await
                        .unwrap()
                        .execute(&insert, &[])
                        .await
                        .unwrap();
                    h.runs.fetch_add(1, Ordering::SeqCst);
                    if headers.contains_key("x-hold") {
                        handed.send(tx.clone()).await.unwrap();
                        wake.notified().await;
                        let again = tx.client().await.map(drop).map_err(|e| e.to_string());
                        late.send(again).await.unwrap();
                    }
                    (StatusCode::CREATED, "held")
                },
            ),
        )
        .route_layer(
            IdempotencyLayer::new(store.clone(), GlobalScope)
                .max_hold(Duration::from_millis(200))
                .transactional(),
        )
        .with_state((h.clone(), db.table.clone()));
    let addr = serve(app).await;
    let first = tokio::spawn(async move {
        send(
            addr,
            "POST",
            "/held",
            &[("idempotency-key", b"k"), ("x-hold", b"1")],
            b"{}",
        )
        .await
    });
    let tx = handed_rx.recv().await.unwrap();
    // The store's rollback signal (30 s: a guard against a hang).
    tokio::time::timeout(Duration::from_secs(30), tx.closed())
        .await
        .expect("the store ends a transaction held past its max hold time");
    assert_eq!(store.transactions_held_too_long(), 1);
    assert_eq!((db.count("items").await, db.count("records").await), (0, 0));
    go_on.notify_one();
    let again = late_rx.recv().await.unwrap().unwrap_err();
    assert!(again.contains("max hold time (200 ms)"), "{again}");
    let first = first.await.unwrap();
    assert_eq!(first.assert_problem(503), types::HELD_TOO_LONG);
    assert_eq!(first.header_str("retry-after"), Some("1"));
    let retry = send(addr, "POST", "/held", &[("idempotency-key", b"k")], b"{}").await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!((db.count("items").await, db.count("records").await), (1, 1));
    assert_eq!(h.runs(), 2);
    assert_eq!(store.transactions_held_too_long(), 1);
    db.drop_tables().await;
}

/// A statement still running when the max hold time (200 ms) passes is
/// cancelled: the handler's `pg_sleep(30)` fails at once instead of holding
/// the connection for 30 s, and the request gets 503 with nothing kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_running_past_the_max_hold_is_cancelled() {
    let db = Db::new().await;
    let store = PostgresStore::builder(&url())
        .table(db.table.clone())
        .open()
        .await
        .unwrap();
    let table = db.table.clone();
    let (slept, mut slept_rx) = tokio::sync::mpsc::channel(1);
    let app = Router::new()
        .route(
            "/sleeps",
            post(move |tx: PostgresTransaction| async move {
                let client = tx.client().await.unwrap();
                client
                    .execute(
                        &format!("INSERT INTO {table}_items (note) VALUES ('x')"),
                        &[],
                    )
                    .await
                    .unwrap();
                let sleep = client.execute("SELECT pg_sleep(30)", &[]).await;
                // The SQLSTATE of the failure: 57014 is query_canceled.
                let code = sleep.map_err(|e| e.code().map(|c| c.code().to_owned()));
                slept.send((code, tx.clone())).await.unwrap();
                (StatusCode::CREATED, "slept")
            }),
        )
        .route_layer(
            IdempotencyLayer::new(store.clone(), GlobalScope)
                .max_hold(Duration::from_millis(200))
                .transactional(),
        )
        .with_state((Harness::default(), db.table.clone()));
    let addr = serve(app).await;
    let r = send(addr, "POST", "/sleeps", &[("idempotency-key", b"k")], b"{}").await;
    assert_eq!(r.assert_problem(503), types::HELD_TOO_LONG);
    assert_eq!(r.header_str("retry-after"), Some("1"));
    let (sleep, tx) = slept_rx.recv().await.unwrap();
    assert_eq!(
        sleep.unwrap_err().as_deref(),
        Some("57014"),
        "the statement was cancelled"
    );
    // Ended, and the key given back (30 s: a guard against a hang).
    tokio::time::timeout(Duration::from_secs(30), tx.closed())
        .await
        .expect("the transaction ends");
    assert_eq!(store.transactions_held_too_long(), 1);
    assert_eq!((db.count("items").await, db.count("records").await), (0, 0));
    db.drop_tables().await;
}
