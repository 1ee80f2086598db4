//! Transactional mode on every sqlx store (PostgreSQL, SQLite, MySQL or
//! MariaDB): one suite, written once over `SqlxTransaction<DB>` and
//! instantiated per database. Each test drives the layer over real sockets
//! and checks the effects: the balance, the credit rows and the records.
//!
//! * The handler's writes, the record and the response commit together, or
//!   none of them do: a 500, a failed statement, a dropped request and a
//!   transaction held past its max hold time each leave nothing, and the
//!   key is free for the retry.
//! * Identical requests released together credit once; distinct keys
//!   credit once each.
//! * A repeat of a key in flight gets 409 at once and another body 422,
//!   without waiting on the first's transaction (without `wait_in_flight`).
//!   With it, on SQLite a repeat waits inside the store, at most its bound
//!   (`Backend::REPEATS_WAIT`).
//!
//! What differs between the databases stays in their own files:
//! `sqlx_postgres_transactional.rs` (statement cancel, aborted transactions,
//! cancelled commits), `mysql.rs` and `sqlx_sqlite.rs` (the one-writer rule).
//!
//! Needs the servers at `TOWER_IDEMPOTENCY_POSTGRES_URL` and
//! `TOWER_IDEMPOTENCY_MYSQL_URL` (`tests/common/services.rs`), each under
//! its store's feature; a server that cannot be reached fails its tests.

use crate::common;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::{Harness, Raw, send, serve};
use tokio::sync::Barrier;
use tower_idempotency::problem::types;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::{FencingToken, Inspect, TransactionalStore};
use tower_idempotency::{DEFAULT_LEASE, IdempotencyLayer};
use tower_idempotency_sqlx::sqlx;
use tower_idempotency_sqlx::{Dialect, SqlxError, SqlxTransaction};

type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// One database under the suite: a store on tables of its own, beside an
/// account table (account 1 at balance 0) and a credit table named after
/// it.
trait Backend: Sized + Send + Sync + 'static {
    type DB: Dialect;
    type Store: TransactionalStore<Transaction = SqlxTransaction<Self::DB>> + Inspect + Clone;

    /// Whether the store itself keeps a repeat of a key in flight waiting
    /// for the first to end, when the layer lets it wait (SQLite's one
    /// write lock, PostgreSQL's held keys; `ClaimRequest::wait_in_flight`).
    const REPEATS_WAIT: bool;

    /// The store and its tables.
    fn open() -> impl Future<Output = Self> + Send;

    fn store(&self) -> &Self::Store;

    /// The prefix of the account and credit tables: `{prefix}_accounts`,
    /// `{prefix}_credits`.
    fn prefix(&self) -> &str;

    /// Transactions the store rolled back past their max hold time.
    fn held_too_long(&self) -> u64;

    /// A number the database answers, on a connection of its own.
    fn scalar(&self, sql: String) -> impl Future<Output = i64> + Send;

    /// Runs one statement on the request's transaction.
    fn execute(
        conn: &mut <Self::DB as sqlx::Database>::Connection,
        sql: String,
    ) -> BoxFut<'_, Result<(), sqlx::Error>>;

    /// Drops the tables; the test passed.
    fn drop_tables(self) -> impl Future<Output = ()> + Send;
}

/// (balance of account 1, credit rows, idempotency records)
async fn effects<B: Backend>(db: &B) -> (i64, i64, i64) {
    let t = db.prefix();
    let balance = db
        .scalar(format!("SELECT balance FROM {t}_accounts WHERE id = 1"))
        .await;
    let credits = db.scalar(format!("SELECT COUNT(*) FROM {t}_credits")).await;
    let c = db.store().counts().await.unwrap();
    let records = c.in_flight + c.stuck + c.completed + c.expired;
    (balance, credits, records as i64)
}

#[derive(Clone)]
struct App {
    h: Harness,
    prefix: String,
}

