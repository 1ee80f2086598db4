//! [`SqliteStoreBuilder`]: the options, the connection pool, and the schema
//! with its migration.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::TransactionBehavior;

use super::{Limits, SqliteStore, blocking};
use crate::store::kit::purge::PurgeTask;
use crate::store::kit::sqlite_sql::{IS_WITHOUT_ROWID, SCHEMA_VERSION, migration};
use crate::store::{Clock, Purge, StoreError, SystemClock, duration_ms};

/// SQLite's `synchronous` setting: how often a commit waits for the disk.
///
/// With WAL, `Normal` survives a process crash (kill -9) but may lose the
/// last commits on power loss; `Full` survives both and costs an fsync per
/// commit. See <https://www.sqlite.org/pragma.html#pragma_synchronous>.
///
/// `#[non_exhaustive]`: SQLite has other levels (`OFF`, `EXTRA`) this may
/// offer later.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Synchronous {
    /// `synchronous=NORMAL`.
    Normal,
    /// `synchronous=FULL` (the default: an acknowledged record survives power loss).
    /// A batch of the writer that holds only claims, releases and lease
    /// renewals (separate mode) commits at `NORMAL`: a power loss can lose
    /// such a claim, which changes no outcome (`docs/contract.md` §8), and
    /// the next batch's sync makes it durable. Completions and
    /// transactional requests always commit at `FULL`.
    #[default]
    Full,
}

/// Options for [`SqliteStore`]; made by [`SqliteStore::builder`].
#[must_use]
pub struct SqliteStoreBuilder {
    path: PathBuf,
    busy_timeout: Duration,
    synchronous: Synchronous,
    pool_size: u32,
    clock: Arc<dyn Clock>,
    group_commit: usize,
    concurrent_transactions: usize,
    replay_cache: usize,
    replay_cache_bytes: usize,
    writer_queue: usize,
    purge: Purge,
    on_connect: Option<ConnectHook>,
}

/// A function run on every connection a [`SqliteStore`] opens.
type ConnectHook = Arc<dyn Fn(&rusqlite::Connection) -> rusqlite::Result<()> + Send + Sync>;

impl SqliteStoreBuilder {
    /// How long a call waits for another connection's lock before it fails
    /// with [`StoreError::Unavailable`]. Default 5 s.
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Default [`Synchronous::Full`].
    pub fn synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// Connections kept open (default 8). SQLite has one writer at a time
    /// whatever this is; more connections let replays read concurrently.
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// The clock that judges leases and TTLs (default the system clock).
    /// Every process sharing a file should use the same clock.
    #[cfg(feature = "test-util")]
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// At most this many transactional requests share one commit (default
    /// 32; 1 commits each request on its own). See [`SqliteTransaction`](super::SqliteTransaction),
    /// "Group commit". A batch never waits to fill: it commits as soon as no
    /// request is waiting for the writer.
    pub fn group_commit(mut self, requests: usize) -> Self {
        self.group_commit = requests.max(1);
        self
    }

    /// How many transactional requests may be open in the writer's batch at
    /// once (default 1; at most [`group_commit`](Self::group_commit) count).
    ///
    /// With 1, a request holds the writer from its claim until the layer
    /// commits or rolls it back, and every other write of the store waits:
    /// handlers run one at a time, and between two handlers' SQL the
    /// writer waits for the async hand-offs of each (claim answered,
    /// handler scheduled, its SQL sent, its response committed).
    ///
    /// With more, the writer claims a request, and while its handler runs,
    /// claims the next one and runs other handlers' SQL: their statements
    /// run back to back, each request in a savepoint of its own on a stack
    /// (SQLite savepoints nest), and one commit makes the batch durable. A
    /// claim of a key that a request of the batch holds waits for it, as it
    /// waits for the writer with 1. The cost: requests' statements
    /// interleave in one transaction, so a request sees the uncommitted
    /// writes of the requests before it, and when a request rolls back (a
    /// response that is not stored, a panic, its max hold time, a dropped
    /// request), every request with SQL after its savepoint is rolled back
    /// with it and answered 503 with `Retry-After` (nothing of it happened;
    /// its retry runs again). And the batch commits once, when its last open
    /// request ends: a slow handler delays the answers of the requests that
    /// shared its batch (SQLite has one writer). Repeats of a key in flight
    /// wait for it without taking a place in the batch, and past the busy
    /// timeout get 409. Use it when handlers rarely fail and are short,
    /// e.g. a ledger's credit. Measured in `BENCHMARKS.md`.
    pub fn concurrent_transactions(mut self, requests: usize) -> Self {
        self.concurrent_transactions = requests.max(1);
        self
    }

