//! The claim's SQL on a `sqlx::SqliteConnection`: the claim inside a
//! `BEGIN IMMEDIATE` transaction, and the completion fenced by the token.
//! The same statements as the rusqlite store's, so both stores can share a
//! file.

use sqlx::{Row, SqliteConnection};

use crate::response::StoredResponse;
use crate::store::{
    Claim, ClaimRequest, Completion, Decision, Existing, FencingToken, Refusal, StoreError, decide,
    duration_ms,
};

/// What the claim did: acquired the record, or refused (the response blob
/// not yet decoded).
pub(super) enum Found {
    Acquired { taken_over: bool },
    Mismatch,
    InFlight(std::time::Duration),
    Completed(Vec<u8>),
}

impl Found {
    /// `Ok(taken_over)` when the claim acquired the record, else the
    /// refusal with its response decoded.
    pub(super) fn decode(self) -> Result<Result<bool, Refusal>, StoreError> {
        Ok(Err(match self {
            Found::Acquired { taken_over } => return Ok(Ok(taken_over)),
            Found::Mismatch => Refusal::Mismatch,
            Found::InFlight(lease_remaining) => Refusal::InFlight { lease_remaining },
            Found::Completed(blob) => StoredResponse::decode(&blob)
                .map(Refusal::Completed)
                .map_err(|e| StoreError::Corrupt(e.to_string()))?,
        }))
    }

    pub(super) fn into_claim(self) -> Result<Claim, StoreError> {
        Ok(match self.decode()? {
            Ok(taken_over) => Claim::Acquired { taken_over },
            Err(refusal) => Claim::Refused(refusal),
        })
    }
}

/// The claim (the table in the module docs of [`crate::store`]) on `conn`,
/// which must be inside a `BEGIN IMMEDIATE` transaction: it holds SQLite's
/// write lock, so what it reads is what it decides on. The insert comes
/// first; the primary key `(scope, key)` decides who inserts first. Only a
/// conflicting insert reads the record it met.
pub(super) async fn claim_in(
    conn: &mut SqliteConnection,
    req: &ClaimRequest,
    now: i64,
) -> Result<Found, sqlx::Error> {
    let lease_until = now.saturating_add(duration_ms(req.lease));
    let expires_at = now.saturating_add(duration_ms(req.ttl));
    let fingerprint = &req.fingerprint.0[..];
    let inserted = sqlx::query(
        "INSERT INTO idempotency_records
            (scope, key, fingerprint, token, state, lease_until, expires_at)
         VALUES (?1, ?2, ?3, ?4, 'in_flight', ?5, ?6)
         ON CONFLICT (scope, key) DO NOTHING",
    )
    .bind(&req.scope)
    .bind(&req.key)
    .bind(fingerprint)
    .bind(req.token.0)
    .bind(lease_until)
    .bind(expires_at)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if inserted == 1 {
        return Ok(Found::Acquired { taken_over: false });
    }
    // The insert conflicted, so the row exists under the write lock.
    let row = sqlx::query(
        "SELECT fingerprint, state, lease_until, expires_at, response
         FROM idempotency_records WHERE scope = ?1 AND key = ?2",
    )
    .bind(&req.scope)
    .bind(&req.key)
    .fetch_one(&mut *conn)
    .await?;
    let stored_fingerprint: Vec<u8> = row.try_get(0)?;
    let state: String = row.try_get(1)?;
    let existing = Existing {
        fingerprint: &stored_fingerprint,
        completed: state == "completed",
        lease_until: row.try_get(2)?,
        expires_at: row.try_get(3)?,
    };
    let taken_over = match decide(&existing, &req.fingerprint, now, req.lease) {
        Decision::Replace { taken_over } => taken_over,
        Decision::Mismatch => return Ok(Found::Mismatch),
        Decision::Replay => {
            let blob: Option<Vec<u8>> = row.try_get(4)?;
            return Ok(Found::Completed(blob.unwrap_or_default()));
        }
        Decision::InFlight(lease_remaining) => return Ok(Found::InFlight(lease_remaining)),
    };
    sqlx::query(
        "UPDATE idempotency_records
         SET fingerprint = ?3, token = ?4, state = 'in_flight',
             lease_until = ?5, expires_at = ?6, response = NULL
         WHERE scope = ?1 AND key = ?2",
    )
    .bind(&req.scope)
    .bind(&req.key)
    .bind(fingerprint)
    .bind(req.token.0)
    .bind(lease_until)
    .bind(expires_at)
    .execute(&mut *conn)
    .await?;
    Ok(Found::Acquired { taken_over })
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
