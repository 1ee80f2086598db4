//! Transactional mode on `SqlxPostgresStore` over real sockets: the
//! handler's writes (through the request's `sqlx` transaction), the record
//! and the response commit together, or none of them do. Needs PostgreSQL:
//! `TOWER_IDEMPOTENCY_POSTGRES_URL`, or the local `test` database; a server
//! that cannot be reached fails.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::{Harness, Raw, send, serve};
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgPool};
use tokio::sync::Barrier;
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::problem::types;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::FencingToken;
use tower_idempotency_sqlx::{SqlxPostgresError, SqlxPostgresStore, SqlxPostgresTransaction};

fn url() -> String {
    crate::common::services::postgres_url()
}

/// A store on a table of its own, and the account and credit tables its
/// handlers write (account 1 starts at balance 0).
struct Db {
    pool: PgPool,
    store: SqlxPostgresStore,
    table: String,
}

impl Db {
    async fn new() -> Db {
        Db::with(|b| b).await
    }

    async fn with(
        options: impl FnOnce(
            tower_idempotency_sqlx::SqlxPostgresStoreBuilder,
        ) -> tower_idempotency_sqlx::SqlxPostgresStoreBuilder,
    ) -> Db {
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(10))
            .connect(&url())
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {} is required: {e}", url()));
        let table = format!("idem_sqlxtx_{:016x}", FencingToken::random().0);
        let store = options(SqlxPostgresStore::builder(pool.clone()).table(table.clone()))
            .open()
            .await
            .unwrap();
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE TABLE {table}_accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL);
             INSERT INTO {table}_accounts VALUES (1, 0);
             CREATE TABLE {table}_credits (id BIGSERIAL PRIMARY KEY, amount BIGINT NOT NULL);"
        )))
        .execute(&pool)
        .await
        .unwrap();
        Db { pool, store, table }
    }

    async fn count(&self, sql: &str) -> i64 {
        let sql = sql.replace("{t}", &self.table);
        sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    /// (balance of account 1, credit rows, idempotency records)
    async fn effects(&self) -> (i64, i64, i64) {
        (
            self.count("SELECT balance FROM {t}_accounts WHERE id = 1")
                .await,
            self.count("SELECT count(*) FROM {t}_credits").await,
            self.count("SELECT count(*) FROM {t}").await,
        )
    }

    async fn drop_tables(self) {
        sqlx::raw_sql(AssertSqlSafe(format!(
            "DROP TABLE {0}; DROP TABLE {0}_accounts; DROP TABLE {0}_credits",
            self.table
        )))
        .execute(&self.pool)
        .await
        .unwrap();
    }
}

#[derive(Clone)]
struct App {
    h: Harness,
    table: String,
}

/// Credits 5 to account 1 and records the credit, both through the
/// request's transaction; counts the run, waits at its gate if asked, then
/// answers with `x-status` (default 201) and the new balance. With `x-sql-error`
/// it runs a failing statement after writing (the `?` answers 500).
async fn credit(
    State(app): State<App>,
    tx: SqlxPostgresTransaction,
    headers: HeaderMap,
) -> Result<Response, SqlxPostgresError> {
    let t = &app.table;
    let mut conn = tx.connection().await?;
    let balance: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "UPDATE {t}_accounts SET balance = balance + 5 WHERE id = 1 RETURNING balance"
    )))
    .fetch_one(&mut *conn)
    .await?;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {t}_credits (amount) VALUES (5)"
    )))
    .execute(&mut *conn)
    .await?;
    if headers.contains_key("x-sql-error") {
        sqlx::query("SELECT 1/0").execute(&mut *conn).await?;
    }
    drop(conn);
    let n = app.h.runs.fetch_add(1, Ordering::SeqCst) + 1;
    app.h.wait_at_gate(&headers).await;
    let status = headers
        .get("x-status")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(201);
    Ok((
        StatusCode::from_u16(status).unwrap(),
        format!("run {n} balance {balance}"),
    )
        .into_response())
}