    /// Keeps up to `records` completed records that were replayed in memory
    /// (default 0: off), so that their next replays need no read: no trip
    /// to the blocking pool, no SQL. A completed record does not change
    /// until it expires (a claim replaces only an expired record, a purge
    /// deletes only expired ones), and every hit is checked against the
    /// store's clock, so a cached replay is the one the database would
    /// give. Only a record changed behind the store's back (by hand, with
    /// SQL) is not seen until its entry is evicted. Bounds: `records`
    /// entries and [`SqliteStoreBuilder::replay_cache_bytes`] of encoded
    /// responses in all; the oldest goes first. A cached replay's body is
    /// shared, not copied.
    pub fn replay_cache(mut self, records: usize) -> Self {
        self.replay_cache = records;
        self
    }

    /// The replay cache's bound in bytes of encoded responses (the body
    /// and the header fields, as stored; default 4 MiB). A record larger
    /// than a quarter of it is never cached, so one large record does not
    /// push out the rest: with the default, records up to 1 MiB. Used only
    /// with [`SqliteStoreBuilder::replay_cache`].
    pub fn replay_cache_bytes(mut self, bytes: usize) -> Self {
        self.replay_cache_bytes = bytes;
        self
    }

    /// When the store deletes its expired records, in statements of at most
    /// how many rows (default: every 60 s, 1,000 rows; [`Purge::off`] for
    /// none): see [`Purge`].
    pub fn purge(mut self, purge: Purge) -> Self {
        self.purge = purge;
        self
    }

    /// At most this many jobs (claims, completions, releases, transactional
    /// requests) wait for the writer (default 1024; at least 1). A claim
    /// that finds the queue full fails at once with
    /// [`StoreError::Unavailable`] (the layer answers 503 with
    /// `Retry-After`) instead of waiting; a completion or release waits for
    /// room, at most the busy timeout.
    pub fn writer_queue(mut self, jobs: usize) -> Self {
        self.writer_queue = jobs.max(1);
        self
    }

    /// Runs `f` on every connection the store opens (all come from its
    /// pool, the writer's included), after the store's own settings (busy
    /// timeout, `synchronous`, `foreign_keys`, `temp_store`) and before the
    /// connection is first used, including for the schema migration. For
    /// per-connection settings SQLite does not keep in the
    /// file, e.g. `PRAGMA max_page_count` (a cap on the file's size, in
    /// pages: writes past it fail with `SQLITE_FULL`, which the layer
    /// answers with 503) or `PRAGMA cache_size`. An error from `f` fails
    /// that connection: [`SqliteStoreBuilder::open`], or the call that
    /// needed it, fails with [`StoreError::Unavailable`].
    ///
    /// Do not change `journal_mode` or `busy_timeout` here: the store sets
    /// them itself. `PRAGMA temp_store = FILE` here puts temporary tables,
    /// sorts and the savepoints' sub-journal back on disk (see
    /// [`SqliteStore`]).
    pub fn on_connect<F>(mut self, f: F) -> Self
    where
        F: Fn(&rusqlite::Connection) -> rusqlite::Result<()> + Send + Sync + 'static,
    {
        self.on_connect = Some(Arc::new(f));
        self
    }

