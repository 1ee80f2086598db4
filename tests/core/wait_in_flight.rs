//! `IdempotencyLayer::wait_in_flight`: repeats that meet their key in flight
//! wait for the first request and get its replay instead of 409; past the
//! bound, or beyond the cap on waiters, they get 409; a first request that
//! gives its key back lets one waiter run. Real parallel clients over
//! loopback HTTP; the first request is held at a gate until every repeat has
//! met its key in flight (counted by the store), so each repeat below waited.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::waiting::{post_key, replayed, server};
use common::{Harness, Raw, eventually};
use tokio::sync::Barrier;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::{Claim, MemoryStore, Refusal, Store};
use tower_idempotency::test_util::WatchClaims;
use tower_idempotency::{IdempotencyLayer, SqliteStore};

/// The store under test, counting the claims it answered "in flight".
#[derive(Clone)]
struct Counting<St> {
    store: St,
    in_flight: Arc<AtomicUsize>,
}

impl<St: Store> Counting<St> {
    fn new(
        inner: St,
    ) -> Counting<WatchClaims<St, impl Fn(&Claim) + Clone + Send + Sync + 'static>> {
        let in_flight = Arc::new(AtomicUsize::new(0));
        let seen = in_flight.clone();
        let store = WatchClaims::new(inner, move |claim: &Claim| {
            if let Claim::Refused(Refusal::InFlight { .. }) = claim {
                seen.fetch_add(1, Ordering::SeqCst);
            }
        });
        Counting { store, in_flight }
    }
}

impl<St> Counting<St> {
    fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }
}

/// Sends `n` repeats at once (a barrier releases them together).
fn repeats(addr: std::net::SocketAddr, n: usize) -> Vec<tokio::task::JoinHandle<Raw>> {
    let barrier = Arc::new(Barrier::new(n));
    (0..n)
        .map(|_| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                post_key(addr, &[]).await
            })
        })
        .collect()
}

/// Starts the first request, held at gate `g`, and returns it once it runs.
async fn first_held(addr: std::net::SocketAddr, h: &Harness) -> tokio::task::JoinHandle<Raw> {
    let mut entered = h.watch();
    let first = tokio::spawn(async move { post_key(addr, &[("x-gate", b"g")]).await });
    assert_eq!(entered.recv().await.as_deref(), Some("g"));
    first
}

