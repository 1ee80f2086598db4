//! [`Inspect`] for [`MySqlStore`]: stuck records and counts, in SQL.

use sqlx::Row;

use super::{MySqlStore, q, unavailable};
use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::store::{Inspect, RecordCounts, RecordSummary, StoreError};

/// One statement each: one reading of the server's clock (`NOW(6)` is fixed
/// for a statement), and at `READ COMMITTED` one consistent read of the
/// table. No index serves the lease: both scan the table.
impl Inspect for MySqlStore {
    async fn stuck(&self, limit: usize) -> Result<Vec<RecordSummary>, StoreError> {
        let limit = u64::try_from(limit).unwrap_or(u64::MAX);
        let rows = q(&self.sql.stuck)
            .bind(self.offset_ms())
            .bind(limit)
            .fetch_all(&self.pool)
            .await
            .map_err(unavailable)?;
        let text = |bytes: Vec<u8>| {
            String::from_utf8(bytes)
                .map_err(|_| StoreError::Corrupt("a scope or key is not UTF-8".into()))
        };
        rows.iter()
            .map(|row| {
                let fingerprint: Vec<u8> = row.try_get(2).map_err(unavailable)?;
                let fingerprint = <[u8; 32]>::try_from(fingerprint.as_slice())
                    .map_err(|_| StoreError::Corrupt("a fingerprint is not 32 bytes".into()))?;
                Ok(RecordSummary::from_deadlines(
                    text(row.try_get(0).map_err(unavailable)?)?,
                    text(row.try_get(1).map_err(unavailable)?)?,
                    Fingerprint(fingerprint),
                    row.try_get(3).map_err(unavailable)?,
                    row.try_get(4).map_err(unavailable)?,
                    row.try_get(5).map_err(unavailable)?,
                ))
            })
            .collect()
    }

    async fn counts(&self) -> Result<RecordCounts, StoreError> {
        let row = q(&self.sql.counts)
            .bind(self.offset_ms())
            .fetch_one(&self.pool)
            .await
            .map_err(unavailable)?;
        let count = |i: usize| -> Result<u64, StoreError> {
            let n: i64 = row.try_get(i).map_err(unavailable)?;
            u64::try_from(n).map_err(unavailable)
        };
        Ok(RecordCounts {
            in_flight: count(0)?,
            stuck: count(1)?,
            completed: count(2)?,
            expired: count(3)?,
        })
    }
}
