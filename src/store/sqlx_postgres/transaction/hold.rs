//! The max hold time of a [`SqlxPostgresTransaction`]: who ends it, the
//! layer (commit or rollback) or the timer, is decided once, by [`Fate`].

use std::sync::atomic::{AtomicU8, Ordering::SeqCst};
use std::time::Duration;

use sqlx::{Connection, PgConnection};

use super::{SqlxPostgresStore, SqlxPostgresTransaction};

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

impl SqlxPostgresStore {
    /// The max-hold timer: once the hold has passed (unless the layer is
    /// ending the transaction already), counts it, cancels a statement still
    /// running on the transaction (backend `pid`), rolls it back and gives
    /// the key back, then lets `closed` resolve. Aborted when the
    /// transaction ends first.
    pub(super) async fn end_past(self, transaction: SqlxPostgresTransaction, pid: i32) {
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
                if let Err(e) = self.cancel_backend(pid).await {
                    tracing::warn!(error = %e, "cancelling a statement past the max hold time failed");
                }
                transaction.connection.lock().await
            }
        };
        // Taken already: the layer's commit or rollback sees the expiry and
        // rolls back itself.
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

    /// Cancels the statement running on backend `pid`, from a connection of
    /// its own made with the pool's options (the pool itself may have no
    /// connection to spare), as PostgreSQL's cancel request would.
    async fn cancel_backend(&self, pid: i32) -> Result<(), sqlx::Error> {
        let options = self.pool.connect_options();
        let mut conn = PgConnection::connect_with(&options).await?;
        sqlx::query("SELECT pg_cancel_backend($1)")
            .bind(pid)
            .execute(&mut conn)
            .await?;
        conn.close().await
    }
}
