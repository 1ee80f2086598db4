//! The embedded default: SQLite through rusqlite (bundled), one file that
//! several processes may share.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::{TransactionBehavior, params};

use super::{
    Claim, ClaimRequest, Clock, Completion, FencingToken, Store, StoreError, SystemClock,
    duration_ms,
};
use crate::response::StoredResponse;

/// The schema version this crate writes, kept in `PRAGMA user_version`.
const SCHEMA_VERSION: i64 = 1;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS idempotency_records (
    scope       TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    fingerprint BLOB    NOT NULL,
    token       INTEGER NOT NULL,
    state       TEXT    NOT NULL CHECK (state IN ('in_flight', 'completed')),
    lease_until INTEGER NOT NULL, -- unix ms; meaningful while in flight
    expires_at  INTEGER NOT NULL, -- unix ms; the record's TTL deadline
    response    BLOB,             -- StoredResponse::encode, once completed
    PRIMARY KEY (scope, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at ON idempotency_records (expires_at);
";

/// SQLite's `synchronous` setting: how often a commit waits for the disk.
///
/// With WAL, `Normal` survives a process crash (kill -9) but may lose the
/// last commits on power loss; `Full` survives both and costs an fsync per
/// commit. See <https://www.sqlite.org/pragma.html#pragma_synchronous>.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Synchronous {
    /// `synchronous=NORMAL`.
    Normal,
    /// `synchronous=FULL` (the default: an acknowledged record survives power loss).
    #[default]
    Full,
}

/// Records in one SQLite file, in WAL mode.
///
/// * The claim runs in a `BEGIN IMMEDIATE` transaction around an
///   `INSERT ... ON CONFLICT DO NOTHING`: the primary key `(scope, key)`
///   decides who is first, in one process or many sharing the file.
/// * Every SQLite call runs on Tokio's blocking pool
///   ([`tokio::task::spawn_blocking`]), never on an async worker thread.
/// * A lock held by another connection is waited for up to the busy timeout
///   (default 5 s); past it the call fails with [`StoreError::Unavailable`],
///   which the layer answers with 503.
/// * The schema is created or migrated when the store opens.
///
/// # Example
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, SqliteStore, Store};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dir = tempfile::tempdir()?;
/// # let path = dir.path().join("app.sqlite3");
/// let store = SqliteStore::open(&path).await?;
/// assert_eq!(store.purge_expired().await?, 0);
/// let layer = IdempotencyLayer::new(store, |parts: &http::request::Parts| {
///     parts.headers.get("x-user").and_then(|v| v.to_str().ok()).unwrap_or("anonymous").to_owned()
/// });
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SqliteStore {
    pool: r2d2::Pool<SqliteConnectionManager>,
    clock: Arc<dyn Clock>,
    path: Arc<PathBuf>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// Options for [`SqliteStore`]; made by [`SqliteStore::builder`].
#[must_use]
pub struct SqliteStoreBuilder {
    path: PathBuf,
    busy_timeout: Duration,
    synchronous: Synchronous,
    pool_size: u32,
    clock: Arc<dyn Clock>,
}

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
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Opens (creating if missing) the file and creates or migrates the schema.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the file cannot be opened or
    /// written, or holds a schema newer than this crate knows.
    pub async fn open(self) -> Result<SqliteStore, StoreError> {
        let busy_ms = duration_ms(self.busy_timeout);
        let synchronous = match self.synchronous {
            Synchronous::Normal => "NORMAL",
            Synchronous::Full => "FULL",
        };
        let manager = SqliteConnectionManager::file(&self.path).with_init(move |c| {
            c.busy_timeout(Duration::from_millis(busy_ms as u64))?;
            c.pragma_update(None, "journal_mode", "WAL")?;
            c.pragma_update(None, "synchronous", synchronous)?;
            Ok(())
        });
        let path = self.path.clone();
        let pool_size = self.pool_size;
        let busy_timeout = self.busy_timeout;
        let pool = blocking(move || {
            let pool = r2d2::Pool::builder()
                .max_size(pool_size)
                .min_idle(Some(1))
                .connection_timeout(busy_timeout + Duration::from_secs(1))
                .build(manager)
                .map_err(StoreError::unavailable)?;
            migrate(&mut *pool.get().map_err(StoreError::unavailable)?)?;
            Ok(pool)
        })
        .await?;
        Ok(SqliteStore {
            pool,
            clock: self.clock,
            path: Arc::new(path),
        })
    }
}

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
    tx.execute_batch(SCHEMA).map_err(StoreError::unavailable)?;
    tx.pragma_update(None, "user_version", SCHEMA_VERSION)
        .map_err(StoreError::unavailable)?;
    tx.commit().map_err(StoreError::unavailable)
}

