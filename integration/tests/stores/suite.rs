//! One conformance suite for every store (docs/contract.md §3 and §8): the checks of
//! `tower_idempotency::test_util` (feature `test-util`), run against each
//! store of this crate by `store_suite!`, and the tests of one store each.

use std::time::Duration;

use tower_idempotency::store::{Claim, FencingToken, Purge, RecordId, Store};
use tower_idempotency::store::{MemoryStore, SqliteStore};
#[cfg(any(feature = "postgres", feature = "redis"))]
use tower_idempotency::test_util::suite::replays_come_from_the_cache_until_the_ttl_ends as cached_replays;
use tower_idempotency::test_util::suite::{
    inspect_is_exact_on_a_manual_clock, two_handles_one_winner,
};
use tower_idempotency::test_util::{ManualClock, START_MS, TTL, acquire, claim_of, store_suite};
// The tests of the networked stores only.
#[cfg(any(feature = "postgres", feature = "redis"))]
use tower_idempotency::test_util::ClockOffset;
#[cfg(feature = "redis")]
use tower_idempotency::{
    store::{Completion, Inspect, Refusal},
    test_util::{LEASE, claim_ttl, counts, id, response},
};

async fn memory(clock: ManualClock) -> (MemoryStore, ()) {
    (MemoryStore::with_clock(clock), ())
}

async fn sqlite(clock: ManualClock) -> (SqliteStore, tempfile::TempDir) {
    sqlite_purging(clock, Purge::default()).await
}

async fn sqlite_purging(clock: ManualClock, purge: Purge) -> (SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::builder(dir.path().join("records.sqlite3"))
        .clock(clock)
        .purge(purge)
        .open()
        .await
        .unwrap();
    (store, dir)
}

store_suite!(memory_store, memory, inspect);
store_suite!(sqlite_store, sqlite, inspect);
store_suite!(sqlite_purge, sqlite_purging, purge);

/// Where the PostgreSQL tests connect: `TOWER_IDEMPOTENCY_POSTGRES_URL`, or
/// the local server's `test` database.
#[cfg(feature = "postgres")]
fn postgres_url() -> String {
    crate::common::services::postgres_url()
}

/// Drops a test's table when the test ends, pass or fail.
#[cfg(feature = "postgres")]
struct DropTable(String);

#[cfg(feature = "postgres")]
impl Drop for DropTable {
    fn drop(&mut self) {
        let table = std::mem::take(&mut self.0);
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let store = tower_idempotency_postgres::PostgresStore::open(&postgres_url())
                    .await
                    .unwrap();
                let client = store.pool().get().await.unwrap();
                client
                    .batch_execute(&format!("DROP TABLE IF EXISTS {table}"))
                    .await
                    .unwrap();
            });
        })
        .join();
    }
}

#[cfg(feature = "postgres")]
async fn postgres(clock: ManualClock) -> (tower_idempotency_postgres::PostgresStore, DropTable) {
    postgres_purging(clock, Purge::default()).await
}

#[cfg(feature = "postgres")]
async fn postgres_purging(
    clock: ManualClock,
    purge: Purge,
) -> (tower_idempotency_postgres::PostgresStore, DropTable) {
    let table = format!("idem_test_{:016x}", FencingToken::random().0);
    let store = tower_idempotency_postgres::PostgresStore::builder(&postgres_url())
        .table(table.clone())
        .clock_offset(ClockOffset(clock))
        .purge(purge)
        .open()
        .await
        .unwrap_or_else(|e| {
            panic!(
                "PostgreSQL at {} is required for these tests: {e}",
                postgres_url()
            )
        });
    (store, DropTable(table))
}

#[cfg(feature = "postgres")]
store_suite!(postgres_store, postgres, inspect);
#[cfg(feature = "postgres")]
store_suite!(postgres_purge, postgres_purging, purge);

/// The whole contract again with the replay cache on.
#[cfg(feature = "postgres")]
async fn postgres_cached(
    clock: ManualClock,
) -> (tower_idempotency_postgres::PostgresStore, DropTable) {
    let table = format!("idem_test_{:016x}", FencingToken::random().0);
    let store = tower_idempotency_postgres::PostgresStore::builder(&postgres_url())
        .table(table.clone())
        .clock_offset(ClockOffset(clock))
        .replay_cache(64)
        .open()
        .await
        .unwrap();
    (store, DropTable(table))
}

#[cfg(feature = "postgres")]
store_suite!(postgres_cached_store, postgres_cached, inspect);