async fn start(db: &Db) -> (std::net::SocketAddr, Harness) {
    let h = Harness::default();
    let app = Router::new()
        .route("/credits", post(credit))
        .route_layer(IdempotencyLayer::new(db.store.clone(), GlobalScope).transactional())
        .with_state(App {
            h: h.clone(),
            table: db.table.clone(),
        });
    (serve(app).await, h)
}

async fn post_credit(addr: std::net::SocketAddr, key: &[u8], extra: &[(&str, &[u8])]) -> Raw {
    let mut headers: Vec<(&str, &[u8])> = vec![("idempotency-key", key)];
    headers.extend_from_slice(extra);
    send(addr, "POST", "/credits", &headers, b"{\"amount\":5}").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effect_record_and_response_commit_together() {
    let db = Db::new().await;
    let (addr, h) = start(&db).await;
    let first = post_credit(addr, b"k", &[]).await;
    assert_eq!(
        (first.status, first.body.as_slice()),
        (201, &b"run 1 balance 5"[..])
    );
    let again = post_credit(addr, b"k", &[]).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.body, first.body);
    assert_eq!(db.effects().await, (5, 1, 1));
    assert_eq!(h.runs(), 1);

    // A 500 is not stored: the credit rolls back with the claim.
    let failed = post_credit(addr, b"f", &[("x-status", b"500")]).await;
    assert_eq!(failed.status, 500);
    assert_eq!(db.effects().await, (5, 1, 1), "rolled back");
    let retry = post_credit(addr, b"f", &[]).await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!(retry.body, b"run 3 balance 10");
    assert_eq!(db.effects().await, (10, 2, 2));
    db.drop_tables().await;
}

/// 16 identical requests released together by a barrier while the winner is
/// held in its handler: exactly one runs, the other 15 get 409 at once;
/// after its commit, 16 more all replay it. The balance is credited once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_identical_requests_credit_once() {
    const N: usize = 16;
    let db = Db::new().await;
    let (addr, h) = start(&db).await;
    let mut entered = h.watch();
    let barrier = Arc::new(Barrier::new(N));
    let tasks: Vec<_> = (0..N)
        .map(|_| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                post_credit(addr, b"same", &[("x-gate", b"g")]).await
            })
        })
        .collect();
    assert_eq!(entered.recv().await.as_deref(), Some("g"));
    // The winner waits at its gate: every other request is answered 409.
    let mut pending = Vec::new();
    let mut in_flight = 0;
    for task in tasks {
        if task.is_finished() {
            let r = task.await.unwrap();
            assert_eq!(r.assert_problem(409), types::IN_FLIGHT, "{r:?}");
            in_flight += 1;
        } else {
            pending.push(task);
        }
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while pending.len() > 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the duplicates never answered"
        );
        let (finished, waiting): (Vec<_>, Vec<_>) =
            pending.into_iter().partition(|t| t.is_finished());
        for task in finished {
            let r = task.await.unwrap();
            assert_eq!(r.assert_problem(409), types::IN_FLIGHT, "{r:?}");
            in_flight += 1;
        }
        pending = waiting;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(in_flight, N - 1);
    assert_eq!(
        db.effects().await,
        (0, 0, 1),
        "the credit is not committed yet"
    );
    h.open("g");
    let first = pending.pop().unwrap().await.unwrap();
    assert_eq!((first.status, first.replayed()), (201, false));
    assert_eq!(first.body, b"run 1 balance 5");

    let barrier = Arc::new(Barrier::new(N));
    let repeats: Vec<_> = (0..N)
        .map(|_| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                post_credit(addr, b"same", &[]).await
            })
        })
        .collect();
    for task in repeats {
        let r = task.await.unwrap();
        assert!(r.replayed(), "{r:?}");
        assert_eq!((r.status, r.body.as_slice()), (201, first.body.as_slice()));
    }
    assert_eq!(h.runs(), 1);
    assert_eq!(db.effects().await, (5, 1, 1));
    db.drop_tables().await;
}

