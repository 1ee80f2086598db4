//! Transactional mode over real sockets: the handler's writes, the record and
//! the response commit together, or none of them do.

use crate::common;

use common::charge::user;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Extension;
use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use common::{Harness, eventually, send, serve};
use tokio::sync::Barrier;
use tower_idempotency::problem::types;
use tower_idempotency::store::{SqliteStore, SqliteStoreBuilder, SqliteTransaction};
use tower_idempotency::{IdempotencyLayer, scope::GlobalScope};

const SCHEMA: &str = "
CREATE TABLE items (id INTEGER PRIMARY KEY, note TEXT NOT NULL);
CREATE TABLE parents (id INTEGER PRIMARY KEY);
CREATE TABLE children (
    id INTEGER PRIMARY KEY,
    parent INTEGER NOT NULL REFERENCES parents (id) DEFERRABLE INITIALLY DEFERRED
);
";

/// Writes an item through the request's transaction, counts the run, waits
/// at its gate if asked, then answers with `x-status` (default 201). With
/// `x-fk-violation` it also writes a row whose deferred foreign key fails at
/// commit; with `x-panic` it panics after writing.
async fn item(State(h): State<Harness>, tx: SqliteTransaction, headers: HeaderMap) -> Response {
    let violate = headers.contains_key("x-fk-violation");
    tx.run(move |t| {
        t.execute("INSERT INTO items (note) VALUES ('x')", [])?;
        if violate {
            t.execute("INSERT INTO children (parent) VALUES (999)", [])?;
        }
        Ok(())
    })
    .await
    .unwrap();
    if headers.contains_key("x-keep-clone") {
        KEPT.lock().unwrap().push(tx.clone());
    }
    let n = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
    h.wait_at_gate(&headers).await;
    if headers.contains_key("x-panic") {
        panic!("the handler panics after writing");
    }
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

/// What the `/held` handler shares with its test.
#[derive(Clone)]
struct Held {
    /// The handler's transaction, sent once it has written its item.
    handed: tokio::sync::mpsc::Sender<SqliteTransaction>,
    /// The test wakes the handler with it.
    go_on: Arc<tokio::sync::Notify>,
    /// What the handler's second write, after it woke, returned.
    late: tokio::sync::mpsc::Sender<Result<(), String>>,
}

/// Writes an item and counts the run; with `x-hold`, hands its transaction
/// to the test, waits to be woken, and tries a second write. Answers 201.
async fn held_item(
    State(h): State<Harness>,
    Extension(held): Extension<Held>,
    tx: SqliteTransaction,
    headers: HeaderMap,
) -> Response {
    tx.run(|t| t.execute("INSERT INTO items (note) VALUES ('held')", []))
        .await
        .unwrap();
    h.runs.fetch_add(1, Ordering::SeqCst);
    if headers.contains_key("x-hold") {
        held.handed.send(tx.clone()).await.unwrap();
        held.go_on.notified().await;
        let late = tx
            .run(|t| t.execute("INSERT INTO items (note) VALUES ('late')", []))
            .await;
        let late = late.map(|inserted| assert_eq!(inserted, 1));
        held.late
            .send(late.map_err(|e| e.to_string()))
            .await
            .unwrap();
    }
    (StatusCode::CREATED, "held").into_response()
}

/// Transactions a handler kept after its request ended.
static KEPT: std::sync::Mutex<Vec<SqliteTransaction>> = std::sync::Mutex::new(Vec::new());

struct Fixture {
    dir: tempfile::TempDir,
    addr: std::net::SocketAddr,
    h: Harness,
    store: SqliteStore,
    /// The `/held` handler's ends.
    handed: tokio::sync::mpsc::Receiver<SqliteTransaction>,
    go_on: Arc<tokio::sync::Notify>,
    late: tokio::sync::mpsc::Receiver<Result<(), String>>,
}

impl Fixture {
    async fn start(busy_timeout: Duration) -> Fixture {
        Fixture::start_with(|b| b.busy_timeout(busy_timeout)).await
    }

    async fn start_with(options: impl FnOnce(SqliteStoreBuilder) -> SqliteStoreBuilder) -> Fixture {
        Fixture::build(options, None, tower_idempotency::DEFAULT_MAX_HOLD).await
    }

    /// As [`Fixture::start`], with repeats that wait up to `wait` for the
    /// request in flight (`wait_in_flight`; without it they get 409 at once).
    async fn start_waiting(busy_timeout: Duration, wait: Duration) -> Fixture {
        let hold = tower_idempotency::DEFAULT_MAX_HOLD;
        Fixture::build(|b| b.busy_timeout(busy_timeout), Some(wait), hold).await
    }

    async fn build(
        options: impl FnOnce(SqliteStoreBuilder) -> SqliteStoreBuilder,
        wait: Option<Duration>,
        max_hold: Duration,
    ) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("app.sqlite3");
        let store = options(SqliteStore::builder(&path)).open().await.unwrap();
        rusqlite::Connection::open(&path)
            .unwrap()
            .execute_batch(SCHEMA)
            .unwrap();
        let h = Harness::default();
        let layer = IdempotencyLayer::new(store.clone(), |p: &Parts| user(p))
            .wait_in_flight(wait.unwrap_or_default())
            .max_hold(max_hold)
            .transactional();
        let (handed, handed_rx) = tokio::sync::mpsc::channel(1);
        let (late, late_rx) = tokio::sync::mpsc::channel(1);
        let go_on = Arc::new(tokio::sync::Notify::new());
        let held = Held {
            handed,
            go_on: go_on.clone(),
            late,
        };
        let app = Router::new()
            .route("/items", post(item))
            .route("/held", post(held_item))
            .route_layer(layer)
            .route("/ping", get(|| async { "pong" }))
            .layer(Extension(held))
            .with_state(h.clone());
        Fixture {
            addr: serve(app).await,
            dir,
            h,
            store,
            handed: handed_rx,
            go_on,
            late: late_rx,
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

    async fn post(&self, key: &[u8], extra: &[(&str, &[u8])]) -> common::Raw {
        let mut headers = vec![("idempotency-key", key)];
        headers.extend_from_slice(extra);
        send(self.addr, "POST", "/items", &headers, b"{}").await
    }
}

#[tokio::test]
async fn effect_record_and_response_commit_together() {
    let f = Fixture::start(Duration::from_secs(5)).await;
    let first = f.post(b"k", &[]).await;
    assert_eq!((first.status, &first.body[..]), (201, &b"item run 1"[..]));
    assert_eq!((f.items(), f.records()), (1, 1));
    let again = f.post(b"k", &[]).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!((f.items(), f.h.runs()), (1, 1));
}

#[tokio::test]
async fn a_response_that_is_not_stored_rolls_the_effect_back() {
    let f = Fixture::start(Duration::from_secs(5)).await;
    let failed = f.post(b"k", &[("x-status", b"500")]).await;
    assert_eq!(failed.status, 500);
    assert_eq!((f.items(), f.records()), (0, 0));
    let retry = f.post(b"k", &[]).await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!((f.items(), f.records(), f.h.runs()), (1, 1, 2));
}

#[tokio::test]
async fn a_stored_4xx_commits_with_its_writes() {
    let f = Fixture::start(Duration::from_secs(5)).await;
    assert_eq!(f.post(b"k", &[("x-status", b"409")]).await.status, 409);
    let again = f.post(b"k", &[("x-status", b"409")]).await;
    assert!(again.replayed());
    assert_eq!((f.items(), f.h.runs()), (1, 1));
}

#[tokio::test]
async fn a_dropped_request_rolls_everything_back() {
    let f = Fixture::start(Duration::from_secs(5)).await;
    let mut entered = f.h.watch();
    let mut conn = tokio::net::TcpStream::connect(f.addr).await.unwrap();
    let req = common::request_bytes(
        "POST",
        "/items",
        &[("idempotency-key", b"k"), ("x-gate", b"g")],
        b"{}",
    );
    tokio::io::AsyncWriteExt::write_all(&mut conn, &req)
        .await
        .unwrap();
    assert_eq!(entered.recv().await.unwrap(), "g");
    drop(conn); // the client goes away after the handler wrote its item
    // The server reads the end of that connection before the retry's
    // request (one runtime here, the end sent first); dropping the request
    // posts its rollback and frees its key, so the retry's claim is queued
    // behind the rollback and runs, however late the writer gets to it. (A
    // retry the server reads first meets the request in flight: 409.)
    let retry = f.post(b"k", &[]).await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!((f.items(), f.records(), f.h.runs()), (1, 1, 2));
}

#[tokio::test]
async fn a_clone_kept_by_the_handler_does_not_keep_the_transaction_open() {
    let f = Fixture::start(Duration::from_millis(500)).await;
    let mut entered = f.h.watch();
    let mut conn = tokio::net::TcpStream::connect(f.addr).await.unwrap();
    let req = common::request_bytes(
        "POST",
        "/items",
        &[
            ("idempotency-key", b"k"),
            ("x-gate", b"g"),
            ("x-keep-clone", b"1"),
        ],
        b"{}",
    );
    tokio::io::AsyncWriteExt::write_all(&mut conn, &req)
        .await
        .unwrap();
    assert_eq!(entered.recv().await.unwrap(), "g");
    drop(conn);
    // The layer rolls back although the handler kept a clone: were the
    // transaction still open, the retry would be told 409 (in flight).
    let retry = f.post(b"k", &[]).await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!((f.items(), f.h.runs()), (1, 2));
    let kept = KEPT.lock().unwrap().pop().unwrap();
    assert!(
        kept.run(|_| Ok(())).await.is_err(),
        "the kept transaction has ended"
    );
}

#[tokio::test]
async fn a_panicking_handler_rolls_everything_back() {
    let f = Fixture::start(Duration::from_secs(5)).await;
    let mut conn = tokio::net::TcpStream::connect(f.addr).await.unwrap();
    let req = common::request_bytes(
        "POST",
        "/items",
        &[("idempotency-key", b"k"), ("x-panic", b"1")],
        b"{}",
    );
    tokio::io::AsyncWriteExt::write_all(&mut conn, &req)
        .await
        .unwrap();
    let mut buf = Vec::new();
    let _ = tokio::io::AsyncReadExt::read_to_end(&mut conn, &mut buf).await;
    assert!(buf.is_empty());
    // The panic unwinds through the layer, whose hold posts the rollback and
    // frees the key before the connection is closed: the retry, sent the
    // moment the client sees it closed, is queued behind the rollback and
    // runs (never 409), however late the writer gets to the rollback.
    let retry = f.post(b"k", &[]).await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!((f.items(), f.records(), f.h.runs()), (1, 1, 2));
}

#[tokio::test]
async fn a_failed_commit_answers_503_and_leaves_nothing() {
    let f = Fixture::start(Duration::from_secs(5)).await;
    let r = f.post(b"k", &[("x-fk-violation", b"1")]).await;
    assert_eq!(r.assert_problem(503), types::STORE_UNAVAILABLE);
    assert_eq!((f.items(), f.records(), f.h.runs()), (0, 0, 1));
    // Nothing happened, so the retry runs (the fingerprint ignores headers).
    let retry = f.post(b"k", &[]).await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!((f.items(), f.records()), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_wait_and_replay_without_running() {
    let f = Fixture::start_waiting(Duration::from_secs(10), Duration::from_secs(10)).await;
    let mut entered = f.h.watch();
    const N: usize = 16;
    let barrier = Arc::new(Barrier::new(N));
    let addr = f.addr;
    let clients: Vec<_> = (0..N)
        .map(|_| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                send(
                    addr,
                    "POST",
                    "/items",
                    &[("idempotency-key", b"k"), ("x-gate", b"g")],
                    b"{}",
                )
                .await
            })
        })
        .collect();
    assert_eq!(entered.recv().await.unwrap(), "g");
    f.h.open("g");
    let mut answers = Vec::new();
    for client in clients {
        answers.push(client.await.unwrap());
    }
    assert!(answers.iter().all(|r| r.status == 201), "{answers:?}");
    assert_eq!(answers.iter().filter(|r| !r.replayed()).count(), 1);
    assert_eq!((f.items(), f.records(), f.h.runs()), (1, 1, 1));
}

/// A duplicate is told at once that the first is in flight (409: no
/// `wait_in_flight`), while a request with another key that outwaits the
/// busy timeout is told the store is busy (503), and another body with the
/// key is refused at once (422).
#[tokio::test]
async fn a_duplicate_that_outwaits_the_busy_timeout_gets_409_another_key_503() {
    let f = Fixture::start(Duration::from_millis(100)).await;
    let mut entered = f.h.watch();
    let addr = f.addr;
    let first = tokio::spawn(async move {
        send(
            addr,
            "POST",
            "/items",
            &[("idempotency-key", b"k"), ("x-gate", b"g")],
            b"{}",
        )
        .await
    });
    assert_eq!(entered.recv().await.unwrap(), "g");
    let repeat = f.post(b"k", &[]).await;
    assert_eq!(repeat.assert_problem(409), types::IN_FLIGHT);
    assert_eq!(repeat.header_str("retry-after"), Some("1"));
    let busy = f.post(b"other", &[]).await;
    assert_eq!(busy.assert_problem(503), types::STORE_UNAVAILABLE);
    assert_eq!(busy.header_str("retry-after"), Some("1"));
    // Another body with the key: 422, checked before anything waits (it
    // would otherwise wait out the busy timeout and get 409).
    let mismatch = send(
        addr,
        "POST",
        "/items",
        &[("idempotency-key", b"k")],
        b"{\"x\":1}",
    )
    .await;
    assert_eq!(mismatch.assert_problem(422), types::MISMATCH);
    f.h.open("g");
    assert_eq!(first.await.unwrap().status, 201);
    assert!(f.post(b"k", &[]).await.replayed());
    assert_eq!((f.items(), f.h.runs()), (1, 1));
}

/// One async worker thread: if anything blocked it on SQLite while a
/// transaction is held (and a duplicate waits for its lock), `/ping` would
/// never be answered.
#[tokio::test(flavor = "current_thread")]
async fn async_workers_never_block_on_the_held_transaction() {
    let f = Fixture::start_waiting(Duration::from_secs(10), Duration::from_secs(10)).await;
    let mut entered = f.h.watch();
    let addr = f.addr;
    let holder = tokio::spawn(async move {
        send(
            addr,
            "POST",
            "/items",
            &[("idempotency-key", b"k"), ("x-gate", b"g")],
            b"{}",
        )
        .await
    });
    assert_eq!(entered.recv().await.unwrap(), "g");
    let duplicate = tokio::spawn(async move {
        send(addr, "POST", "/items", &[("idempotency-key", b"k")], b"{}").await
    });
    let other_key = tokio::spawn(async move {
        send(addr, "POST", "/items", &[("idempotency-key", b"k2")], b"{}").await
    });
    let ping = send(f.addr, "GET", "/ping", &[], b"").await;
    assert_eq!((ping.status, &ping.body[..]), (200, &b"pong"[..]));
    f.h.open("g");
    assert_eq!(holder.await.unwrap().status, 201);
    assert!(duplicate.await.unwrap().replayed());
    assert_eq!(other_key.await.unwrap().status, 201);
    assert_eq!((f.items(), f.h.runs()), (2, 2));
}

#[tokio::test]
async fn the_extractor_refuses_a_request_without_a_transaction() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("a.sqlite3"))
        .await
        .unwrap();
    let app =
        Router::new()
            .route("/items", post(|_tx: SqliteTransaction| async { "wrote" }))
            .route(
                "/maybe",
                post(|tx: Option<SqliteTransaction>| async move {
                    if tx.is_some() { "in" } else { "out" }
                }),
            )
            .route_layer(IdempotencyLayer::new(store, GlobalScope).transactional());
    let addr = serve(app).await;
    // No key on a layer that does not require one: the request passes through.
    let r = send(addr, "POST", "/items", &[], b"").await;
    assert_eq!(r.status, 500);
    assert_eq!(
        r.header_str("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(send(addr, "POST", "/maybe", &[], b"").await.body, b"out");
    assert_eq!(
        send(addr, "POST", "/maybe", &[("idempotency-key", b"m")], b"")
            .await
            .body,
        b"in"
    );
}

/// Sends `POST /items` with `key` and `extra` headers from a task of its own.
fn spawn_post(
    f: &Fixture,
    key: &'static [u8],
    extra: &'static [(&'static str, &'static [u8])],
) -> tokio::task::JoinHandle<common::Raw> {
    let addr = f.addr;
    tokio::spawn(async move {
        let mut headers = vec![("idempotency-key", key)];
        headers.extend_from_slice(extra);
        send(addr, "POST", "/items", &headers, b"{}").await
    })
}

/// Group commit: requests that wait for the writer while another request
/// holds it join that request's transaction, and one commit makes all of
/// them durable.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiting_requests_share_one_commit() {
    let f = Fixture::start(Duration::from_secs(10)).await;
    let mut entered = f.h.watch();
    let first = spawn_post(&f, b"a", &[("x-gate", b"a")]);
    assert_eq!(entered.recv().await.unwrap(), "a");
    let others = [b"b" as &[u8], b"c", b"d"].map(|key| spawn_post(&f, key, &[]));
    let store = f.store.clone();
    eventually(Duration::from_secs(10), || {
        store.transactions_waiting() == 3
    })
    .await;
    assert_eq!((f.items(), f.records()), (0, 0), "nothing is committed yet");
    f.h.open("a");
    for client in std::iter::once(first).chain(others) {
        let answer = client.await.unwrap();
        assert_eq!((answer.status, answer.replayed()), (201, false));
    }
    let stats = f.store.group_commit_stats();
    assert_eq!((stats.commits, stats.requests), (1, 4));
    assert_eq!((f.items(), f.records(), f.h.runs()), (4, 4, 4));
}

