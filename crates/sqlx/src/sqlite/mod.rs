//! Records in the app's own SQLite database, through the app's own
//! `sqlx::SqlitePool` (feature `sqlx-sqlite`, sqlx 0.9).
//!
//! * `mod.rs`: [`SqlxSqliteStore`], its builder, the schema and its
//!   migration, and what a SQLite error means.
//! * `claim.rs`: the claim's and the completion's SQL.
//! * `transaction.rs`: [`SqlxSqliteTransaction`], the handler's handle on the
//!   request's write transaction, and transactional mode.
//! * `inspect.rs`: [`Inspect`](tower_idempotency::store::Inspect) in SQL.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

use sqlx::{Row, Sqlite, SqlitePool};

use tower_idempotency::response::StoredResponse;
use tower_idempotency::store::kit::held::HeldKeys;
use tower_idempotency::store::kit::purge::{PurgeTask, in_batches};
use tower_idempotency::store::kit::sqlite_sql::{
    IS_WITHOUT_ROWID, PURGE, RENEW, SCHEMA_VERSION, migration,
};
use tower_idempotency::store::{
    Claim, ClaimRequest, Clock, Completion, FencingToken, Purge, RecordId, Store, StoreError,
    SystemClock,
};

mod claim;
mod inspect;
mod transaction;

pub use transaction::{SqlxSqliteError, SqlxSqliteTransaction};

/// Records in the SQLite database of the app's own [`sqlx::SqlitePool`],
/// in both modes: [`Separate`](tower_idempotency::mode::Separate), and
/// [`Transactional`](tower_idempotency::mode::Transactional) where the handler writes
/// through the request's [`SqlxSqliteTransaction`].
///
/// * The claim is an `INSERT ... ON CONFLICT DO NOTHING` inside a
///   `BEGIN IMMEDIATE` transaction on one of the pool's connections: the
///   primary key `(scope, key)` decides who is first, in one process or many
///   sharing the file. Only an insert that met a record reads it, under the
///   same write lock. Leases and TTLs are judged by the store's [`Clock`]
///   (the system clock unless `SqlxSqliteStoreBuilder::clock`, feature
///   `test-util`, says otherwise), read after the write lock is held.
/// * The schema and semantics are those of `SqliteStore`
///   (feature `sqlite`): the same table, so the two stores can share a file.
/// * A completion, a release and a purge are one statement each on the pool.
///
/// # Configuring the pool
///
/// The store uses the pool as the app configured it, and runs on each of its
/// calls with one of its connections. For this store, configure it so:
///
/// * **WAL** (`SqliteConnectOptions::journal_mode(SqliteJournalMode::Wal)`):
///   readers, such as the app's `GET`s and the replays of this store, never
///   wait for the writer. Without it the store works, but every read waits
///   for each commit. [`SqlxSqliteStoreBuilder::open`] logs a warning when the
///   database is not in WAL mode.
/// * **`busy_timeout`** (sqlx's default is 5 s): how long a connection waits
///   for SQLite's write lock. A claim that waits longer fails with
///   [`StoreError::Unavailable`] (the layer answers 503 with `Retry-After`).
///   0 makes every claim that meets another writer fail at once; `open` logs
///   a warning then.
/// * **`max_connections`**: in transactional mode each request in its
///   handler holds one connection; a request that finds none free waits the
///   pool's `acquire_timeout`, then gets 503.
///
/// # The one-writer rule (transactional mode)
///
/// SQLite has ONE writer per database. In transactional mode a request holds
/// the write lock from its claim until its response is committed, on the
/// connection of its [`SqlxSqliteTransaction`]. So:
///
/// **A handler must write only through its [`SqlxSqliteTransaction`].** A
/// write through another connection (`&pool`, a second transaction) waits
/// for the lock its own request holds: it waits the pool's `busy_timeout`
/// and then fails with `SQLITE_BUSY` ("database is locked"), and the request
/// is rolled back. Every other writer of the database (other requests,
/// background jobs, other processes) waits, too, for as long as a handler
/// runs: at most the layer's max hold, [`IdempotencyLayer::max_hold`](tower_idempotency::IdempotencyLayer::max_hold)
/// (default 60 s), after which the store rolls the request back
/// (see [`SqlxSqliteTransaction`]). Keep transactional handlers short.
///
/// When this store's own call fails with `SQLITE_BUSY`, its
/// [`StoreError::Unavailable`] says so and names the likely cause (a request
/// of this store holding the lock, or another writer); see
/// [`SqlxSqliteStore::explain_busy`] for the handler's own errors.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
/// use tower_idempotency::{IdempotencyLayer, Store, scope};
/// use tower_idempotency_sqlx::SqlxSqliteStore;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dir = tempfile::tempdir()?;
/// # let path = dir.path().join("app.sqlite3");
/// let options = SqliteConnectOptions::new()
///     .filename(&path)
///     .create_if_missing(true)
///     .journal_mode(SqliteJournalMode::Wal)
///     .busy_timeout(Duration::from_secs(5));
/// let pool = SqlitePoolOptions::new().max_connections(8).connect_with(options).await?;
/// // Creates or migrates the `idempotency_records` table.
/// let store = SqlxSqliteStore::from_pool(pool.clone()).await?;
/// assert_eq!(store.purge_expired().await?, 0);
/// let layer = IdempotencyLayer::new(store, scope::header(http::HeaderName::from_static("x-user")));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SqlxSqliteStore {
    pool: SqlitePool,
    clock: Arc<dyn Clock>,
    /// The pool's `busy_timeout`, read when the store opened: the longest a
    /// claim waits for an open request holding its key, unless the layer
    /// bounds it further (`ClaimRequest::wait_in_flight`).
    busy_timeout: Duration,
    counters: Arc<Counters>,
    /// The keys this store's open transactional requests hold.
    held: Arc<HeldKeys>,
    /// The rows one purge statement deletes at most, and the purge task.
    purge: (u32, PurgeTask),
}

