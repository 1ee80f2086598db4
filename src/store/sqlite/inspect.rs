//! [`Inspect`] for [`SqliteStore`]: stuck records and counts, in SQL.

use rusqlite::params;

use super::SqliteStore;
use crate::store::{Inspect, RecordCounts, RecordSummary, StoreError};

/// One `SELECT` each, so every answer is one snapshot of the file (WAL
/// readers never wait for the writer). The time is read after the connection
/// is had, as the claim reads it. No index serves the lease: both scan the
/// table, which is fine for an operator's occasional look.
impl Inspect for SqliteStore {
    async fn stuck(&self, limit: usize) -> Result<Vec<RecordSummary>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self
            .with_conn(move |conn, clock| {
                let now = clock.now_ms();
                let mut statement = conn.prepare_cached(
                    "SELECT scope, key, fingerprint, lease_until, expires_at
                     FROM idempotency_records
                     WHERE state = 'in_flight' AND lease_until <= ?1 AND expires_at > ?1
                     ORDER BY lease_until, scope, key
                     LIMIT ?2",
                )?;
                let rows = statement
                    .query_map(params![now, limit], |r| {
                        Ok((
                            r.get::<_, String>(0)?,
                            r.get::<_, String>(1)?,
                            r.get::<_, Vec<u8>>(2)?,
                            r.get::<_, i64>(3)?,
                            r.get::<_, i64>(4)?,
                        ))
                    })?
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                Ok((now, rows))
            })
            .await?;
        let (now, rows) = rows;
        rows.into_iter()
            .map(|(scope, key, fingerprint, lease_until, expires_at)| {
                let fingerprint = <[u8; 32]>::try_from(fingerprint.as_slice())
                    .map_err(|_| StoreError::Corrupt("a fingerprint is not 32 bytes".into()))?;
                Ok(RecordSummary::from_deadlines(
                    scope,
                    key,
                    crate::fingerprint::Fingerprint(fingerprint),
                    lease_until,
                    expires_at,
                    now,
                ))
            })
            .collect()
    }

    async fn counts(&self) -> Result<RecordCounts, StoreError> {
        self.with_conn(|conn, clock| {
            conn.query_row(
                "SELECT
                    COALESCE(SUM(expires_at > ?1 AND state = 'in_flight' AND lease_until > ?1), 0),
                    COALESCE(SUM(expires_at > ?1 AND state = 'in_flight' AND lease_until <= ?1), 0),
                    COALESCE(SUM(expires_at > ?1 AND state = 'completed'), 0),
                    COALESCE(SUM(expires_at <= ?1), 0)
                 FROM idempotency_records",
                params![clock.now_ms()],
                |r| {
                    // COUNT-like sums: never negative.
                    let count = |i| r.get::<_, i64>(i).map(|n| n.max(0) as u64);
                    Ok(RecordCounts {
                        in_flight: count(0)?,
                        stuck: count(1)?,
                        completed: count(2)?,
                        expired: count(3)?,
                    })
                },
            )
        })
        .await
    }
}