/// 16 different keys at once: 16 credits, each with its record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_distinct_keys_each_credit_once() {
    const N: usize = 16;
    let db = Db::new().await;
    let (addr, h) = start(&db).await;
    let barrier = Arc::new(Barrier::new(N));
    let tasks: Vec<_> = (0..N)
        .map(|i| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                post_credit(addr, format!("k{i}").as_bytes(), &[]).await
            })
        })
        .collect();
    for task in tasks {
        let r = task.await.unwrap();
        assert_eq!((r.status, r.replayed()), (201, false), "{r:?}");
    }
    assert_eq!(h.runs(), N);
    assert_eq!(db.effects().await, (5 * N as i64, N as i64, N as i64));
    db.drop_tables().await;
}

/// A statement that fails answers through `?` as a 500 problem that does
/// not echo the SQL error; nothing is kept and the key is given back, so
/// the retry runs (and, fixed, commits once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_statement_answers_500_and_keeps_nothing() {
    let db = Db::new().await;
    let (addr, h) = start(&db).await;
    for _ in 0..2 {
        let r = post_credit(addr, b"k", &[("x-sql-error", b"1")]).await;
        assert_eq!(r.status, 500, "{r:?}");
        assert_eq!(
            r.header_str("content-type"),
            Some("application/problem+json")
        );
        assert_eq!(
            r.json()["detail"],
            "a database statement failed while this request was processed"
        );
    }
    assert_eq!(h.runs(), 0);
    assert_eq!(db.effects().await, (0, 0, 0));
    let fixed = post_credit(addr, b"k", &[]).await;
    assert_eq!((fixed.status, fixed.replayed()), (201, false));
    assert_eq!(db.effects().await, (5, 1, 1));
    db.drop_tables().await;
}

/// A handler that swallows its statement's error (PostgreSQL aborted the
/// transaction) answers 201, but the completion cannot run: 503, nothing
/// kept, the key given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_answers_503_and_gives_the_key_back() {
    let db = Db::new().await;
    let t = db.table.clone();
    let app = Router::new()
        .route(
            "/swallows",
            post(move |tx: SqlxPostgresTransaction| async move {
                let mut conn = tx.connection().await.unwrap();
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO {t}_credits (amount) VALUES (5)"
                )))
                .execute(&mut *conn)
                .await
                .unwrap();
                assert!(sqlx::query("SELECT 1/0").execute(&mut *conn).await.is_err());
                (StatusCode::CREATED, "swallowed the error")
            }),
        )
        .route_layer(IdempotencyLayer::new(db.store.clone(), GlobalScope).transactional());
    let addr = serve(app).await;
    for _ in 0..2 {
        let r = send(
            addr,
            "POST",
            "/swallows",
            &[("idempotency-key", b"k")],
            b"{}",
        )
        .await;
        assert_eq!(r.assert_problem(503), types::STORE_UNAVAILABLE);
        assert_eq!(r.header_str("retry-after"), Some("1"));
    }
    assert_eq!(db.effects().await, (0, 0, 0));
    db.drop_tables().await;
}

/// A duplicate never waits on the first one's uncommitted row: 409 at once,
/// 422 for another body, and the replay once the first has committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_gets_409_and_another_body_422_without_blocking() {
    let db = Db::new().await;
    let (addr, h) = start(&db).await;
    let mut entered = h.watch();
    let first = tokio::spawn(async move { post_credit(addr, b"k", &[("x-gate", b"g")]).await });
    assert_eq!(entered.recv().await.as_deref(), Some("g"));
    let busy = post_credit(addr, b"k", &[]).await;
    assert_eq!(busy.assert_problem(409), types::IN_FLIGHT);
    let retry_after: u64 = busy.header_str("retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    let other = send(
        addr,
        "POST",
        "/credits",
        &[("idempotency-key", b"k")],
        b"{\"amount\":6}",
    )
    .await;
    assert_eq!(other.assert_problem(422), types::MISMATCH);
    h.open("g");
    assert_eq!(first.await.unwrap().status, 201);
    assert!(post_credit(addr, b"k", &[]).await.replayed());
    assert_eq!(h.runs(), 1);
    assert_eq!(db.effects().await, (5, 1, 1));
    db.drop_tables().await;
}