#[derive(Default)]
struct Counters {
    /// Transactions of this store open right now.
    open: AtomicUsize,
    /// Transactions rolled back past their max hold time.
    held_too_long: AtomicU64,
}

impl std::fmt::Debug for SqlxSqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlxSqliteStore").finish_non_exhaustive()
    }
}

/// Options for [`SqlxSqliteStore`]; made by [`SqlxSqliteStore::builder`].
#[must_use]
pub struct SqlxSqliteStoreBuilder {
    pool: SqlitePool,
    clock: Arc<dyn Clock>,
    purge: Purge,
}

impl SqlxSqliteStoreBuilder {
    /// The clock that judges leases and TTLs (default the system clock).
    /// Every process sharing a file should use the same clock.
    #[cfg(feature = "test-util")]
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// When the store deletes its expired records, in statements of at most
    /// how many rows (default: every 60 s, 1,000 rows; `Purge::off()` for
    /// none): see [`Purge`].
    pub fn purge(mut self, purge: Purge) -> Self {
        self.purge = purge;
        self
    }

    /// Creates or migrates the schema (in one `BEGIN IMMEDIATE`
    /// transaction), checks the pool's settings (a warning is logged when
    /// the database is not in WAL mode or `busy_timeout` is 0), and returns
    /// the store.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the database cannot be written, or
    /// holds a schema newer than this crate knows.
    pub async fn open(self) -> Result<SqlxSqliteStore, StoreError> {
        let mut store = SqlxSqliteStore {
            pool: self.pool,
            clock: self.clock,
            busy_timeout: Duration::ZERO,
            counters: Arc::default(),
            held: Arc::default(),
            purge: (self.purge.batch_rows(), PurgeTask::default()),
        };
        store.busy_timeout = store.migrate().await?;
        store.purge.1 = PurgeTask::start(store.clone(), self.purge);
        Ok(store)
    }
}

impl SqlxSqliteStore {
    /// A store over `pool` with the default options (see
    /// [`SqlxSqliteStoreBuilder`]): creates or migrates the schema.
    ///
    /// # Errors
    ///
    /// As [`SqlxSqliteStoreBuilder::open`].
    pub async fn from_pool(pool: SqlitePool) -> Result<Self, StoreError> {
        Self::builder(pool).open().await
    }

    /// Options: the clock and the purge.
    pub fn builder(pool: SqlitePool) -> SqlxSqliteStoreBuilder {
        SqlxSqliteStoreBuilder {
            pool,
            clock: Arc::new(SystemClock),
            purge: Purge::default(),
        }
    }

    /// The app's pool, as given.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// Transactional requests the store has rolled back because they held
    /// the write lock past their max hold time, since the store was made.
    pub fn transactions_held_too_long(&self) -> u64 {
        self.counters.held_too_long.load(Relaxed)
    }

    /// Whether `error` is SQLite's `SQLITE_BUSY` ("database is locked"): the
    /// connection waited its `busy_timeout` for the write lock. With a
    /// [`StoreError`] that names the likely cause: in a transactional
    /// handler, a write that did not go through the request's
    /// [`SqlxSqliteTransaction`] (the request holds the lock itself); else
    /// another writer held the lock that long. `None` for any other error.
    /// For a handler's logs: `SqlxSqliteStore::explain_busy(&e)`.
    pub fn explain_busy(error: &sqlx::Error) -> Option<StoreError> {
        is_busy(error).then(|| {
            StoreError::unavailable(format!(
                "{error}: SQLite's write lock was held past this connection's busy_timeout. \
                 In transactional mode a request holds the lock until its response is \
                 committed: a handler must write only through its SqlxSqliteTransaction, \
                 never through the pool or another connection (it would wait for itself)"
            ))
        })
    }

