//! The outbox on SQLite: [`enqueue`] inside the handler's transaction
//! ([`SqliteTransaction::run`](crate::store::SqliteTransaction::run)), and the
//! relay's queue over a connection of its own to the same file.
//!
//! Several processes may share the file, each with a relay: a claim is one
//! `UPDATE ... RETURNING` statement, which SQLite runs under its write lock,
//! so two relays never claim one message at once.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::{OptionalExtension, params};

use super::queue::{BoxFut, Claimed, Counts, Entry, Fate, Queue, View};
use super::{Message, TABLE};
use crate::store::StoreError;

/// The outbox's table and index, created if missing: run by
/// [`Outbox::sqlite`](super::Outbox::sqlite); call it yourself only if
/// handlers enqueue before any relay of the database has started.
///
/// # Errors
///
/// SQLite's error, e.g. the database is locked past its busy timeout.
pub fn migrate(conn: &rusqlite::Connection) -> rusqlite::Result<()> {
    conn.execute_batch(&format!(
        "CREATE TABLE IF NOT EXISTS {TABLE} (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            msg_key TEXT NOT NULL UNIQUE,
            destination TEXT NOT NULL,
            content_type TEXT NOT NULL,
            payload BLOB NOT NULL,
            state TEXT NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'done', 'dead')),
            attempts INTEGER NOT NULL DEFAULT 0,
            created_ms INTEGER NOT NULL,
            due_ms INTEGER NOT NULL,
            lease_until_ms INTEGER,
            lease_owner TEXT,
            finished_ms INTEGER,
            last_error TEXT
        );
        CREATE INDEX IF NOT EXISTS {TABLE}_due ON {TABLE} (due_ms) WHERE state = 'pending';
        CREATE INDEX IF NOT EXISTS {TABLE}_finished ON {TABLE} (finished_ms) WHERE state = 'done';"
    ))
}

/// Adds `message` to the outbox in the transaction of `conn` (pass the
/// `&rusqlite::Transaction` that [`SqliteTransaction::run`] hands its
/// closure): it commits with the handler's writes and the idempotency
/// record, or rolls back with them.
///
/// Returns `false` when a message with the same key is already in the
/// outbox (it is kept, this one is not added): a key names one message.
///
/// [`SqliteTransaction::run`]: crate::store::SqliteTransaction::run
///
/// # Errors
///
/// SQLite's error; `no such table` if no [`Outbox::sqlite`](super::Outbox::sqlite)
/// (or [`migrate`]) has run on the database.
pub fn enqueue(conn: &rusqlite::Connection, message: &Message) -> rusqlite::Result<bool> {
    let now = now_ms();
    let n = conn
        .prepare_cached(&format!(
            "INSERT INTO {TABLE} (msg_key, destination, content_type, payload, created_ms, due_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?5) ON CONFLICT (msg_key) DO NOTHING"
        ))?
        .execute(params![
            message.key,
            message.destination,
            message.content_type,
            message.payload,
            now
        ])?;
    Ok(n == 1)
}

/// Milliseconds since the Unix epoch, by this machine's clock (processes
/// sharing a SQLite file share the machine).
fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4)
}

/// The relay's queue: one connection of its own, used on Tokio's blocking
/// pool.
pub(super) struct SqliteQueue {
    conn: Arc<Mutex<rusqlite::Connection>>,
}

impl SqliteQueue {
    pub(super) async fn open(path: &Path) -> Result<SqliteQueue, StoreError> {
        let path = path.to_owned();
        let conn = tokio::task::spawn_blocking(move || -> rusqlite::Result<_> {
            let conn = rusqlite::Connection::open(path)?;
            conn.busy_timeout(Duration::from_secs(5))?;
            conn.pragma_update(None, "journal_mode", "WAL")?;
            migrate(&conn)?;
            Ok(conn)
        })
        .await
        .map_err(StoreError::unavailable)?
        .map_err(StoreError::unavailable)?;
        Ok(SqliteQueue {
            conn: Arc::new(Mutex::new(conn)),
        })
    }

    fn with<T, F>(&self, f: F) -> BoxFut<'_, Result<T, StoreError>>
    where
        F: FnOnce(&mut rusqlite::Connection, i64) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let conn = self.conn.clone();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || {
                let mut conn = conn.lock().unwrap_or_else(|p| p.into_inner());
                f(&mut conn, now_ms())
            })
            .await
            .map_err(StoreError::unavailable)?
            .map_err(StoreError::unavailable)
        })
    }
}

fn entry(r: &rusqlite::Row<'_>, now: i64) -> rusqlite::Result<Entry> {
    let created: i64 = r.get(4)?;
    let due: i64 = r.get(5)?;
    let lease: Option<i64> = r.get(6)?;
    Ok(Entry {
        id: r.get(0)?,
        key: r.get(1)?,
        destination: r.get(2)?,
        attempts: r.get::<_, i64>(3)?.try_into().unwrap_or(u32::MAX),
        age_ms: (now - created).max(0) as u64,
        due_in_ms: (due - now).max(0) as u64,
        lease_remaining_ms: lease.map(|l| (l - now).max(0) as u64).filter(|l| *l > 0),
        last_error: r.get(7)?,
    })
}

