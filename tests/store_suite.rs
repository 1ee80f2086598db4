//! One conformance suite for every store (DESIGN §3 and §8): each test is a
//! generic function, and `store_suite!` runs all of them against one store.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use tokio::sync::Barrier;
use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::store::{
    Claim, ClaimRequest, Completion, FencingToken, Inspect, ManualClock, MemoryStore, RecordCounts,
    RecordSummary, SqliteStore, Store,
};
use tower_idempotency::{StoredBody, StoredResponse};

const LEASE: Duration = Duration::from_secs(60);
const TTL: Duration = Duration::from_secs(3600);
const START_MS: i64 = 1_800_000_000_000;

fn claim_of(scope: &str, key: &str, fp: u8, token: FencingToken) -> ClaimRequest {
    ClaimRequest {
        scope: scope.into(),
        key: key.into(),
        fingerprint: Fingerprint([fp; 32]),
        token,
        lease: LEASE,
        ttl: TTL,
    }
}

fn response(body: &'static [u8]) -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.append("link", "</a>; rel=next".parse().unwrap());
    headers.append("link", "</b>; rel=prev".parse().unwrap());
    StoredResponse::capture(
        StatusCode::CREATED,
        &headers,
        Bytes::from_static(body),
        None,
    )
}

async fn acquire<S: Store>(store: &S, key: &str) -> FencingToken {
    let token = FencingToken::random();
    assert_eq!(
        store.claim(claim_of("s", key, 1, token)).await.unwrap(),
        Claim::Acquired { taken_over: false }
    );
    token
}

async fn complete<S: Store>(
    store: &S,
    key: &str,
    token: FencingToken,
    body: &'static [u8],
) -> Completion {
    store
        .complete("s".into(), key.into(), token, response(body))
        .await
        .unwrap()
}

async fn new_key_is_acquired<S: Store>(store: S, _clock: ManualClock) {
    acquire(&store, "k").await;
}

async fn completed_record_is_replayed<S: Store>(store: S, _clock: ManualClock) {
    let token = acquire(&store, "k").await;
    assert_eq!(
        complete(&store, "k", token, b"\xff\x00\xfe").await,
        Completion::Stored
    );
    let again = store
        .claim(claim_of("s", "k", 1, FencingToken::random()))
        .await
        .unwrap();
    assert_eq!(again, Claim::Completed(response(b"\xff\x00\xfe")));
}

async fn mismatch_is_checked_first<S: Store>(store: S, _clock: ManualClock) {
    let token = acquire(&store, "k").await;
    // In flight: a different fingerprint is a mismatch, not a 409.
    let other = store
        .claim(claim_of("s", "k", 2, FencingToken::random()))
        .await
        .unwrap();
    assert_eq!(other, Claim::Mismatch);
    complete(&store, "k", token, b"done").await;
    let other = store
        .claim(claim_of("s", "k", 2, FencingToken::random()))
        .await
        .unwrap();
    assert_eq!(other, Claim::Mismatch);
}

async fn in_flight_reports_remaining_lease<S: Store>(store: S, clock: ManualClock) {
    acquire(&store, "k").await;
    clock.advance(Duration::from_secs(10));
    let again = store
        .claim(claim_of("s", "k", 1, FencingToken::random()))
        .await
        .unwrap();
    // Exactly 50 s on a manual clock; a server's clock also moved on a little.
    let Claim::InFlight { lease_remaining } = again else {
        panic!("expected in flight, got {again:?}");
    };
    assert!(
        lease_remaining <= Duration::from_secs(50) && lease_remaining > Duration::from_secs(49),
        "{lease_remaining:?}"
    );
}

async fn expired_lease_is_taken_over_and_fenced<S: Store>(store: S, clock: ManualClock) {
    let first = acquire(&store, "k").await;
    clock.advance(LEASE + Duration::from_millis(1));
    let second = FencingToken::random();
    let claim = store.claim(claim_of("s", "k", 1, second)).await.unwrap();
    assert_eq!(claim, Claim::Acquired { taken_over: true });
    // The first holder comes back late: it can neither complete nor release.
    assert_eq!(
        complete(&store, "k", first, b"first").await,
        Completion::Fenced
    );
    assert!(!store.release("s".into(), "k".into(), first).await.unwrap());
    assert_eq!(
        complete(&store, "k", second, b"second").await,
        Completion::Stored
    );
    let replay = store
        .claim(claim_of("s", "k", 1, FencingToken::random()))
        .await
        .unwrap();
    assert_eq!(replay, Claim::Completed(response(b"second")));
}

