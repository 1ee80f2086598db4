//! A sick SQLite database under `SqlxSqliteStore` fails closed and recovers,
//! as `integration/tests/stores/sqlite_faults.rs` shows for the rusqlite store: while the layer serves
//! real HTTP and a handler counts its runs,
//!
//! * every request the store cannot decide gets the 503 `store-unavailable`
//!   problem with `Retry-After: 1`, and runs nothing;
//! * nothing is replayed while the database is sick;
//! * once the fault is gone, the SAME key runs exactly once and its repeat
//!   is replayed byte for byte, without restarting the app.

use crate::common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, request::Parts};
use axum::response::Response;
use axum::routing::post;
use common::charge::{answer, assert_ran, assert_replay_of, assert_unavailable, request};
use common::{Harness, serve};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::problem::types;
use tower_idempotency::test_util::ManualClock;
use tower_idempotency_sqlx::{SqlxSqliteError, SqlxSqliteStore, SqlxSqliteTransaction};

const START_MS: i64 = 1_700_000_000_000;
/// A lock held longer than this fails the store call.
const BUSY: Duration = Duration::from_millis(100);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Separate,
    Transactional,
}

/// Counts the run, writes its effect (through the request's transaction
/// when there is one), waits at its gate if asked, answers 201 `charge n`
/// or `x-size` bytes of `x`.
async fn charge(
    State(h): State<Harness>,
    tx: Option<SqlxSqliteTransaction>,
    headers: HeaderMap,
) -> Result<Response, SqlxSqliteError> {
    let n = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
    if let Some(tx) = tx {
        let mut conn = tx.connection().await?;
        sqlx::query("INSERT INTO effects (note) VALUES ('charged')")
            .execute(&mut *conn)
            .await?;
    }
    h.wait_at_gate(&headers).await;
    Ok(answer(n, &headers))
}

/// One SQLite file, its clock and the handler's run count.
struct Db {
    _dir: tempfile::TempDir,
    path: PathBuf,
    clock: ManualClock,
    h: Harness,
}

impl Db {
    fn new() -> Db {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("app.sqlite3");
        Db {
            _dir: dir,
            path,
            clock: ManualClock::new(START_MS),
            h: Harness::default(),
        }
    }

    /// Serves `/charge` behind a layer over a new pool and store on the
    /// file; with `max_pages`, every connection caps the file's size.
    async fn app(&self, mode: Mode, max_pages: Option<i64>) -> SocketAddr {
        self.app_on(mode, max_pages, 4).await
    }

    /// As [`Db::app`], over a pool of `connections`.
    async fn app_on(&self, mode: Mode, max_pages: Option<i64>, connections: u32) -> SocketAddr {
        let mut options = SqliteConnectOptions::new()
            .filename(&self.path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(BUSY);
        if let Some(pages) = max_pages {
            options = options.pragma("max_page_count", pages.to_string());
        }
        let pool = SqlitePoolOptions::new()
            .max_connections(connections)
            .connect_with(options)
            .await
            .unwrap();
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS effects (id INTEGER PRIMARY KEY, note TEXT NOT NULL)",
        )
        .execute(&pool)
        .await
        .unwrap();
        let store = SqlxSqliteStore::builder(pool.clone())
            .clock(self.clock.clone())
            .open()
            .await
            .unwrap();
        let user = |p: &Parts| {
            p.headers
                .get("x-user")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("anonymous")
                .to_owned()
        };
        // Retry-After shows the remaining lease: the clock state under test.
        let layer = IdempotencyLayer::new(store, user).in_flight_retry_after(Duration::MAX);
        let router = Router::new().route("/charge", post(charge));
        let router = match mode {
            Mode::Separate => router.route_layer(layer),
            Mode::Transactional => router.route_layer(layer.transactional()),
        };
        serve(router.with_state(self.h.clone())).await
    }

    /// A connection of the test's own (no busy timeout).
    fn raw(&self) -> rusqlite::Connection {
        rusqlite::Connection::open(&self.path).unwrap()
    }

    fn count(&self, sql: &str) -> i64 {
        self.raw().query_row(sql, [], |r| r.get(0)).unwrap()
    }

    fn effects(&self) -> i64 {
        self.count("SELECT count(*) FROM effects")
    }

    fn page_count(&self) -> i64 {
        self.count("PRAGMA page_count")
    }
}

