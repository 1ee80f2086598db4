//! The row of the read-first replay (`completed`), decoded once for the
//! sqlx PostgreSQL and MySQL stores: `fingerprint, response, TTL left (ms)`.

use sqlx::{ColumnIndex, Decode, Row, Type};
use tower_idempotency::store::kit::claim::CompletedRow;

/// The three columns of a `completed` row.
pub(crate) fn completed_row<R>(row: &R) -> Result<CompletedRow, sqlx::Error>
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
