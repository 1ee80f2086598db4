//! [`StoreError`]: what a store answers when it cannot decide.

use std::fmt;
use std::time::Duration;

#[cfg(doc)]
use super::MemoryStore;

/// A store failure. The layer never replays or runs the request on a store
/// error during the claim: it answers 503 (`store-unavailable`, worth a
/// retry), or 500 (`store-misconfigured`) for [`StoreError::Config`].
#[derive(Debug)]
#[non_exhaustive]
pub enum StoreError {
    /// The store did not answer: locked past its busy timeout, unreachable,
    /// an I/O error, a pool timeout. Retrying may succeed.
    Unavailable(Box<dyn std::error::Error + Send + Sync>),
    /// A record could not be decoded.
    Corrupt(String),
    /// The store holds as many live records as its capacity allows
    /// ([`MemoryStore::with_max_records`]): the claim was refused and nothing
    /// was recorded. The layer answers 503 with `Retry-After`.
    Full {
        /// The capacity, in records.
        capacity: usize,
        /// How long until the store expects room again.
        retry_after: Duration,
    },
    /// The store's configuration is invalid: a table name, URL or key
    /// prefix the store rejects. Returned by the builders' `open`, before
    /// any connection is tried; retrying with the same input fails the same
    /// way. A store that returned it from a request would be answered with
    /// a 500 problem, not 503.
    Config(Box<dyn std::error::Error + Send + Sync>),
    /// A transactional request held its transaction past its max hold time,
    /// so the store rolled it back: its writes and its claim are gone, and
    /// a retry runs afresh. The layer answers 503 (`held-too-long`), not
    /// `store-unavailable`: the database was reachable, the request was slow.
    HeldTooLong {
        /// The hold that passed.
        hold: Duration,
    },
}

impl StoreError {
    /// Wraps any error as [`StoreError::Unavailable`].
    pub fn unavailable(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        StoreError::Unavailable(e.into())
    }

    /// [`StoreError::HeldTooLong`] for a transaction held past `hold`.
    pub fn held_too_long(hold: Duration) -> Self {
        StoreError::HeldTooLong { hold }
    }

    /// Wraps any error (or a message) as [`StoreError::Config`].
    pub fn config(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        StoreError::Config(e.into())
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Unavailable(e) => write!(f, "idempotency store unavailable: {e}"),
            StoreError::Corrupt(why) => write!(f, "idempotency record corrupt: {why}"),
            StoreError::Full { capacity, .. } => {
                write!(f, "idempotency store full: {capacity} live records")
            }
            StoreError::Config(e) => write!(f, "idempotency store misconfigured: {e}"),
            StoreError::HeldTooLong { hold } => write!(
                f,
                "the idempotency transaction was rolled back: it was held past its max hold time ({} ms)",
                hold.as_millis()
            ),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StoreError::Unavailable(e) | StoreError::Config(e) => Some(&**e),
            StoreError::Corrupt(_) | StoreError::Full { .. } | StoreError::HeldTooLong { .. } => {
                None
            }
        }
    }
}