/// Credits 5 to account 1 and records the credit, both through the
/// request's transaction, with `?` on every call; counts the run, waits at
/// its gate if asked, then answers `x-status` (default 201) with the run's
/// number. With `x-sql-error` a statement fails after the writes; with
/// `x-hold-connection` it keeps the connection 500 ms after them; with
/// `x-hold` it waits until the store has ended the transaction, then tries
/// to write again.
async fn credit<B: Backend>(
    State(app): State<App>,
    tx: SqlxTransaction<B::DB>,
    headers: HeaderMap,
) -> Result<Response, SqlxError> {
    let t = &app.prefix;
    let mut conn = tx.connection().await?;
    B::execute(
        &mut conn,
        format!("UPDATE {t}_accounts SET balance = balance + 5 WHERE id = 1"),
    )
    .await?;
    B::execute(
        &mut conn,
        format!("INSERT INTO {t}_credits (amount) VALUES (5)"),
    )
    .await?;
    if headers.contains_key("x-sql-error") {
        B::execute(&mut conn, format!("SELECT * FROM {t}_no_such_table")).await?;
    }
    if headers.contains_key("x-hold-connection") {
        // Idle, the connection borrowed, past a 200 ms max hold.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    drop(conn);
    let n = app.h.runs.fetch_add(1, Ordering::SeqCst) + 1;
    app.h.wait_at_gate(&headers).await;
    if headers.contains_key("x-hold") {
        tx.closed().await;
        let again = tx.connection().await.map(drop).map_err(|e| e.to_string());
        let late = again.expect_err("a transaction the store ended gives no connection");
        assert!(late.contains("max hold time (200 ms)"), "{late}");
    }
    let status = headers
        .get("x-status")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(201);
    Ok((StatusCode::from_u16(status).unwrap(), format!("run {n}")).into_response())
}

async fn start<B: Backend>(db: &B) -> (std::net::SocketAddr, Harness) {
    start_leased(db, DEFAULT_LEASE, tower_idempotency::DEFAULT_MAX_HOLD).await
}

/// As [`start`], with this lease and max hold.
async fn start_leased<B: Backend>(
    db: &B,
    lease: Duration,
    max_hold: Duration,
) -> (std::net::SocketAddr, Harness) {
    let h = Harness::default();
    let app = Router::new()
        .route("/credits", post(credit::<B>))
        .route_layer(
            IdempotencyLayer::new(db.store().clone(), GlobalScope)
                .require_key(true)
                .lease(lease)
                .max_hold(max_hold)
                .transactional(),
        )
        .with_state(App {
            h: h.clone(),
            prefix: db.prefix().to_owned(),
        });
    (serve(app).await, h)
}

async fn post_credit(addr: std::net::SocketAddr, key: &[u8], extra: &[(&str, &[u8])]) -> Raw {
    let mut headers: Vec<(&str, &[u8])> = vec![("idempotency-key", key)];
    headers.extend_from_slice(extra);
    send(addr, "POST", "/credits", &headers, b"{\"amount\":5}").await
}

/// A credit commits with its record and is replayed byte for byte; a 500
/// is not stored, so its credit rolls back with its claim and the retry
/// runs once.
async fn effect_record_and_response_commit_together<B: Backend>() {
    let db = B::open().await;
    let (addr, h) = start(&db).await;
    let first = post_credit(addr, b"k", &[]).await;
    assert_eq!((first.status, first.body.as_slice()), (201, &b"run 1"[..]));
    let again = post_credit(addr, b"k", &[]).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!((again.status, again.body), (201, first.body));
    assert_eq!(effects(&db).await, (5, 1, 1));
    assert_eq!(h.runs(), 1);

    let failed = post_credit(addr, b"f", &[("x-status", b"500")]).await;
    assert_eq!((failed.status, failed.replayed()), (500, false));
    assert_eq!(effects(&db).await, (5, 1, 1), "rolled back");
    let retry = post_credit(addr, b"f", &[]).await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!(retry.body, b"run 3");
    assert_eq!(effects(&db).await, (10, 2, 2));
    db.drop_tables().await;
}

/// 16 identical requests released together by a barrier, in 3 rounds of a
/// key each: exactly one runs. Each other one is its replay, or (two-phase
/// stores, while it is in flight) a 409; once it has committed, 16 more all
/// replay it. Each key's credit is made once.
async fn parallel_identical_requests_credit_once<B: Backend>() {
    const N: usize = 16;
    let db = B::open().await;
    let (addr, h) = start(&db).await;
    let together = |key: String| {
        let barrier = Arc::new(Barrier::new(N));
        (0..N)
            .map(|_| {
                let (barrier, key) = (barrier.clone(), key.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    post_credit(addr, key.as_bytes(), &[]).await
                })
            })
            .collect::<Vec<_>>()
    };
    for round in 1..=3 {
        let key = format!("same-{round}");
        let run = format!("run {round}");
        let (mut runs, mut replays, mut in_flight) = (0, 0, 0);
        for task in together(key.clone()) {
            let r = task.await.unwrap();
            match (r.status, r.replayed()) {
                (201, false) => runs += 1,
                (201, true) => replays += 1,
                _ => {
                    assert_eq!(r.assert_problem(409), types::IN_FLIGHT, "{r:?}");
                    in_flight += 1;
                    continue;
                }
            }
            assert_eq!(r.body, run.as_bytes(), "round {round}");
        }
        assert_eq!((runs, replays + in_flight), (1, N - 1), "round {round}");
        for task in together(key) {
            let r = task.await.unwrap();
            assert!(r.replayed(), "{r:?}");
            assert_eq!((r.status, r.body.as_slice()), (201, run.as_bytes()));
        }
        let n = round as i64;
        assert_eq!(effects(&db).await, (5 * n, n, n), "round {round}");
    }
    assert_eq!(h.runs(), 3);
    db.drop_tables().await;
}