/// Another connection holds the write lock past the busy timeout: 503,
/// nothing runs, no record; released, the same key runs once and replays.
async fn locked(mode: Mode) {
    let db = Db::new();
    let addr = db.app(mode, None).await;
    let blocker = db.raw();
    blocker.execute_batch("BEGIN EXCLUSIVE").unwrap();
    for _ in 0..3 {
        assert_unavailable(&request(addr, "k", &[]).await);
    }
    assert_eq!(db.h.runs(), 0);
    assert_eq!(db.count("SELECT count(*) FROM idempotency_records"), 0);
    blocker.execute_batch("ROLLBACK").unwrap();
    let first = request(addr, "k", &[]).await;
    assert_ran(&first, 1);
    assert_replay_of(&request(addr, "k", &[]).await, &first);
    assert_eq!(db.h.runs(), 1);
    assert_eq!(db.effects(), i64::from(mode == Mode::Transactional));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_separate() {
    locked(Mode::Separate).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_transactional() {
    locked(Mode::Transactional).await;
}

/// The lock appears while the handler runs (separate mode): the claim
/// committed, the completion fails; the caller still gets the answer, the
/// record stays in flight until its lease ends, then a retry runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_between_claim_and_completion() {
    let db = Db::new();
    let addr = db.app(Mode::Separate, None).await;
    let mut entered = db.h.watch();
    let held = tokio::spawn(async move { request(addr, "k", &[("x-gate", b"g")]).await });
    assert_eq!(entered.recv().await.as_deref(), Some("g"));
    let blocker = db.raw();
    blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
    db.h.open("g");
    assert_ran(&held.await.unwrap(), 1);
    blocker.execute_batch("ROLLBACK").unwrap();
    let in_flight = request(addr, "k", &[]).await;
    assert_eq!(in_flight.assert_problem(409), types::IN_FLIGHT);
    assert_eq!(in_flight.header_str("retry-after"), Some("10"));
    db.clock.advance(Duration::from_secs(10));
    let second = request(addr, "k", &[]).await;
    assert_ran(&second, 2);
    assert_replay_of(&request(addr, "k", &[]).await, &second);
    assert_eq!(db.h.runs(), 2);
}

/// Fills the records table under a cap of `max_pages` until SQLite answers
/// `SQLITE_FULL`.
fn fill(db: &Db, max_pages: i64) {
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

/// The file is full: the claim needs a page it cannot have, so 503 and
/// nothing runs; the cap raised (a new pool), the same key runs once.
async fn disk_full_at_claim(mode: Mode) {
    let db = Db::new();
    db.app(mode, None).await;
    let cap = db.page_count() + 4;
    fill(&db, cap);
    let addr = db.app(mode, Some(cap)).await;
    for _ in 0..3 {
        assert_unavailable(&request(addr, "k", &[]).await);
    }
    assert_eq!((db.h.runs(), db.effects()), (0, 0));
    let addr = db.app(mode, None).await;
    let first = request(addr, "k", &[]).await;
    assert_ran(&first, 1);
    assert_replay_of(&request(addr, "k", &[]).await, &first);
    assert_eq!(db.h.runs(), 1);
    assert_eq!(db.effects(), i64::from(mode == Mode::Transactional));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_full_at_claim_separate() {
    disk_full_at_claim(Mode::Separate).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_full_at_claim_transactional() {
    disk_full_at_claim(Mode::Transactional).await;
}

/// Transactional mode with the file capped at its size: the claim and the
/// effect fit, the commit with a 64 KiB response does not. Nothing
/// happened: 503, no effect, no record, and the key is free at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_full_at_commit_transactional() {
    const LARGE: &[(&str, &[u8])] = &[("x-size", b"65536")];
    let db = Db::new();
    db.app(Mode::Transactional, None).await;
    let addr = db.app(Mode::Transactional, Some(db.page_count())).await;
    for runs in 1..=2 {
        assert_unavailable(&request(addr, "k", LARGE).await);
        assert_eq!(db.h.runs(), runs);
        assert_eq!(db.effects(), 0);
        assert_eq!(db.count("SELECT count(*) FROM idempotency_records"), 0);
    }
    let addr = db.app(Mode::Transactional, None).await;
    let first = request(addr, "k", LARGE).await;
    assert_ran(&first, 3);
    assert_eq!(first.body, vec![b'x'; 65536]);
    assert_replay_of(&request(addr, "k", LARGE).await, &first);
    assert_eq!((db.h.runs(), db.effects()), (3, 1));
}

/// The same over a pool of one connection, so that each retry gets the
/// connection the failed completion used. SQLite ended that transaction by
/// itself (SQLITE_FULL) while sqlx still counted it open; before the store
/// reconciled the two at its rollback, the connection went back to the pool
/// counted inside a transaction and every later claim on it failed at its
/// BEGIN: the second request got 503 without running (1 run, not 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_full_at_commit_leaves_the_connection_usable() {
    const LARGE: &[(&str, &[u8])] = &[("x-size", b"65536")];
    let db = Db::new();
    db.app(Mode::Transactional, None).await;
    let addr = db
        .app_on(Mode::Transactional, Some(db.page_count()), 1)
        .await;
    for runs in 1..=3 {
        assert_unavailable(&request(addr, "k", LARGE).await);
        assert_eq!(db.h.runs(), runs);
    }
    // The same pool and connection, a response that fits: it runs and replays.
    let small = request(addr, "small", &[]).await;
    assert_ran(&small, 4);
    assert_replay_of(&request(addr, "small", &[]).await, &small);
    assert_eq!((db.h.runs(), db.effects()), (4, 1));
}

/// A completed record whose response is garbage: 503, neither replayed nor
/// run; a garbage fingerprint: 422. Each repaired, the key replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_record() {
    let db = Db::new();
    let addr = db.app(Mode::Separate, None).await;
    let first = request(addr, "k", &[]).await;
    assert_ran(&first, 1);
    for (name, garbage, status, problem) in [
        (
            "response",
            &b"\x00garbage"[..],
            503,
            types::STORE_UNAVAILABLE,
        ),
        ("fingerprint", &b"\x01"[..], 422, types::MISMATCH),
    ] {
        let select = format!("SELECT {name} FROM idempotency_records WHERE key = 'k'");
        let good: Vec<u8> = db.raw().query_row(&select, [], |r| r.get(0)).unwrap();
        let update = format!("UPDATE idempotency_records SET {name} = ?1 WHERE key = 'k'");
        assert_eq!(db.raw().execute(&update, [garbage]).unwrap(), 1);
        for _ in 0..2 {
            let r = request(addr, "k", &[]).await;
            assert_eq!(r.assert_problem(status), problem, "{name}: {r:?}");
            assert_eq!(r.header("idempotent-replayed"), None);
        }
        assert_eq!(db.raw().execute(&update, [good]).unwrap(), 1);
        assert_replay_of(&request(addr, "k", &[]).await, &first);
    }
    assert_eq!(db.h.runs(), 1);
}
