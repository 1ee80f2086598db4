//! `SqliteStoreBuilder::concurrent_transactions`: several transactional
//! requests open in one batch of the writer, their SQL back to back, one
//! commit for all; a request that rolls back takes the requests that ran
//! after it down with it (503, nothing kept), never half of one.

use crate::common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use common::{Harness, eventually, send, serve};
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::problem::types;
use tower_idempotency::store::{SqliteStore, SqliteTransaction};

const SCHEMA: &str = "CREATE TABLE items (id INTEGER PRIMARY KEY, note TEXT NOT NULL);";

/// Writes an item in the request's transaction, counts the run, waits at
/// its gate if asked, then answers `x-status` (default 201).
async fn item(State(h): State<Harness>, tx: SqliteTransaction, headers: HeaderMap) -> Response {
    tx.run(|t| t.execute("INSERT INTO items (note) VALUES ('x')", []))
        .await
        .unwrap();
    let n = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
    h.wait_at_gate(&headers).await;
    let status = headers
        .get("x-status")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(201);
    (
        StatusCode::from_u16(status).unwrap(),
        format!("item run {n}"),
    )
        .into_response()
}

struct Fixture {
    dir: tempfile::TempDir,
    addr: std::net::SocketAddr,
    h: Harness,
    store: SqliteStore,
}

impl Fixture {
    /// Duplicates wait up to 10 s for the request in flight (without
    /// `wait_in_flight`: 409 at once).
    async fn start(concurrent: usize) -> Fixture {
        Fixture::start_waiting(concurrent, Duration::from_secs(10)).await
    }

    async fn start_waiting(concurrent: usize, wait: Duration) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("app.sqlite3");
        let store = SqliteStore::builder(&path)
            .concurrent_transactions(concurrent)
            .open()
            .await
            .unwrap();
        rusqlite::Connection::open(&path)
            .unwrap()
            .execute_batch(SCHEMA)
            .unwrap();
        let h = Harness::default();
        let layer = IdempotencyLayer::new(store.clone(), |_: &Parts| "anonymous".to_owned())
            .wait_in_flight(wait)
            .transactional();
        let app = Router::new()
            .route("/items", post(item))
            .route_layer(layer)
            .with_state(h.clone());
        Fixture {
            addr: serve(app).await,
            dir,
            h,
            store,
        }
    }

    fn count(&self, sql: &str) -> i64 {
        let conn = rusqlite::Connection::open(self.dir.path().join("app.sqlite3")).unwrap();
        conn.query_row(sql, [], |r| r.get(0)).unwrap()
    }

    fn items(&self) -> i64 {
        self.count("SELECT count(*) FROM items")
    }

    fn records(&self) -> i64 {
        self.count("SELECT count(*) FROM idempotency_records")
    }

    fn post(
        &self,
        key: &'static [u8],
        extra: &'static [(&'static str, &'static [u8])],
    ) -> tokio::task::JoinHandle<common::Raw> {
        let addr = self.addr;
        tokio::spawn(async move {
            let mut headers = vec![("idempotency-key", key)];
            headers.extend_from_slice(extra);
            send(addr, "POST", "/items", &headers, b"{}").await
        })
    }
}

/// Three handlers run their SQL while a fourth request, claimed first, is
/// still open in its handler; nothing is durable until all four are done,
/// and then one commit makes all four durable.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn open_requests_run_back_to_back_and_share_one_commit() {
    let f = Fixture::start(8).await;
    let mut entered = f.h.watch();
    let first = f.post(b"a", &[("x-gate", b"a")]);
    assert_eq!(entered.recv().await.unwrap(), "a");
    let others = [
        f.post(b"b", &[("x-gate", b"b")]),
        f.post(b"c", &[("x-gate", b"c")]),
        f.post(b"d", &[("x-gate", b"d")]),
    ];
    let mut gates = Vec::new();
    for _ in 0..3 {
        gates.push(entered.recv().await.unwrap());
    }
    gates.sort();
    assert_eq!(gates, ["b", "c", "d"], "all ran while `a` was open");
    assert_eq!(f.h.runs(), 4);
    assert_eq!((f.items(), f.records()), (0, 0), "nothing is committed yet");
    for gate in ["b", "c", "d", "a"] {
        f.h.open(gate);
    }
    for client in std::iter::once(first).chain(others) {
        let answer = client.await.unwrap();
        assert_eq!((answer.status, answer.replayed()), (201, false));
    }
    let stats = f.store.group_commit_stats();
    assert_eq!((stats.commits, stats.requests), (1, 4));
    assert_eq!((f.items(), f.records()), (4, 4));
}