/// 16 different keys at once: 16 credits, each with its record.
async fn parallel_distinct_keys_each_credit_once<B: Backend>() {
    const N: usize = 16;
    let db = B::open().await;
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
    assert_eq!(effects(&db).await, (5 * N as i64, N as i64, N as i64));
    db.drop_tables().await;
}

/// A statement that fails answers through `?` as a 500 problem that does
/// not echo the SQL error; nothing is kept and the key is given back, so
/// the retry runs (and, fixed, commits once).
async fn a_failed_statement_answers_500_and_keeps_nothing<B: Backend>() {
    let db = B::open().await;
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
    assert_eq!(effects(&db).await, (0, 0, 0));
    let fixed = post_credit(addr, b"k", &[]).await;
    assert_eq!((fixed.status, fixed.replayed()), (201, false));
    assert_eq!(effects(&db).await, (5, 1, 1));
    db.drop_tables().await;
}

/// A client that goes away while the handler runs: everything rolls back
/// and the key is given back, so the retry runs once.
async fn a_dropped_request_rolls_everything_back<B: Backend>() {
    let db = B::open().await;
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
    assert_eq!(retry.body, b"run 2");
    assert_eq!(effects(&db).await, (5, 1, 1));
    db.drop_tables().await;
}

/// A handler that holds its transaction past the max hold time (200 ms):
/// the store rolls it back, counts it and gives the key back; the handler's
/// later `connection()` fails naming the max hold time, and the request
/// gets 503 with `Retry-After`. The retry runs afresh and commits once.
async fn a_transaction_held_past_its_max_hold_is_rolled_back_and_answered_503<B: Backend>() {
    let db = B::open().await;
    let (addr, h) = start_leased(&db, DEFAULT_LEASE, Duration::from_millis(200)).await;
    let first = post_credit(addr, b"k", &[("x-hold", b"1")]).await;
    assert_eq!(first.assert_problem(503), types::HELD_TOO_LONG);
    assert_eq!(first.header_str("retry-after"), Some("1"));
    assert_eq!(db.held_too_long(), 1);
    assert_eq!(effects(&db).await, (0, 0, 0));
    let retry = post_credit(addr, b"k", &[]).await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!(retry.body, b"run 2");
    assert_eq!(effects(&db).await, (5, 1, 1));
    assert_eq!(h.runs(), 2);
    db.drop_tables().await;
}