/// A request's answer waits for the commit of its batch: while a later
/// request of the same batch still runs, the first one's effect is not
/// durable, so its client must not have its answer yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_answer_before_its_batch_is_durable() {
    let f = Fixture::start(Duration::from_secs(10)).await;
    let mut entered = f.h.watch();
    let (addr, path) = (f.addr, f.dir.path().join("app.sqlite3"));
    let first = tokio::spawn(async move {
        let answer = send(
            addr,
            "POST",
            "/items",
            &[("idempotency-key", b"a"), ("x-gate", b"a")],
            b"{}",
        )
        .await;
        // What another connection sees the moment the answer arrives.
        let conn = rusqlite::Connection::open(path).unwrap();
        let seen: i64 = conn
            .query_row("SELECT count(*) FROM items", [], |r| r.get(0))
            .unwrap();
        (answer, seen)
    });
    assert_eq!(entered.recv().await.unwrap(), "a");
    let second = spawn_post(&f, b"b", &[("x-gate", b"b")]);
    let store = f.store.clone();
    eventually(Duration::from_secs(10), || {
        store.transactions_waiting() == 1
    })
    .await;
    f.h.open("a");
    // The second request runs inside the first one's batch...
    assert_eq!(entered.recv().await.unwrap(), "b");
    assert_eq!(
        f.items(),
        0,
        "the first request's effect is not committed yet"
    );
    f.h.open("b");
    let (answer, seen) = first.await.unwrap();
    assert_eq!(answer.status, 201);
    assert_eq!(
        seen, 2,
        "the first answer arrived only after the batch committed"
    );
    assert_eq!(second.await.unwrap().status, 201);
}

