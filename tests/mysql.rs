//! `MySqlStore` on a real MySQL/MariaDB server: the store contract suite,
//! several app servers on one table, and transactional mode over real
//! sockets with exact effects. Needs the server at
//! `TOWER_IDEMPOTENCY_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`);
//! an unreachable server fails every test.

#![cfg(feature = "mysql")]

mod common;

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
use tower_idempotency::problem::types;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::FencingToken;
use tower_idempotency::test_util::suite::two_handles_one_winner;
use tower_idempotency::test_util::{ClockOffset, ManualClock, store_suite};
use tower_idempotency::{IdempotencyLayer, StoreError};
use tower_idempotency_sqlx::MySqlStore;
use tower_idempotency_sqlx::MySqlTransaction;
use tower_idempotency_sqlx::sqlx;

fn url() -> String {
    crate::common::services::mysql_url()
}

fn unique(prefix: &str) -> String {
    format!("{prefix}_{:016x}", FencingToken::random().0)
}

/// Drops a test's tables when the test ends, pass or fail.
struct DropTables(Vec<String>);

impl Drop for DropTables {
    fn drop(&mut self) {
        let tables = std::mem::take(&mut self.0).join(", ");
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let pool = sqlx::MySqlPool::connect(&url()).await.unwrap();
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DROP TABLE IF EXISTS {tables}"
                )))
                .execute(&pool)
                .await
                .unwrap();
            });
        })
        .join();
    }
}

async fn open(table: &str) -> MySqlStore {
    MySqlStore::builder(&url())
        .table(table)
        .open()
        .await
        .unwrap_or_else(|e| {
            panic!(
                "MySQL/MariaDB at {} is required for these tests: {e}",
                url()
            )
        })
}

async fn mysql(clock: ManualClock) -> (MySqlStore, DropTables) {
    let table = unique("idem_test");
    let store = MySqlStore::builder(&url())
        .table(table.clone())
        .clock_offset(ClockOffset(clock))
        .open()
        .await
        .unwrap_or_else(|e| {
            panic!(
                "MySQL/MariaDB at {} is required for these tests: {e}",
                url()
            )
        });
    (store, DropTables(vec![table]))
}

store_suite!(mysql_store, mysql, inspect);

/// Two app servers' stores (two pools) on one table: one winner per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_one_table_one_winner() {
    let table = unique("idem_two");
    let _drop = DropTables(vec![table.clone()]);
    two_handles_one_winner(open(&table).await, open(&table).await).await;
}

/// A table name outside the rule, or a URL that does not parse, is a
/// configuration error found before any connection; a server that does not
/// answer is `Unavailable`; a table on an engine without transactions is
/// refused.
#[tokio::test]
async fn bad_config_is_config_and_unreachable_is_unavailable() {
    for table in ["bad name;", "", "1st", &"t".repeat(49)] {
        let err = MySqlStore::builder(&url())
            .table(table)
            .open()
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Config(_)), "{table:?}: {err:?}");
    }
    let err = MySqlStore::open("not a url").await.unwrap_err();
    assert!(matches!(err, StoreError::Config(_)), "{err:?}");
    let err = MySqlStore::builder("mysql://root@127.0.0.1:1/test")
        .wait_timeout(Duration::from_secs(2))
        .open()
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");

    let table = unique("idem_myisam");
    let _drop = DropTables(vec![table.clone()]);
    let pool = sqlx::MySqlPool::connect(&url()).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {table} (id BINARY(32) PRIMARY KEY) ENGINE=MyISAM"
    )))
    .execute(&pool)
    .await
    .unwrap();
    let err = MySqlStore::builder(&url())
        .table(table)
        .open()
        .await
        .unwrap_err();
    assert!(
        matches!(&err, StoreError::Config(e) if e.to_string().contains("MyISAM")),
        "{err:?}"
    );
}

/// Keys are compared byte for byte: keys that a case- or accent-insensitive
/// collation would call equal are two records.
#[tokio::test]
async fn keys_differing_in_case_are_two_records() {
    let table = unique("idem_case");
    let _drop = DropTables(vec![table.clone()]);
    let store = open(&table).await;
    for key in ["key", "KEY", "kéy", "key "] {
        tower_idempotency::test_util::acquire(&store, key).await;
    }
    let counts = tower_idempotency::store::Inspect::counts(&store)
        .await
        .unwrap();
    assert_eq!(counts.in_flight, 4);
}

