//! The store's clock: the one time source that judges leases and TTLs in the
//! embedded stores.

use std::time::Duration;

/// `d` in whole milliseconds, the time unit every store keeps (leases, TTLs
/// and Unix times alike); `i64::MAX` past about 292 million years.
pub fn duration_ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A source of the current time for the embedded stores, in milliseconds since
/// the Unix epoch. [`SystemClock`] in production; `test_util::ManualClock`
/// (feature `test-util`) lets tests move time on without sleeping.
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
