//! `SqliteStore` (rusqlite) fails closed and recovers. Each fault (a file
//! locked past the busy timeout, read-only, full; a corrupt record) is
//! injected while the layer serves real HTTP, with a handler that counts its
//! runs:
//!
//! * every request the sick store cannot decide is answered with the 503
//!   `store-unavailable` problem and `Retry-After: 1`, and runs nothing;
//! * nothing is ever replayed while the store is sick;
//! * once the fault is gone, the SAME key runs exactly once and its repeat
//!   is replayed byte for byte, without restarting the app.
//!
//! Needs nothing but the file system (`chattr` for the read-only file).
//! The other stores' faults: `postgres_faults.rs`, `redis_faults.rs`,
//! `sqlx_postgres_faults.rs`, `sqlx_sqlite_faults.rs`, `mysql_faults.rs`.

use crate::common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, request::Parts};
use axum::response::Response;
use axum::routing::post;
use common::charge::{
    assert_in_flight, assert_ran, assert_replay_of, assert_unavailable, charge, request, user,
};
use common::{Harness, Raw, serve};
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::problem::types;
use tower_idempotency::store::{SqliteStore, SqliteTransaction};
use tower_idempotency::test_util::ManualClock;

/// Writes its effect through the request's transaction first, then as [`charge`].
async fn charge_in_transaction(
    State(h): State<Harness>,
    tx: SqliteTransaction,
    headers: HeaderMap,
) -> Response {
    tx.run(|t| t.execute("INSERT INTO effects (note) VALUES ('charged')", []))
        .await
        .unwrap();
    charge(State(h), headers).await
}

/// The clock every SQLite store of these tests reads (Unix ms).
const START_MS: i64 = 1_700_000_000_000;
/// A lock held longer than this fails the store call.
const BUSY: Duration = Duration::from_millis(100);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Separate,
    Transactional,
}

/// One SQLite file, its clock, and the handler's run count, shared by every
/// app (and store) the test starts on that file.
struct Sqlite {
    _dir: tempfile::TempDir,
    path: PathBuf,
    clock: ManualClock,
    h: Harness,
}

impl Sqlite {
    fn new() -> Sqlite {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("app.sqlite3");
        Sqlite {
            _dir: dir,
            path,
            clock: ManualClock::new(START_MS),
            h: Harness::default(),
        }
    }

    /// Serves `/charge` behind a layer over a new store on the file; with
    /// `max_pages`, every pooled connection caps the file at that many pages.
    async fn app(&self, mode: Mode, max_pages: Option<i64>) -> SocketAddr {
        let mut builder = SqliteStore::builder(&self.path)
            .busy_timeout(BUSY)
            .clock(self.clock.clone());
        if let Some(pages) = max_pages {
            builder = builder.on_connect(move |c| {
                c.pragma_update(None, "max_page_count", pages)?;
                Ok(())
            });
        }
        let store = builder.open().await.unwrap();
        self.raw()
            .execute_batch(
                "CREATE TABLE IF NOT EXISTS effects (id INTEGER PRIMARY KEY, note TEXT NOT NULL)",
            )
            .unwrap();
        // Retry-After shows the remaining lease: the clock state under test.
        let layer =
            IdempotencyLayer::new(store, |p: &Parts| user(p)).in_flight_retry_after(Duration::MAX);
        let app = match mode {
            Mode::Separate => Router::new()
                .route("/charge", post(charge))
                .route_layer(layer),
            Mode::Transactional => Router::new()
                .route("/charge", post(charge_in_transaction))
                .route_layer(layer.transactional()),
        };
        serve(app.with_state(self.h.clone())).await
    }

    /// A connection of the test's own (busy timeout 0).
    fn raw(&self) -> rusqlite::Connection {
        rusqlite::Connection::open(&self.path).unwrap()
    }

    fn count(&self, sql: &str) -> i64 {
        self.raw().query_row(sql, [], |r| r.get(0)).unwrap()
    }

    fn effects(&self) -> i64 {
        self.count("SELECT count(*) FROM effects")
    }

    fn state(&self, key: &str) -> String {
        self.raw()
            .query_row(
                "SELECT state FROM idempotency_records WHERE scope = 'alice' AND key = ?1",
                [key],
                |r| r.get(0),
            )
            .unwrap()
    }
}