/// The store's clock steps back an hour after a claim with a 60 s lease:
/// the record's lease deadline is 1 h 60 s ahead, further than one lease,
/// so the next claim takes it over instead of answering 409 for an hour; the
/// new claim's own lease (60 s ahead) holds, and the first holder is fenced.
async fn stepped_back_clock_lease_is_taken_over<S: Store>(store: S, clock: ManualClock) {
    clock.set(START_MS + 3_600_000);
    let first = acquire(&store, "k").await;
    clock.set(START_MS);
    let second = FencingToken::random();
    let claim = store.claim(claim_of("s", "k", 1, second)).await.unwrap();
    assert_eq!(claim, Claim::Acquired { taken_over: true });
    let again = store
        .claim(claim_of("s", "k", 1, FencingToken::random()))
        .await
        .unwrap();
    let Claim::InFlight { lease_remaining } = again else {
        panic!("expected in flight, got {again:?}");
    };
    assert!(lease_remaining <= LEASE, "{lease_remaining:?}");
    assert_eq!(
        complete(&store, "k", first, b"first").await,
        Completion::Fenced
    );
    assert_eq!(
        complete(&store, "k", second, b"second").await,
        Completion::Stored
    );
}

async fn release_needs_the_token<S: Store>(store: S, _clock: ManualClock) {
    let token = acquire(&store, "k").await;
    let stranger = FencingToken::random();
    assert!(
        !store
            .release("s".into(), "k".into(), stranger)
            .await
            .unwrap()
    );
    assert!(matches!(
        store
            .claim(claim_of("s", "k", 1, FencingToken::random()))
            .await
            .unwrap(),
        Claim::InFlight { .. }
    ));
    assert!(store.release("s".into(), "k".into(), token).await.unwrap());
    // Released: the next request runs at once, even with another fingerprint.
    let next = store
        .claim(claim_of("s", "k", 2, FencingToken::random()))
        .await
        .unwrap();
    assert_eq!(next, Claim::Acquired { taken_over: false });
}

async fn completed_record_is_final<S: Store>(store: S, _clock: ManualClock) {
    let token = acquire(&store, "k").await;
    assert_eq!(
        complete(&store, "k", token, b"one").await,
        Completion::Stored
    );
    assert_eq!(
        complete(&store, "k", token, b"two").await,
        Completion::Fenced
    );
    assert!(!store.release("s".into(), "k".into(), token).await.unwrap());
    let replay = store
        .claim(claim_of("s", "k", 1, FencingToken::random()))
        .await
        .unwrap();
    assert_eq!(replay, Claim::Completed(response(b"one")));
}

async fn record_past_ttl_is_new<S: Store>(store: S, clock: ManualClock) {
    let token = acquire(&store, "k").await;
    complete(&store, "k", token, b"old").await;
    // A second of slack for stores on a server's clock, which moves on by itself.
    clock.advance(TTL - Duration::from_secs(1));
    assert!(matches!(
        store
            .claim(claim_of("s", "k", 1, FencingToken::random()))
            .await
            .unwrap(),
        Claim::Completed(_)
    ));
    clock.advance(Duration::from_secs(1));
    // Past its TTL the record is ignored, whatever its fingerprint was.
    let fresh = store
        .claim(claim_of("s", "k", 2, FencingToken::random()))
        .await
        .unwrap();
    assert_eq!(fresh, Claim::Acquired { taken_over: false });
}

async fn purge_removes_only_expired<S: Store>(store: S, clock: ManualClock) {
    acquire(&store, "old").await;
    clock.advance(TTL / 2);
    acquire(&store, "young").await;
    assert_eq!(store.purge_expired().await.unwrap(), 0);
    clock.advance(TTL / 2);
    assert_eq!(store.purge_expired().await.unwrap(), 1);
    // "young" survived the purge: its lease is long over, so it is taken over
    // (a purged record would be claimed afresh).
    assert_eq!(
        store
            .claim(claim_of("s", "young", 1, FencingToken::random()))
            .await
            .unwrap(),
        Claim::Acquired { taken_over: true }
    );
    assert_eq!(store.purge_expired().await.unwrap(), 0);
}

