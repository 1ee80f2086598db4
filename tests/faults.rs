//! A sick store fails closed and recovers. Each fault is injected while the
//! layer serves real HTTP, with a handler that counts its runs:
//!
//! * every request the sick store cannot decide is answered with the 503
//!   `store-unavailable` problem and `Retry-After: 1`, and runs nothing;
//! * nothing is ever replayed while the store is sick;
//! * once the fault is gone, the SAME key runs exactly once and its repeat
//!   is replayed byte for byte, without restarting the app.
//!
//! SQLite faults need nothing else. The PostgreSQL and Redis faults run
//! behind the `postgres` and `redis` features, on the shared servers
//! (`TOWER_IDEMPOTENCY_POSTGRES_URL`, `TOWER_IDEMPOTENCY_REDIS_URL`) and, for
//! restarts, on private servers the tests start and stop themselves
//! (`initdb`/`pg_ctl` under `/usr/lib/postgresql/*/bin`, run as the
//! `postgres` user; `redis-server` on the `PATH`). A missing service fails.

mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, request::Parts};
use axum::response::Response;
use axum::routing::post;
use common::charge::{answer, assert_ran, assert_replay_of, assert_unavailable, request};
use common::{Harness, Raw, serve};
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::problem::types;
use tower_idempotency::store::{SqliteStore, SqliteTransaction};
use tower_idempotency::test_util::ManualClock;

/// The scope of every request: the `x-user` header.
fn user(parts: &Parts) -> String {
    parts
        .headers
        .get("x-user")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("anonymous")
        .to_owned()
}

/// Counts the run, waits at its gate if asked, answers.
async fn charge(State(h): State<Harness>, headers: HeaderMap) -> Response {
    let n = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
    h.wait_at_gate(&headers).await;
    answer(n, &headers)
}

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

/// The 409 `in-flight` problem, with `Retry-After` in seconds.
#[track_caller]
fn assert_in_flight(r: &Raw, retry_after: &str) {
    assert_eq!(r.assert_problem(409), types::IN_FLIGHT, "{r:?}");
    assert_eq!(r.header_str("retry-after"), Some(retry_after), "{r:?}");
    assert_eq!(r.header("idempotent-replayed"), None, "{r:?}");
}

// ------------------------------------------------------------------ SQLite

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

    // The whole default lease (60 s) is left: the clock has not moved.
    assert_in_flight(&request(addr, "k", &[]).await, "60");
    db.clock.advance(Duration::from_secs(59));
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
    assert_in_flight(&request(addr, "k", LARGE).await, "60");

    let addr = db.app(Mode::Separate, None).await;
    assert_in_flight(&request(addr, "k", LARGE).await, "60");
    assert_eq!(db.h.runs(), 1);
    db.clock.advance(Duration::from_secs(60));
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

// -------------------------------------------------------------- networked

/// A free TCP port on 127.0.0.1 (bound, read and let go).
#[cfg(any(feature = "postgres", feature = "redis"))]
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs `program` to its end and fails the test, with its output, unless it
/// succeeded. (Only the PostgreSQL tests start programs.)
#[cfg(feature = "postgres")]
fn run(program: &str, args: &[&str]) {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program} is required: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Serves `/charge` (the counting handler) behind a separate-mode layer.
#[cfg(any(feature = "postgres", feature = "redis"))]
async fn serve_separate<St: tower_idempotency::Store>(store: St, h: &Harness) -> SocketAddr {
    let app = Router::new()
        .route("/charge", post(charge))
        .route_layer(IdempotencyLayer::new(store, |p: &Parts| user(p)));
    serve(app.with_state(h.clone())).await
}

#[cfg(feature = "postgres")]
mod pg {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicI32;
    use tower_idempotency::store::FencingToken;
    use tower_idempotency_postgres::PostgresStore;
    use tower_idempotency_postgres::PostgresTransaction;

    fn url() -> String {
        crate::common::services::postgres_url()
    }