/// A client that goes away while the handler runs: everything rolls back
/// and the key is given back, so the retry runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_request_rolls_everything_back() {
    let db = Db::new().await;
    let (addr, h) = start(&db).await;
    let mut entered = h.watch();
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = common::request_bytes(
        "POST",
        "/credits",
        &[("idempotency-key", b"k"), ("x-gate", b"g")],
        b"{\"amount\":5}",
    );
    tokio::io::AsyncWriteExt::write_all(&mut conn, &req)
        .await
        .unwrap();
    assert_eq!(entered.recv().await.as_deref(), Some("g"));
    drop(conn);
    let post = || post_credit(addr, b"k", &[]);
    let retry = common::until_not_in_flight(post, |r| r.status).await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!(retry.body, b"run 2 balance 5");
    assert_eq!(db.effects().await, (5, 1, 1));
    db.drop_tables().await;
}

/// A commit cancelled while its completion waits on a lock must not let the
/// pool hand out a connection still inside the transaction: 20 later
/// requests each credit once, and the cancelled credit never commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_commit_never_leaks_its_transaction() {
    use tower::ServiceExt;
    let db = Db::new().await;
    let h = Harness::default();
    let app = Router::new()
        .route("/credits", post(credit))
        .route_layer(IdempotencyLayer::new(db.store.clone(), GlobalScope).transactional())
        .with_state(App {
            h: h.clone(),
            table: db.table.clone(),
        });
    let request = |key: &str| {
        http::Request::post("/credits")
            .header("idempotency-key", key)
            .header("x-gate", key)
            .body(axum::body::Body::from("{}"))
            .unwrap()
    };
    let mut entered = h.watch();
    let first = tokio::spawn(app.clone().oneshot(request("k")));
    assert_eq!(entered.recv().await.as_deref(), Some("k"));
    // Lock the claimed record, so that the layer's completion UPDATE waits.
    let mut lock = db.pool.begin().await.unwrap();
    let locked = sqlx::query(AssertSqlSafe(format!(
        "SELECT 1 FROM {} WHERE key = 'k' FOR UPDATE",
        db.table
    )))
    .execute(&mut *lock)
    .await
    .unwrap();
    assert_eq!(locked.rows_affected(), 1);
    h.open("k");
    let blocked = format!("UPDATE {} SET state = 'completed'%", db.table);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1",
        )
        .bind(&blocked)
        .fetch_one(&db.pool)
        .await
        .unwrap();
        if waiting > 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the completion never blocked"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    lock.rollback().await.unwrap();
    for n in 0..20 {
        let key = format!("n{n}");
        h.open(&key);
        let r = app.clone().oneshot(request(&key)).await.unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
    }
    assert_eq!(
        db.effects().await,
        (100, 20, 21),
        "the cancelled request's credit was committed"
    );
    db.drop_tables().await;
}