    /// Every pooled connection's settings: refused while read-only, the
    /// busy timeout, the statement cache, `synchronous`, foreign keys, an
    /// in-memory temp store, then the application's `on_connect` hook.
    fn connection_manager(&self) -> SqliteConnectionManager {
        let busy_ms = duration_ms(self.busy_timeout);
        let synchronous = match self.synchronous {
            Synchronous::Normal => "NORMAL",
            Synchronous::Full => "FULL",
        };
        let on_connect = self.on_connect.clone();
        SqliteConnectionManager::file(&self.path).with_init(move |c| {
            // SQLite opens a file it may not write read-only, and such a
            // connection stays read-only after the file is writable again:
            // kept in the pool, it would fail every write it is handed.
            // Refused here, the pool opens it again on a later call.
            if c.is_readonly(rusqlite::MAIN_DB)? {
                return Err(rusqlite::Error::SqliteFailure(
                    rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_READONLY),
                    Some("the database file cannot be opened for writing".into()),
                ));
            }
            c.busy_timeout(Duration::from_millis(busy_ms as u64))?;
            // The store's statements, a savepoint's three per stack depth,
            // and a handler's own: parsed once per connection.
            c.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
            c.pragma_update(None, "synchronous", synchronous)?;
            // For the handler's own tables in transactional mode.
            c.pragma_update(None, "foreign_keys", "ON")?;
            // The savepoints' sub-journal (one savepoint per transactional
            // request, stacked with `concurrent_transactions`) in memory: on
            // disk, SQLite spills it past 64 KiB to a temporary file that
            // each batch creates, writes and deletes (BENCHMARKS.md).
            c.pragma_update(None, "temp_store", "MEMORY")?;
            if let Some(hook) = &on_connect {
                hook(c)?;
            }
            Ok(())
        })
    }

    /// Opens (creating if missing) the file and creates or migrates the schema.
    ///
    /// # Errors
    ///
    /// [`StoreError::Config`] when the path holds a NUL byte (no file can
    /// have that name); [`StoreError::Unavailable`] when the file cannot be
    /// opened or written, or holds a schema newer than this crate knows.
    pub async fn open(self) -> Result<SqliteStore, StoreError> {
        if self.path.as_os_str().as_encoded_bytes().contains(&0) {
            return Err(StoreError::config(format!(
                "the SQLite path {:?} holds a NUL byte",
                self.path
            )));
        }
        let manager = self.connection_manager();
        let path = self.path.clone();
        let pool_size = self.pool_size;
        let busy_timeout = self.busy_timeout;
        let wal_path = self.path.clone();
        let pool = blocking(move || {
            // WAL is a property of the file: set once here, not on every
            // pooled connection (each change takes a lock that contends with
            // other processes' writers).
            let conn = rusqlite::Connection::open(&wal_path).map_err(StoreError::unavailable)?;
            conn.busy_timeout(busy_timeout)
                .map_err(StoreError::unavailable)?;
            conn.pragma_update(None, "journal_mode", "WAL")
                .map_err(StoreError::unavailable)?;
            drop(conn);
            let pool = r2d2::Pool::builder()
                .max_size(pool_size)
                .min_idle(Some(1))
                .connection_timeout(busy_timeout + Duration::from_secs(1))
                // r2d2's check runs an empty batch on every checkout, which
                // cannot fail on an open SQLite connection: a cost on every
                // replay read and every batch of the writer, for nothing.
                .test_on_check_out(false)
                .build(manager)
                .map_err(StoreError::unavailable)?;
            migrate(&mut *pool.get().map_err(StoreError::unavailable)?)?;
            Ok(pool)
        })
        .await?;
        let mut store = SqliteStore {
            pool,
            clock: self.clock,
            path: Arc::new(path),
            busy_timeout,
            limits: Limits {
                batch: self.group_commit,
                concurrent: self.concurrent_transactions,
                queue: self.writer_queue,
                lock_wait: busy_timeout,
                lazy_batches: self.synchronous == Synchronous::Full,
            },
            writer: Arc::new(std::sync::OnceLock::new()),
            completed: Arc::new(crate::store::kit::replay_cache::ReplayCache::new(
                self.replay_cache,
                self.replay_cache_bytes,
            )),
            purge: (self.purge.batch_rows(), PurgeTask::default()),
        };
        store.purge.1 = PurgeTask::start(store.clone(), self.purge);
        Ok(store)
    }
}

