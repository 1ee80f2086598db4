//! The PostgreSQL stores' first statement: a completed record is answered,
//! and a new key claimed, without a lock, and an expired record is not
//! replayed. Needs a PostgreSQL server: `TOWER_IDEMPOTENCY_POSTGRES_URL`, or
//! the local `test` database.

use crate::common;

use std::time::Duration;

use tower_idempotency::fingerprint::{Fingerprint, Hasher};
use tower_idempotency::store::{Claim, ClaimRequest, FencingToken, RecordId, Refusal, Store};
use tower_idempotency::test_util::{ClockOffset, ManualClock, START_MS, response};
use tower_idempotency_postgres::PostgresStore;
use tower_idempotency_sqlx::SqlxPostgresStore;

fn url() -> String {
    crate::common::services::postgres_url()
}

fn claim(key: &str, fp: u8) -> ClaimRequest {
    ClaimRequest::new(
        RecordId::new("s", key),
        Fingerprint([fp; 32]),
        FencingToken::random(),
    )
    .with_lease(Duration::from_secs(60))
    .with_ttl(Duration::from_secs(3600))
}

/// The stores' advisory lock key of `("s", key)` in `table`, as documented
/// in the stores: 64 bits of SHA-256 over table, scope and key.
fn advisory_key(table: &str, key: &str) -> i64 {
    let mut hasher = Hasher::new("tower-idempotency/pg-lock/v1");
    hasher
        .part(table.as_bytes())
        .part(b"s")
        .part(key.as_bytes());
    let digest = hasher.finish().0;
    i64::from_be_bytes(digest[..8].try_into().unwrap())
}

/// Claims and completes `key` with fingerprint 1 and body `b"done"`.
async fn complete<S: Store>(store: &S, key: &str) {
    let req = claim(key, 1);
    let token = req.token;
    assert!(matches!(
        store.claim(req).await.unwrap(),
        Claim::Acquired { taken_over: false }
    ));
    store
        .complete(RecordId::new("s", key), token, response(b"done"))
        .await
        .unwrap();
}

/// With another session holding the key's advisory lock and the record's
/// row lock, replays (and a 422) are answered; a new key's claim is not
/// blocked by its advisory lock either, while a repeat of a key in flight
/// takes the locking path and waits.
async fn replays_under_locks<S: Store + Clone + 'static>(store: &S, table: &str) {
    complete(store, "k").await;
    let (locker, connection) = tokio_postgres::connect(&url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    locker
        .batch_execute(&format!(
            "BEGIN; SELECT pg_advisory_xact_lock({}); SELECT pg_advisory_xact_lock({}); \
             SELECT 1 FROM {table} WHERE scope = 's' AND key = 'k' FOR UPDATE",
            advisory_key(table, "k"),
            advisory_key(table, "k3")
        ))
        .await
        .unwrap();
    for _ in 0..3 {
        let answer = tokio::time::timeout(Duration::from_secs(20), store.claim(claim("k", 1)))
            .await
            .expect("a replay waited on a lock")
            .unwrap();
        match answer {
            Claim::Refused(Refusal::Completed(stored)) => assert_eq!(stored, response(b"done")),
            other => panic!("expected a replay, got {other:?}"),
        }
    }
    let mismatch = tokio::time::timeout(Duration::from_secs(20), store.claim(claim("k", 2)))
        .await
        .expect("a mismatch waited on a lock")
        .unwrap();
    assert!(matches!(mismatch, Claim::Refused(Refusal::Mismatch)));
    // A new key is claimed by the insert alone: its advisory lock, held by
    // the other session, is not taken.
    let new_key = tokio::time::timeout(Duration::from_secs(20), store.claim(claim("k3", 1)))
        .await
        .expect("a new key's claim waited on a lock")
        .unwrap();
    assert!(matches!(new_key, Claim::Acquired { taken_over: false }));
    // The control: a repeat of a key in flight takes the locking path, and
    // waits for the advisory lock the other session holds.
    let k2 = claim("k2", 1);
    assert!(matches!(
        store.claim(k2).await.unwrap(),
        Claim::Acquired { taken_over: false }
    ));
    locker
        .execute(
            "SELECT pg_advisory_xact_lock($1)",
            &[&advisory_key(table, "k2")],
        )
        .await
        .unwrap();
    let waiting = tokio::spawn({
        let store = store.clone();
        async move { store.claim(claim("k2", 1)).await }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let waiters = locker
            .query(
                common::services::ADVISORY_WAITERS,
                &[&advisory_key(table, "k2")],
            )
            .await
            .unwrap()
            .len();
        if waiters >= 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the claim of k2 never waited"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!waiting.is_finished());
    locker.batch_execute("ROLLBACK").await.unwrap();
    assert!(matches!(
        waiting.await.unwrap().unwrap(),
        Claim::Refused(Refusal::InFlight { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_replays_take_no_lock_and_expired_records_are_not_replayed() {
    let table = format!("idem_replay_{:016x}", FencingToken::random().0);
    let clock = ManualClock::new(START_MS);
    let store = PostgresStore::builder(&url())
        .table(table.clone())
        .clock_offset(ClockOffset(clock.clone()))
        .open()
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {} is required: {e}", url()));
    replays_under_locks(&store, &table).await;
    expired_is_not_replayed(&store, &clock).await;
    let client = store.pool().get().await.unwrap();
    client
        .batch_execute(&format!("DROP TABLE {table}"))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_postgres_replays_take_no_lock_and_expired_records_are_not_replayed() {
    let table = format!("idem_replay_{:016x}", FencingToken::random().0);
    let clock = ManualClock::new(START_MS);
    let pool = sqlx::PgPool::connect(&url())
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {} is required: {e}", url()));
    let store = SqlxPostgresStore::builder(pool.clone())
        .table(table.clone())
        .clock_offset(ClockOffset(clock.clone()))
        .open()
        .await
        .unwrap();
    replays_under_locks(&store, &table).await;
    expired_is_not_replayed(&store, &clock).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&pool)
        .await
        .unwrap();
}

/// A completed record past its TTL is claimed anew, not replayed; one just
/// before its TTL ends is still replayed.
async fn expired_is_not_replayed<S: Store>(store: &S, clock: &ManualClock) {
    complete(store, "old").await;
    clock.advance(Duration::from_secs(3599));
    assert!(matches!(
        store.claim(claim("old", 1)).await.unwrap(),
        Claim::Refused(Refusal::Completed(_))
    ));
    clock.advance(Duration::from_secs(2));
    assert!(matches!(
        store.claim(claim("old", 1)).await.unwrap(),
        Claim::Acquired { taken_over: false }
    ));
    // Another fingerprint on an expired record is a new claim too, not 422.
    complete(store, "old2").await;
    clock.advance(Duration::from_secs(3601));
    assert!(matches!(
        store.claim(claim("old2", 2)).await.unwrap(),
        Claim::Acquired { taken_over: false }
    ));
}