/// `a` is claimed first and rolls back (a 500 is not stored) after `b` has
/// written and completed on top of it: `b` is rolled back with it and
/// answered 503; nothing of either stays, and both retries run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rollback_takes_the_requests_after_it_down_whole() {
    let f = Fixture::start(8).await;
    let mut entered = f.h.watch();
    let first = f.post(b"a", &[("x-gate", b"a"), ("x-status", b"500")]);
    assert_eq!(entered.recv().await.unwrap(), "a");
    let second = f.post(b"b", &[("x-gate", b"b")]);
    assert_eq!(entered.recv().await.unwrap(), "b");
    f.h.open("b");
    f.h.open("a");
    assert_eq!(first.await.unwrap().status, 500);
    let second = second.await.unwrap();
    assert_eq!(second.assert_problem(503), types::STORE_UNAVAILABLE);
    assert_eq!(second.header_str("retry-after"), Some("1"));
    assert_eq!((f.items(), f.records(), f.h.runs()), (0, 0, 2));
    for key in [b"a" as &'static [u8], b"b"] {
        let retry = f.post(key, &[]).await.unwrap();
        assert_eq!((retry.status, retry.replayed()), (201, false));
    }
    assert_eq!((f.items(), f.records(), f.h.runs()), (2, 2, 4));
}

/// A request that completes before another is claimed is not harmed by that
/// later request's rollback: only frames above the rolled-back one go.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rollback_keeps_the_requests_before_it() {
    let f = Fixture::start(8).await;
    let mut entered = f.h.watch();
    let first = f.post(b"a", &[("x-gate", b"a")]);
    assert_eq!(entered.recv().await.unwrap(), "a");
    let second = f.post(b"b", &[("x-gate", b"b"), ("x-status", b"500")]);
    assert_eq!(entered.recv().await.unwrap(), "b");
    f.h.open("b");
    assert_eq!(second.await.unwrap().status, 500);
    f.h.open("a");
    let first = first.await.unwrap();
    assert_eq!((first.status, first.replayed()), (201, false));
    assert_eq!((f.items(), f.records(), f.h.runs()), (1, 1, 2));
}

/// Sixteen deliveries of one key at once: one runs, the others wait for it
/// inside the batch and replay its answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_of_an_open_request_wait_for_it_and_replay() {
    let f = Fixture::start(32).await;
    let mut entered = f.h.watch();
    let first = f.post(b"k", &[("x-gate", b"k")]);
    assert_eq!(entered.recv().await.unwrap(), "k");
    let duplicates: Vec<_> = (0..15).map(|_| f.post(b"k", &[])).collect();
    // A later request of another key: once it has run, the duplicates sent
    // before it have reached the writer, or will find `k` completed. Its
    // answer waits for the batch, so only its run is awaited here.
    let other = f.post(b"other", &[]);
    eventually(Duration::from_secs(10), || f.h.runs() == 2).await;
    f.h.open("k");
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(other.await.unwrap().status, 201);
    for duplicate in duplicates {
        let answer = duplicate.await.unwrap();
        assert_eq!((answer.status, answer.replayed()), (201, true));
        assert_eq!(answer.body, b"item run 1");
    }
    assert_eq!((f.items(), f.records(), f.h.runs()), (2, 2, 2));
}

mod live_holder {
    //! A key held by a request open in the writer (issue 36, items 1 and 2):
    //! its uncommitted record's lease is no judge, so a repeat after the
    //! lease never takes it over (the holder's fenced commit rolled back
    //! both); a repeat waits for it at most its own bound, and at most 256
    //! repeats of one key wait in the writer.

    use std::time::Duration;

    use tower_idempotency::store::{
        ClaimRequest, Completion, FencingToken, Refusal, SqliteStore, SqliteTransaction,
        TransactionClaim, TransactionalStore,
    };
    use tower_idempotency::test_util::{self, ManualClock};

    const LEASE: Duration = Duration::from_secs(2);

    async fn store(dir: &tempfile::TempDir, clock: &ManualClock) -> SqliteStore {
        let path = dir.path().join("app.sqlite3");
        // A busy timeout past every wait here: the claims' own bounds decide.
        let store = SqliteStore::builder(&path)
            .busy_timeout(Duration::from_secs(120))
            .concurrent_transactions(4)
            .clock(clock.clone())
            .open()
            .await
            .unwrap();
        rusqlite::Connection::open(&path)
            .unwrap()
            .execute_batch(super::SCHEMA)
            .unwrap();
        store
    }

    /// A claim of `key` with fingerprint 1, a 2 s lease renewed up to 30 s,
    /// waiting at most `wait` for a holder.
    fn claim(key: &str, wait: Duration) -> ClaimRequest {
        test_util::claim_of("s", key, 1, FencingToken::random())
            .with_lease(LEASE)
            .with_max_hold(Duration::from_secs(30))
            .with_wait_in_flight(wait)
    }

    async fn acquire(store: &SqliteStore, key: &str) -> SqliteTransaction {
        match store
            .claim_in_transaction(claim(key, Duration::ZERO))
            .await
            .unwrap()
        {
            TransactionClaim::Acquired {
                transaction,
                taken_over: false,
            } => transaction,
            other => panic!("{other:?}"),
        }
    }