/// Prepared statements kept per connection (rusqlite's default is 16).
const STATEMENT_CACHE: usize = 256;

fn migrate(conn: &mut rusqlite::Connection) -> Result<(), StoreError> {
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(StoreError::unavailable)?;
    let version: i64 = tx
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(StoreError::unavailable)?;
    if version > SCHEMA_VERSION {
        return Err(StoreError::unavailable(format!(
            "the database holds idempotency schema version {version}; this build knows {SCHEMA_VERSION}"
        )));
    }
    let without_rowid: bool = tx
        .query_row(IS_WITHOUT_ROWID, [], |r| r.get(0))
        .map_err(StoreError::unavailable)?;
    tx.execute_batch(&migration(without_rowid))
        .map_err(StoreError::unavailable)?;
    tx.commit().map_err(StoreError::unavailable)
}

impl SqliteStore {
    /// Opens `path` with the default options (see [`SqliteStoreBuilder`]).
    ///
    /// # Errors
    ///
    /// As [`SqliteStoreBuilder::open`].
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::builder(path).open().await
    }

    /// Options: busy timeout, `synchronous`, pool size, group commit,
    /// concurrent transactions, the replay cache (records and bytes), max
    /// hold time, writer queue, a hook run on each connection the store
    /// opens; with the `test-util` feature, the clock.
    pub fn builder(path: impl AsRef<Path>) -> SqliteStoreBuilder {
        SqliteStoreBuilder {
            path: path.as_ref().to_owned(),
            busy_timeout: Duration::from_secs(5),
            synchronous: Synchronous::default(),
            pool_size: 8,
            clock: Arc::new(SystemClock),
            group_commit: 32,
            concurrent_transactions: 1,
            replay_cache: 0,
            replay_cache_bytes: crate::store::kit::replay_cache::DEFAULT_BYTES,
            writer_queue: 1024,
            purge: Purge::default(),
            on_connect: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sqlite3");
        SqliteStore::open(&path).await.unwrap();
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.pragma_update(None, "user_version", 99).unwrap();
        drop(conn);
        let err = SqliteStore::open(&path).await.unwrap_err();
        assert!(err.to_string().contains("schema version 99"), "{err}");
    }

    #[tokio::test]
    async fn a_path_with_a_nul_byte_is_a_config_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = SqliteStore::open(dir.path().join("a\0b.sqlite3"))
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Config(_)), "{err:?}");
        assert!(!dir.path().join("a").exists());
    }

    #[tokio::test]
    async fn reopening_keeps_records_and_wal_is_on() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sqlite3");
        let store = SqliteStore::open(&path).await.unwrap();
        let mode: String = store
            .with_conn(|c, _| c.pragma_query_value(None, "journal_mode", |r| r.get(0)))
            .await
            .unwrap();
        assert_eq!(mode, "wal");
        drop(store);
        let again = SqliteStore::open(&path).await.unwrap();
        let version: i64 = again
            .with_conn(|c, _| c.pragma_query_value(None, "user_version", |r| r.get(0)))
            .await
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
    }

    /// Temporary storage (the savepoints' sub-journal among it) is in memory
    /// on the store's connections, and `on_connect` can put it back on disk.
    #[tokio::test]
    async fn temporary_storage_is_in_memory_unless_on_connect_says_otherwise() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sqlite3");
        let temp_store = |store: SqliteStore| async move {
            store
                .with_conn(|c, _| c.pragma_query_value(None, "temp_store", |r| r.get::<_, i64>(0)))
                .await
                .unwrap()
        };
        // 2 is MEMORY, 1 is FILE (https://www.sqlite.org/pragma.html#pragma_temp_store).
        assert_eq!(temp_store(SqliteStore::open(&path).await.unwrap()).await, 2);
        let on_disk = SqliteStore::builder(&path)
            .on_connect(|c| c.pragma_update(None, "temp_store", "FILE"))
            .open()
            .await
            .unwrap();
        assert_eq!(temp_store(on_disk).await, 1);
    }
}