/// A batch whose commit fails answers 503 to every request in it, and none
/// of them happened: their retries run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_batch_commit_fails_every_member_and_keeps_nothing() {
    let f = Fixture::start(Duration::from_secs(10)).await;
    let mut entered = f.h.watch();
    let first = spawn_post(&f, b"a", &[("x-gate", b"a")]);
    assert_eq!(entered.recv().await.unwrap(), "a");
    // Its deferred foreign key fails when the batch commits.
    let violating = spawn_post(&f, b"b", &[("x-fk-violation", b"1")]);
    let store = f.store.clone();
    eventually(Duration::from_secs(10), || {
        store.transactions_waiting() == 1
    })
    .await;
    f.h.open("a");
    for client in [first, violating] {
        let answer = client.await.unwrap();
        assert_eq!(answer.assert_problem(503), types::STORE_UNAVAILABLE);
    }
    assert_eq!((f.items(), f.records()), (0, 0));
    let retry = f.post(b"a", &[]).await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!((f.items(), f.records(), f.h.runs()), (1, 1, 3));
}

// ------------------------------------------------------------ bounds

/// A handler that holds the writer past the store's max hold time (200 ms,
/// shorter than the 60 s lease): the writer rolls its savepoint back, the
/// handler's later SQL fails, the request gets 503 with `Retry-After`, and
/// nothing of it stays; the retry runs afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_held_past_its_max_hold_is_rolled_back_and_answered_503() {
    let options = |b: SqliteStoreBuilder| b.busy_timeout(Duration::from_secs(5));
    let mut f = Fixture::build(options, None, Duration::from_millis(200)).await;
    let addr = f.addr;
    let first = tokio::spawn(async move {
        send(
            addr,
            "POST",
            "/held",
            &[("idempotency-key", b"k"), ("x-hold", b"1")],
            b"{}",
        )
        .await
    });
    let tx = f.handed.recv().await.unwrap();
    // The store's rollback signal: the writer ended the transaction (30 s:
    // a guard against a hang, far past the 200 ms it takes).
    tokio::time::timeout(Duration::from_secs(30), tx.closed())
        .await
        .expect("the writer ends a transaction held past its max hold time");
    assert_eq!(f.store.transactions_held_too_long(), 1);
    assert_eq!((f.items(), f.records()), (0, 0));
    f.go_on.notify_one();
    let late = f.late.recv().await.unwrap().unwrap_err();
    assert!(late.contains("max hold time (200 ms)"), "{late}");
    let first = first.await.unwrap();
    assert_eq!(first.assert_problem(503), types::HELD_TOO_LONG);
    assert_eq!(first.header_str("retry-after"), Some("1"));
    assert_eq!((f.items(), f.records(), f.h.runs()), (0, 0, 1));
    // The same request (the fingerprint ignores headers) runs again.
    let retry = send(addr, "POST", "/held", &[("idempotency-key", b"k")], b"{}").await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!((f.items(), f.records(), f.h.runs()), (1, 1, 2));
    assert_eq!(f.store.transactions_held_too_long(), 1);
}