async fn scopes_never_meet<S: Store>(store: S, _clock: ManualClock) {
    let token = FencingToken::random();
    store.claim(claim_of("alice", "k", 1, token)).await.unwrap();
    store
        .complete("alice".into(), "k".into(), token, response(b"alice's"))
        .await
        .unwrap();
    let bob = store
        .claim(claim_of("bob", "k", 1, FencingToken::random()))
        .await
        .unwrap();
    assert_eq!(bob, Claim::Acquired { taken_over: false });
}

async fn concurrent_claims_have_one_winner<S: Store>(store: S, _clock: ManualClock) {
    const N: usize = 32;
    let barrier = Arc::new(Barrier::new(N));
    let tasks: Vec<_> = (0..N)
        .map(|_| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store
                    .claim(claim_of("s", "k", 1, FencingToken::random()))
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut acquired = 0;
    for task in tasks {
        match task.await.unwrap() {
            Claim::Acquired { taken_over: false } => acquired += 1,
            Claim::InFlight { .. } => {}
            other => panic!("unexpected claim outcome {other:?}"),
        }
    }
    assert_eq!(acquired, 1);
}

async fn omitted_body_round_trips<S: Store>(store: S, _clock: ManualClock) {
    let token = acquire(&store, "k").await;
    let mut stored = response(b"");
    stored.body = StoredBody::Omitted;
    store
        .complete("s".into(), "k".into(), token, stored.clone())
        .await
        .unwrap();
    let replay = store
        .claim(claim_of("s", "k", 1, FencingToken::random()))
        .await
        .unwrap();
    assert_eq!(replay, Claim::Completed(stored));
}

// ------------------------------------------------------------- inspection

/// A claim with its own fingerprint and TTL (the lease is `LEASE`).
async fn claim_ttl<S: Store>(store: &S, scope: &str, key: &str, fp: u8, ttl: Duration) {
    let claim = ClaimRequest {
        ttl,
        ..claim_of(scope, key, fp, FencingToken::random())
    };
    assert_eq!(
        store.claim(claim).await.unwrap(),
        Claim::Acquired { taken_over: false }
    );
}

fn counts(in_flight: u64, stuck: u64, completed: u64, expired: u64) -> RecordCounts {
    RecordCounts {
        in_flight,
        stuck,
        completed,
        expired,
    }
}

/// Asserts one stuck record. Its lease ended `ago` before the suite's clock
/// reading; a store on a server's clock also saw the real time pass since
/// the test began (`started`), so it may read up to that much later. Either
/// way the two figures add up to exactly TTL minus lease.
fn assert_summary(
    got: &RecordSummary,
    (scope, key, fp): (&str, &str, u8),
    ago: Duration,
    ttl: Duration,
    started: std::time::Instant,
) {
    let drift = started.elapsed().as_millis() as u64 + 1;
    assert_eq!(
        (got.scope.as_str(), got.key.as_str()),
        (scope, key),
        "{got:?}"
    );
    assert_eq!(got.fingerprint, Fingerprint([fp; 32]), "{got:?}");
    assert_eq!(got.fingerprint_hex(), format!("{fp:02x}").repeat(32));
    let ago = ago.as_millis() as u64;
    assert!(
        (ago..=ago + drift).contains(&got.lease_ended_ms_ago),
        "lease ended {} ms ago, expected {ago} (+ up to {drift})",
        got.lease_ended_ms_ago
    );
    assert_eq!(
        got.lease_ended_ms_ago + got.ttl_remaining_ms,
        (ttl - LEASE).as_millis() as u64,
        "{got:?}"
    );
}

async fn counts_sort_every_record_into_one_kind<S: Inspect>(store: S, clock: ManualClock) {
    assert_eq!(store.counts().await.unwrap(), counts(0, 0, 0, 0));
    // t0: one to expire in flight, one whose holder crashes, one completed.
    claim_ttl(&store, "s", "short", 1, Duration::from_secs(30)).await;
    claim_ttl(&store, "s", "crashed", 1, TTL).await;
    let token = acquire(&store, "done").await;
    complete(&store, "done", token, b"ok").await;
    assert_eq!(store.counts().await.unwrap(), counts(2, 0, 1, 0));
    // t0 + 61 s: the leases of t0 are over; "short" is past its TTL too.
    clock.advance(LEASE + Duration::from_secs(1));
    claim_ttl(&store, "s", "alive", 1, TTL).await;
    assert_eq!(store.counts().await.unwrap(), counts(1, 1, 1, 1));
    assert_eq!(store.purge_expired().await.unwrap(), 1);
    assert_eq!(store.counts().await.unwrap(), counts(1, 1, 1, 0));
    // t0 + 1 h + 1 s: only "alive" (claimed at t0 + 61 s) is within its TTL,
    // and its lease is long over.
    clock.advance(TTL - LEASE);
    assert_eq!(store.counts().await.unwrap(), counts(0, 1, 0, 2));
    assert_eq!(store.purge_expired().await.unwrap(), 2);
    assert_eq!(store.counts().await.unwrap(), counts(0, 1, 0, 0));
}

async fn stuck_lists_ended_leases_oldest_first<S: Inspect>(store: S, clock: ManualClock) {
    let started = std::time::Instant::now();
    claim_ttl(&store, "s", "old", 1, TTL).await;
    claim_ttl(&store, "s", "gone", 3, Duration::from_secs(70)).await;
    clock.advance(Duration::from_secs(10));
    claim_ttl(&store, "t", "new", 2, TTL).await;
    let token = acquire(&store, "done").await;
    complete(&store, "done", token, b"ok").await;
    assert_eq!(store.stuck(10).await.unwrap(), vec![]);
    // t0 + 75 s: "old" ended 15 s ago, "new" 5 s ago; "gone" is past its
    // TTL and "done" is completed, so neither is stuck.
    clock.advance(Duration::from_secs(65));
    claim_ttl(&store, "s", "alive", 4, TTL).await;
    let stuck = store.stuck(10).await.unwrap();
    assert_eq!(stuck.len(), 2, "{stuck:?}");
    assert_summary(
        &stuck[0],
        ("s", "old", 1),
        Duration::from_secs(15),
        TTL,
        started,
    );
    assert_summary(
        &stuck[1],
        ("t", "new", 2),
        Duration::from_secs(5),
        TTL,
        started,
    );
    let first = store.stuck(1).await.unwrap();
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].key, "old");
    assert_eq!(store.stuck(0).await.unwrap(), vec![]);
    // The retry takes "old" over: a fresh lease, no longer stuck.
    assert_eq!(
        store
            .claim(claim_of("s", "old", 1, FencingToken::random()))
            .await
            .unwrap(),
        Claim::Acquired { taken_over: true }
    );
    let stuck = store.stuck(10).await.unwrap();
    assert_eq!(stuck.len(), 1, "{stuck:?}");
    assert_summary(
        &stuck[0],
        ("t", "new", 2),
        Duration::from_secs(5),
        TTL,
        started,
    );
}