    fn items(dir: &tempfile::TempDir) -> i64 {
        let conn = rusqlite::Connection::open(dir.path().join("app.sqlite3")).unwrap();
        conn.query_row("SELECT count(*) FROM items", [], |r| r.get(0))
            .unwrap()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_repeat_past_the_lease_never_takes_over_a_live_holder() {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(test_util::START_MS);
        let store = store(&dir, &clock).await;
        let first = acquire(&store, "k").await;
        first
            .run(|t| t.execute("INSERT INTO items (note) VALUES ('first')", []))
            .await
            .unwrap();
        // The record's lease (2 s) is over; its holder is alive.
        clock.advance(Duration::from_secs(3));
        let repeat = store
            .claim_in_transaction(claim("k", Duration::from_millis(200)))
            .await
            .unwrap();
        let TransactionClaim::Refused(Refusal::InFlight { lease_remaining }) = repeat else {
            panic!("a repeat of a live holder's key: {repeat:?}");
        };
        assert!(
            lease_remaining > Duration::from_secs(20),
            "{lease_remaining:?}"
        );
        let stored = store
            .commit(&first, test_util::response(b"first"))
            .await
            .unwrap();
        assert_eq!(stored, Completion::Stored);
        assert_eq!(items(&dir), 1);
        // Now the repeat gets the first request's answer.
        match store
            .claim_in_transaction(claim("k", Duration::ZERO))
            .await
            .unwrap()
        {
            TransactionClaim::Refused(Refusal::Completed(r)) => {
                assert_eq!(r, test_util::response(b"first"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn at_most_256_repeats_wait_and_each_waits_its_own_bound() {
        const REPEATS: usize = 300;
        const WAITERS: usize = 256;
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(test_util::START_MS);
        let store = store(&dir, &clock).await;
        let first = acquire(&store, "k").await;
        // A repeat with a short bound is answered in flight while its
        // holder is still open (the store would wait its 5 s busy timeout).
        let short = tokio::time::timeout(
            Duration::from_secs(4),
            store.claim_in_transaction(claim("k", Duration::from_millis(100))),
        )
        .await
        .expect("answered within its bound, not the busy timeout")
        .unwrap();
        assert!(
            matches!(short, TransactionClaim::Refused(Refusal::InFlight { .. })),
            "{short:?}"
        );
        // 300 repeats that would wait a minute each, from a barrier.
        let start = std::sync::Arc::new(tokio::sync::Barrier::new(REPEATS));
        let (answers, mut answered) = tokio::sync::mpsc::unbounded_channel();
        for _ in 0..REPEATS {
            let (store, start, answers) = (store.clone(), start.clone(), answers.clone());
            tokio::spawn(async move {
                start.wait().await;
                let answer = store
                    .claim_in_transaction(claim("k", Duration::from_secs(60)))
                    .await;
                let _ = answers.send(answer);
            });
        }
        // Past the 256th waiter, each is refused at once: the holder is
        // still open when they are answered.
        for _ in WAITERS..REPEATS {
            let answer = tokio::time::timeout(Duration::from_secs(30), answered.recv())
                .await
                .expect("the repeats past the cap are answered while the holder is open")
                .unwrap()
                .unwrap();
            assert!(
                matches!(answer, TransactionClaim::Refused(Refusal::InFlight { .. })),
                "{answer:?}"
            );
        }
        let stored = store.commit(&first, test_util::response(b"first")).await;
        assert_eq!(stored.unwrap(), Completion::Stored);
        for _ in 0..WAITERS {
            match answered.recv().await.unwrap().unwrap() {
                TransactionClaim::Refused(Refusal::Completed(r)) => {
                    assert_eq!(r, test_util::response(b"first"));
                }
                other => panic!("a waiter: {other:?}"),
            }
        }
    }
}

/// `SqliteStore` over real sockets (issue 36, item 2): 300 repeats released
/// together while the first request is open, each allowed to wait 200 ms
/// (`wait_in_flight`), are each answered 409 while the first still holds
/// its key: none waited for it (they used to wait the 5 s busy timeout and
/// then get its replay), none ran; the first then commits once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn repeats_of_an_open_request_wait_at_most_their_bound() {
    const REPEATS: usize = 300;
    let f = Fixture::start_waiting(4, Duration::from_millis(200)).await;
    let (h, addr) = (f.h.clone(), f.addr);
    let mut entered = h.watch();
    let first = tokio::spawn(async move {
        let headers: [(&str, &[u8]); 2] = [("idempotency-key", b"k"), ("x-gate", b"g")];
        send(addr, "POST", "/items", &headers, b"{}").await
    });
    assert_eq!(entered.recv().await.as_deref(), Some("g"));
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(REPEATS));
    let repeats: Vec<_> = (0..REPEATS)
        .map(|_| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                send(addr, "POST", "/items", &[("idempotency-key", b"k")], b"{}").await
            })
        })
        .collect();
    for repeat in repeats {
        let r = repeat.await.unwrap();
        assert_eq!(r.assert_problem(409), types::IN_FLIGHT, "{r:?}");
    }
    h.open("g");
    let first = first.await.unwrap();
    assert_eq!((first.status, first.replayed()), (201, false));
    assert_eq!((f.items(), f.h.runs()), (1, 1));
}
