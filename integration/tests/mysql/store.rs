//! `MySqlStore` on a real MySQL/MariaDB server: the store contract suite,
//! several app servers on one table, its configuration errors and its
//! byte-exact keys (transactional mode is `sqlx_transactional.rs`'s suite). Needs the server at
//! `TOWER_IDEMPOTENCY_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`);
//! an unreachable server fails every test.

#![cfg(feature = "mysql")]

use std::time::Duration;

use tower_idempotency::StoreError;
use tower_idempotency::store::{FencingToken, Purge};
use tower_idempotency::test_util::suite::replays_come_from_the_cache_until_the_ttl_ends as cached_replays;
use tower_idempotency::test_util::suite::two_handles_one_winner;
use tower_idempotency::test_util::{ClockOffset, ManualClock, START_MS, store_suite};
use tower_idempotency_sqlx::MySqlStore;
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
    purging(clock, Purge::default()).await
}

async fn purging(clock: ManualClock, purge: Purge) -> (MySqlStore, DropTables) {
    let table = unique("idem_test");
    let store = MySqlStore::builder(&url())
        .table(table.clone())
        .clock_offset(ClockOffset(clock))
        .purge(purge)
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
store_suite!(mysql_purge, purging, purge);

/// A replay cached by one replay answers the next ones, until its TTL ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_come_from_the_cache_until_the_ttl_ends() {
    let (plain_clock, clock) = (ManualClock::new(START_MS), ManualClock::new(START_MS));
    let (plain, tables) = mysql(plain_clock.clone()).await;
    let cached = MySqlStore::builder(&url())
        .table(&tables.0[0])
        .clock_offset(ClockOffset(clock.clone()))
        .replay_cache(16)
        .open()
        .await
        .unwrap();
    cached_replays(cached, clock, plain, plain_clock).await;
}

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

/// A replay (and a 422) is answered by a consistent read while another
/// session holds the record's row lock (which that session is seen to hold:
/// a third session cannot take it without waiting).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_take_no_row_lock() {
    use sqlx::Connection;
    use tower_idempotency::fingerprint::Fingerprint;
    use tower_idempotency::store::{Claim, ClaimRequest, RecordId, Refusal, Store};
    use tower_idempotency::test_util::response;

    let claim = |key: &str, fp: u8| {
        ClaimRequest::new(
            RecordId::new("s", key),
            Fingerprint([fp; 32]),
            FencingToken::random(),
        )
        .with_lease(Duration::from_secs(60))
        .with_ttl(Duration::from_secs(3600))
    };
    let table = unique("idem_replay");
    let _drop = DropTables(vec![table.clone()]);
    let store = open(&table).await;
    let done = claim("k", 1);
    let token = done.token;
    assert!(matches!(
        store.claim(done).await.unwrap(),
        Claim::Acquired { taken_over: false }
    ));
    store
        .complete(RecordId::new("s", "k"), token, response(b"done"))
        .await
        .unwrap();

    let mut locker = sqlx::MySqlConnection::connect(&url()).await.unwrap();
    let mut lock = locker.begin().await.unwrap();
    let locked = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT id FROM {table} WHERE scope = 's' FOR UPDATE"
    )))
    .fetch_all(&mut *lock)
    .await
    .unwrap();
    assert_eq!(locked.len(), 1);
    // The control: the row is locked.
    let mut other = sqlx::MySqlConnection::connect(&url()).await.unwrap();
    let mut attempt = other.begin().await.unwrap();
    let blocked = sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT id FROM {table} WHERE scope = 's' FOR UPDATE NOWAIT"
    )))
    .fetch_all(&mut *attempt)
    .await;
    assert!(blocked.is_err(), "the record was not locked: {blocked:?}");
    attempt.rollback().await.unwrap();

    for _ in 0..3 {
        let answer = tokio::time::timeout(Duration::from_secs(20), store.claim(claim("k", 1)))
            .await
            .expect("a replay waited on the row lock")
            .unwrap();
        match answer {
            Claim::Refused(Refusal::Completed(stored)) => assert_eq!(stored, response(b"done")),
            other => panic!("expected a replay, got {other:?}"),
        }
    }
    let mismatch = tokio::time::timeout(Duration::from_secs(20), store.claim(claim("k", 2)))
        .await
        .expect("a mismatch waited on the row lock")
        .unwrap();
    assert!(matches!(mismatch, Claim::Refused(Refusal::Mismatch)));
    lock.rollback().await.unwrap();
}

/// Renewals touch only their own claims' rows: with another key's claim
/// held uncommitted in an open transaction (one phase, the default), a
/// separate-mode claim's batch renewal succeeds. A statement that scanned
/// the table (MariaDB does not look `(id, token) IN (...)` up in the
/// primary key) waited on that row lock until `innodb_lock_wait_timeout`
/// and failed, and the ledger's renewals lost their leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_do_not_wait_on_another_keys_open_claim() {
    use tower_idempotency::fingerprint::Fingerprint;
    use tower_idempotency::store::{
        Claim, ClaimRequest, RecordId, Store, TransactionClaim, TransactionalStore,
    };
    let table = unique("idem_renew");
    let _drop = DropTables(vec![table.clone()]);
    let store = open(&table).await;
    let request = |key: &str| {
        ClaimRequest::new(
            RecordId::new("s", key),
            Fingerprint([7; 32]),
            FencingToken::random(),
        )
        .with_lease(Duration::from_secs(60))
        .with_ttl(Duration::from_secs(3600))
    };
    // Claims before and after the open one in the primary key's order.
    let mut separate = Vec::new();
    for key in ["a", "b", "c", "d", "e", "f"] {
        let req = request(key);
        let (id, token) = (req.record_id(), req.token);
        let claim = store.claim(req).await.unwrap();
        assert!(matches!(claim, Claim::Acquired { .. }), "{key}: {claim:?}");
        separate.push((id, token));
    }
    let TransactionClaim::Acquired { transaction, .. } =
        store.claim_in_transaction(request("open")).await.unwrap()
    else {
        panic!("the transactional claim is acquired");
    };
    let renewed = store
        .renew_all(separate.clone(), Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(renewed, vec![true; separate.len()]);
    for (id, token) in separate {
        assert!(
            store
                .renew(id, token, Duration::from_secs(60))
                .await
                .unwrap()
        );
    }
    store.rollback(&transaction);
}