macro_rules! store_suite {
    ($store:ident, $make:expr) => {
        mod $store {
            use super::*;

            store_suite!(@tests $make;
                new_key_is_acquired,
                completed_record_is_replayed,
                mismatch_is_checked_first,
                in_flight_reports_remaining_lease,
                expired_lease_is_taken_over_and_fenced,
                stepped_back_clock_lease_is_taken_over,
                release_needs_the_token,
                completed_record_is_final,
                record_past_ttl_is_new,
                purge_removes_only_expired,
                scopes_never_meet,
                concurrent_claims_have_one_winner,
                omitted_body_round_trips,
                counts_sort_every_record_into_one_kind,
                stuck_lists_ended_leases_oldest_first,
            );
        }
    };
    (@tests $make:expr; $($test:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                let clock = ManualClock::new(START_MS);
                let (store, _keep) = $make(clock.clone()).await;
                super::$test(store, clock).await;
            }
        )*
    };
}

async fn memory(clock: ManualClock) -> (MemoryStore, ()) {
    (MemoryStore::with_clock(clock), ())
}

async fn sqlite(clock: ManualClock) -> (SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::builder(dir.path().join("records.sqlite3"))
        .clock(clock)
        .open()
        .await
        .unwrap();
    (store, dir)
}

store_suite!(memory_store, memory);
store_suite!(sqlite_store, sqlite);

/// The suite's clock as an offset from the server's clock, for the networked
/// stores (whose expiry is judged by the server).
#[cfg(any(feature = "postgres", feature = "redis"))]
struct Offset(ManualClock);