/// A handler that keeps its connection, idle, past the max hold time
/// (200 ms), in 10 rounds: each gets 503, and a retry sent the moment the
/// 503 arrives runs at once (the key was given back before the answer),
/// never 409; each retry commits its credit once.
async fn a_retry_sent_on_the_max_hold_503_runs_at_once<B: Backend>() {
    let db = B::open().await;
    let (addr, h) = start_leased(&db, DEFAULT_LEASE, Duration::from_millis(200)).await;
    for round in 1..=10i64 {
        let key = format!("k{round}");
        let held = post_credit(addr, key.as_bytes(), &[("x-hold-connection", b"1")]).await;
        assert_eq!(
            held.assert_problem(503),
            types::HELD_TOO_LONG,
            "round {round}"
        );
        let retry = post_credit(addr, key.as_bytes(), &[]).await;
        assert_eq!(
            (retry.status, retry.replayed()),
            (201, false),
            "round {round}: {retry:?}"
        );
        assert_eq!(
            effects(&db).await,
            (5 * round, round, round),
            "round {round}"
        );
    }
    assert_eq!((h.runs(), db.held_too_long()), (20, 10));
    db.drop_tables().await;
}

/// A max hold and a lease of 25 days, past PostgreSQL's largest
/// `idle_in_transaction_session_timeout` (`i32::MAX` ms, about 24.8 days):
/// the transaction opens and the credit commits once.
async fn a_hold_of_25_days_is_accepted<B: Backend>() {
    const DAYS_25: Duration = Duration::from_secs(25 * 24 * 3600);
    let db = B::open().await;
    let (addr, h) = start_leased(&db, DAYS_25, DAYS_25).await;
    let r = post_credit(addr, b"k", &[]).await;
    assert_eq!((r.status, r.body.as_slice()), (201, &b"run 1"[..]), "{r:?}");
    assert_eq!((effects(&db).await, h.runs()), ((5, 1, 1), 1));
    db.drop_tables().await;
}

/// Without `wait_in_flight` a duplicate never waits on the first one's
/// uncommitted row: 409 at once with `Retry-After`, 422 for another body,
/// and the replay once the first has committed.
async fn a_duplicate_gets_409_and_another_body_422_without_blocking<B: Backend>() {
    let db = B::open().await;
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
    // The claim is committed already where it commits first (MySQL); on
    // SQLite and PostgreSQL it lives in the open transaction.
    let claimed = i64::from(db.store().claim_commits_first());
    assert_eq!(effects(&db).await, (0, 0, claimed), "not committed yet");
    h.open("g");
    assert_eq!(first.await.unwrap().status, 201);
    assert!(post_credit(addr, b"k", &[]).await.replayed());
    assert_eq!(h.runs(), 1);
    assert_eq!(effects(&db).await, (5, 1, 1));
    db.drop_tables().await;
}

/// Two-phase stores with a renewed 1 s lease: a handler that holds its
/// transaction 2.5 s keeps its key (a repeat gets 409, not a take-over),
/// its transaction is not cut at one lease, and it commits once.
async fn a_renewed_lease_keeps_a_slow_transaction<B: Backend>() {
    let db = B::open().await;
    let (addr, h) = start_renewed(&db, None).await;
    let mut entered = h.watch();
    let first = tokio::spawn(async move { post_credit(addr, b"k", &[("x-gate", b"g")]).await });
    assert_eq!(entered.recv().await.as_deref(), Some("g"));
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let busy = post_credit(addr, b"k", &[]).await;
    assert_eq!(busy.assert_problem(409), types::IN_FLIGHT);
    h.open("g");
    let first = first.await.unwrap();
    assert_eq!((first.status, first.body.as_slice()), (201, &b"run 1"[..]));
    assert!(post_credit(addr, b"k", &[]).await.replayed());
    assert_eq!((effects(&db).await, h.runs()), ((5, 1, 1), 1));
    assert_eq!(db.held_too_long(), 0);
    db.drop_tables().await;
}

/// A layer as the ledger's: a 1 s lease renewed up to 60 s; repeats wait
/// at most `wait`, if given.
async fn start_renewed<B: Backend>(
    db: &B,
    wait: Option<Duration>,
) -> (std::net::SocketAddr, Harness) {
    let h = Harness::default();
    let layer = IdempotencyLayer::new(db.store().clone(), GlobalScope)
        .require_key(true)
        .lease(Duration::from_secs(1))
        .max_hold(Duration::from_secs(60));
    let layer = match wait {
        Some(wait) => layer.wait_in_flight(wait),
        None => layer,
    };
    let app = Router::new()
        .route("/credits", post(credit::<B>))
        .route_layer(layer.transactional())
        .with_state(App {
            h: h.clone(),
            prefix: db.prefix().to_owned(),
        });
    (serve(app).await, h)
}