    /// A store on a table of its own, with an items table beside it.
    async fn store(url: &str) -> (PostgresStore, String) {
        let table = format!("idem_faults_{:016x}", FencingToken::random().0);
        let store = PostgresStore::builder(url)
            .table(table.clone())
            .open()
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {url} is required: {e}"));
        store
            .pool()
            .get()
            .await
            .unwrap()
            .batch_execute(&format!(
                "CREATE TABLE {table}_items (id BIGSERIAL PRIMARY KEY, note TEXT)"
            ))
            .await
            .unwrap();
        (store, table)
    }

    async fn query_i64(store: &PostgresStore, sql: &str) -> i64 {
        let client = store.pool().get().await.unwrap();
        client.query_one(sql, &[]).await.unwrap().get(0)
    }

    async fn drop_tables(store: &PostgresStore, table: &str) {
        let client = store.pool().get().await.unwrap();
        client
            .batch_execute(&format!("DROP TABLE {table}; DROP TABLE {table}_items"))
            .await
            .unwrap();
    }

    /// Terminates one backend from a connection of the test's own.
    async fn terminate(pid: i32) {
        let (admin, connection) = tokio_postgres::connect(&url(), tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        let row = admin
            .query_one(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid = $1",
                &[&pid],
            )
            .await
            .unwrap();
        assert!(row.get::<_, bool>(0), "backend {pid} not terminated");
    }

    /// A completed record whose response is garbage: 503, no replay, no
    /// second run; a garbage fingerprint: 422. Repaired, it replays.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_corrupt_record() {
        let (store, table) = store(&url()).await;
        let h = Harness::default();
        let addr = serve_separate(store.clone(), &h).await;
        let first = request(addr, "k", &[]).await;
        assert_ran(&first, 1);
        let client = store.pool().get().await.unwrap();
        for (column, garbage, status, problem) in [
            (
                "response",
                &b"\x00garbage"[..],
                503,
                types::STORE_UNAVAILABLE,
            ),
            ("fingerprint", &b"\x01"[..], 422, types::MISMATCH),
        ] {
            let good: Vec<u8> = client
                .query_one(
                    &format!("SELECT {column} FROM {table} WHERE key = 'k'"),
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            let set = format!("UPDATE {table} SET {column} = $1 WHERE key = 'k'");
            assert_eq!(client.execute(&set, &[&garbage]).await.unwrap(), 1);
            for _ in 0..2 {
                let r = request(addr, "k", &[]).await;
                assert_eq!(r.assert_problem(status), problem, "{column}: {r:?}");
                assert_eq!(r.header("idempotent-replayed"), None);
            }
            assert_eq!(client.execute(&set, &[&good]).await.unwrap(), 1);
            assert_replay_of(&request(addr, "k", &[]).await, &first);
        }
        assert_eq!(h.runs(), 1);
        drop(client);
        drop_tables(&store, &table).await;
    }

    /// Separate mode: while the handler is held, the server terminates the
    /// pooled connection the completion would use. The pool notices it
    /// closed and opens a new one: the answer is stored and replayed, the
    /// handler ran once, and the next keys work.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_connection_killed_separate() {
        let (store, table) = store(&url()).await;
        let h = Harness::default();
        let addr = serve_separate(store.clone(), &h).await;
        let mut entered = h.watch();
        let held = tokio::spawn(async move { request(addr, "k", &[("x-gate", b"g")]).await });
        assert_eq!(entered.recv().await.as_deref(), Some("g"));
        // The claim's connection is the pool's only one, idle again.
        assert_eq!(store.pool().status().size, 1);
        let pooled = store.pool().get().await.unwrap();
        let pid: i32 = pooled
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        terminate(pid).await;
        common::eventually(Duration::from_secs(5), || pooled.is_closed()).await;
        drop(pooled);
        h.open("g");
        let first = held.await.unwrap();
        assert_ran(&first, 1);
        assert_replay_of(&request(addr, "k", &[]).await, &first);
        assert_ran(&request(addr, "next", &[]).await, 2);
        assert_eq!(h.runs(), 2);
        drop_tables(&store, &table).await;
    }

