//! The outbox on MySQL 8 and MariaDB 10.6+: [`enqueue`] through the
//! request's [`MySqlTransaction`](crate::store::MySqlTransaction), and the
//! relay's queue over the store's pool.
//!
//! ```no_run
//! use tower_idempotency::key::ClaimedKey;
//! use tower_idempotency::outbox::{self, Message};
//! use tower_idempotency::store::{MySqlTransaction, StoreError};
//!
//! async fn order(tx: MySqlTransaction, claimed: ClaimedKey) -> Result<(), StoreError> {
//!     let event = Message::new(&claimed, 0, "http://billing.internal/events",
//!         "application/json", br#"{"order":17}"#.to_vec()).expect("a valid message");
//!     let mut conn = tx.connection().await?;
//!     outbox::mysql::enqueue(&mut conn, &event) // commits with the handler's writes
//!         .await
//!         .map_err(StoreError::unavailable)?;
//!     Ok(())
//! }
//! ```
//!
//! Relays in several processes claim with `SELECT ... FOR UPDATE SKIP
//! LOCKED` (MySQL 8.0.1+, MariaDB 10.6+) and mark the rows claimed in the
//! same transaction: each due row goes to one of them, and none waits for
//! another's claim. Times are the database server's clock, so the app
//! servers' clocks need not agree.

use std::time::Duration;

use sqlx::mysql::{MySqlConnection, MySqlPool};
use sqlx::{AssertSqlSafe, Connection, Row};

use super::queue::{BoxFut, Claimed, Counts, Entry, Fate, Queue, View};
use super::{Message, TABLE};
use crate::store::StoreError;

/// The database's clock, in milliseconds since the Unix epoch.
const NOW_MS: &str = "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)";

/// The outbox's table and its indexes, created if missing: run by
/// [`Outbox::mysql`](super::Outbox::mysql). Column sizes hold what
/// [`Message`] accepts (keys of 255 bytes, destinations of 2048, payloads
/// of 1 MiB in a `MEDIUMBLOB`).
///
/// # Errors
///
/// The database's error.
pub async fn migrate(conn: &mut MySqlConnection) -> Result<(), sqlx::Error> {
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {TABLE} (
            id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
            msg_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
            destination VARCHAR(2048) NOT NULL,
            content_type VARCHAR(255) NOT NULL,
            payload MEDIUMBLOB NOT NULL,
            state VARCHAR(8) NOT NULL DEFAULT 'pending',
            attempts INT NOT NULL DEFAULT 0,
            created_ms BIGINT NOT NULL,
            due_ms BIGINT NOT NULL,
            lease_until_ms BIGINT NULL,
            lease_owner VARCHAR(64) NULL,
            finished_ms BIGINT NULL,
            last_error TEXT NULL,
            UNIQUE KEY {TABLE}_key (msg_key),
            KEY {TABLE}_due (state, due_ms),
            KEY {TABLE}_finished (state, finished_ms)
        ) ENGINE=InnoDB"
    )))
    .execute(conn)
    .await?;
    Ok(())
}

/// Adds `message` to the outbox through `conn`, the connection of the
/// request's transaction (`&mut *tx.connection().await?` of a
/// [`MySqlTransaction`](crate::store::MySqlTransaction)): it commits with
/// the handler's writes and the idempotency record, or rolls back with
/// them.
///
/// Returns `false` when a message with the same key is already in the
/// outbox (it is kept; this one is not added). The insert is an `INSERT
/// IGNORE`, which ignores only the duplicate key here: every other field
/// was checked by [`Message`] to fit its column.
///
/// # Errors
///
/// The database's error; `Table ... doesn't exist` if no
/// [`Outbox::mysql`](super::Outbox::mysql) (or [`migrate`]) has run on the
/// database.
pub async fn enqueue(conn: &mut MySqlConnection, message: &Message) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(AssertSqlSafe(format!(
        "INSERT IGNORE INTO {TABLE} (msg_key, destination, content_type, payload, created_ms, due_ms)
         VALUES (?, ?, ?, ?, {NOW_MS}, {NOW_MS})"
    )))
    .bind(&message.key)
    .bind(&message.destination)
    .bind(&message.content_type)
    .bind(&message.payload)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4)
}

fn to_u64(v: i64) -> u64 {
    v.max(0) as u64
}

