//! [`Inspect`] for [`SqlxSqliteStore`]: stuck records and counts, in SQL.

use sqlx::Row;

use super::SqlxSqliteStore;
use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::store::{Inspect, RecordCounts, RecordSummary, StoreError};

/// One `SELECT` each on a pooled connection, so every answer is one snapshot
/// of the database (WAL readers never wait for the writer). No index serves
/// the lease: both scan the table, which is fine for an operator's
/// occasional look.
impl Inspect for SqlxSqliteStore {
    async fn stuck(&self, limit: usize) -> Result<Vec<RecordSummary>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let now = self.clock.now_ms();
        let rows = sqlx::query(
            "SELECT scope, key, fingerprint, lease_until, expires_at
             FROM idempotency_records
             WHERE state = 'in_flight' AND lease_until <= ?1 AND expires_at > ?1
             ORDER BY lease_until, scope, key
             LIMIT ?2",
        )
        .bind(now)
        .bind(limit)
        .fetch_all(&self.pool)
        .await
        .map_err(|e| self.error(e))?;
        rows.iter()
            .map(|r| {
                let column = |e: sqlx::Error| StoreError::Corrupt(e.to_string());
                let fingerprint: Vec<u8> = r.try_get(2).map_err(column)?;
                let fingerprint = <[u8; 32]>::try_from(fingerprint.as_slice())
                    .map_err(|_| StoreError::Corrupt("a fingerprint is not 32 bytes".into()))?;
                Ok(RecordSummary::from_deadlines(
                    r.try_get(0).map_err(column)?,
                    r.try_get(1).map_err(column)?,
                    Fingerprint(fingerprint),
                    r.try_get(3).map_err(column)?,
                    r.try_get(4).map_err(column)?,
                    now,
                ))
            })
            .collect()
    }

    async fn counts(&self) -> Result<RecordCounts, StoreError> {
        let row = sqlx::query(
            "SELECT
                COALESCE(SUM(expires_at > ?1 AND state = 'in_flight' AND lease_until > ?1), 0),
                COALESCE(SUM(expires_at > ?1 AND state = 'in_flight' AND lease_until <= ?1), 0),
                COALESCE(SUM(expires_at > ?1 AND state = 'completed'), 0),
                COALESCE(SUM(expires_at <= ?1), 0)
             FROM idempotency_records",
        )
        .bind(self.clock.now_ms())
        .fetch_one(&self.pool)
        .await
        .map_err(|e| self.error(e))?;
        // COUNT-like sums: never negative.
        let count = |i: usize| {
            row.try_get::<i64, _>(i)
                .map(|n| n.max(0) as u64)
                .map_err(|e| StoreError::Corrupt(e.to_string()))
        };
        Ok(RecordCounts {
            in_flight: count(0)?,
            stuck: count(1)?,
            completed: count(2)?,
            expired: count(3)?,
        })
    }
}