/// Another connection holds SQLite's write lock past the store's busy
/// timeout: every claim fails with 503 and runs nothing; once the lock is
/// released the same key runs once and replays.
async fn lock_past_busy_timeout(mode: Mode) {
    let db = Sqlite::new();
    let addr = db.app(mode, None).await;
    let blocker = db.raw();
    blocker.execute_batch("BEGIN EXCLUSIVE").unwrap();
    for _ in 0..3 {
        assert_unavailable(&request(addr, "k", &[]).await);
    }
    assert_eq!(db.h.runs(), 0);
    // WAL readers are not blocked: the key was never claimed.
    assert_eq!(db.count("SELECT count(*) FROM idempotency_records"), 0);
    blocker.execute_batch("ROLLBACK").unwrap();

    let first = request(addr, "k", &[]).await;
    assert_ran(&first, 1);
    let again = request(addr, "k", &[]).await;
    assert_replay_of(&again, &first);
    assert_eq!(db.h.runs(), 1);
    let effects = if mode == Mode::Transactional { 1 } else { 0 };
    assert_eq!(db.effects(), effects);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_locked_separate() {
    lock_past_busy_timeout(Mode::Separate).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_locked_transactional() {
    lock_past_busy_timeout(Mode::Transactional).await;
}

/// The lock appears while the handler runs (separate mode): the claim
/// committed, the completion fails. The caller still gets the handler's
/// answer; the record stays in flight (docs/contract.md §3: never deleted, the effect
/// happened), so a retry gets 409 until the lease ends, then runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_lock_between_claim_and_completion() {
    let db = Sqlite::new();
    let addr = db.app(Mode::Separate, None).await;
    let mut entered = db.h.watch();
    let held = tokio::spawn(async move { request(addr, "k", &[("x-gate", b"g")]).await });
    assert_eq!(entered.recv().await.as_deref(), Some("g"));
    let blocker = db.raw();
    blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
    db.h.open("g");
    let first = held.await.unwrap();
    assert_ran(&first, 1);
    blocker.execute_batch("ROLLBACK").unwrap();
    assert_eq!(db.state("k"), "in_flight");

    // The whole default lease (10 s) is left: the clock has not moved.
    assert_in_flight(&request(addr, "k", &[]).await, "10");
    db.clock.advance(Duration::from_secs(9));
    assert_in_flight(&request(addr, "k", &[]).await, "1");
    assert_eq!(db.h.runs(), 1);
    // The lease is over: the retry takes the key over and runs (separate
    // mode's documented second execution), then replays.
    db.clock.advance(Duration::from_secs(1));
    let second = request(addr, "k", &[]).await;
    assert_ran(&second, 2);
    assert_replay_of(&request(addr, "k", &[]).await, &second);
    assert_eq!(db.h.runs(), 2);
}

/// Makes files immutable (`chattr +i`) for as long as it lives: not even
/// root can write them, through new or already open descriptors.
struct Immutable(Vec<PathBuf>);

impl Immutable {
    fn new(paths: &[PathBuf]) -> Immutable {
        for path in paths {
            assert!(path.exists(), "{path:?}");
        }
        chattr("+i", paths);
        Immutable(paths.to_vec())
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        chattr("-i", &self.0);
    }
}

fn chattr(flag: &str, paths: &[PathBuf]) {
    let status = std::process::Command::new("chattr")
        .arg(flag)
        .args(paths)
        .status()
        .expect("chattr (e2fsprogs) is required");
    assert!(
        status.success(),
        "chattr {flag} failed: a filesystem with the immutable attribute and CAP_LINUX_IMMUTABLE are required"
    );
}

fn wal(path: &Path) -> PathBuf {
    let mut wal = path.as_os_str().to_owned();
    wal.push("-wal");
    PathBuf::from(wal)
}

/// `n` requests at once, keys `{prefix}-0..n`; their answers in key order.
async fn concurrently(addr: SocketAddr, prefix: &str, n: usize) -> Vec<Raw> {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let key = format!("{prefix}-{i}");
            tokio::spawn(async move { request(addr, &key, &[]).await })
        })
        .collect();
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.unwrap());
    }
    answers
}

