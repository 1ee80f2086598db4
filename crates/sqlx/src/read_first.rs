//! The row of the read-first replay (`completed`), decoded and answered
//! once for the sqlx PostgreSQL and MySQL stores: `fingerprint, response,
//! TTL left (ms)`.

use std::time::Instant;

use sqlx::{ColumnIndex, Decode, Row, Type};
use tower_idempotency::store::kit::claim::{CompletedRow, answer_completed};
use tower_idempotency::store::kit::replay_cache::ReplayCache;
use tower_idempotency::store::{Claim, ClaimRequest, Refusal, StoreError};

/// The answer of the read-first row, if the read found a completed record:
/// its replay (cached until the TTL it had left, from `sent`), or 422.
pub(crate) fn answer<R>(
    row: Option<R>,
    req: &ClaimRequest,
    replays: &ReplayCache,
    sent: Instant,
) -> Result<Option<Refusal>, StoreError>
where
    R: Row,
    usize: ColumnIndex<R>,
    for<'r> Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    let Some(row) = row else { return Ok(None) };
    let row = completed_row(&row).map_err(StoreError::unavailable)?;
    Ok(match answer_completed(row, req, replays, sent)? {
        Claim::Refused(refused) => Some(refused),
        Claim::Acquired { .. } => None,
    })
}

/// The three columns of a `completed` row.
fn completed_row<R>(row: &R) -> Result<CompletedRow, sqlx::Error>
where
    R: Row,
    usize: ColumnIndex<R>,
    for<'r> Vec<u8>: Decode<'r, R::Database> + Type<R::Database>,
    for<'r> i64: Decode<'r, R::Database> + Type<R::Database>,
{
    Ok(CompletedRow {
        fingerprint: row.try_get(0)?,
        response: row.try_get(1)?,
        ttl_left_ms: row.try_get(2)?,
    })
}