#[cfg(any(feature = "postgres", feature = "redis"))]
impl tower_idempotency::store::Clock for Offset {
    fn now_ms(&self) -> i64 {
        self.0.now_ms() - START_MS
    }
}

/// Where the PostgreSQL tests connect: `TOWER_IDEMPOTENCY_POSTGRES_URL`, or
/// the local server's `test` database.
#[cfg(feature = "postgres")]
fn postgres_url() -> String {
    std::env::var("TOWER_IDEMPOTENCY_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
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
                let store = tower_idempotency::PostgresStore::open(&postgres_url())
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
async fn postgres(clock: ManualClock) -> (tower_idempotency::PostgresStore, DropTable) {
    let table = format!("idem_test_{:016x}", FencingToken::random().0);
    let store = tower_idempotency::PostgresStore::builder(&postgres_url())
        .table(table.clone())
        .time_offset(Offset(clock))
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
store_suite!(postgres_store, postgres);

/// On a manual clock the figures are exact, ties in the lease end go by
/// scope then key, and the boundaries are those of the claim: a lease ending
/// now is over, a TTL ending now is over.
async fn inspect_is_exact_on_a_manual_clock<S: Inspect>(store: S, clock: ManualClock) {
    for (scope, key) in [("b", "k"), ("a", "z"), ("a", "k")] {
        claim_ttl(&store, scope, key, 5, TTL).await;
    }
    clock.advance(LEASE - Duration::from_millis(1));
    assert_eq!(store.counts().await.unwrap(), counts(3, 0, 0, 0));
    clock.advance(Duration::from_millis(1));
    assert_eq!(store.counts().await.unwrap(), counts(0, 3, 0, 0));
    let summary = |scope: &str, key: &str, ago: u64| RecordSummary {
        scope: scope.into(),
        key: key.into(),
        fingerprint: Fingerprint([5; 32]),
        lease_ended_ms_ago: ago,
        ttl_remaining_ms: (TTL - LEASE).as_millis() as u64 - ago,
    };
    assert_eq!(
        store.stuck(10).await.unwrap(),
        vec![
            summary("a", "k", 0),
            summary("a", "z", 0),
            summary("b", "k", 0)
        ]
    );
    clock.advance(Duration::from_millis(1234));
    assert_eq!(
        store.stuck(2).await.unwrap(),
        vec![summary("a", "k", 1234), summary("a", "z", 1234)]
    );
    clock.advance(TTL - LEASE - Duration::from_millis(1235));
    assert_eq!(
        store.stuck(1).await.unwrap(),
        vec![RecordSummary {
            ttl_remaining_ms: 1,
            ..summary("a", "k", 3_539_999)
        }]
    );
    clock.advance(Duration::from_millis(1));
    assert_eq!(store.counts().await.unwrap(), counts(0, 0, 0, 3));
    assert_eq!(store.stuck(10).await.unwrap(), vec![]);
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

/// Two independent handles on one file (as two processes would have): the
/// primary key decides, not anything in either handle.
/// Ten rounds of 16 claimers of one key, half through each of two store
/// handles on the same records: exactly one wins each round.
async fn two_handles_one_winner<S: Store>(one: S, two: S) {
    for round in 0..10 {
        let key = format!("k{round}");
        let barrier = Arc::new(Barrier::new(16));
        let tasks: Vec<_> = (0..16)
            .map(|i| {
                let store = if i % 2 == 0 { one.clone() } else { two.clone() };
                let (barrier, key) = (barrier.clone(), key.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    store
                        .claim(claim_of("s", &key, 1, FencingToken::random()))
                        .await
                        .unwrap()
                })
            })
            .collect();
        let mut acquired = 0;
        for task in tasks {
            if let Claim::Acquired { .. } = task.await.unwrap() {
                acquired += 1;
            }
        }
        assert_eq!(acquired, 1, "round {round}");
    }
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
    use tower_idempotency::store::RedisStore;

    pub(crate) fn url() -> String {
        std::env::var("TOWER_IDEMPOTENCY_REDIS_URL")
            .unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
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
            .time_offset(Offset(clock))
            .open()
            .await
            .unwrap();
        (store, ())
    }
}

#[cfg(feature = "redis")]
use redis_support::redis;

#[cfg(feature = "redis")]
store_suite!(redis_store, redis);

/// Two independent handles (as two app servers would have) racing one key:
/// the claim script, run whole by the server, decides.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_two_handles_one_key_one_winner() {
    use tower_idempotency::store::RedisStore;
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
    use tower_idempotency::store::RedisStore;
    let prefix = redis_support::unique_prefix("layout");
    let store = RedisStore::builder(redis_support::url())
        .prefix(prefix.clone())
        .open()
        .await
        .unwrap();
    let client = ::redis::Client::open(redis_support::url()).unwrap();
    let mut raw = client.get_multiplexed_async_connection().await.unwrap();
    // The scope's length in bytes, then the scope, then the key.
    let record = format!("{prefix}5:alice:k");
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
        .complete("alice".into(), "k".into(), token, response(b"x"))
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
        .arg(format!("{prefix}1:s:string"))
        .arg("hello")
        .query_async(&mut raw)
        .await
        .unwrap();
    let _: () = ::redis::cmd("HSET")
        .arg(format!("{prefix}1:s:foreign"))
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
        assert!(!store.release("s".into(), key.into(), token).await.unwrap());
        assert_eq!(
            store
                .complete("s".into(), key.into(), token, response(b"x"))
                .await
                .unwrap(),
            Completion::Fenced
        );
    }
    // The purge leaves what it does not recognise alone.
    assert_eq!(store.purge_expired().await.unwrap(), 0);
    let _: () = ::redis::cmd("DEL")
        .arg(&record)
        .arg(format!("{prefix}1:s:string"))
        .arg(format!("{prefix}1:s:foreign"))
        .query_async(&mut raw)
        .await
        .unwrap();
}

/// An unreachable server is `Unavailable` when the store opens.
#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_bad_url_is_unavailable() {
    use tower_idempotency::StoreError;
    use tower_idempotency::store::RedisStore;
    let err = RedisStore::open("http://127.0.0.1:6379").await.unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
}