/// The database file and its WAL cannot be written, even by root (`chattr
/// +i`). While the file is frozen, and also locked by another connection so
/// that concurrent requests make the pool open new connections: 503, nothing
/// runs. Frozen but unlocked, separate mode's claim fails at its commit (503,
/// nothing runs); transactional mode's claim and the handler's writes live in
/// the open transaction until its commit, which fails: the handler ran, its
/// effect was rolled back, 503. Writable again: the same key runs once and
/// replays, and so do concurrent requests that use every pooled connection
/// (none opened during the fault stays read-only).
async fn read_only_file(mode: Mode) {
    let db = Sqlite::new();
    let addr = db.app(mode, None).await;
    // A first request fills the WAL and the pool.
    assert_ran(&request(addr, "before", &[]).await, 1);
    let blocker = db.raw();
    // SQLite opens the file on first use: before it is frozen.
    blocker
        .query_row("SELECT count(*) FROM effects", [], |_| Ok(()))
        .unwrap();
    let ran_in_fault = {
        let _frozen = Immutable::new(&[db.path.clone(), wal(&db.path)]);
        blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
        for answer in concurrently(addr, "locked", 6).await {
            assert_unavailable(&answer);
        }
        blocker.execute_batch("ROLLBACK").unwrap();
        assert_eq!(db.h.runs(), 1);
        assert_unavailable(&request(addr, "k", &[]).await);
        db.h.runs() - 1
    };
    let expected = if mode == Mode::Transactional { 1 } else { 0 };
    assert_eq!(ran_in_fault, expected);
    assert_eq!(db.effects(), expected as i64);

    let first = request(addr, "k", &[]).await;
    assert_ran(&first, 2 + ran_in_fault);
    assert_replay_of(&request(addr, "k", &[]).await, &first);
    for answer in concurrently(addr, "after", 8).await {
        assert_eq!(answer.status, 201, "{answer:?}");
        assert!(!answer.replayed());
    }
    assert_eq!(db.h.runs(), 10 + ran_in_fault);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_read_only_file_separate() {
    read_only_file(Mode::Separate).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_read_only_file_transactional() {
    read_only_file(Mode::Transactional).await;
}

/// The file's current size in pages.
fn page_count(db: &Sqlite) -> i64 {
    db.raw()
        .pragma_query_value(None, "page_count", |r| r.get(0))
        .unwrap()
}

/// Fills the records table, under the cap of `max_pages`, with in-flight
/// records of other keys of alice that sort before every key these tests
/// use, each no larger than a real claim's, until SQLite answers
/// `SQLITE_FULL`: the last page of both the table and its index is then too
/// full for another record, and a claim of a later key needs a page the cap
/// refuses.
fn fill(db: &Sqlite, max_pages: i64) {
    let conn = db.raw();
    conn.pragma_update(None, "max_page_count", max_pages)
        .unwrap();
    for i in 0.. {
        let inserted = conn.execute(
            "INSERT INTO idempotency_records
                 (scope, key, fingerprint, token, state, lease_until, expires_at)
             VALUES ('alice', ?1, zeroblob(32), 1, 'in_flight', 0, 1)",
            [format!("a{i:07}")],
        );
        match inserted {
            Ok(1) => {}
            Err(rusqlite::Error::SqliteFailure(e, _))
                if e.code == rusqlite::ErrorCode::DiskFull =>
            {
                return;
            }
            other => panic!("filling the file: {other:?}"),
        }
    }
}

/// The file is full (`PRAGMA max_page_count` on every pooled connection,
/// through `on_connect`): a claim needs a page it cannot have, so 503 and
/// nothing runs. The cap raised (a new store on the same file), the same key
/// runs once and replays.
async fn disk_full_at_claim(mode: Mode) {
    let db = Sqlite::new();
    db.app(mode, None).await;
    let cap = page_count(&db) + 4;
    fill(&db, cap);
    assert_eq!(page_count(&db), cap);
    let addr = db.app(mode, Some(cap)).await;
    for _ in 0..3 {
        assert_unavailable(&request(addr, "k", &[]).await);
    }
    assert_eq!(db.h.runs(), 0);
    assert_eq!(db.effects(), 0);

    let addr = db.app(mode, None).await;
    let first = request(addr, "k", &[]).await;
    assert_ran(&first, 1);
    assert_replay_of(&request(addr, "k", &[]).await, &first);
    assert_eq!(db.h.runs(), 1);
    let effects = if mode == Mode::Transactional { 1 } else { 0 };
    assert_eq!(db.effects(), effects);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_disk_full_at_claim_separate() {
    disk_full_at_claim(Mode::Separate).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_disk_full_at_claim_transactional() {
    disk_full_at_claim(Mode::Transactional).await;
}

/// A 64 KiB response body (kept: the layer's limit is 1 MiB).
const LARGE: &[(&str, &[u8])] = &[("x-size", b"65536")];

/// The file is capped at its current size: a claim fits in a page that
/// exists, the 64 KiB response does not (separate mode). The caller gets the
/// handler's whole answer; the record stays in flight, so a retry gets 409
/// until the lease ends, also after the cap is raised, then runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_disk_full_at_completion_separate() {
    let db = Sqlite::new();
    db.app(Mode::Separate, None).await;
    let addr = db.app(Mode::Separate, Some(page_count(&db))).await;
    let first = request(addr, "k", LARGE).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(first.header("idempotent-replayed"), None);
    assert_eq!(first.body, vec![b'x'; 65536]);
    assert_eq!(db.state("k"), "in_flight");
    assert_in_flight(&request(addr, "k", LARGE).await, "10");

    let addr = db.app(Mode::Separate, None).await;
    assert_in_flight(&request(addr, "k", LARGE).await, "10");
    assert_eq!(db.h.runs(), 1);
    db.clock.advance(Duration::from_secs(10));
    let second = request(addr, "k", LARGE).await;
    assert_eq!((second.status, second.replayed()), (201, false));
    assert_eq!(second.header_str("x-charge"), Some("2"));
    assert_replay_of(&request(addr, "k", LARGE).await, &second);
    assert_eq!(db.h.runs(), 2);
}

/// Transactional mode, the same cap: the claim and the handler's write fit,
/// the commit with the 64 KiB response does not. Nothing happened, so the
/// caller gets 503 and the key is free at once (its claim was in the
/// rolled-back transaction): every retry runs the handler and is rolled back
/// until the cap is raised; then it commits once and replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_disk_full_at_commit_transactional() {
    let db = Sqlite::new();
    db.app(Mode::Transactional, None).await;
    let addr = db.app(Mode::Transactional, Some(page_count(&db))).await;
    for runs in 1..=2 {
        assert_unavailable(&request(addr, "k", LARGE).await);
        assert_eq!(db.h.runs(), runs);
        assert_eq!(db.effects(), 0);
        assert_eq!(db.count("SELECT count(*) FROM idempotency_records"), 0);
    }
    let addr = db.app(Mode::Transactional, None).await;
    let first = request(addr, "k", LARGE).await;
    assert_eq!((first.status, first.replayed()), (201, false));
    assert_eq!(first.header_str("x-charge"), Some("3"));
    assert_eq!(first.body, vec![b'x'; 65536]);
    assert_replay_of(&request(addr, "k", LARGE).await, &first);
    assert_eq!(db.h.runs(), 3);
    assert_eq!(db.effects(), 1);
}

/// A completed record whose response blob is garbage: the repeat is neither
/// replayed nor run again (the effect happened), it gets 503. A record whose
/// fingerprint is garbage no longer matches any request: 422. Each repaired,
/// the key replays the first answer byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_corrupt_record() {
    let db = Sqlite::new();
    let addr = db.app(Mode::Separate, None).await;
    let first = request(addr, "k", &[]).await;
    assert_ran(&first, 1);
    let column = |name: &str| -> Vec<u8> {
        db.raw()
            .query_row(
                &format!("SELECT {name} FROM idempotency_records WHERE key = 'k'"),
                [],
                |r| r.get(0),
            )
            .unwrap()
    };
    let set = |name: &str, value: &[u8]| {
        let updated = db
            .raw()
            .execute(
                &format!("UPDATE idempotency_records SET {name} = ?1 WHERE key = 'k'"),
                [value],
            )
            .unwrap();
        assert_eq!(updated, 1);
    };
    for (name, garbage, status, problem) in [
        (
            "response",
            &b"\x00garbage"[..],
            503,
            types::STORE_UNAVAILABLE,
        ),
        ("fingerprint", &b"\x01"[..], 422, types::MISMATCH),
    ] {
        let good = column(name);
        set(name, garbage);
        for _ in 0..2 {
            let r = request(addr, "k", &[]).await;
            assert_eq!(r.assert_problem(status), problem, "{name}: {r:?}");
            assert_eq!(r.header("idempotent-replayed"), None);
        }
        assert_eq!(db.h.runs(), 1);
        set(name, &good);
        assert_replay_of(&request(addr, "k", &[]).await, &first);
    }
    assert_eq!(db.h.runs(), 1);
}