    /// Creates or migrates the schema; returns the pool's `busy_timeout`.
    async fn migrate(&self) -> Result<Duration, StoreError> {
        let mut tx = self.begin_immediate().await?;
        let version: i64 = sqlx::query("PRAGMA user_version")
            .fetch_one(&mut *tx)
            .await
            .and_then(|r| r.try_get(0))
            .map_err(|e| self.error(e))?;
        if version > SCHEMA_VERSION {
            return Err(StoreError::unavailable(format!(
                "the database holds idempotency schema version {version}; this build knows {SCHEMA_VERSION}"
            )));
        }
        let without_rowid: bool = sqlx::query(IS_WITHOUT_ROWID)
            .fetch_one(&mut *tx)
            .await
            .and_then(|r| r.try_get(0))
            .map_err(|e| self.error(e))?;
        sqlx::raw_sql(sqlx::AssertSqlSafe(migration(without_rowid)))
            .execute(&mut *tx)
            .await
            .map_err(|e| self.error(e))?;
        tx.commit().await.map_err(|e| self.error(e))?;
        let mut conn = self.pool.acquire().await.map_err(|e| self.error(e))?;
        let journal: String = sqlx::query("PRAGMA journal_mode")
            .fetch_one(&mut *conn)
            .await
            .and_then(|r| r.try_get(0))
            .map_err(|e| self.error(e))?;
        if !journal.eq_ignore_ascii_case("wal") {
            tracing::warn!(
                journal_mode = %journal,
                "the SqlitePool's database is not in WAL mode: every read waits for the writer; set SqliteConnectOptions::journal_mode(SqliteJournalMode::Wal)"
            );
        }
        let busy: i64 = sqlx::query("PRAGMA busy_timeout")
            .fetch_one(&mut *conn)
            .await
            .and_then(|r| r.try_get(0))
            .map_err(|e| self.error(e))?;
        if busy == 0 {
            tracing::warn!(
                "the SqlitePool's busy_timeout is 0: every claim that meets another writer fails at once (503); set SqliteConnectOptions::busy_timeout"
            );
        }
        Ok(Duration::from_millis(u64::try_from(busy).unwrap_or(0)))
    }

    /// A pool connection inside `BEGIN IMMEDIATE`: it holds SQLite's write
    /// lock from the start, so no statement in it fails on a lock upgrade.
    async fn begin_immediate(&self) -> Result<sqlx::Transaction<'static, Sqlite>, StoreError> {
        self.pool
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(|e| self.error(e))
    }

    /// A sqlx error as a [`StoreError`]; `SQLITE_BUSY` and a pool timeout
    /// name their cause.
    fn error(&self, error: sqlx::Error) -> StoreError {
        if is_busy(&error) {
            let open = self.counters.open.load(Relaxed);
            let cause = if open > 0 {
                format!(
                    "{open} transactional request(s) of this store hold or wait for it; a request holds it until its response is committed"
                )
            } else {
                "another connection (the app's own writes, another process) held it".to_owned()
            };
            tracing::warn!(error = %error, open_transactions = open, "SQLITE_BUSY: {cause}");
            return StoreError::unavailable(format!(
                "{error}: SQLite's write lock was busy past the pool's busy_timeout; {cause}"
            ));
        }
        if let sqlx::Error::PoolTimedOut = error {
            return StoreError::unavailable(
                "no connection of the SqlitePool was free within its acquire_timeout (in transactional mode each request in its handler holds one)",
            );
        }
        StoreError::unavailable(error)
    }
}

/// `SQLITE_BUSY` or one of its extended codes (primary code 5).
fn is_busy(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(e) => e
            .code()
            .and_then(|code| code.parse::<i32>().ok())
            .is_some_and(|code| code & 0xff == 5),
        _ => false,
    }
}

impl Store for SqlxSqliteStore {
    async fn claim(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        let mut tx = self.begin_immediate().await?;
        // After the lock is held: a claim that waited must not start its
        // lease in the past.
        let now = self.clock.now_ms();
        let found = claim::claim_in(&mut tx, &req, now)
            .await
            .map_err(|e| self.error(e))?;
        if found.is_acquired() {
            tx.commit().await.map_err(|e| self.error(e))?;
        } else {
            // Nothing was written.
            tx.rollback().await.map_err(|e| self.error(e))?;
        }
        found.into_claim()
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        let blob = response.encode();
        claim::complete_in(&self.pool, id.scope(), id.key(), token, &blob)
            .await
            .map_err(|e| self.error(e))
    }

    async fn release(&self, id: RecordId, token: FencingToken) -> Result<bool, StoreError> {
        let deleted = sqlx::query(
            "DELETE FROM idempotency_records
             WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in_flight'",
        )
        .bind(id.scope())
        .bind(id.key())
        .bind(token.0)
        .execute(&self.pool)
        .await
        .map_err(|e| self.error(e))?;
        Ok(deleted.rows_affected() == 1)
    }

    async fn renew(
        &self,
        id: RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let now = self.clock.now_ms();
        let renewed = sqlx::query(RENEW)
            .bind(id.scope())
            .bind(id.key())
            .bind(token.0)
            .bind(now.saturating_add(tower_idempotency::store::duration_ms(lease)))
            .bind(now)
            .execute(&self.pool)
            .await
            .map_err(|e| self.error(e))?;
        Ok(renewed.rows_affected() == 1)
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        in_batches(self.purge.0, |rows| {
            let purge = sqlx::query(PURGE).bind(self.clock.now_ms()).bind(rows);
            async move {
                let deleted = purge.execute(&self.pool).await.map_err(|e| self.error(e))?;
                Ok(deleted.rows_affected())
            }
        })
        .await
    }
}
