//! The outbox on PostgreSQL: [`enqueue`] through the request's
//! [`PostgresTransaction`](crate::store::PostgresTransaction), and the
//! relay's queue over the store's pool.
//!
//! Relays in several processes claim with `FOR UPDATE SKIP LOCKED`: each
//! due row goes to one of them, and none waits for another's claim. Times are
//! the database server's clock (`clock_timestamp()`), so the app servers'
//! clocks need not agree.

use std::time::Duration;

use deadpool_postgres::Pool;
use tokio_postgres::GenericClient;

use super::queue::{BoxFut, Claimed, Counts, Entry, Fate, Queue, View};
use super::{Message, TABLE};
use crate::store::StoreError;

/// The database's clock, in milliseconds since the Unix epoch.
const NOW_MS: &str = "(floor(extract(epoch from clock_timestamp()) * 1000))::bigint";

/// The outbox's table and indexes, created if missing (under an advisory
/// lock, so processes starting together do not race): run by
/// [`Outbox::postgres`](super::Outbox::postgres).
///
/// # Errors
///
/// The database's error.
pub async fn migrate(client: &mut tokio_postgres::Client) -> Result<(), tokio_postgres::Error> {
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock(7261, 15)", &[])
        .await?;
    tx.batch_execute(&format!(
        "CREATE TABLE IF NOT EXISTS {TABLE} (
            id BIGSERIAL PRIMARY KEY,
            msg_key TEXT NOT NULL UNIQUE,
            destination TEXT NOT NULL,
            content_type TEXT NOT NULL,
            payload BYTEA NOT NULL,
            state TEXT NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'done', 'dead')),
            attempts INTEGER NOT NULL DEFAULT 0,
            created_ms BIGINT NOT NULL DEFAULT {NOW_MS},
            due_ms BIGINT NOT NULL DEFAULT {NOW_MS},
            lease_until_ms BIGINT,
            lease_owner TEXT,
            finished_ms BIGINT,
            last_error TEXT
        );
        CREATE INDEX IF NOT EXISTS {TABLE}_due ON {TABLE} (due_ms) WHERE state = 'pending';
        CREATE INDEX IF NOT EXISTS {TABLE}_finished ON {TABLE} (finished_ms) WHERE state = 'done';"
    ))
    .await?;
    tx.commit().await
}

/// Adds `message` to the outbox through `client`, the connection of the
/// request's transaction (`&*tx.client().await?` of a
/// [`PostgresTransaction`](crate::store::PostgresTransaction)): it commits
/// with the handler's writes and the idempotency record, or rolls back with
/// them.
///
/// Returns `false` when a message with the same key is already in the
/// outbox (it is kept; this one is not added).
///
/// # Errors
///
/// The database's error; `relation ... does not exist` if no
/// [`Outbox::postgres`](super::Outbox::postgres) (or [`migrate`]) has run on
/// the database.
pub async fn enqueue<C: GenericClient>(
    client: &C,
    message: &Message,
) -> Result<bool, tokio_postgres::Error> {
    let n = client
        .execute(
            &format!(
                "INSERT INTO {TABLE} (msg_key, destination, content_type, payload)
                 VALUES ($1, $2, $3, $4) ON CONFLICT (msg_key) DO NOTHING"
            ),
            &[
                &message.key,
                &message.destination,
                &message.content_type,
                &message.payload,
            ],
        )
        .await?;
    Ok(n == 1)
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4)
}

/// The relay's queue: the app's pool.
pub(super) struct PostgresQueue {
    pool: Pool,
}

impl PostgresQueue {
    pub(super) async fn open(pool: Pool) -> Result<PostgresQueue, StoreError> {
        let mut client = pool.get().await.map_err(StoreError::unavailable)?;
        migrate(&mut client)
            .await
            .map_err(StoreError::unavailable)?;
        Ok(PostgresQueue { pool })
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool.get().await.map_err(StoreError::unavailable)
    }
}

fn err(e: tokio_postgres::Error) -> StoreError {
    StoreError::unavailable(e)
}

fn to_u64(v: i64) -> u64 {
    v.max(0) as u64
}