/// Every store: a repeat that arrives past the first request's lease while
/// the first is alive never costs it its work. The repeat is answered 409
/// at its wait's bound (the first still runs), the first commits its credit
/// (201), and the repeat after it is the replay: one credit. On
/// `SqliteStore` with concurrent transactions the repeat used to take the
/// uncommitted record over, and the first's fenced commit rolled back both
/// (issue 36, item 1).
async fn a_repeat_past_the_lease_never_costs_a_live_holder_its_work<B: Backend>() {
    let db = B::open().await;
    let (addr, h) = start_renewed(&db, Some(Duration::from_millis(300))).await;
    let mut entered = h.watch();
    let first = tokio::spawn(async move { post_credit(addr, b"k", &[("x-gate", b"g")]).await });
    assert_eq!(entered.recv().await.as_deref(), Some("g"));
    // Two leases in: the record's lease has been renewed (two-phase), or
    // lives only in the open transaction (SQLite).
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let repeat = post_credit(addr, b"k", &[]).await;
    assert_eq!(repeat.assert_problem(409), types::IN_FLIGHT, "{repeat:?}");
    h.open("g");
    let first = first.await.unwrap();
    assert_eq!((first.status, first.body.as_slice()), (201, &b"run 1"[..]));
    let again = post_credit(addr, b"k", &[]).await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!((again.status, again.body), (201, first.body));
    assert_eq!((effects(&db).await, h.runs()), ((5, 1, 1), 1));
    db.drop_tables().await;
}

/// Stores whose repeats wait for the first (SQLite; PostgreSQL in one
/// phase, in memory): 300 repeats released
/// together while the first is open, each allowed to wait 200 ms, are each
/// answered 409 while the first still holds its key (no replay: none waited
/// for it, where they used to wait out the busy timeout and get 503), and
/// none runs; the first then credits once (issue 36, item 2).
async fn repeats_wait_at_most_their_bound<B: Backend>() {
    const REPEATS: usize = 300;
    assert!(B::REPEATS_WAIT);
    let db = B::open().await;
    let (addr, h) = start_renewed(&db, Some(Duration::from_millis(200))).await;
    let mut entered = h.watch();
    let first = tokio::spawn(async move { post_credit(addr, b"k", &[("x-gate", b"g")]).await });
    assert_eq!(entered.recv().await.as_deref(), Some("g"));
    let barrier = Arc::new(Barrier::new(REPEATS));
    let repeats: Vec<_> = (0..REPEATS)
        .map(|_| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                let sent = std::time::Instant::now();
                (post_credit(addr, b"k", &[]).await, sent.elapsed())
            })
        })
        .collect();
    let mut slowest = Duration::ZERO;
    for repeat in repeats {
        let (r, took) = repeat.await.unwrap();
        assert_eq!(r.assert_problem(409), types::IN_FLIGHT, "{r:?}");
        slowest = slowest.max(took);
    }
    eprintln!("{REPEATS} repeats, bound 200 ms: the slowest 409 took {slowest:?}");
    h.open("g");
    let first = first.await.unwrap();
    assert_eq!((first.status, first.body.as_slice()), (201, &b"run 1"[..]));
    assert_eq!((effects(&db).await, h.runs()), ((5, 1, 1), 1));
    db.drop_tables().await;
}

/// The suite's tests for backend `$b`, each a test of its own; `waits`
/// adds those of the stores whose repeats wait in the store.
macro_rules! suite {
    (@tests $b:ty; $($name:ident,)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() {
                crate::sqlx_transactional::$name::<$b>().await
            }
        )*
    };
    ($b:ty, waits) => {
        suite!($b);
        suite!(@tests $b; repeats_wait_at_most_their_bound,);
    };
    ($b:ty) => {
        suite!(@tests $b;
            effect_record_and_response_commit_together,
            parallel_identical_requests_credit_once,
            parallel_distinct_keys_each_credit_once,
            a_failed_statement_answers_500_and_keeps_nothing,
            a_dropped_request_rolls_everything_back,
            a_transaction_held_past_its_max_hold_is_rolled_back_and_answered_503,
            a_retry_sent_on_the_max_hold_503_runs_at_once,
            a_hold_of_25_days_is_accepted,
            a_repeat_past_the_lease_never_costs_a_live_holder_its_work,
            a_duplicate_gets_409_and_another_body_422_without_blocking,
        );
    };
}