/// Leases and TTLs too long for Lua's numbers or `PEXPIRE` are clamped, not
/// refused.
#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_huge_durations_are_clamped() {
    use tower_idempotency::store::RedisStore;
    let store = RedisStore::builder(redis_support::url())
        .prefix(redis_support::unique_prefix("huge"))
        .open()
        .await
        .unwrap();
    let huge = |token| ClaimRequest {
        lease: Duration::MAX,
        ttl: Duration::MAX,
        ..claim_of("s", "k", 1, token)
    };
    let token = FencingToken::random();
    assert_eq!(
        store.claim(huge(token)).await.unwrap(),
        Claim::Acquired { taken_over: false }
    );
    let again = store.claim(huge(FencingToken::random())).await.unwrap();
    assert!(
        matches!(again, Claim::InFlight { lease_remaining } if lease_remaining > Duration::from_secs(1 << 40)),
        "{again:?}"
    );
    assert!(store.release("s".into(), "k".into(), token).await.unwrap());
}

/// The purge walks every `SCAN` page and leaves keys outside its prefix alone.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_purge_walks_every_scan_page() {
    use tower_idempotency::store::RedisStore;
    let clock = ManualClock::new(START_MS);
    let open = |prefix: String| {
        RedisStore::builder(redis_support::url())
            .prefix(prefix)
            .time_offset(Offset(clock.clone()))
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
    use tower_idempotency::store::RedisStore;
    let clock = ManualClock::new(START_MS);
    let prefix = redis_support::unique_prefix("inspect_pages");
    let store = RedisStore::builder(redis_support::url())
        .prefix(prefix.clone())
        .time_offset(Offset(clock.clone()))
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
        .arg(format!("{prefix}1:s:string"))
        .arg(format!("{prefix}1:s:foreign"))
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
    assert!(!store.release("s".into(), "k".into(), first).await.unwrap());
    assert!(store.release("s".into(), "k".into(), second).await.unwrap());
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
    let store = tower_idempotency::PostgresStore::builder(&postgres_url())
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
    use tower_idempotency::store::RedisStore;
    let prefix = redis_support::unique_prefix("stepped");
    let store = RedisStore::builder(redis_support::url())
        .prefix(prefix.clone())
        .open()
        .await
        .unwrap();
    let client = ::redis::Client::open(redis_support::url()).unwrap();
    let mut raw = client.get_multiplexed_async_connection().await.unwrap();
    let record = format!("{prefix}1:s:k");
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
        .arg(format!("{prefix}1:s:k"))
        .query_async(&mut raw)
        .await
        .unwrap();
}
