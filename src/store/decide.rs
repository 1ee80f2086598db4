//! The state machine of one record, for the stores written in Rust: what a
//! claim does with the record it found, and the kind a record is of at an
//! instant. The table it follows is in the [module docs](super).

use std::time::Duration;

use crate::fingerprint::Fingerprint;

/// The record a claim found, as read under the store's lock.
pub(crate) struct Existing<'a> {
    pub(crate) fingerprint: &'a [u8],
    pub(crate) completed: bool,
    /// Unix ms.
    pub(crate) lease_until: i64,
    /// Unix ms.
    pub(crate) expires_at: i64,
}

/// What a claim does with a record it found: the rows of the table in the
/// [module docs](super) after "nothing", in order. The stores written in Rust all
/// decide here; `RedisStore`'s Lua script mirrors it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Overwrite the record with the new claim (`taken_over`: its lease had
    /// ended; otherwise it was past its TTL and counts as absent).
    Replace { taken_over: bool },
    /// Another fingerprint: 422.
    Mismatch,
    /// Completed: replay its stored response.
    Replay,
    /// In flight, with this much lease left: 409.
    InFlight(Duration),
}

pub(crate) fn decide(existing: &Existing<'_>, fingerprint: &Fingerprint, now: i64) -> Decision {
    if existing.expires_at <= now {
        Decision::Replace { taken_over: false }
    } else if existing.fingerprint != fingerprint.0 {
        Decision::Mismatch
    } else if existing.completed {
        Decision::Replay
    } else if existing.lease_until > now {
        Decision::InFlight(Duration::from_millis((existing.lease_until - now) as u64))
    } else {
        Decision::Replace { taken_over: true }
    }
}

/// The kind of a record at `now` (Unix ms), for the stores that count in Rust.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    InFlight,
    Stuck,
    Completed,
    Expired,
}

impl Kind {
    pub(crate) fn of(completed: bool, lease_until: i64, expires_at: i64, now: i64) -> Kind {
        // The order of `decide`: past the TTL first, then the state, then the lease.
        if expires_at <= now {
            Kind::Expired
        } else if completed {
            Kind::Completed
        } else if lease_until > now {
            Kind::InFlight
        } else {
            Kind::Stuck
        }
    }
}

/// Seconds for `Retry-After` from a remaining lease: whole seconds not past
/// the lease's end, and at least 1.
pub(crate) fn retry_after_secs(remaining: Duration) -> u64 {
    remaining.as_secs().max(1)
}