/// A replay cached by one replay answers the next ones, until its TTL ends.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_replays_come_from_the_cache_until_the_ttl_ends() {
    let clock = ManualClock::new(START_MS);
    let (cached, table) = postgres_cached(clock.clone()).await;
    let plain_clock = ManualClock::new(START_MS);
    let plain = tower_idempotency_postgres::PostgresStore::builder(&postgres_url())
        .table(table.0.clone())
        .clock_offset(ClockOffset(plain_clock.clone()))
        .open()
        .await
        .unwrap();
    cached_replays(cached, clock, plain, plain_clock).await;
}

/// A table name outside the rule, or a URL that does not parse, is a
/// configuration error, found before any connection is tried; a valid URL of
/// a server that does not answer is `Unavailable`.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_bad_config_is_config_and_unreachable_is_unavailable() {
    use tower_idempotency::StoreError;
    use tower_idempotency_postgres::PostgresStore;
    for table in ["bad name;", "", "1st", &"t".repeat(49)] {
        let err = PostgresStore::builder(&postgres_url())
            .table(table)
            .open()
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Config(_)), "{table:?}: {err:?}");
    }
    let err = PostgresStore::open("not a url = =").await.unwrap_err();
    assert!(matches!(err, StoreError::Config(_)), "{err:?}");
    // Port 1 on the loopback: a valid URL where nothing listens.
    let err = PostgresStore::builder("postgres://postgres@127.0.0.1:1/test")
        .wait_timeout(Duration::from_secs(2))
        .open()
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
}

#[tokio::test]
async fn memory_inspect_is_exact() {
    let clock = ManualClock::new(START_MS);
    inspect_is_exact_on_a_manual_clock(MemoryStore::with_clock(clock.clone()), clock).await;
}

#[tokio::test]
async fn sqlite_inspect_is_exact() {
    let clock = ManualClock::new(START_MS);
    let (store, _dir) = sqlite(clock.clone()).await;
    inspect_is_exact_on_a_manual_clock(store, clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_two_handles_one_file_one_winner() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shared.sqlite3");
    let one = SqliteStore::open(&path).await.unwrap();
    let two = SqliteStore::open(&path).await.unwrap();
    two_handles_one_winner(one, two).await;
}

#[tokio::test]
async fn the_purge_task_removes_expired_records() {
    let clock = ManualClock::new(START_MS);
    let store = MemoryStore::with_clock(clock.clone());
    acquire(&store, "k").await;
    let task = tower_idempotency::store::spawn_purge_task(store.clone(), Duration::from_millis(10));
    clock.advance(TTL);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !store.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the purge task never ran"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    task.abort();
}

// ------------------------------------------------------------------ Redis

/// The Redis suite runs against `TOWER_IDEMPOTENCY_REDIS_URL`, or the local
/// server (`redis://127.0.0.1:6379`).
#[cfg(feature = "redis")]
mod redis_support {
    use super::*;
    use tower_idempotency_redis::RedisStore;

    pub(crate) fn url() -> String {
        crate::common::services::redis_url()
    }

    pub(crate) async fn hget(
        raw: &mut ::redis::aio::MultiplexedConnection,
        key: &str,
        field: &str,
    ) -> Option<Vec<u8>> {
        ::redis::cmd("HGET")
            .arg(key)
            .arg(field)
            .query_async(raw)
            .await
            .unwrap()
    }

    pub(crate) async fn pttl(raw: &mut ::redis::aio::MultiplexedConnection, key: &str) -> i64 {
        ::redis::cmd("PTTL")
            .arg(key)
            .query_async(raw)
            .await
            .unwrap()
    }

    /// A prefix no other test (or run) shares.
    pub(crate) fn unique_prefix(what: &str) -> String {
        format!(
            "tower-idempotency-test:{what}:{:016x}:",
            FencingToken::random().0
        )
    }

    pub(crate) async fn redis(clock: ManualClock) -> (RedisStore, ()) {
        // libtest names the thread a test runs on after the test.
        let test = std::thread::current().name().unwrap_or("suite").to_owned();
        let store = RedisStore::builder(url())
            .prefix(unique_prefix(&test))
            .clock_offset(ClockOffset(clock))
            .open()
            .await
            .unwrap();
        (store, ())
    }
}

#[cfg(feature = "redis")]
use redis_support::redis;

#[cfg(feature = "redis")]
store_suite!(redis_store, redis, inspect);

/// A replay cached by one replay answers the next ones, until its TTL ends.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_replays_come_from_the_cache_until_the_ttl_ends() {
    use tower_idempotency_redis::RedisStore;
    let prefix = redis_support::unique_prefix("replay_cache");
    let (clock, plain_clock) = (ManualClock::new(START_MS), ManualClock::new(START_MS));
    let open = |clock: &ManualClock, records: usize| {
        RedisStore::builder(redis_support::url())
            .prefix(prefix.clone())
            .clock_offset(ClockOffset(clock.clone()))
            .replay_cache(records)
            .open()
    };
    let cached = open(&clock, 16).await.unwrap();
    let plain = open(&plain_clock, 0).await.unwrap();
    cached_replays(cached, clock, plain, plain_clock).await;
}