/// A table name of the test's own.
fn unique(prefix: &str) -> String {
    format!("{prefix}_{:016x}", FencingToken::random().0)
}

#[cfg(feature = "sqlx-postgres")]
mod postgres {
    use super::*;
    use sqlx::postgres::PgPoolOptions;
    use sqlx::{AssertSqlSafe, PgPool, Postgres};
    use tower_idempotency_sqlx::SqlxPostgresStore;

    pub(crate) struct Pg {
        pool: PgPool,
        store: SqlxPostgresStore,
        table: String,
    }

    impl Backend for Pg {
        type DB = Postgres;
        type Store = SqlxPostgresStore;
        const REPEATS_WAIT: bool = true;

        async fn open() -> Pg {
            let url = common::services::postgres_url();
            let pool = PgPoolOptions::new()
                .max_connections(8)
                .acquire_timeout(Duration::from_secs(10))
                .connect(&url)
                .await
                .unwrap_or_else(|e| panic!("PostgreSQL at {url} is required: {e}"));
            let table = unique("idem_sqlxtx");
            let store = SqlxPostgresStore::builder(pool.clone())
                .table(table.clone())
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
            Pg { pool, store, table }
        }

        fn store(&self) -> &SqlxPostgresStore {
            &self.store
        }

        fn prefix(&self) -> &str {
            &self.table
        }

        fn held_too_long(&self) -> u64 {
            self.store.transactions_held_too_long()
        }

        async fn scalar(&self, sql: String) -> i64 {
            sqlx::query_scalar(AssertSqlSafe(sql))
                .fetch_one(&self.pool)
                .await
                .unwrap()
        }

        fn execute(
            conn: &mut sqlx::PgConnection,
            sql: String,
        ) -> BoxFut<'_, Result<(), sqlx::Error>> {
            Box::pin(async move {
                sqlx::raw_sql(AssertSqlSafe(sql))
                    .execute(conn)
                    .await
                    .map(drop)
            })
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

    // One phase (the default): this process's repeats wait in memory.
    suite!(Pg, waits);
}

#[cfg(feature = "mysql")]
mod mysql {
    use super::*;
    use sqlx::{AssertSqlSafe, MySql};
    use tower_idempotency_sqlx::MySqlStore;

    /// MySQL/MariaDB; its claims commit first when `FIRST` (two phases);
    /// MySQL's statements on a MariaDB server when `MYSQL_SQL`.
    pub(crate) struct My<const FIRST: bool, const MYSQL_SQL: bool = false> {
        store: MySqlStore,
        table: String,
    }

    impl<const FIRST: bool, const MYSQL_SQL: bool> Backend for My<FIRST, MYSQL_SQL> {
        type DB = MySql;
        type Store = MySqlStore;
        const REPEATS_WAIT: bool = !FIRST;

        async fn open() -> Self {
            let url = common::services::mysql_url();
            let table = unique("idem_sqlxtx");
            let mut builder = MySqlStore::builder(&url)
                .table(table.clone())
                .commit_claims_first(FIRST);
            if MYSQL_SQL {
                builder = builder.without_mariadb_sql();
            }
            let store = builder
                .open()
                .await
                .unwrap_or_else(|e| panic!("MySQL/MariaDB at {url} is required: {e}"));
            for statement in [
                format!(
                    "CREATE TABLE {table}_accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL) ENGINE=InnoDB"
                ),
                format!("INSERT INTO {table}_accounts VALUES (1, 0)"),
                format!(
                    "CREATE TABLE {table}_credits (id BIGINT AUTO_INCREMENT PRIMARY KEY, amount BIGINT NOT NULL) ENGINE=InnoDB"
                ),
            ] {
                sqlx::raw_sql(AssertSqlSafe(statement))
                    .execute(store.pool())
                    .await
                    .unwrap();
            }
            My { store, table }
        }

