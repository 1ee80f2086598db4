//! `SqlxPostgresStore` (feature `sqlx-postgres`): the store contract suite
//! and the store's own checks, on a PostgreSQL server:
//! `TOWER_IDEMPOTENCY_POSTGRES_URL`, or the local `test` database. A server
//! that cannot be reached fails every test here; nothing is skipped.

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tower_idempotency::store::{FencingToken, Purge};
use tower_idempotency::test_util::suite::replays_come_from_the_cache_until_the_ttl_ends as cached_replays;
use tower_idempotency::test_util::suite::two_handles_one_winner;
use tower_idempotency::test_util::{ClockOffset, ManualClock, START_MS, store_suite};
use tower_idempotency::{StoreError, store::Store};
use tower_idempotency_sqlx::SqlxPostgresStore;

/// Where the tests connect: `TOWER_IDEMPOTENCY_POSTGRES_URL`, or the local
/// server's `test` database (as every PostgreSQL test of this crate).
fn url() -> String {
    crate::common::services::postgres_url()
}

async fn pool() -> PgPool {
    PgPoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&url())
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {} is required for these tests: {e}", url()))
}

/// Drops a test's table when the test ends, pass or fail.
struct DropTable(String);

impl Drop for DropTable {
    fn drop(&mut self) {
        let table = std::mem::take(&mut self.0);
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let pool = pool().await;
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
                    .execute(&pool)
                    .await
                    .unwrap();
                pool.close().await;
            });
        })
        .join();
    }
}

fn table() -> String {
    format!("idem_sqlx_{:016x}", FencingToken::random().0)
}

async fn sqlx_postgres(clock: ManualClock) -> (SqlxPostgresStore, DropTable) {
    open(clock, false).await
}

/// A store on a table of its own; `notify`: with `notify_waiters`.
async fn open(clock: ManualClock, notify: bool) -> (SqlxPostgresStore, DropTable) {
    open_purging(clock, notify, Purge::default()).await
}

async fn purging(clock: ManualClock, purge: Purge) -> (SqlxPostgresStore, DropTable) {
    open_purging(clock, false, purge).await
}

async fn open_purging(
    clock: ManualClock,
    notify: bool,
    purge: Purge,
) -> (SqlxPostgresStore, DropTable) {
    let table = table();
    let store = SqlxPostgresStore::builder(pool().await)
        .table(table.clone())
        .clock_offset(ClockOffset(clock))
        .notify_waiters(notify)
        .purge(purge)
        .open()
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {} is required for these tests: {e}", url()));
    (store, DropTable(table))
}

store_suite!(sqlx_postgres_store, sqlx_postgres, inspect);
store_suite!(sqlx_postgres_purge, purging, purge);

/// With `notify_waiters`: the completion and the release run the notifying
/// statements, whose row counts the store reads as stored or fenced.
async fn sqlx_postgres_notifying(clock: ManualClock) -> (SqlxPostgresStore, DropTable) {
    open(clock, true).await
}

store_suite!(
    sqlx_postgres_notifying_store,
    sqlx_postgres_notifying,
    inspect
);

/// A replay cached by one replay answers the next ones, until its TTL ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_come_from_the_cache_until_the_ttl_ends() {
    let (plain_clock, clock) = (ManualClock::new(START_MS), ManualClock::new(START_MS));
    let (plain, table) = sqlx_postgres(plain_clock.clone()).await;
    let cached = SqlxPostgresStore::builder(pool().await)
        .table(table.0.clone())
        .clock_offset(ClockOffset(clock.clone()))
        .replay_cache(16)
        .open()
        .await
        .unwrap();
    cached_replays(cached, clock, plain, plain_clock).await;
}

/// Two app servers (two pools) on one table: one winner per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pools_one_table_one_winner() {
    let (one, table) = sqlx_postgres(ManualClock::new(START_MS)).await;
    let two = SqlxPostgresStore::builder(pool().await)
        .table(table.0.clone())
        .open()
        .await
        .unwrap();
    two_handles_one_winner(one, two).await;
}

/// The tokio-postgres store and this one share a table's records and its
/// advisory locks: a key claimed by one is in flight for the other, and a
/// response completed by one is replayed by the other.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_a_table_with_the_tokio_postgres_store() {
    use tower_idempotency::store::{Claim, Completion, Refusal};
    use tower_idempotency::test_util::{acquire, claim_of, id, response};
    let (sqlx_store, table) = sqlx_postgres(ManualClock::new(START_MS)).await;
    let tokio_store = tower_idempotency_postgres::PostgresStore::builder(&url())
        .table(table.0.clone())
        .open()
        .await
        .unwrap();
    let token = acquire(&tokio_store, "k").await;
    let refused = sqlx_store
        .claim(claim_of("s", "k", 1, FencingToken::random()))
        .await
        .unwrap();
    assert!(
        matches!(refused, Claim::Refused(Refusal::InFlight { .. })),
        "{refused:?}"
    );
    assert_eq!(
        tokio_store
            .complete(id("k"), token, response(b"done"))
            .await
            .unwrap(),
        Completion::Stored
    );
    assert_eq!(
        sqlx_store
            .claim(claim_of("s", "k", 1, FencingToken::random()))
            .await
            .unwrap(),
        Claim::Refused(Refusal::Completed(response(b"done")))
    );
}

/// A table name outside the rule is a configuration error found before any
/// statement runs; a pool whose server does not answer is `Unavailable`.
#[tokio::test]
async fn bad_table_is_config_and_unreachable_is_unavailable() {
    let pool = pool().await;
    for name in ["bad name;", "", "1st", &"t".repeat(49), "a-b"] {
        let err = SqlxPostgresStore::builder(pool.clone())
            .table(name)
            .open()
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Config(_)), "{name:?}: {err:?}");
    }
    // Port 1 on the loopback: a valid URL where nothing listens.
    let nowhere = PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy("postgres://postgres@127.0.0.1:1/test")
        .unwrap();
    let err = SqlxPostgresStore::from_pool(nowhere).await.unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
}

/// Opening twice is harmless (`IF NOT EXISTS`), and `new` uses the default
/// table name.
#[tokio::test]
async fn open_is_idempotent_and_new_uses_the_default_table() {
    let (store, _table) = sqlx_postgres(ManualClock::new(START_MS)).await;
    let again = SqlxPostgresStore::builder(store.pool().clone())
        .table(store.table())
        .open()
        .await
        .unwrap();
    assert_eq!(again.table(), store.table());
    let default = SqlxPostgresStore::from_pool(store.pool().clone())
        .await
        .unwrap();
    assert_eq!(default.table(), "idempotency_records");
}