    #[derive(Clone)]
    struct TxState {
        h: Harness,
        items: String,
        pid: Arc<AtomicI32>,
    }

    /// Writes an item in the request's transaction and notes its backend,
    /// then as [`charge`].
    async fn charge_pg(
        State(s): State<TxState>,
        tx: PostgresTransaction,
        headers: HeaderMap,
    ) -> Response {
        let client = tx.client().await.unwrap();
        let pid: i32 = client
            .query_one(
                &format!(
                    "INSERT INTO {} (note) VALUES ('charged') RETURNING pg_backend_pid()",
                    s.items
                ),
                &[],
            )
            .await
            .unwrap()
            .get(0);
        drop(client);
        s.pid.store(pid, Ordering::SeqCst);
        charge(State(s.h), headers).await
    }

    /// Transactional mode: while the handler is held, the server terminates
    /// the transaction's connection. The commit fails: 503, the item was
    /// rolled back with it and the key given back, so the retry runs once
    /// and commits; its repeat replays. The pool works on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_connection_killed_transactional() {
        let (store, table) = store(&url()).await;
        let state = TxState {
            h: Harness::default(),
            items: format!("{table}_items"),
            pid: Arc::new(AtomicI32::new(0)),
        };
        let app = Router::new()
            .route("/charge", post(charge_pg))
            .route_layer(IdempotencyLayer::new(store.clone(), |p: &Parts| user(p)).transactional())
            .with_state(state.clone());
        let addr = serve(app).await;
        let h = state.h.clone();
        let mut entered = h.watch();
        let held = tokio::spawn(async move { request(addr, "k", &[("x-gate", b"g")]).await });
        assert_eq!(entered.recv().await.as_deref(), Some("g"));
        terminate(state.pid.load(Ordering::SeqCst)).await;
        h.open("g");
        assert_unavailable(&held.await.unwrap());
        assert_eq!(h.runs(), 1);
        let items = format!("SELECT count(*) FROM {table}_items");
        assert_eq!(query_i64(&store, &items).await, 0);