/// Two independent handles (as two app servers would have) racing one key:
/// the claim script, run whole by the server, decides.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_two_handles_one_key_one_winner() {
    use tower_idempotency_redis::RedisStore;
    let prefix = redis_support::unique_prefix("two_handles");
    let one = RedisStore::builder(redis_support::url())
        .prefix(prefix.clone())
        .open()
        .await
        .unwrap();
    let two = RedisStore::builder(redis_support::url())
        .prefix(prefix)
        .open()
        .await
        .unwrap();
    two_handles_one_winner(one, two).await;
}

/// The record is the documented hash, carries a native expiry, and a key
/// that another program wrote under the prefix is an error, not a panic.
#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_record_layout_expiry_and_corruption() {
    use redis_support::{hget, pttl};
    use tower_idempotency::StoreError;
    use tower_idempotency_redis::RedisStore;
    let prefix = redis_support::unique_prefix("layout");
    let store = RedisStore::builder(redis_support::url())
        .prefix(prefix.clone())
        .open()
        .await
        .unwrap();
    let client = ::redis::Client::open(redis_support::url()).unwrap();
    let mut raw = client.get_multiplexed_async_connection().await.unwrap();
    // The scope's length in bytes, then the scope, then the key.
    let record = format!("{prefix}{{5:alice:k}}");
    let token = FencingToken::random();
    store.claim(claim_of("alice", "k", 7, token)).await.unwrap();
    assert_eq!(
        hget(&mut raw, &record, "state").await.as_deref(),
        Some(&b"in_flight"[..])
    );
    assert_eq!(
        hget(&mut raw, &record, "fingerprint").await,
        Some(vec![7; 32])
    );
    assert_eq!(
        hget(&mut raw, &record, "token").await,
        Some(token.0.to_string().into_bytes())
    );
    let ttl = pttl(&mut raw, &record).await;
    assert!(ttl > 0 && ttl <= 3_600_000, "PTTL {ttl}");
    store
        .complete(RecordId::new("alice", "k"), token, response(b"x"))
        .await
        .unwrap();
    assert_eq!(
        hget(&mut raw, &record, "state").await.as_deref(),
        Some(&b"completed"[..])
    );
    assert_eq!(
        hget(&mut raw, &record, "response").await,
        Some(response(b"x").encode())
    );
    let ttl = pttl(&mut raw, &record).await;
    assert!(ttl > 0 && ttl <= 3_600_000, "PTTL {ttl}");

    // A completed record whose response does not decode.
    let _: () = ::redis::cmd("HSET")
        .arg(&record)
        .arg("response")
        .arg(&b"\x00not a response"[..])
        .query_async(&mut raw)
        .await
        .unwrap();
    let claim = store
        .claim(claim_of("alice", "k", 7, FencingToken::random()))
        .await;
    assert!(matches!(claim, Err(StoreError::Corrupt(_))), "{claim:?}");
    // A key that is not a hash at all; a hash without our fields.
    let _: () = ::redis::cmd("SET")
        .arg(format!("{prefix}{{1:s:string}}"))
        .arg("hello")
        .query_async(&mut raw)
        .await
        .unwrap();
    let _: () = ::redis::cmd("HSET")
        .arg(format!("{prefix}{{1:s:foreign}}"))
        .arg("name")
        .arg("x")
        .query_async(&mut raw)
        .await
        .unwrap();
    for key in ["string", "foreign"] {
        let claim = store
            .claim(claim_of("s", key, 1, FencingToken::random()))
            .await;
        assert!(matches!(claim, Err(StoreError::Corrupt(_))), "{claim:?}");
        assert!(!store.release(id(key), token).await.unwrap());
        assert_eq!(
            store
                .complete(id(key), token, response(b"x"))
                .await
                .unwrap(),
            Completion::Fenced
        );
    }
    // The purge leaves what it does not recognise alone.
    assert_eq!(store.purge_expired().await.unwrap(), 0);
    let _: () = ::redis::cmd("DEL")
        .arg(&record)
        .arg(format!("{prefix}{{1:s:string}}"))
        .arg(format!("{prefix}{{1:s:foreign}}"))
        .query_async(&mut raw)
        .await
        .unwrap();
}

