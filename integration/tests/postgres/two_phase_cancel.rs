//! Transactional mode in two phases, cancelled at its await points: a
//! request dropped while its phase-one claim is under way must give a
//! committed claim back, so a retry runs at once instead of waiting for the
//! lease. Needs PostgreSQL: `TOWER_IDEMPOTENCY_POSTGRES_URL`, or the local
//! `test` database.

#![cfg(feature = "postgres")]

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Wake, Waker};
use std::time::Duration;

use tokio::sync::Notify;
use tower_idempotency::store::{
    Claim, ClaimRequest, FencingToken, RecordId, Store, TransactionClaim, TransactionalStore,
};
use tower_idempotency_postgres::PostgresStore;

fn url() -> String {
    crate::common::services::postgres_url()
}

/// The lease of every claim here: far longer than the test may take, so a
/// key left in flight is refused for the whole test.
const LEASE: Duration = Duration::from_secs(600);

fn claim(key: &str) -> ClaimRequest {
    ClaimRequest::new(
        RecordId::new("s", key),
        tower_idempotency::fingerprint::Fingerprint([1; 32]),
        FencingToken::random(),
    )
    .with_lease(LEASE)
    .with_ttl(Duration::from_secs(3600))
}

/// A waker that records its wake-ups in a [`Notify`].
struct Flag(Notify);

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.0.notify_one();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.notify_one();
    }
}

async fn store() -> (PostgresStore, String) {
    let table = format!("idem_brk_{:016x}", FencingToken::random().0);
    let store = PostgresStore::builder(&url())
        .table(table.clone())
        .commit_claims_first(true)
        .open()
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {} is required: {e}", url()));
    (store, table)
}

async fn drop_table(store: &PostgresStore, table: &str) {
    let client = store.pool().get().await.unwrap();
    client
        .batch_execute(&format!("DROP TABLE {table}"))
        .await
        .unwrap();
}

/// Claims `key` again until it is acquired, or `rounds` claims were refused
/// (a few round trips: the key is given back by a spawned task). `None`
/// when every claim was refused.
async fn reclaim(store: &PostgresStore, key: &str, rounds: usize) -> Option<bool> {
    for _ in 0..rounds {
        match store.claim(claim(key)).await.unwrap() {
            Claim::Acquired { taken_over } => return Some(taken_over),
            Claim::Refused(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    None
}

/// The request is dropped after phase one's claim has committed and been
/// answered, but before the request read the answer: the claim must still
/// be given back. The request's future is polled by hand, once, with a
/// waker that tells when the answer arrived; it is then dropped unpolled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_dropped_once_its_claim_is_answered_gives_the_key_back() {
    let (store, table) = store().await;
    for round in 0..5 {
        let key = format!("answered-{round}");
        let flag = Arc::new(Flag(Notify::new()));
        let waker = Waker::from(flag.clone());
        let mut request = Box::pin(store.claim_in_transaction(claim(&key)));
        // The first poll spawns phase one and waits for its answer.
        let first = request.as_mut().poll(&mut Context::from_waker(&waker));
        assert!(
            first.is_pending(),
            "phase one cannot answer before its round trip"
        );
        // Woken: phase one's claim committed and its answer was sent.
        tokio::time::timeout(Duration::from_secs(30), flag.0.notified())
            .await
            .expect("phase one answered");
        // The request is cancelled before it reads the answer.
        drop(request);
        assert_eq!(
            reclaim(&store, &key, 250).await,
            Some(false),
            "round {round}: the cancelled request's claim was given back (released, not taken over)"
        );
    }
    drop_table(&store, &table).await;
}

/// The request is dropped before phase one answers: the claim task gives
/// the key back itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_dropped_before_its_claim_is_answered_gives_the_key_back() {
    let (store, table) = store().await;
    for round in 0..5 {
        let key = format!("unanswered-{round}");
        let flag = Arc::new(Flag(Notify::new()));
        let waker = Waker::from(flag.clone());
        let mut request = Box::pin(store.claim_in_transaction(claim(&key)));
        let first = request.as_mut().poll(&mut Context::from_waker(&waker));
        assert!(first.is_pending());
        drop(request);
        assert_eq!(
            reclaim(&store, &key, 250).await,
            Some(false),
            "round {round}: the cancelled request's claim was given back"
        );
    }
    drop_table(&store, &table).await;
}

/// Control: a claim answered and read holds the key; the transaction rolled
/// back gives it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_read_holds_the_key_until_rolled_back() {
    let (store, table) = store().await;
    let TransactionClaim::Acquired { transaction, .. } =
        store.claim_in_transaction(claim("held")).await.unwrap()
    else {
        panic!("the first claim is acquired");
    };
    assert!(
        matches!(store.claim(claim("held")).await.unwrap(), Claim::Refused(_)),
        "the key is in flight while its transaction is open"
    );
    store.roll_back_and_wait(&transaction).await;
    assert_eq!(reclaim(&store, "held", 1).await, Some(false));
    drop_table(&store, &table).await;
}
