//! The max hold time of a [`MySqlTransaction`]: who ends it, the layer
//! (commit or rollback) or the timer, is decided once, by [`Fate`].

use std::sync::atomic::{AtomicU8, Ordering::SeqCst};
use std::time::Duration;

use sqlx::{AssertSqlSafe, Executor};

use super::{MySqlStore, MySqlTransaction};

const OPEN: u8 = 0;
/// The layer is committing or rolling back.
const ENDING: u8 = 1;
/// The max hold time passed first: whoever holds the connection rolls back.
const EXPIRED: u8 = 2;

pub(super) struct Fate {
    state: AtomicU8,
    /// The max hold time, or the lease if shorter.
    pub(super) hold: Duration,
}

impl Fate {
    pub(super) fn new(hold: Duration) -> Fate {
        Fate {
            state: AtomicU8::new(OPEN),
            hold,
        }
    }

    /// The layer ends the transaction; `false` when the max hold time
    /// passed first.
    pub(super) fn end(&self) -> bool {
        match self.state.compare_exchange(OPEN, ENDING, SeqCst, SeqCst) {
            Ok(_) => true,
            Err(state) => state == ENDING,
        }
    }

    /// The timer ends it; `false` when the layer got there first.
    fn expire(&self) -> bool {
        self.state
            .compare_exchange(OPEN, EXPIRED, SeqCst, SeqCst)
            .is_ok()
    }

    pub(super) fn expired(&self) -> bool {
        self.state.load(SeqCst) == EXPIRED
    }
}

impl MySqlStore {
    /// The max-hold timer: once the hold has passed (unless the layer is
    /// ending the transaction already), counts it, stops a statement still
    /// running on the transaction (`KILL QUERY` from another connection),
    /// rolls it back and gives the key back, then lets `closed` resolve.
    /// Aborted when the transaction ends first.
    pub(super) async fn end_past(self, transaction: MySqlTransaction, connection_id: u64) {
        let hold = transaction.fate.hold;
        tokio::time::sleep(hold).await;
        if !transaction.fate.expire() {
            return;
        }
        self.held_too_long
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::warn!(
            max_hold_ms = hold.as_millis() as u64,
            "an idempotency transaction was held past its max hold time; rolling it back"
        );
        let mut guard = match transaction.connection.try_lock() {
            Ok(guard) => guard,
            Err(_) => {
                // The handler is using the connection: stop its statement.
                let kill = format!("KILL QUERY {connection_id}");
                if let Err(e) = self.pool.execute(AssertSqlSafe(kill)).await {
                    tracing::warn!(error = %e, "stopping a statement past the max hold time failed");
                }
                transaction.connection.lock().await
            }
        };
        let Some(mut connection) = guard.take() else {
            return;
        };
        drop(guard);
        // This task ends the transaction itself: dropping the connection
        // must not abort it halfway.
        connection.timer = None;
        let ended = connection.ended.take();
        self.roll_back_and_release(connection).await;
        drop(ended);
    }
}
