//! Transactional mode on `SqlxPostgresStore` over real sockets, where
//! PostgreSQL differs from the other sqlx stores (whose shared rules are
//! `sqlx_transactional.rs`'s suite): a swallowed error leaves an aborted
//! transaction that cannot commit, a cancelled commit never leaks its
//! transaction, and a statement past the max hold is cancelled. Needs PostgreSQL:
//! `TOWER_IDEMPOTENCY_POSTGRES_URL`, or the local `test` database; a server
//! that cannot be reached fails.

use crate::common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::{Harness, send, serve};
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgPool};
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
        Db::on_pool(8, options).await
    }

    /// As [`Db::with`], on a pool of `connections` (acquire timeout 30 s).
    async fn on_pool(
        connections: u32,
        options: impl FnOnce(
            tower_idempotency_sqlx::SqlxPostgresStoreBuilder,
        ) -> tower_idempotency_sqlx::SqlxPostgresStoreBuilder,
    ) -> Db {
        let pool = PgPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(Duration::from_secs(30))
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

/// A commit cancelled while its completion waits on a lock must not let the
/// pool hand out a connection still inside the transaction: 20 later
/// requests each credit once, and the cancelled credit never commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_commit_never_leaks_its_transaction() {
    use tower::ServiceExt;
    // Two phases: the completion's UPDATE must meet a committed record that
    // another session can lock.
    let db = Db::with(|b| b.commit_claims_first(true)).await;
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

/// A statement still running when the max hold time (200 ms) passes is
/// cancelled: `pg_sleep(30)` fails with SQLSTATE 57014 (query_canceled) at
/// once, and the request gets 503 with nothing kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_running_past_the_max_hold_is_cancelled() {
    let db = Db::with(|b| b).await;
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
        .route_layer(
            IdempotencyLayer::new(db.store.clone(), GlobalScope)
                .max_hold(Duration::from_millis(200))
                .transactional(),
        );
    let addr = serve(app).await;
    let r = send(addr, "POST", "/sleeps", &[("idempotency-key", b"k")], b"{}").await;
    assert_eq!(r.assert_problem(503), types::HELD_TOO_LONG);
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

/// Issue 38: twelve transactional credits slower than the default lease
/// (11 s against 10 s) at once, with the default settings, on sqlx's
/// default pool size of 10. Ten hold a connection each for their whole run
/// and two wait for one; the leases are renewed on the store's own
/// connection, never behind them, so no request hears of a lost lease: all
/// twelve answer 201 and commit once (twelve credits, twelve records).
/// Renewed through the request pool, the first ten lost their leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_requests_on_a_full_pool_lose_no_lease() {
    use tower_idempotency::key::ClaimedKey;
    let db = Db::on_pool(10, |b| b).await;
    let t = db.table.clone();
    let h = Harness::default();
    let runs = h.clone();
    let app = Router::new()
        .route(
            "/slow",
            post(
                move |claimed: ClaimedKey, tx: SqlxPostgresTransaction| async move {
                    let mut conn = tx.connection().await?;
                    sqlx::query(AssertSqlSafe(format!(
                        "INSERT INTO {t}_credits (amount) VALUES (5)"
                    )))
                    .execute(&mut *conn)
                    .await?;
                    drop(conn);
                    runs.runs.fetch_add(1, Ordering::SeqCst);
                    let answer = tokio::select! {
                        () = tokio::time::sleep(Duration::from_secs(11)) => {
                            (StatusCode::CREATED, "kept its lease")
                        }
                        () = claimed.lease_lost() => {
                            (StatusCode::SERVICE_UNAVAILABLE, "lost its lease")
                        }
                    };
                    Ok::<_, SqlxPostgresError>(answer.into_response())
                },
            ),
        )
        .route_layer(IdempotencyLayer::new(db.store.clone(), GlobalScope).transactional());
    let addr = serve(app).await;
    let start = std::sync::Arc::new(tokio::sync::Barrier::new(12));
    let requests: Vec<_> = (0..12)
        .map(|i| {
            let start = start.clone();
            tokio::spawn(async move {
                let key = format!("slow-{i}");
                start.wait().await;
                send(
                    addr,
                    "POST",
                    "/slow",
                    &[("idempotency-key", key.as_bytes())],
                    b"{}",
                )
                .await
            })
        })
        .collect();
    for request in requests {
        let r = request.await.unwrap();
        assert_eq!(
            (r.status, r.body.as_slice()),
            (201, &b"kept its lease"[..]),
            "{r:?}"
        );
    }
    assert_eq!(h.runs(), 12);
    assert_eq!(db.count("SELECT count(*) FROM {t}_credits").await, 12);
    assert_eq!(
        db.count("SELECT count(*) FROM {t} WHERE state = 'completed'")
            .await,
        12
    );
    db.drop_tables().await;
}
