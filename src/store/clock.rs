//! The store's clock: the one time source that judges leases and TTLs in the
//! embedded stores.

use std::time::Duration;

/// Milliseconds since the Unix epoch, the time unit every store keeps.
pub(crate) fn duration_ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A source of the current time for the embedded stores, in milliseconds since
/// the Unix epoch. [`SystemClock`] in production; [`ManualClock`] lets tests
/// move time on without sleeping.
pub trait Clock: Send + Sync + 'static {
    /// Now, in milliseconds since the Unix epoch.
    fn now_ms(&self) -> i64;
}

/// The operating system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, duration_ms)
    }
}

/// A clock that moves only when told to: for tests of leases and TTLs.
#[derive(Debug, Clone, Default)]
pub struct ManualClock(std::sync::Arc<std::sync::atomic::AtomicI64>);

impl ManualClock {
    /// A clock reading `start_ms`.
    pub fn new(start_ms: i64) -> Self {
        ManualClock(std::sync::Arc::new(start_ms.into()))
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.0
            .fetch_add(duration_ms(by), std::sync::atomic::Ordering::SeqCst);
    }

    /// Sets the clock to `ms` (Unix milliseconds), forward or back: for
    /// tests of a wall clock that steps back (NTP, a restored VM, an
    /// operator), which the stores must survive (see
    /// [`crate::store::ClaimRequest::lease`]).
    pub fn set(&self, ms: i64) {
        self.0.store(ms, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}
