//! Who ends a [`SqlxSqliteTransaction`](super::SqlxSqliteTransaction), the
//! layer (commit or rollback) or the max-hold timer, decided once by
//! [`Fate`]; and the count of open transactions that `SQLITE_BUSY` errors
//! name.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering::Relaxed, Ordering::SeqCst};
use std::time::Duration;

use crate::store::StoreError;

use super::super::Counters;

const OPEN: u8 = 0;
/// The layer is committing or rolling back.
const ENDING: u8 = 1;
/// The max hold time passed first: whoever holds the transaction rolls back.
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
    pub(super) fn expire(&self) -> bool {
        self.state
            .compare_exchange(OPEN, EXPIRED, SeqCst, SeqCst)
            .is_ok()
    }

    pub(super) fn expired(&self) -> bool {
        self.state.load(SeqCst) == EXPIRED
    }
}

pub(super) fn held_too_long(hold: Duration) -> StoreError {
    StoreError::unavailable(format!(
        "the idempotency transaction was rolled back: it held SQLite's write lock past its max hold time ({} ms)",
        hold.as_millis()
    ))
}

/// One transaction of the store, waiting for the write lock or open:
/// counted from `new` until dropped.
pub(super) struct OpenCount(Arc<Counters>);

impl OpenCount {
    pub(super) fn new(counters: &Arc<Counters>) -> OpenCount {
        counters.open.fetch_add(1, Relaxed);
        OpenCount(counters.clone())
    }
}

impl Drop for OpenCount {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Relaxed);
    }
}
