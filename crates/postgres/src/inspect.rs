//! [`Inspect`] for [`PostgresStore`]: stuck records and counts, in SQL.

use super::{PostgresStore, unavailable};
use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::store::{Inspect, RecordCounts, RecordSummary, StoreError};

/// One statement each: one snapshot of the table, judged at one reading of
/// the server's clock. No index serves the lease: both scan the table.
///
/// Committed records only: a transactional request's claim, which lives in
/// its open transaction (one phase, the default), is counted by neither
/// until it commits completed, and can never be stuck (a crash rolls it
/// back). Separate-mode claims, and transactional ones with
/// [`commit_claims_first`](crate::PostgresStoreBuilder::commit_claims_first),
/// are counted in flight from their claim on.
impl Inspect for PostgresStore {
    async fn stuck(&self, limit: usize) -> Result<Vec<RecordSummary>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let client = self.client().await?;
        let rows = client
            .query(&self.sql.stuck, &[&self.offset_ms(), &limit])
            .await
            .map_err(unavailable)?;
        rows.iter()
            .map(|row| {
                let fingerprint: Vec<u8> = row.try_get(2).map_err(unavailable)?;
                let fingerprint = <[u8; 32]>::try_from(fingerprint.as_slice())
                    .map_err(|_| StoreError::Corrupt("a fingerprint is not 32 bytes".into()))?;
                Ok(RecordSummary::from_deadlines(
                    row.try_get(0).map_err(unavailable)?,
                    row.try_get(1).map_err(unavailable)?,
                    Fingerprint(fingerprint),
                    row.try_get(3).map_err(unavailable)?,
                    row.try_get(4).map_err(unavailable)?,
                    row.try_get(5).map_err(unavailable)?,
                ))
            })
            .collect()
    }

    async fn counts(&self) -> Result<RecordCounts, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_one(&self.sql.counts, &[&self.offset_ms()])
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