/// A URL that is not a Redis URL, or an empty prefix, is a configuration
/// error when the store opens; a valid URL of a server that does not answer
/// is `Unavailable`.
#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_bad_config_is_config_and_unreachable_is_unavailable() {
    use tower_idempotency::StoreError;
    use tower_idempotency_redis::RedisStore;
    for url in ["not a url", "http://127.0.0.1:6379"] {
        let err = RedisStore::open(url).await.unwrap_err();
        assert!(matches!(err, StoreError::Config(_)), "{url}: {err:?}");
    }
    let err = RedisStore::builder(redis_support::url())
        .prefix("")
        .open()
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Config(_)), "{err:?}");
    // Port 1 on the loopback: a valid URL where nothing listens.
    let err = RedisStore::open("redis://127.0.0.1:1").await.unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
}

/// Leases and TTLs too long for Lua's numbers or `PEXPIRE` are clamped, not
/// refused.
#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_huge_durations_are_clamped() {
    use tower_idempotency_redis::RedisStore;
    let store = RedisStore::builder(redis_support::url())
        .prefix(redis_support::unique_prefix("huge"))
        .open()
        .await
        .unwrap();
    let huge = |token| {
        claim_of("s", "k", 1, token)
            .with_lease(Duration::MAX)
            .with_ttl(Duration::MAX)
    };
    let token = FencingToken::random();
    assert_eq!(
        store.claim(huge(token)).await.unwrap(),
        Claim::Acquired { taken_over: false }
    );
    let again = store.claim(huge(FencingToken::random())).await.unwrap();
    assert!(
        matches!(again, Claim::Refused(Refusal::InFlight { lease_remaining }) if lease_remaining > Duration::from_secs(1 << 40)),
        "{again:?}"
    );
    assert!(store.release(id("k"), token).await.unwrap());
}

/// The purge walks every `SCAN` page and leaves keys outside its prefix alone.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_purge_walks_every_scan_page() {
    use tower_idempotency_redis::RedisStore;
    let clock = ManualClock::new(START_MS);
    let open = |prefix: String| {
        RedisStore::builder(redis_support::url())
            .prefix(prefix)
            .clock_offset(ClockOffset(clock.clone()))
            .open()
    };
    let prefix = redis_support::unique_prefix("purge_pages");
    let store = open(prefix.clone()).await.unwrap();
    // A glob character in a neighbour's prefix that would match ours.
    let neighbour = open(format!("{}*", &prefix[..prefix.len() - 1]))
        .await
        .unwrap();
    acquire(&neighbour, "k").await;
    let tasks: Vec<_> = (0..1200)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let claim = claim_of("s", &format!("k{i}"), 1, FencingToken::random());
                store.claim(claim).await.unwrap()
            })
        })
        .collect();
    for task in tasks {
        assert_eq!(task.await.unwrap(), Claim::Acquired { taken_over: false });
    }
    clock.advance(TTL);
    // Unescaped, the neighbour's pattern would match (and purge) our keys too.
    assert_eq!(neighbour.purge_expired().await.unwrap(), 1);
    assert_eq!(store.purge_expired().await.unwrap(), 1200);
    assert_eq!(store.purge_expired().await.unwrap(), 0);
}

/// Inspection walks every `SCAN` page, keeps the oldest stuck records across
/// pages, and leaves keys it does not recognise (another program's) out.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_inspect_walks_every_scan_page() {
    use tower_idempotency_redis::RedisStore;
    let clock = ManualClock::new(START_MS);
    let prefix = redis_support::unique_prefix("inspect_pages");
    let store = RedisStore::builder(redis_support::url())
        .prefix(prefix.clone())
        .clock_offset(ClockOffset(clock.clone()))
        .open()
        .await
        .unwrap();
    let client = ::redis::Client::open(redis_support::url()).unwrap();
    let mut raw = client.get_multiplexed_async_connection().await.unwrap();
    for (name, kind) in [("1:s:string", "SET"), ("1:s:foreign", "HSET")] {
        let mut cmd = ::redis::cmd(kind);
        cmd.arg(format!("{prefix}{name}"));
        if kind == "HSET" {
            cmd.arg("name");
        }
        let _: () = cmd.arg("x").query_async(&mut raw).await.unwrap();
    }
    // Keys k0..k1199, claimed in order, 1 ms apart on the suite's clock.
    for i in 0..1200 {
        claim_ttl(&store, "s", &format!("k{i}"), 1, TTL).await;
        clock.advance(Duration::from_millis(1));
    }
    assert_eq!(store.counts().await.unwrap(), counts(1200, 0, 0, 0));
    clock.advance(LEASE);
    assert_eq!(store.counts().await.unwrap(), counts(0, 1200, 0, 0));
    let stuck = store.stuck(3).await.unwrap();
    let keys: Vec<_> = stuck.iter().map(|s| s.key.as_str()).collect();
    assert_eq!(keys, ["k0", "k1", "k2"]);
    let all = store.stuck(5000).await.unwrap();
    assert_eq!(all.len(), 1200);
    assert!(
        all.windows(2)
            .all(|w| w[0].lease_ended_ms_ago >= w[1].lease_ended_ms_ago)
    );
    clock.advance(TTL);
    assert_eq!(store.counts().await.unwrap(), counts(0, 0, 0, 1200));
    assert_eq!(store.purge_expired().await.unwrap(), 1200);
    assert_eq!(store.counts().await.unwrap(), counts(0, 0, 0, 0));
    let _: () = ::redis::cmd("DEL")
        .arg(format!("{prefix}{{1:s:string}}"))
        .arg(format!("{prefix}{{1:s:foreign}}"))
        .query_async(&mut raw)
        .await
        .unwrap();
}