// ------------------------------------------------------- transactional mode

/// A store on tables of its own: the records and an `accounts` table.
struct Db {
    store: MySqlStore,
    table: String,
    _drop: DropTables,
}

impl Db {
    async fn new(builder: impl FnOnce(&str) -> tower_idempotency_sqlx::MySqlStoreBuilder) -> Db {
        let table = unique("idem_tx");
        let drop = DropTables(vec![table.clone(), format!("{table}_credits")]);
        let store = builder(&table)
            .open()
            .await
            .unwrap_or_else(|e| panic!("MySQL/MariaDB at {} is required: {e}", url()));
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {table}_credits (id BIGINT AUTO_INCREMENT PRIMARY KEY, amount BIGINT NOT NULL) ENGINE=InnoDB"
        )))
        .execute(store.pool())
        .await
        .unwrap();
        Db {
            store,
            table,
            _drop: drop,
        }
    }

    async fn default() -> Db {
        Db::new(|table| MySqlStore::builder(&url()).table(table)).await
    }

    /// (credit rows, their total, idempotency records)
    async fn effects(&self) -> (i64, i64, i64) {
        let (rows, total): (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT COUNT(*), CAST(COALESCE(SUM(amount), 0) AS SIGNED) FROM {}_credits",
            self.table
        )))
        .fetch_one(self.store.pool())
        .await
        .unwrap();
        let records: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT COUNT(*) FROM {}",
            self.table
        )))
        .fetch_one(self.store.pool())
        .await
        .unwrap();
        (rows, total, records)
    }
}

/// Credits 5 inside the request's transaction, then waits at its gate, then
/// answers `x-status` (default 201) with the run's number.
async fn credit(
    State((h, table)): State<(Harness, String)>,
    tx: MySqlTransaction,
    headers: HeaderMap,
) -> Response {
    {
        let mut conn = tx.connection().await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {table}_credits (amount) VALUES (5)"
        )))
        .execute(&mut *conn)
        .await
        .unwrap();
    }
    let n = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
    h.wait_at_gate(&headers).await;
    if let Some(ms) = headers.get("x-sleep-ms") {
        let ms: u64 = ms.to_str().unwrap().parse().unwrap();
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let status = headers
        .get("x-status")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(201);
    (
        StatusCode::from_u16(status).unwrap(),
        format!("credit run {n}"),
    )
        .into_response()
}

async fn start(db: &Db) -> (std::net::SocketAddr, Harness) {
    let h = Harness::default();
    let app = Router::new()
        .route("/credits", post(credit))
        .route_layer(IdempotencyLayer::new(db.store.clone(), GlobalScope).transactional())
        .with_state((h.clone(), db.table.clone()));
    (serve(app).await, h)
}

#[tokio::test]
async fn transactional_effect_record_and_response_commit_together() {
    let db = Db::default().await;
    let (addr, h) = start(&db).await;
    let first = send(
        addr,
        "POST",
        "/credits",
        &[("idempotency-key", b"k")],
        b"{}",
    )
    .await;
    assert_eq!(first.status, 201);
    assert_eq!(first.body, b"credit run 1");
    let again = send(
        addr,
        "POST",
        "/credits",
        &[("idempotency-key", b"k")],
        b"{}",
    )
    .await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!((db.effects().await, h.runs()), ((1, 5, 1), 1));

    // A 500 is not stored: the credit and the claim roll back together.
    let failed = send(
        addr,
        "POST",
        "/credits",
        &[("idempotency-key", b"f"), ("x-status", b"500")],
        b"{}",
    )
    .await;
    assert_eq!(failed.status, 500);
    assert_eq!(db.effects().await, (1, 5, 1), "rolled back");
    let retry = send(
        addr,
        "POST",
        "/credits",
        &[("idempotency-key", b"f")],
        b"{}",
    )
    .await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!(db.effects().await, (2, 10, 2));
}