/// A handler that holds its transaction past the max hold time (200 ms):
/// the store rolls it back and gives the key back, the handler's later
/// `acquire` fails naming the max hold time, and the request gets 503; the
/// retry runs afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_held_past_its_max_hold_is_rolled_back_and_answered_503() {
    let db = Db::with(|b| b.max_hold(Duration::from_millis(200))).await;
    let t = db.table.clone();
    let (handed, mut handed_rx) = tokio::sync::mpsc::channel(1);
    let (late, mut late_rx) = tokio::sync::mpsc::channel(1);
    let go_on = Arc::new(tokio::sync::Notify::new());
    let wake = go_on.clone();
    let h = Harness::default();
    let runs = h.clone();
    let app = Router::new()
        .route(
            "/held",
            post(
                move |tx: SqlxPostgresTransaction, headers: HeaderMap| async move {
                    let insert = format!("INSERT INTO {t}_credits (amount) VALUES (5)");
                    let mut conn = tx.connection().await.unwrap();
                    sqlx::query(AssertSqlSafe(insert))
                        .execute(&mut *conn)
                        .await
                        .unwrap();
                    drop(conn);
                    runs.runs.fetch_add(1, Ordering::SeqCst);
                    if headers.contains_key("x-hold") {
                        handed.send(tx.clone()).await.unwrap();
                        wake.notified().await;
                        let again = tx.connection().await.map(drop).map_err(|e| e.to_string());
                        late.send(again).await.unwrap();
                    }
                    (StatusCode::CREATED, "held")
                },
            ),
        )
        .route_layer(IdempotencyLayer::new(db.store.clone(), GlobalScope).transactional());
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
    tokio::time::timeout(Duration::from_secs(30), tx.closed())
        .await
        .expect("the store ends a transaction held past its max hold time");
    assert_eq!(db.store.transactions_held_too_long(), 1);
    assert_eq!(db.effects().await, (0, 0, 0));
    go_on.notify_one();
    let again = late_rx.recv().await.unwrap().unwrap_err();
    assert!(again.contains("max hold time (200 ms)"), "{again}");
    let first = first.await.unwrap();
    assert_eq!(first.assert_problem(503), types::STORE_UNAVAILABLE);
    assert_eq!(first.header_str("retry-after"), Some("1"));
    let retry = send(addr, "POST", "/held", &[("idempotency-key", b"k")], b"{}").await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!(db.effects().await, (0, 1, 1));
    assert_eq!(h.runs(), 2);
    db.drop_tables().await;
}

/// A statement still running when the max hold time (200 ms) passes is
/// cancelled: `pg_sleep(30)` fails with SQLSTATE 57014 (query_canceled) at
/// once, and the request gets 503 with nothing kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_running_past_the_max_hold_is_cancelled() {
    let db = Db::with(|b| b.max_hold(Duration::from_millis(200))).await;
    let t = db.table.clone();
    let (slept, mut slept_rx) = tokio::sync::mpsc::channel(1);
    let app = Router::new()
        .route(
            "/sleeps",
            post(move |tx: SqlxPostgresTransaction| async move {
                let mut conn = tx.connection().await.unwrap();
                sqlx::query(AssertSqlSafe(format!(
                    "INSERT INTO {t}_credits (amount) VALUES (5)"
                )))
                .execute(&mut *conn)
                .await
                .unwrap();
                let sleep = sqlx::query("SELECT pg_sleep(30)").execute(&mut *conn).await;
                let code = sleep.map(drop).map_err(|e| {
                    e.as_database_error()
                        .and_then(|d| d.code())
                        .map(|c| c.into_owned())
                });
                drop(conn);
                slept.send((code, tx.clone())).await.unwrap();
                (StatusCode::CREATED, "slept")
            }),
        )
        .route_layer(IdempotencyLayer::new(db.store.clone(), GlobalScope).transactional());
    let addr = serve(app).await;
    let r = send(addr, "POST", "/sleeps", &[("idempotency-key", b"k")], b"{}").await;
    assert_eq!(r.assert_problem(503), types::STORE_UNAVAILABLE);
    assert_eq!(r.header_str("retry-after"), Some("1"));
    let (sleep, tx) = slept_rx.recv().await.unwrap();
    assert_eq!(sleep.unwrap_err().as_deref(), Some("57014"));
    tokio::time::timeout(Duration::from_secs(30), tx.closed())
        .await
        .expect("the transaction ends");
    assert_eq!(db.store.transactions_held_too_long(), 1);
    assert_eq!(db.effects().await, (0, 0, 0));
    db.drop_tables().await;
}
