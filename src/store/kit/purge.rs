//! Retention, on by default: every SQL store deletes its expired records on
//! its own, in bounded batches. Written once here; a store supplies its
//! bounded `DELETE` and keeps a [`PurgeTask`].
//!
//! ```
//! use std::time::Duration;
//! use tower_idempotency::store::Purge;
//!
//! // The default: every 60 s, statements of at most 1,000 rows each.
//! assert_eq!(Purge::default(), Purge::every(Duration::from_secs(60)).batch(1_000));
//! // Tuned, or off (the application purges, or nothing does).
//! let hourly = Purge::every(Duration::from_secs(3600)).batch(10_000);
//! assert_eq!(hourly.period(), Some(Duration::from_secs(3600)));
//! assert_eq!(Purge::off().period(), None);
//! ```
//!
//! A record past its TTL is ignored by every lookup whether or not it was
//! deleted; the purge only gives its space back. A statement deletes at
//! most [`Purge::batch`] rows, so no purge holds locks, writes WAL or a
//! binlog, or bloats a table in one burst of millions of rows; a round
//! runs statements until one deletes fewer than a batch.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::store::{Store, StoreError};

/// When a store deletes its expired records, and how many one statement
/// deletes (the builders' `purge` setting). Default: every 60 s, at most
/// 1,000 rows a statement.
///
/// Which stores: `SqliteStore`, `PostgresStore`, and the sqlx stores
/// (`SqlxPostgresStore`, `SqlxSqliteStore`, `MySqlStore`). `RedisStore`
/// needs none (each record carries its TTL as Redis's own expiry), nor does
/// `MemoryStore` (it evicts expired records when it reaches its capacity).
/// [`Store::purge_expired`] (and the admin router's purge) deletes in the
/// same batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Purge {
    every: Option<Duration>,
    batch: u32,
}

impl Default for Purge {
    fn default() -> Self {
        Purge::every(Duration::from_secs(60))
    }
}

impl Purge {
    /// A round every `period` (at least 1 ms), once the first period has
    /// passed, in batches of 1,000 rows.
    pub const fn every(period: Duration) -> Purge {
        let floor = Duration::from_millis(1);
        let every = if period.as_nanos() < floor.as_nanos() {
            floor
        } else {
            period
        };
        Purge {
            every: Some(every),
            batch: 1_000,
        }
    }

    /// No purge task: expired records stay until [`Store::purge_expired`]
    /// is called (by the application, [`spawn_purge_task`](crate::store::spawn_purge_task),
    /// or the admin router).
    pub const fn off() -> Purge {
        Purge {
            every: None,
            batch: 1_000,
        }
    }

    /// At most `rows` rows (at least 1) a statement.
    pub const fn batch(mut self, rows: u32) -> Purge {
        self.batch = if rows == 0 { 1 } else { rows };
        self
    }

    /// The period of the purge task; `None` when it is off.
    pub const fn period(&self) -> Option<Duration> {
        self.every
    }

    /// The rows one statement deletes at most.
    pub const fn batch_rows(&self) -> u32 {
        self.batch
    }
}

/// Runs `batch(rows)`, one statement deleting at most `rows` expired
/// records, until one deletes fewer: how many were deleted in all. Between
/// two statements the task yields, so other work on the runtime goes on.
pub async fn in_batches<F, Fut>(rows: u32, mut batch: F) -> Result<u64, StoreError>
where
    F: FnMut(u32) -> Fut,
    Fut: Future<Output = Result<u64, StoreError>>,
{
    let mut total = 0;
    loop {
        let deleted = batch(rows).await?;
        total += deleted;
        if deleted < u64::from(rows) {
            return Ok(total);
        }
        tokio::task::yield_now().await;
    }
}

/// A store's purge task, shared by the store's clones: it ends when the
/// last of them is dropped. The default is no task.
#[derive(Clone, Default)]
pub struct PurgeTask(Option<Arc<AbortOnDrop>>);

impl std::fmt::Debug for PurgeTask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "PurgeTask(running)"
        } else {
            "PurgeTask(none)"
        })
    }
}

struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl PurgeTask {
    /// Calls `store.purge_expired()` every [`Purge::period`] on the current
    /// Tokio runtime; no task when the purge is off or no runtime is
    /// running. `store` must be a clone whose own `PurgeTask` is the
    /// default (none): the task holds it, and a task held by its own store
    /// would never end. Errors are logged (`warn`) and the next round tries
    /// again.
    pub fn start<S: Store>(store: S, purge: Purge) -> PurgeTask {
        let Some(period) = purge.period() else {
            return PurgeTask(None);
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return PurgeTask(None);
        };
        let task = runtime.spawn(async move {
            let start = tokio::time::Instant::now() + period;
            let mut every = tokio::time::interval_at(start, period);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                match store.purge_expired().await {
                    Ok(0) => {}
                    Ok(n) => tracing::debug!(purged = n, "purged expired idempotency records"),
                    Err(e) => {
                        tracing::warn!(error = %e, "purging expired idempotency records failed")
                    }
                }
            }
        });
        PurgeTask(Some(Arc::new(AbortOnDrop(task.abort_handle()))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_keep_their_bounds() {
        assert_eq!(
            Purge::every(Duration::ZERO).period(),
            Some(Duration::from_millis(1))
        );
        assert_eq!(Purge::off().batch(0).batch_rows(), 1);
        assert_eq!(Purge::default().batch_rows(), 1_000);
    }

    #[tokio::test]
    async fn batches_run_until_one_is_short() {
        let mut left = 2_500u64;
        let mut statements = 0;
        let total = in_batches(1_000, |rows| {
            statements += 1;
            let n = left.min(u64::from(rows));
            left -= n;
            async move { Ok(n) }
        })
        .await
        .unwrap();
        assert_eq!((total, statements), (2_500, 3));
    }

    #[tokio::test]
    async fn the_task_ends_with_the_last_clone_of_its_store() {
        let store = crate::store::MemoryStore::new();
        let held = store.records_handle();
        let task = PurgeTask::start(store.clone(), Purge::every(Duration::from_millis(5)));
        assert_eq!(
            std::sync::Arc::strong_count(&held),
            3,
            "the test's, the store's, the task's"
        );
        let clone = task.clone();
        drop(task);
        tokio::task::yield_now().await;
        assert_eq!(
            std::sync::Arc::strong_count(&held),
            3,
            "a clone still holds the task"
        );
        drop(clone);
        for _ in 0..100 {
            if std::sync::Arc::strong_count(&held) == 2 {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("the task still holds its store");
    }

    #[test]
    fn no_task_outside_a_runtime_or_when_off() {
        let store = crate::store::MemoryStore::new();
        assert!(
            PurgeTask::start(store.clone(), Purge::default())
                .0
                .is_none()
        );
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let _enter = runtime.enter();
        assert!(PurgeTask::start(store, Purge::off()).0.is_none());
    }
}
