//! The settings every SQL store with a configurable table and a two-phase
//! transaction shares, written once: `table`, `purge`,
//! `replay_cache`, `replay_cache_bytes` and (feature `test-util`)
//! `clock_offset`, with one
//! documentation; [`Settings`] holds them on a builder, [`Limits`] on the
//! store it opens.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use super::purge::{Purge, PurgeTask};
use super::replay_cache::{CacheBounds, ReplayCache, offset_instant};
use crate::store::Clock;

/// A builder's shared settings.
pub struct Settings {
    /// The table's name, checked when the store opens
    /// ([`check_table_name`](crate::store::kit::table::check_table_name)).
    pub table: String,
    /// A test clock whose reading (ms) is added to the server's clock.
    pub offset: Option<Arc<dyn Clock>>,
    /// The replay cache's bounds (off by default).
    pub replays: CacheBounds,
    /// When the store deletes its expired records (every 60 s by default).
    pub purge: Purge,
}

impl Default for Settings {
    /// Table `idempotency_records`, the server's clock,
    /// no replay cache, a purge every 60 s.
    fn default() -> Self {
        Settings {
            table: "idempotency_records".into(),
            offset: None,
            replays: CacheBounds::default(),
            purge: Purge::default(),
        }
    }
}

impl Settings {
    /// What the opened store keeps of them.
    pub fn limits(&self) -> Limits {
        Limits {
            offset: self.offset.clone(),
            held_too_long: Arc::default(),
            replays: self.replays.open(),
            purge_batch: self.purge.batch_rows(),
            purge_task: PurgeTask::default(),
        }
    }
}

/// What a two-phase store keeps of its settings, shared by its clones.
#[derive(Clone)]
pub struct Limits {
    offset: Option<Arc<dyn Clock>>,
    /// Transactions rolled back past their max hold time.
    pub held_too_long: Arc<AtomicU64>,
    /// Completed records cached for replays, each until an [`Instant`]
    /// (see [`Limits::instant`]).
    pub replays: Arc<ReplayCache>,
    /// The rows one purge statement deletes at most.
    pub purge_batch: u32,
    /// The store's purge task (none until the store starts it:
    /// [`PurgeTask::start`]).
    pub purge_task: PurgeTask,
}

impl Limits {
    /// The test clock's offset, in milliseconds, added to the server's
    /// clock (0 in production).
    pub fn offset_ms(&self) -> i64 {
        self.offset.as_ref().map_or(0, |c| c.now_ms())
    }

    /// Now on the replay cache's clock: the monotonic clock, moved by the
    /// test clock's offset as the server's clock is.
    pub fn instant(&self) -> Instant {
        offset_instant(self.offset_ms())
    }

    /// Transactions rolled back past their max hold time so far.
    pub fn held_too_long(&self) -> u64 {
        self.held_too_long.load(Relaxed)
    }
}

/// The shared setters of `$builder`, whose field `settings: Settings`
/// they set;
/// `$transaction` is the store's transaction type, whose docs say what
/// happens past the max hold time.
#[doc(hidden)]
#[macro_export]
macro_rules! __sql_builder_settings {
    ($builder:ty, $transaction:ident) => {
        $crate::store::kit::replay_cache::replay_cache_settings!($builder, settings.replays);

        impl $builder {
            /// The table (default `idempotency_records`): 1 to 48 ASCII
            /// letters, digits and underscores, not starting with a digit, so
            /// that the index named after it fits every database's
            /// identifiers. Checked when the store opens.
            pub fn table(mut self, table: impl Into<String>) -> Self {
                self.settings.table = table.into();
                self
            }

            /// When the store deletes its expired records, in statements of
            /// at most how many rows (default: every 60 s, 1,000 rows;
            /// `Purge::off()` for none): see `tower_idempotency::store::Purge`.
            pub fn purge(mut self, purge: $crate::store::Purge) -> Self {
                self.settings.purge = purge;
                self
            }
        }

        // The core's `test-util` feature decides, not the calling crate's.
        $crate::__if_test_util! {
            impl $builder {
                /// For tests of leases and TTLs: a `Clock`
                /// whose reading, in milliseconds, is added to the database
                /// server's clock, which judges leases and TTLs on this store.
                pub fn clock_offset(mut self, offset: impl $crate::store::Clock) -> Self {
                    self.settings.offset = Some(std::sync::Arc::new(offset));
                    self
                }
            }
        }
    };
}
#[doc(inline)]
pub use crate::__sql_builder_settings as sql_builder_settings;