        fn store(&self) -> &MySqlStore {
            &self.store
        }

        fn prefix(&self) -> &str {
            &self.table
        }

        fn held_too_long(&self) -> u64 {
            self.store.transactions_held_too_long()
        }

        async fn scalar(&self, sql: String) -> i64 {
            // BIGINT and COUNT(*) alike, as a signed 64-bit number.
            sqlx::query_scalar(AssertSqlSafe(format!("SELECT CAST(({sql}) AS SIGNED)")))
                .fetch_one(self.store.pool())
                .await
                .unwrap()
        }

        fn execute(
            conn: &mut sqlx::MySqlConnection,
            sql: String,
        ) -> BoxFut<'_, Result<(), sqlx::Error>> {
            Box::pin(async move {
                sqlx::raw_sql(AssertSqlSafe(sql))
                    .execute(conn)
                    .await
                    .map(drop)
            })
        }

        async fn drop_tables(self) {
            sqlx::raw_sql(AssertSqlSafe(format!(
                "DROP TABLE {0}, {0}_accounts, {0}_credits",
                self.table
            )))
            .execute(self.store.pool())
            .await
            .unwrap();
        }
    }

    // One phase (the default): this process's repeats wait in memory.
    suite!(My<false>, waits);

    /// What a MySQL server gets (`wait_timeout` as the backstop, the wait
    /// bound lifted in its own round trip): MariaDB takes it too.
    mod mysql_sql {
        suite!(super::My<false, true>, waits);
    }

    mod two_phase {
        suite!(@tests super::My<true>; a_renewed_lease_keeps_a_slow_transaction,);
    }
}

#[cfg(feature = "sqlx-sqlite")]
mod sqlite {
    use super::*;
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
    use sqlx::{AssertSqlSafe, Sqlite, SqlitePool};
    use tower_idempotency_sqlx::SqlxSqliteStore;

    /// A file of its own (WAL, a 5 s busy timeout, 8 connections): the
    /// records and the app's tables share its write lock.
    pub(crate) struct Lite {
        pool: SqlitePool,
        store: SqlxSqliteStore,
        _dir: tempfile::TempDir,
    }

    impl Backend for Lite {
        type DB = Sqlite;
        type Store = SqlxSqliteStore;
        const REPEATS_WAIT: bool = true;

        async fn open() -> Lite {
            let dir = tempfile::tempdir().unwrap();
            let options = SqliteConnectOptions::new()
                .filename(dir.path().join("app.sqlite3"))
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .busy_timeout(Duration::from_secs(5));
            let pool = SqlitePoolOptions::new()
                .max_connections(8)
                .connect_with(options)
                .await
                .unwrap();
            sqlx::raw_sql(
                "CREATE TABLE app_accounts (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL);
                 INSERT INTO app_accounts VALUES (1, 0);
                 CREATE TABLE app_credits (id INTEGER PRIMARY KEY, amount INTEGER NOT NULL);",
            )
            .execute(&pool)
            .await
            .unwrap();
            let store = SqlxSqliteStore::builder(pool.clone()).open().await.unwrap();
            Lite {
                pool,
                store,
                _dir: dir,
            }
        }

        fn store(&self) -> &SqlxSqliteStore {
            &self.store
        }

        fn prefix(&self) -> &str {
            "app"
        }

        fn held_too_long(&self) -> u64 {
            self.store.transactions_held_too_long()
        }

        async fn scalar(&self, sql: String) -> i64 {
            sqlx::query_scalar(AssertSqlSafe(sql))
                .fetch_one(&self.pool)
                .await
                .unwrap()
        }

        fn execute(
            conn: &mut sqlx::SqliteConnection,
            sql: String,
        ) -> BoxFut<'_, Result<(), sqlx::Error>> {
            Box::pin(async move {
                sqlx::raw_sql(AssertSqlSafe(sql))
                    .execute(conn)
                    .await
                    .map(drop)
            })
        }

        /// The file goes with its temporary directory.
        async fn drop_tables(self) {}
    }

    suite!(Lite, waits);
}