impl Queue for PostgresQueue {
    fn claim(
        &self,
        owner: &str,
        limit: usize,
        lease: Duration,
    ) -> BoxFut<'_, Result<Vec<Claimed>, StoreError>> {
        let owner = owner.to_owned();
        Box::pin(async move {
            let client = self.client().await?;
            let rows = client
                .query(
                    &format!(
                        "WITH now AS (SELECT {NOW_MS} AS ms)
                         UPDATE {TABLE} SET lease_owner = $1, lease_until_ms = (SELECT ms FROM now) + $2,
                           attempts = attempts + 1
                         WHERE id IN (SELECT id FROM {TABLE} WHERE state = 'pending'
                           AND due_ms <= (SELECT ms FROM now)
                           AND (lease_until_ms IS NULL OR lease_until_ms <= (SELECT ms FROM now))
                           ORDER BY due_ms, id LIMIT $3 FOR UPDATE SKIP LOCKED)
                         RETURNING id, attempts, msg_key, destination, content_type, payload"
                    ),
                    &[&owner, &ms(lease), &(limit as i64)],
                )
                .await
                .map_err(err)?;
            rows.iter()
                .map(|r| {
                    Ok(Claimed {
                        id: r.try_get(0)?,
                        attempt: r.try_get::<_, i32>(1)?.try_into().unwrap_or(u32::MAX),
                        message: Message {
                            key: r.try_get(2)?,
                            destination: r.try_get(3)?,
                            content_type: r.try_get(4)?,
                            payload: r.try_get(5)?,
                        },
                    })
                })
                .collect::<Result<_, tokio_postgres::Error>>()
                .map_err(err)
        })
    }

    fn finish(&self, id: i64, attempt: u32, fate: Fate) -> BoxFut<'_, Result<bool, StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            let attempt = i32::try_from(attempt).unwrap_or(i32::MAX);
            let n = match fate {
                Fate::Done => client
                    .execute(
                        &format!(
                            "UPDATE {TABLE} SET state = 'done', finished_ms = {NOW_MS}, lease_until_ms = NULL,
                             lease_owner = NULL, last_error = NULL WHERE id = $1 AND state = 'pending'"
                        ),
                        &[&id],
                    )
                    .await,
                Fate::Retry { after, error } => client
                    .execute(
                        &format!(
                            "UPDATE {TABLE} SET due_ms = {NOW_MS} + $3, lease_until_ms = NULL, lease_owner = NULL,
                             last_error = $4 WHERE id = $1 AND attempts = $2 AND state = 'pending'"
                        ),
                        &[&id, &attempt, &ms(after), &error],
                    )
                    .await,
                Fate::Dead { error } => client
                    .execute(
                        &format!(
                            "UPDATE {TABLE} SET state = 'dead', finished_ms = {NOW_MS}, lease_until_ms = NULL,
                             lease_owner = NULL, last_error = $3
                             WHERE id = $1 AND attempts = $2 AND state = 'pending'"
                        ),
                        &[&id, &attempt, &error],
                    )
                    .await,
            }
            .map_err(err)?;
            Ok(n == 1)
        })
    }

    fn purge(&self, older_than: Duration, limit: usize) -> BoxFut<'_, Result<u64, StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            client
                .execute(
                    &format!(
                        "DELETE FROM {TABLE} WHERE id IN (SELECT id FROM {TABLE}
                         WHERE state = 'done' AND finished_ms <= {NOW_MS} - $1 LIMIT $2)"
                    ),
                    &[&ms(older_than), &(limit as i64)],
                )
                .await
                .map_err(err)
        })
    }

    fn list(&self, view: View, limit: usize) -> BoxFut<'_, Result<Vec<Entry>, StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            let filter = match view {
                View::Pending => {
                    "state = 'pending' AND (lease_until_ms IS NULL OR lease_until_ms <= n.ms)"
                }
                View::InFlight => "state = 'pending' AND lease_until_ms > n.ms",
                View::Dead => "state = 'dead'",
            };
            let rows = client
                .query(
                    &format!(
                        "SELECT id, msg_key, destination, attempts, n.ms - created_ms, due_ms - n.ms,
                           lease_until_ms - n.ms, last_error
                         FROM {TABLE}, (SELECT {NOW_MS} AS ms) n WHERE {filter} ORDER BY id LIMIT $1"
                    ),
                    &[&(limit as i64)],
                )
                .await
                .map_err(err)?;
            rows.iter()
                .map(|r| {
                    Ok(Entry {
                        id: r.try_get(0)?,
                        key: r.try_get(1)?,
                        destination: r.try_get(2)?,
                        attempts: r.try_get::<_, i32>(3)?.try_into().unwrap_or(0),
                        age_ms: to_u64(r.try_get(4)?),
                        due_in_ms: to_u64(r.try_get(5)?),
                        lease_remaining_ms: r
                            .try_get::<_, Option<i64>>(6)?
                            .filter(|l| *l > 0)
                            .map(to_u64),
                        last_error: r.try_get(7)?,
                    })
                })
                .collect::<Result<_, tokio_postgres::Error>>()
                .map_err(err)
        })
    }

    fn requeue(&self, id: i64) -> BoxFut<'_, Result<bool, StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            let n = client
                .execute(
                    &format!(
                        "UPDATE {TABLE} SET state = 'pending', attempts = 0, due_ms = {NOW_MS}, finished_ms = NULL
                         WHERE id = $1 AND state = 'dead'"
                    ),
                    &[&id],
                )
                .await
                .map_err(err)?;
            Ok(n == 1)
        })
    }

    fn counts(&self) -> BoxFut<'_, Result<Counts, StoreError>> {
        Box::pin(async move {
            let client = self.client().await?;
            let r = client
                .query_one(
                    &format!(
                        "WITH n AS (SELECT {NOW_MS} AS ms) SELECT
                           COUNT(*) FILTER (WHERE state = 'pending'
                             AND (lease_until_ms IS NULL OR lease_until_ms <= (SELECT ms FROM n))),
                           COUNT(*) FILTER (WHERE state = 'pending' AND lease_until_ms > (SELECT ms FROM n)),
                           COUNT(*) FILTER (WHERE state = 'dead'),
                           COUNT(*) FILTER (WHERE state = 'done'),
                           (SELECT ms FROM n) - MIN(created_ms) FILTER (WHERE state = 'pending')
                         FROM {TABLE}"
                    ),
                    &[],
                )
                .await
                .map_err(err)?;
            let get = |i| r.try_get::<_, i64>(i).map(to_u64).map_err(err);
            Ok(Counts {
                pending: get(0)?,
                in_flight: get(1)?,
                dead: get(2)?,
                done: get(3)?,
                oldest_pending_age_ms: r.try_get::<_, Option<i64>>(4).map_err(err)?.map(to_u64),
            })
        })
    }
}