/// A writer queue of one job: one request holds the writer, one waits in
/// the queue, and the next is answered 503 with `Retry-After` at once
/// (its busy timeout is 30 s), without running or writing anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_writer_queue_answers_503_at_once_and_writes_nothing() {
    let f = Fixture::start_with(|b| b.busy_timeout(Duration::from_secs(30)).writer_queue(1)).await;
    let mut entered = f.h.watch();
    let first = spawn_post(&f, b"a", &[("x-gate", b"a")]);
    assert_eq!(entered.recv().await.unwrap(), "a");
    let queued = spawn_post(&f, b"b", &[]);
    let store = f.store.clone();
    eventually(Duration::from_secs(10), || {
        store.transactions_waiting() == 1
    })
    .await;
    let refused = f.post(b"c", &[]).await;
    assert_eq!(refused.assert_problem(503), types::STORE_UNAVAILABLE);
    assert_eq!(refused.header_str("retry-after"), Some("1"));
    assert_eq!(f.h.runs(), 1, "only the holder has run");
    f.h.open("a");
    for client in [first, queued] {
        let answer = client.await.unwrap();
        assert_eq!((answer.status, answer.replayed()), (201, false));
    }
    assert_eq!((f.items(), f.records(), f.h.runs()), (2, 2, 2));
    assert_eq!(
        f.count("SELECT count(*) FROM idempotency_records WHERE key = 'c'"),
        0
    );
    let retry = f.post(b"c", &[]).await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!((f.items(), f.records(), f.h.runs()), (3, 3, 3));
}