// ------------------------------------------- a lease deadline stepped ahead

/// The system clock, and a record whose `lease_until` was moved 1 h ahead
/// in the store itself (what a wall clock stepping back looks like to the
/// next claim): with a 60 s lease the claim takes the record over; the
/// record's own deadline is `poke`d by each store's raw access.
async fn raw_deadline_an_hour_ahead_is_taken_over<S, P, F>(store: S, poke: P)
where
    S: Store,
    P: FnOnce() -> F,
    F: std::future::Future<Output = u64>,
{
    let first = acquire(&store, "k").await;
    assert_eq!(poke().await, 1, "one record's lease_until moved");
    let second = FencingToken::random();
    assert_eq!(
        store.claim(claim_of("s", "k", 1, second)).await.unwrap(),
        Claim::Acquired { taken_over: true }
    );
    assert!(!store.release(RecordId::new("s", "k"), first).await.unwrap());
    assert!(
        store
            .release(RecordId::new("s", "k"), second)
            .await
            .unwrap()
    );
}

#[tokio::test]
async fn sqlite_lease_until_an_hour_ahead_in_the_file_is_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stepped.sqlite3");
    let store = SqliteStore::open(&path).await.unwrap();
    raw_deadline_an_hour_ahead_is_taken_over(store, || async {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute(
            "UPDATE idempotency_records SET lease_until = lease_until + 3600000",
            [],
        )
        .unwrap() as u64
    })
    .await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn postgres_lease_until_an_hour_ahead_in_the_table_is_taken_over() {
    let table = format!("idem_test_{:016x}", FencingToken::random().0);
    let _drop = DropTable(table.clone());
    let store = tower_idempotency_postgres::PostgresStore::builder(&postgres_url())
        .table(table.clone())
        .open()
        .await
        .unwrap();
    let pool = store.pool().clone();
    raw_deadline_an_hour_ahead_is_taken_over(store, || async move {
        let client = pool.get().await.unwrap();
        client
            .execute(
                &format!("UPDATE {table} SET lease_until = lease_until + 3600000"),
                &[],
            )
            .await
            .unwrap()
    })
    .await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_lease_until_an_hour_ahead_in_the_hash_is_taken_over() {
    use tower_idempotency_redis::RedisStore;
    let prefix = redis_support::unique_prefix("stepped");
    let store = RedisStore::builder(redis_support::url())
        .prefix(prefix.clone())
        .open()
        .await
        .unwrap();
    let client = ::redis::Client::open(redis_support::url()).unwrap();
    let mut raw = client.get_multiplexed_async_connection().await.unwrap();
    let record = format!("{prefix}{{1:s:k}}");
    let poke_raw = raw.clone();
    raw_deadline_an_hour_ahead_is_taken_over(store, || async move {
        let mut raw = poke_raw;
        let exists: u64 = ::redis::cmd("EXISTS")
            .arg(&record)
            .query_async(&mut raw)
            .await
            .unwrap();
        let _: i64 = ::redis::cmd("HINCRBY")
            .arg(&record)
            .arg("lease_until")
            .arg(3_600_000)
            .query_async(&mut raw)
            .await
            .unwrap();
        exists
    })
    .await;
    let _: () = ::redis::cmd("DEL")
        .arg(format!("{prefix}{{1:s:k}}"))
        .query_async(&mut raw)
        .await
        .unwrap();
}