/// Runs `f` on Tokio's blocking pool.
async fn blocking<T, F>(f: F) -> Result<T, StoreError>
where
    F: FnOnce() -> Result<T, StoreError> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(StoreError::unavailable)?
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

    /// Options: busy timeout, `synchronous`, pool size, clock.
    pub fn builder(path: impl AsRef<Path>) -> SqliteStoreBuilder {
        SqliteStoreBuilder {
            path: path.as_ref().to_owned(),
            busy_timeout: Duration::from_secs(5),
            synchronous: Synchronous::default(),
            pool_size: 8,
            clock: Arc::new(SystemClock),
        }
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` with a pooled connection on the blocking pool.
    async fn with_conn<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(&mut rusqlite::Connection, i64) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let pool = self.pool.clone();
        let clock = self.clock.clone();
        blocking(move || {
            let mut conn = pool.get().map_err(StoreError::unavailable)?;
            // Read the clock once the connection is ours, so a wait for the
            // pool does not make the store judge leases by a stale time.
            f(&mut conn, clock.now_ms()).map_err(StoreError::unavailable)
        })
        .await
    }
}

/// What the claim found, before the response blob is decoded.
enum Found {
    Claim(Claim),
    Completed(Vec<u8>),
}

impl Store for SqliteStore {
    async fn claim(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        let found = self
            .with_conn(move |conn, now| {
                let lease_until = now.saturating_add(duration_ms(req.lease));
                let expires_at = now.saturating_add(duration_ms(req.ttl));
                let fingerprint = &req.fingerprint.0[..];
                let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
                let inserted = tx.execute(
                    "INSERT INTO idempotency_records
                        (scope, key, fingerprint, token, state, lease_until, expires_at)
                     VALUES (?1, ?2, ?3, ?4, 'in_flight', ?5, ?6)
                     ON CONFLICT (scope, key) DO NOTHING",
                    params![
                        req.scope,
                        req.key,
                        fingerprint,
                        req.token.0,
                        lease_until,
                        expires_at
                    ],
                )?;
                if inserted == 1 {
                    tx.commit()?;
                    return Ok(Found::Claim(Claim::Acquired { taken_over: false }));
                }
                // The primary key refused the insert: the record exists. The
                // IMMEDIATE transaction holds the write lock, so what we read
                // now is what we decide on.
                let (old_fingerprint, state, old_lease, old_expiry, response) = tx.query_row(
                    "SELECT fingerprint, state, lease_until, expires_at, response
                     FROM idempotency_records WHERE scope = ?1 AND key = ?2",
                    params![req.scope, req.key],
                    |r| {
                        Ok((
                            r.get::<_, Vec<u8>>(0)?,
                            r.get::<_, String>(1)?,
                            r.get::<_, i64>(2)?,
                            r.get::<_, i64>(3)?,
                            r.get::<_, Option<Vec<u8>>>(4)?,
                        ))
                    },
                )?;
                let expired = old_expiry <= now;
                let found = if !expired && old_fingerprint != fingerprint {
                    Found::Claim(Claim::Mismatch)
                } else if !expired && state == "completed" {
                    Found::Completed(response.unwrap_or_default())
                } else if !expired && old_lease > now {
                    Found::Claim(Claim::InFlight {
                        lease_remaining: Duration::from_millis((old_lease - now) as u64),
                    })
                } else {
                    tx.execute(
                        "UPDATE idempotency_records
                         SET fingerprint = ?3, token = ?4, state = 'in_flight',
                             lease_until = ?5, expires_at = ?6, response = NULL
                         WHERE scope = ?1 AND key = ?2",
                        params![
                            req.scope,
                            req.key,
                            fingerprint,
                            req.token.0,
                            lease_until,
                            expires_at
                        ],
                    )?;
                    Found::Claim(Claim::Acquired {
                        taken_over: !expired,
                    })
                };
                tx.commit()?;
                Ok(found)
            })
            .await?;
        match found {
            Found::Claim(claim) => Ok(claim),
            Found::Completed(blob) => StoredResponse::decode(&blob)
                .map(Claim::Completed)
                .map_err(|e| StoreError::Corrupt(e.to_string())),
        }
    }

    async fn complete(
        &self,
        scope: String,
        key: String,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        let blob = response.encode();
        self.with_conn(move |conn, _now| {
            let updated = conn.execute(
                "UPDATE idempotency_records SET state = 'completed', response = ?4
                 WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in_flight'",
                params![scope, key, token.0, blob],
            )?;
            Ok(if updated == 1 {
                Completion::Stored
            } else {
                Completion::Fenced
            })
        })
        .await
    }

    async fn release(
        &self,
        scope: String,
        key: String,
        token: FencingToken,
    ) -> Result<bool, StoreError> {
        self.with_conn(move |conn, _now| {
            let deleted = conn.execute(
                "DELETE FROM idempotency_records
                 WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in_flight'",
                params![scope, key, token.0],
            )?;
            Ok(deleted == 1)
        })
        .await
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.with_conn(|conn, now| {
            let n = conn.execute(
                "DELETE FROM idempotency_records WHERE expires_at <= ?1",
                params![now],
            )?;
            Ok(n as u64)
        })
        .await
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
}