impl Queue for SqliteQueue {
    fn claim(
        &self,
        owner: &str,
        limit: usize,
        lease: Duration,
    ) -> BoxFut<'_, Result<Vec<Claimed>, StoreError>> {
        let owner = owner.to_owned();
        let lease = ms(lease);
        self.with(move |conn, now| {
            // A read first: an idle relay polls without taking the write lock.
            let due: bool = conn
                .prepare_cached(&format!(
                    "SELECT EXISTS (SELECT 1 FROM {TABLE} WHERE state = 'pending' AND due_ms <= ?1
                     AND (lease_until_ms IS NULL OR lease_until_ms <= ?1))"
                ))?
                .query_row(params![now], |r| r.get(0))?;
            if !due {
                return Ok(Vec::new());
            }
            let mut stmt = conn.prepare_cached(&format!(
                "UPDATE {TABLE} SET lease_owner = ?1, lease_until_ms = ?2 + ?3, attempts = attempts + 1
                 WHERE id IN (SELECT id FROM {TABLE} WHERE state = 'pending' AND due_ms <= ?2
                   AND (lease_until_ms IS NULL OR lease_until_ms <= ?2) ORDER BY due_ms, id LIMIT ?4)
                 RETURNING id, attempts, msg_key, destination, content_type, payload"
            ))?;
            let rows = stmt.query_map(params![owner, now, lease, limit as i64], |r| {
                Ok(Claimed {
                    id: r.get(0)?,
                    attempt: r.get::<_, i64>(1)?.try_into().unwrap_or(u32::MAX),
                    message: Message {
                        key: r.get(2)?,
                        destination: r.get(3)?,
                        content_type: r.get(4)?,
                        payload: r.get(5)?,
                    },
                })
            })?;
            rows.collect()
        })
    }

    fn finish(&self, id: i64, attempt: u32, fate: Fate) -> BoxFut<'_, Result<bool, StoreError>> {
        self.with(move |conn, now| {
            let n = match fate {
                // Delivered: whoever holds the lease now, the message is done.
                Fate::Done => conn.execute(
                    &format!(
                        "UPDATE {TABLE} SET state = 'done', finished_ms = ?2, lease_until_ms = NULL,
                         lease_owner = NULL, last_error = NULL WHERE id = ?1 AND state = 'pending'"
                    ),
                    params![id, now],
                )?,
                // Only the attempt that holds the claim schedules the next.
                Fate::Retry { after, error } => conn.execute(
                    &format!(
                        "UPDATE {TABLE} SET due_ms = ?3, lease_until_ms = NULL, lease_owner = NULL,
                         last_error = ?4 WHERE id = ?1 AND attempts = ?2 AND state = 'pending'"
                    ),
                    params![id, attempt, now + ms(after), error],
                )?,
                Fate::Dead { error } => conn.execute(
                    &format!(
                        "UPDATE {TABLE} SET state = 'dead', finished_ms = ?3, lease_until_ms = NULL,
                         lease_owner = NULL, last_error = ?4 WHERE id = ?1 AND attempts = ?2 AND state = 'pending'"
                    ),
                    params![id, attempt, now, error],
                )?,
            };
            Ok(n == 1)
        })
    }

    fn purge(&self, older_than: Duration, limit: usize) -> BoxFut<'_, Result<u64, StoreError>> {
        let age = ms(older_than);
        self.with(move |conn, now| {
            let n = conn.execute(
                &format!(
                    "DELETE FROM {TABLE} WHERE id IN (SELECT id FROM {TABLE}
                     WHERE state = 'done' AND finished_ms <= ?1 LIMIT ?2)"
                ),
                params![now - age, limit as i64],
            )?;
            Ok(n as u64)
        })
    }

    fn list(&self, view: View, limit: usize) -> BoxFut<'_, Result<Vec<Entry>, StoreError>> {
        self.with(move |conn, now| {
            let filter = match view {
                View::Pending => "state = 'pending' AND (lease_until_ms IS NULL OR lease_until_ms <= ?1)",
                View::InFlight => "state = 'pending' AND lease_until_ms > ?1",
                View::Dead => "state = 'dead' AND ?1 = ?1",
            };
            let mut stmt = conn.prepare(&format!(
                "SELECT id, msg_key, destination, attempts, created_ms, due_ms, lease_until_ms, last_error
                 FROM {TABLE} WHERE {filter} ORDER BY id LIMIT ?2"
            ))?;
            let rows = stmt.query_map(params![now, limit as i64], |r| entry(r, now))?;
            rows.collect()
        })
    }

    fn requeue(&self, id: i64) -> BoxFut<'_, Result<bool, StoreError>> {
        self.with(move |conn, now| {
            let n = conn.execute(
                &format!(
                    "UPDATE {TABLE} SET state = 'pending', attempts = 0, due_ms = ?2, finished_ms = NULL
                     WHERE id = ?1 AND state = 'dead'"
                ),
                params![id, now],
            )?;
            Ok(n == 1)
        })
    }

    fn counts(&self) -> BoxFut<'_, Result<Counts, StoreError>> {
        self.with(move |conn, now| {
            let (pending, in_flight, dead, done): (i64, i64, i64, i64) = conn.query_row(
                &format!(
                    "SELECT
                       COUNT(*) FILTER (WHERE state = 'pending' AND (lease_until_ms IS NULL OR lease_until_ms <= ?1)),
                       COUNT(*) FILTER (WHERE state = 'pending' AND lease_until_ms > ?1),
                       COUNT(*) FILTER (WHERE state = 'dead'),
                       COUNT(*) FILTER (WHERE state = 'done')
                     FROM {TABLE}"
                ),
                params![now],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
            )?;
            let oldest: Option<i64> = conn
                .query_row(
                    &format!("SELECT MIN(created_ms) FROM {TABLE} WHERE state = 'pending'"),
                    [],
                    |r| r.get(0),
                )
                .optional()?
                .flatten();
            Ok(Counts {
                pending: pending as u64,
                in_flight: in_flight as u64,
                dead: dead as u64,
                done: done as u64,
                oldest_pending_age_ms: oldest.map(|c| (now - c).max(0) as u64),
            })
        })
    }
}