        let first = request(addr, "k", &[]).await;
        assert_ran(&first, 2);
        assert_replay_of(&request(addr, "k", &[]).await, &first);
        assert_ran(&request(addr, "next", &[]).await, 3);
        assert_eq!(h.runs(), 3);
        assert_eq!(query_i64(&store, &items).await, 2);
        drop_tables(&store, &table).await;
    }

    /// A PostgreSQL cluster of the test's own in a temporary directory, run
    /// as the `postgres` user (initdb refuses root), on a free port.
    struct PrivatePostgres {
        dir: tempfile::TempDir,
        port: u16,
        bin: PathBuf,
    }

    impl PrivatePostgres {
        fn init() -> PrivatePostgres {
            let bin = std::fs::read_dir("/usr/lib/postgresql")
                .expect("PostgreSQL server binaries under /usr/lib/postgresql are required")
                .map(|e| e.unwrap().path().join("bin"))
                .find(|bin| bin.join("initdb").exists())
                .expect("initdb under /usr/lib/postgresql/*/bin is required");
            let dir = tempfile::tempdir().unwrap();
            run("chown", &["postgres:", dir.path().to_str().unwrap()]);
            let pg = PrivatePostgres {
                dir,
                port: free_port(),
                bin,
            };
            pg.as_postgres(
                "initdb",
                &[
                    "-D",
                    &pg.data(),
                    "-U",
                    "postgres",
                    "-A",
                    "trust",
                    "--no-sync",
                ],
            );
            pg
        }

        fn data(&self) -> String {
            self.dir.path().join("data").to_str().unwrap().to_owned()
        }

        fn as_postgres(&self, tool: &str, args: &[&str]) {
            let tool = self.bin.join(tool);
            let mut all = vec!["-u", "postgres", "--", tool.to_str().unwrap()];
            all.extend_from_slice(args);
            run("runuser", &all);
        }

        fn start(&self) {
            let options = format!(
                "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} -c fsync=off",
                self.port,
                self.dir.path().display()
            );
            let log = self.dir.path().join("log");
            self.as_postgres(
                "pg_ctl",
                &[
                    "-D",
                    &self.data(),
                    "-o",
                    &options,
                    "-l",
                    log.to_str().unwrap(),
                    "-w",
                    "start",
                ],
            );
        }

        /// `-m immediate`: the server dies without a clean shutdown, as in
        /// a crash; its WAL brings back every commit on the next start.
        fn stop(&self) {
            self.as_postgres(
                "pg_ctl",
                &["-D", &self.data(), "-m", "immediate", "-w", "stop"],
            );
        }

        fn url(&self) -> String {
            format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
        }
    }

    impl Drop for PrivatePostgres {
        fn drop(&mut self) {
            let _ = std::process::Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(self.bin.join("pg_ctl"))
                .args(["-D", &self.data(), "-m", "immediate", "stop"])
                .output();
        }
    }

    /// The server goes down: every request gets 503 and runs nothing, also
    /// the repeat of a completed key (the store cannot confirm it). Back up,
    /// the same app (the same pool) serves again: the pending key runs once,
    /// the completed key replays (PostgreSQL kept it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_server_restarted() {
        let pg = PrivatePostgres::init();
        pg.start();
        let (store, _) = store(&pg.url()).await;
        let h = Harness::default();
        let addr = serve_separate(store, &h).await;
        let done = request(addr, "done", &[]).await;
        assert_ran(&done, 1);

        pg.stop();
        for key in ["done", "k", "k"] {
            assert_unavailable(&request(addr, key, &[]).await);
        }
        assert_eq!(h.runs(), 1);

        pg.start();
        let first = request(addr, "k", &[]).await;
        assert_ran(&first, 2);
        assert_replay_of(&request(addr, "k", &[]).await, &first);
        assert_replay_of(&request(addr, "done", &[]).await, &done);
        assert_eq!(h.runs(), 2);
    }
}

#[cfg(feature = "redis")]
mod redis_faults {
    use super::*;
    use tower_idempotency::store::{FencingToken, Store};
    use tower_idempotency_redis::RedisStore;

    fn url() -> String {
        crate::common::services::redis_url()
    }

    fn prefix(what: &str) -> String {
        format!(
            "tower-idempotency-faults:{what}:{:016x}:",
            FencingToken::random().0
        )
    }