fn err(e: sqlx::Error) -> StoreError {
    StoreError::unavailable(e)
}

/// The relay's queue: the store's pool.
pub(super) struct MySqlQueue {
    pool: MySqlPool,
}

impl MySqlQueue {
    pub(super) async fn open(pool: MySqlPool) -> Result<MySqlQueue, StoreError> {
        let mut conn = pool.acquire().await.map_err(err)?;
        migrate(&mut conn).await.map_err(err)?;
        Ok(MySqlQueue { pool })
    }

    async fn claim_once(
        &self,
        owner: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<Claimed>, sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        let mut tx = conn.begin().await?;
        let now: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT {NOW_MS}")))
            .fetch_one(&mut *tx)
            .await?;
        let ids: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT id FROM {TABLE} WHERE state = 'pending' AND due_ms <= ?
               AND (lease_until_ms IS NULL OR lease_until_ms <= ?)
             ORDER BY due_ms, id LIMIT ? FOR UPDATE SKIP LOCKED"
        )))
        .bind(now)
        .bind(now)
        .bind(limit as i64)
        .fetch_all(&mut *tx)
        .await?;
        if ids.is_empty() {
            tx.commit().await?;
            return Ok(Vec::new());
        }
        let list = vec!["?"; ids.len()].join(", ");
        let mut update = sqlx::query(AssertSqlSafe(format!(
            "UPDATE {TABLE} SET lease_owner = ?, lease_until_ms = ?, attempts = attempts + 1
             WHERE id IN ({list})"
        )))
        .bind(owner)
        .bind(now + ms(lease));
        for id in &ids {
            update = update.bind(id);
        }
        update.execute(&mut *tx).await?;
        let mut select = sqlx::query(AssertSqlSafe(format!(
            "SELECT id, attempts, msg_key, destination, content_type, payload FROM {TABLE}
             WHERE id IN ({list}) ORDER BY due_ms, id"
        )));
        for id in &ids {
            select = select.bind(id);
        }
        let rows = select.fetch_all(&mut *tx).await?;
        tx.commit().await?;
        rows.iter()
            .map(|r| {
                Ok(Claimed {
                    id: r.try_get(0)?,
                    attempt: r.try_get::<i32, _>(1)?.try_into().unwrap_or(u32::MAX),
                    message: Message {
                        key: r.try_get(2)?,
                        destination: r.try_get(3)?,
                        content_type: r.try_get(4)?,
                        payload: r.try_get(5)?,
                    },
                })
            })
            .collect()
    }
}

