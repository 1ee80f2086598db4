//! The claim's SQL on a `sqlx::SqliteConnection`: the claim inside a
//! `BEGIN IMMEDIATE` transaction, and the completion fenced by the token.
//! The same statements as the rusqlite store's, so both stores can share a
//! file.

use sqlx::{Row, SqliteConnection};

pub(super) use tower_idempotency::store::kit::claim::Found;
use tower_idempotency::store::kit::claim::{ClaimSteps, Met};
use tower_idempotency::store::{ClaimRequest, Completion, FencingToken};

/// The claim (the table in the module docs of [`tower_idempotency::store`]) on `conn`,
/// which must be inside a `BEGIN IMMEDIATE` transaction: it holds SQLite's
/// write lock, so what it reads is what it decides on.
pub(super) async fn claim_in(
    conn: &mut SqliteConnection,
    req: &ClaimRequest,
    now: i64,
) -> Result<Found, sqlx::Error> {
    tower_idempotency::store::kit::claim::claim_in(&mut Steps(conn), req, now).await
}

/// The claim's statements on a connection holding the write lock.
struct Steps<'a>(&'a mut SqliteConnection);

impl ClaimSteps for Steps<'_> {
    type Error = sqlx::Error;

    async fn insert(
        &mut self,
        req: &ClaimRequest,
        lease_until: i64,
        expires_at: i64,
    ) -> Result<bool, sqlx::Error> {
        let inserted = sqlx::query(
            "INSERT INTO idempotency_records
                (scope, key, fingerprint, token, state, lease_until, expires_at)
             VALUES (?1, ?2, ?3, ?4, 'in_flight', ?5, ?6)
             ON CONFLICT (scope, key) DO NOTHING",
        )
        .bind(&req.scope)
        .bind(&req.key)
        .bind(&req.fingerprint.0[..])
        .bind(req.token.0)
        .bind(lease_until)
        .bind(expires_at)
        .execute(&mut *self.0)
        .await?;
        Ok(inserted.rows_affected() == 1)
    }

    /// Under the write lock, the row an insert met is there.
    async fn select(&mut self, req: &ClaimRequest) -> Result<Option<Met>, sqlx::Error> {
        let row = sqlx::query(
            "SELECT fingerprint, state, lease_until, expires_at, response
             FROM idempotency_records WHERE scope = ?1 AND key = ?2",
        )
        .bind(&req.scope)
        .bind(&req.key)
        .fetch_one(&mut *self.0)
        .await?;
        Ok(Some(Met {
            fingerprint: row.try_get(0)?,
            completed: row.try_get::<String, _>(1)? == "completed",
            lease_until: row.try_get(2)?,
            expires_at: row.try_get(3)?,
            response: row.try_get(4)?,
            now: None,
        }))
    }

    async fn take_over(
        &mut self,
        req: &ClaimRequest,
        lease_until: i64,
        expires_at: i64,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(
            "UPDATE idempotency_records
             SET fingerprint = ?3, token = ?4, state = 'in_flight',
                 lease_until = ?5, expires_at = ?6, response = NULL
             WHERE scope = ?1 AND key = ?2",
        )
        .bind(&req.scope)
        .bind(&req.key)
        .bind(&req.fingerprint.0[..])
        .bind(req.token.0)
        .bind(lease_until)
        .bind(expires_at)
        .execute(&mut *self.0)
        .await?;
        Ok(())
    }

    fn vanished() -> sqlx::Error {
        sqlx::Error::RowNotFound
    }
}

/// Completes the record if it still carries `token`.
pub(super) async fn complete_in<'c, E>(
    executor: E,
    scope: &str,
    key: &str,
    token: FencingToken,
    blob: &[u8],
) -> Result<Completion, sqlx::Error>
where
    E: sqlx::Executor<'c, Database = sqlx::Sqlite>,
{
    let updated = sqlx::query(
        "UPDATE idempotency_records SET state = 'completed', response = ?4
         WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in_flight'",
    )
    .bind(scope)
    .bind(key)
    .bind(token.0)
    .bind(blob)
    .execute(executor)
    .await?
    .rows_affected();
    Ok(if updated == 1 {
        Completion::Stored
    } else {
        Completion::Fenced
    })
}