/// N identical requests released together by a barrier: exactly one credit,
/// the exact balance, and every other answer is the replay or a 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn parallel_identical_requests_credit_exactly_once() {
    const N: usize = 16;
    let db = Db::default().await;
    let (addr, h) = start(&db).await;
    for round in 0..5 {
        let key = format!("k{round}");
        let barrier = Arc::new(Barrier::new(N));
        let tasks: Vec<_> = (0..N)
            .map(|_| {
                let (barrier, key) = (barrier.clone(), key.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    send(
                        addr,
                        "POST",
                        "/credits",
                        &[("idempotency-key", key.as_bytes())],
                        b"{}",
                    )
                    .await
                })
            })
            .collect();
        let (mut fresh, mut replayed, mut busy) = (0, 0, 0);
        for task in tasks {
            let answer = task.await.unwrap();
            match (answer.status, answer.replayed()) {
                (201, false) => fresh += 1,
                (201, true) => replayed += 1,
                (409, _) => {
                    assert_eq!(answer.assert_problem(409), types::IN_FLIGHT);
                    busy += 1;
                }
                other => panic!("round {round}: unexpected {other:?}: {answer:?}"),
            }
        }
        assert_eq!((fresh, replayed + busy), (1, N - 1), "round {round}");
        let rounds = round as i64 + 1;
        assert_eq!(db.effects().await, (rounds, 5 * rounds, rounds));
    }
    assert_eq!(h.runs(), 5);
}

/// A duplicate never waits on the first one's transaction: 409 at once, a
/// different body 422 at once, the replay once the first has committed.
#[tokio::test]
async fn transactional_duplicate_gets_409_without_blocking() {
    let db = Db::default().await;
    let (addr, h) = start(&db).await;
    let mut entered = h.watch();
    let first = tokio::spawn(async move {
        send(
            addr,
            "POST",
            "/credits",
            &[("idempotency-key", b"k"), ("x-gate", b"g")],
            b"{}",
        )
        .await
    });
    assert_eq!(entered.recv().await.unwrap(), "g");
    let busy = send(
        addr,
        "POST",
        "/credits",
        &[("idempotency-key", b"k")],
        b"{}",
    )
    .await;
    assert_eq!(busy.assert_problem(409), types::IN_FLIGHT);
    let other = send(
        addr,
        "POST",
        "/credits",
        &[("idempotency-key", b"k")],
        b"{\"other\":1}",
    )
    .await;
    assert_eq!(other.assert_problem(422), types::MISMATCH);
    h.open("g");
    assert_eq!(first.await.unwrap().status, 201);
    let replay = send(
        addr,
        "POST",
        "/credits",
        &[("idempotency-key", b"k")],
        b"{}",
    )
    .await;
    assert!(replay.replayed());
    assert_eq!((db.effects().await, h.runs()), ((1, 5, 1), 1));
}

/// A client that goes away mid-handler: the credit rolls back and the key
/// is free; the retry credits once.
#[tokio::test]
async fn transactional_dropped_request_rolls_back() {
    let db = Db::default().await;
    let (addr, h) = start(&db).await;
    let mut entered = h.watch();
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = common::request_bytes(
        "POST",
        "/credits",
        &[("idempotency-key", b"k"), ("x-gate", b"g")],
        b"{}",
    );
    tokio::io::AsyncWriteExt::write_all(&mut conn, &req)
        .await
        .unwrap();
    assert_eq!(entered.recv().await.unwrap(), "g");
    drop(conn);
    let post = || {
        send(
            addr,
            "POST",
            "/credits",
            &[("idempotency-key", b"k")],
            b"{}",
        )
    };
    let retry = common::until_not_in_flight(post, |r| r.status).await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!((db.effects().await, h.runs()), ((1, 5, 1), 2));
}

/// A handler that holds its transaction past the max hold time: the store
/// rolls it back (the credit vanishes), gives the key back and counts it;
/// the request is answered 503 and the retry credits once.
#[tokio::test]
async fn held_past_max_hold_is_rolled_back_and_answered_503() {
    let db = Db::new(|table| {
        MySqlStore::builder(&url())
            .table(table)
            .max_hold(Duration::from_millis(300))
    })
    .await;
    let (addr, h) = start(&db).await;
    let slow = send(
        addr,
        "POST",
        "/credits",
        &[("idempotency-key", b"k"), ("x-sleep-ms", b"1500")],
        b"{}",
    )
    .await;
    assert_eq!(slow.assert_problem(503), types::STORE_UNAVAILABLE);
    assert_eq!(db.store.transactions_held_too_long(), 1);
    assert_eq!(db.effects().await, (0, 0, 0));
    let retry = send(
        addr,
        "POST",
        "/credits",
        &[("idempotency-key", b"k")],
        b"{}",
    )
    .await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!((db.effects().await, h.runs()), ((1, 5, 1), 2));
}
