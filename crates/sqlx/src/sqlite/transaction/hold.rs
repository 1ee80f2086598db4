//! Who ends a [`SqlxSqliteTransaction`](super::SqlxSqliteTransaction), the
//! layer (commit or rollback) or the max-hold timer, decided once by the
//! store kit's [`Fate`]; and the count of open transactions that
//! `SQLITE_BUSY` errors name.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

pub(super) use tower_idempotency::store::kit::fate::Fate;

use super::super::Counters;

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