impl Queue for MySqlQueue {
    fn claim(
        &self,
        owner: &str,
        limit: usize,
        lease: Duration,
    ) -> BoxFut<'_, Result<Vec<Claimed>, StoreError>> {
        let owner = owner.to_owned();
        Box::pin(async move { self.claim_once(&owner, limit, lease).await.map_err(err) })
    }

    fn finish(&self, id: i64, attempt: u32, fate: Fate) -> BoxFut<'_, Result<bool, StoreError>> {
        Box::pin(async move {
            let attempt = i32::try_from(attempt).unwrap_or(i32::MAX);
            let done = match fate {
                Fate::Done => sqlx::query(AssertSqlSafe(format!(
                    "UPDATE {TABLE} SET state = 'done', finished_ms = {NOW_MS}, lease_until_ms = NULL,
                     lease_owner = NULL, last_error = NULL WHERE id = ? AND state = 'pending'"
                )))
                .bind(id)
                .execute(&self.pool)
                .await,
                Fate::Retry { after, error } => sqlx::query(AssertSqlSafe(format!(
                    "UPDATE {TABLE} SET due_ms = {NOW_MS} + ?, lease_until_ms = NULL, lease_owner = NULL,
                     last_error = ? WHERE id = ? AND attempts = ? AND state = 'pending'"
                )))
                .bind(ms(after))
                .bind(error)
                .bind(id)
                .bind(attempt)
                .execute(&self.pool)
                .await,
                Fate::Dead { error } => sqlx::query(AssertSqlSafe(format!(
                    "UPDATE {TABLE} SET state = 'dead', finished_ms = {NOW_MS}, lease_until_ms = NULL,
                     lease_owner = NULL, last_error = ?
                     WHERE id = ? AND attempts = ? AND state = 'pending'"
                )))
                .bind(error)
                .bind(id)
                .bind(attempt)
                .execute(&self.pool)
                .await,
            }
            .map_err(err)?;
            Ok(done.rows_affected() == 1)
        })
    }

    fn purge(&self, older_than: Duration, limit: usize) -> BoxFut<'_, Result<u64, StoreError>> {
        Box::pin(async move {
            let done = sqlx::query(AssertSqlSafe(format!(
                "DELETE FROM {TABLE} WHERE state = 'done' AND finished_ms <= {NOW_MS} - ?
                 ORDER BY id LIMIT ?"
            )))
            .bind(ms(older_than))
            .bind(limit as i64)
            .execute(&self.pool)
            .await
            .map_err(err)?;
            Ok(done.rows_affected())
        })
    }

    fn list(&self, view: View, limit: usize) -> BoxFut<'_, Result<Vec<Entry>, StoreError>> {
        Box::pin(async move {
            let filter = match view {
                View::Pending => {
                    "state = 'pending' AND (lease_until_ms IS NULL OR lease_until_ms <= n.ms)"
                }
                View::InFlight => "state = 'pending' AND lease_until_ms > n.ms",
                View::Dead => "state = 'dead'",
            };
            let rows = sqlx::query(AssertSqlSafe(format!(
                "SELECT id, msg_key, destination, attempts, n.ms - created_ms, due_ms - n.ms,
                   lease_until_ms - n.ms, last_error
                 FROM {TABLE}, (SELECT {NOW_MS} AS ms) n WHERE {filter} ORDER BY id LIMIT ?"
            )))
            .bind(limit as i64)
            .fetch_all(&self.pool)
            .await
            .map_err(err)?;
            rows.iter()
                .map(|r| {
                    Ok(Entry {
                        id: r.try_get(0)?,
                        key: r.try_get(1)?,
                        destination: r.try_get(2)?,
                        attempts: r.try_get::<i32, _>(3)?.try_into().unwrap_or(0),
                        age_ms: to_u64(r.try_get(4)?),
                        due_in_ms: to_u64(r.try_get(5)?),
                        lease_remaining_ms: r
                            .try_get::<Option<i64>, _>(6)?
                            .filter(|l| *l > 0)
                            .map(to_u64),
                        last_error: r.try_get(7)?,
                    })
                })
                .collect::<Result<_, sqlx::Error>>()
                .map_err(err)
        })
    }

    fn requeue(&self, id: i64) -> BoxFut<'_, Result<bool, StoreError>> {
        Box::pin(async move {
            let done = sqlx::query(AssertSqlSafe(format!(
                "UPDATE {TABLE} SET state = 'pending', attempts = 0, due_ms = {NOW_MS}, finished_ms = NULL
                 WHERE id = ? AND state = 'dead'"
            )))
            .bind(id)
            .execute(&self.pool)
            .await
            .map_err(err)?;
            Ok(done.rows_affected() == 1)
        })
    }

    fn counts(&self) -> BoxFut<'_, Result<Counts, StoreError>> {
        Box::pin(async move {
            let count = |cond: &str| {
                format!("CAST(COALESCE(SUM(CASE WHEN {cond} THEN 1 ELSE 0 END), 0) AS SIGNED)")
            };
            let r = sqlx::query(AssertSqlSafe(format!(
                "SELECT {}, {}, {}, {},
                   n.ms - MIN(CASE WHEN state = 'pending' THEN created_ms END)
                 FROM (SELECT {NOW_MS} AS ms) n LEFT JOIN {TABLE} ON TRUE GROUP BY n.ms",
                count("state = 'pending' AND (lease_until_ms IS NULL OR lease_until_ms <= n.ms)"),
                count("state = 'pending' AND lease_until_ms > n.ms"),
                count("state = 'dead'"),
                count("state = 'done'"),
            )))
            .fetch_one(&self.pool)
            .await
            .map_err(err)?;
            let get = |i| r.try_get::<i64, _>(i).map(to_u64).map_err(err);
            Ok(Counts {
                pending: get(0)?,
                in_flight: get(1)?,
                dead: get(2)?,
                done: get(3)?,
                oldest_pending_age_ms: r.try_get::<Option<i64>, _>(4).map_err(err)?.map(to_u64),
            })
        })
    }
}