async fn repeats_wait_and_get_the_replay<St: Store>(store: St) {
    const N: usize = 24;
    let h = Harness::default();
    let counting = Counting::new(store);
    let layer = IdempotencyLayer::new(counting.store.clone(), GlobalScope)
        .wait_in_flight(Duration::from_secs(20));
    let addr = server(layer, &h).await;
    let first = first_held(addr, &h).await;
    let waiting = repeats(addr, N);
    // Every repeat has met the key in flight (without the option, N 409s).
    eventually(Duration::from_secs(20), || counting.in_flight() >= N).await;
    h.open("g");
    let first = first.await.unwrap();
    assert_eq!(
        (first.status, first.body.as_slice()),
        (201, b"run 1".as_slice())
    );
    assert!(!replayed(&first));
    let mut woken_with_replay = 0;
    for repeat in waiting {
        let repeat = repeat.await.unwrap();
        assert_eq!(
            (repeat.status, repeat.body.as_slice()),
            (201, b"run 1".as_slice())
        );
        assert!(replayed(&repeat));
        woken_with_replay += 1;
    }
    assert_eq!(woken_with_replay, N);
    assert_eq!(h.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn repeats_wait_for_the_first_and_get_its_replay_memory() {
    repeats_wait_and_get_the_replay(MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn repeats_wait_for_the_first_and_get_its_replay_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("records.db"))
        .await
        .unwrap();
    repeats_wait_and_get_the_replay(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_repeat_past_its_bound_gets_409() {
    let h = Harness::default();
    let counting = Counting::new(MemoryStore::new());
    let layer = IdempotencyLayer::new(counting.store.clone(), GlobalScope)
        .wait_in_flight(Duration::from_millis(50));
    let addr = server(layer, &h).await;
    let first = first_held(addr, &h).await;
    let repeat = post_key(addr, &[]).await;
    assert_eq!(repeat.status, 409);
    assert_eq!(repeat.header("retry-after"), Some(b"1".as_slice()));
    // It claimed more than once while it waited: at once, then polling.
    assert!(counting.in_flight() >= 2, "{}", counting.in_flight());
    h.open("g");
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(h.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn repeats_beyond_the_cap_get_409_at_once() {
    let h = Harness::default();
    let counting = Counting::new(MemoryStore::new());
    let layer = IdempotencyLayer::new(counting.store.clone(), GlobalScope)
        .wait_in_flight(Duration::from_secs(20))
        .max_waiters(2, 1024 * 1024);
    let addr = server(layer, &h).await;
    let first = first_held(addr, &h).await;
    let (tx, mut answers) = tokio::sync::mpsc::unbounded_channel();
    for repeat in repeats(addr, 5) {
        let tx = tx.clone();
        tokio::spawn(async move { tx.send(repeat.await.unwrap()) });
    }
    // Three find no place and are answered while the first is still held.
    for _ in 0..3 {
        assert_eq!(answers.recv().await.unwrap().status, 409);
    }
    h.open("g");
    assert_eq!(first.await.unwrap().status, 201);
    for _ in 0..2 {
        let repeat = answers.recv().await.unwrap();
        assert_eq!((repeat.status, replayed(&repeat)), (201, true));
    }
    assert_eq!(h.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_given_back_runs_for_one_waiter_and_the_other_gets_its_replay() {
    let h = Harness::default();
    let counting = Counting::new(MemoryStore::new());
    let layer = IdempotencyLayer::new(counting.store.clone(), GlobalScope)
        .wait_in_flight(Duration::from_secs(20));
    let addr = server(layer, &h).await;
    let mut entered = h.watch();
    let first =
        tokio::spawn(async move { post_key(addr, &[("x-gate", b"g"), ("x-fail", b"1")]).await });
    assert_eq!(entered.recv().await.as_deref(), Some("g"));
    let waiting = repeats(addr, 2);
    eventually(Duration::from_secs(20), || counting.in_flight() >= 2).await;
    h.open("g");
    assert_eq!(first.await.unwrap().status, 500);
    let mut answers = Vec::new();
    for repeat in waiting {
        let repeat = repeat.await.unwrap();
        answers.push((repeat.status, replayed(&repeat), repeat.body));
    }
    answers.sort();
    assert_eq!(
        answers,
        [
            (201, false, b"run 2".to_vec()),
            (201, true, b"run 2".to_vec())
        ]
    );
    assert_eq!(h.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiter_on_another_server_sees_the_completion_by_polling() {
    let h = Harness::default();
    let counting = Counting::new(MemoryStore::new());
    // Two layers, so two sets of waiters: server B is never woken by A's
    // completion, only by its own claims.
    let wait = Duration::from_secs(20);
    let a = server(
        IdempotencyLayer::new(counting.store.clone(), GlobalScope),
        &h,
    )
    .await;
    let b = server(
        IdempotencyLayer::new(counting.store.clone(), GlobalScope).wait_in_flight(wait),
        &h,
    )
    .await;
    let first = first_held(a, &h).await;
    let waiting = repeats(b, 3);
    eventually(Duration::from_secs(20), || counting.in_flight() >= 3).await;
    h.open("g");
    assert_eq!(first.await.unwrap().status, 201);
    for repeat in waiting {
        let repeat = repeat.await.unwrap();
        assert_eq!(
            (repeat.status, replayed(&repeat), repeat.body.as_slice()),
            (201, true, b"run 1".as_slice())
        );
    }
    assert_eq!(h.runs(), 1);
}