    /// A completed record whose `response` field is garbage: 503, no replay,
    /// no second run; a garbage `fingerprint` field: 422. Repaired, it
    /// replays.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_corrupt_record() {
        let prefix = prefix("corrupt");
        let store = RedisStore::builder(url())
            .prefix(prefix.clone())
            .open()
            .await
            .unwrap_or_else(|e| panic!("Redis at {} is required: {e}", url()));
        let h = Harness::default();
        let addr = serve_separate(store, &h).await;
        let first = request(addr, "k", &[]).await;
        assert_ran(&first, 1);
        let client = ::redis::Client::open(url()).unwrap();
        let mut raw = client.get_multiplexed_async_connection().await.unwrap();
        // `{prefix}{{scope length}:{scope}:{key}}`, see RedisStore's docs.
        let record = format!("{prefix}{{5:alice:k}}");
        for (field, garbage, status, problem) in [
            (
                "response",
                &b"\x00garbage"[..],
                503,
                types::STORE_UNAVAILABLE,
            ),
            ("fingerprint", &b"\x01"[..], 422, types::MISMATCH),
        ] {
            let good: Vec<u8> = ::redis::cmd("HGET")
                .arg(&record)
                .arg(field)
                .query_async(&mut raw)
                .await
                .unwrap();
            let set = |value: Vec<u8>| {
                let mut raw = raw.clone();
                let record = record.clone();
                async move {
                    let added: i64 = ::redis::cmd("HSET")
                        .arg(&record)
                        .arg(field)
                        .arg(value)
                        .query_async(&mut raw)
                        .await
                        .unwrap();
                    assert_eq!(added, 0, "the field existed");
                }
            };
            set(garbage.to_vec()).await;
            for _ in 0..2 {
                let r = request(addr, "k", &[]).await;
                assert_eq!(r.assert_problem(status), problem, "{field}: {r:?}");
                assert_eq!(r.header("idempotent-replayed"), None);
            }
            set(good).await;
            assert_replay_of(&request(addr, "k", &[]).await, &first);
        }
        assert_eq!(h.runs(), 1);
        let _: i64 = ::redis::cmd("DEL")
            .arg(&record)
            .query_async(&mut raw)
            .await
            .unwrap();
    }

    /// A Redis server of the test's own, without persistence, on a free port.
    struct PrivateRedis {
        port: u16,
        child: Option<std::process::Child>,
    }

    impl PrivateRedis {
        fn new() -> PrivateRedis {
            PrivateRedis {
                port: free_port(),
                child: None,
            }
        }

        fn url(&self) -> String {
            format!("redis://127.0.0.1:{}", self.port)
        }

        /// Starts the server and waits until it answers `PING`.
        async fn start(&mut self) {
            let port = self.port.to_string();
            let child = std::process::Command::new("redis-server")
                .args(["--port", &port, "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
                .stdout(std::process::Stdio::null())
                .spawn()
                .expect("redis-server is required");
            self.child = Some(child);
            let client = ::redis::Client::open(self.url()).unwrap();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            loop {
                if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
                    let pong: Result<String, _> = ::redis::cmd("PING").query_async(&mut conn).await;
                    if pong.is_ok() {
                        return;
                    }
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "redis-server did not start"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }

        /// SIGKILL: every record, kept in memory only, is gone.
        fn kill(&mut self) {
            if let Some(mut child) = self.child.take() {
                child.kill().unwrap();
                child.wait().unwrap();
            }
        }
    }

    impl Drop for PrivateRedis {
        fn drop(&mut self) {
            self.kill();
        }
    }

    /// The server goes down: 503 on every request, also the repeat of a
    /// completed key; nothing runs. Back up, the same store (its
    /// ConnectionManager) reconnects: the pending key runs once and replays.
    /// A server without persistence lost its records: the completed key is
    /// new to it and runs a second time, as RedisStore's "Durability" docs
    /// say.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_server_restarted() {
        let mut redis = PrivateRedis::new();
        redis.start().await;
        let store = RedisStore::builder(redis.url())
            .prefix(prefix("restart"))
            .open()
            .await
            .unwrap();
        let h = Harness::default();
        let addr = serve_separate(store.clone(), &h).await;
        let done = request(addr, "done", &[]).await;
        assert_ran(&done, 1);

        redis.kill();
        for key in ["done", "k", "k"] {
            assert_unavailable(&request(addr, key, &[]).await);
        }
        assert_eq!(h.runs(), 1);

        redis.start().await;
        // The ConnectionManager reconnects on the call after a failed one:
        // the first store call may still see the old connection's error.
        let mut failed = 0;
        while let Err(e) = store.purge_expired().await {
            failed += 1;
            assert!(failed < 3, "no reconnection: {e}");
        }
        let first = request(addr, "k", &[]).await;
        assert_ran(&first, 2);
        assert_replay_of(&request(addr, "k", &[]).await, &first);
        // The completed record was lost with the server's memory.
        let again = request(addr, "done", &[]).await;
        assert_ran(&again, 3);
        assert_replay_of(&request(addr, "done", &[]).await, &again);
        assert_eq!(h.runs(), 3);
    }
}
