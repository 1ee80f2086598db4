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

/// `lease` is the claiming request's lease ([`ClaimRequest::lease`](super::ClaimRequest::lease)):
/// a lease deadline further ahead than `now + lease` cannot have been set by
/// a claim at or before `now` with that lease, so the clock has stepped back
/// since (NTP, a VM restored, an operator): the lease counts as over and the
/// claim takes the record over, instead of leaving the key in flight for as
/// long as the clock stepped.
pub(crate) fn decide(
    existing: &Existing<'_>,
    fingerprint: &Fingerprint,
    now: i64,
    lease: Duration,
) -> Decision {
    if existing.expires_at <= now {
        Decision::Replace { taken_over: false }
    } else if existing.fingerprint != fingerprint.0 {
        Decision::Mismatch
    } else if existing.completed {
        Decision::Replay
    } else if lease_alive(existing.lease_until, now, lease) {
        Decision::InFlight(Duration::from_millis((existing.lease_until - now) as u64))
    } else {
        Decision::Replace { taken_over: true }
    }
}

/// Whether an in-flight record's lease holds at `now` against a claim with
/// `lease`: its deadline is ahead, and not further ahead than `lease` (a
/// deadline past `now + lease` is one the clock stepped back from).
/// `RedisStore`'s claim script applies the same rule.
pub(crate) fn lease_alive(lease_until: i64, now: i64, lease: Duration) -> bool {
    lease_until > now && lease_until - now <= super::duration_ms(lease)
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

/// Seconds for `Retry-After` (RFC 9110 §10.2.3, delay-seconds) on a 409:
/// the layer's `hint` rounded up to whole seconds, but not past the claim's
/// remaining lease (whole seconds), nor past the layer's `lease` (rounded
/// up: a store that reports more than a whole lease left, a clock stepped
/// back, never makes a client wait longer than one lease), and at least 1.
pub(crate) fn retry_after_secs(remaining: Duration, lease: Duration, hint: Duration) -> u64 {
    let ceil = |d: Duration| d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0));
    ceil(hint).min(remaining.as_secs()).min(ceil(lease)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(60);

    fn in_flight(lease_until: i64) -> Existing<'static> {
        Existing {
            fingerprint: &[7; 32],
            completed: false,
            lease_until,
            expires_at: i64::MAX,
        }
    }

    #[test]
    fn a_deadline_past_one_lease_ahead_is_taken_over() {
        let fingerprint = Fingerprint([7; 32]);
        let now = 1_000_000;
        let decide_at = |lease_until| decide(&in_flight(lease_until), &fingerprint, now, LEASE);
        assert_eq!(
            decide_at(now + 60_000),
            Decision::InFlight(Duration::from_secs(60))
        );
        assert_eq!(
            decide_at(now + 60_001),
            Decision::Replace { taken_over: true }
        );
        assert_eq!(
            decide_at(now + 3_660_000),
            Decision::Replace { taken_over: true }
        );
        assert_eq!(decide_at(now), Decision::Replace { taken_over: true });
        assert_eq!(
            decide_at(now + 1),
            Decision::InFlight(Duration::from_millis(1))
        );
    }

    #[test]
    fn retry_after_is_within_one_lease() {
        assert_eq!(
            retry_after_secs(Duration::from_secs(3659), LEASE, Duration::MAX),
            60
        );
        assert_eq!(
            retry_after_secs(Duration::from_millis(59_999), LEASE, Duration::MAX),
            59
        );
        assert_eq!(
            retry_after_secs(Duration::from_millis(1), LEASE, Duration::MAX),
            1
        );
        assert_eq!(retry_after_secs(Duration::ZERO, LEASE, Duration::MAX), 1);
        assert_eq!(
            retry_after_secs(
                Duration::from_secs(9),
                Duration::from_millis(1500),
                Duration::MAX
            ),
            2
        );
        assert_eq!(
            retry_after_secs(Duration::from_secs(9), Duration::ZERO, Duration::MAX),
            1
        );
    }

    #[test]
    fn retry_after_is_the_hint_rounded_up_within_the_remaining_lease() {
        let secs = |remaining_ms, hint_ms| {
            let (remaining, hint) = (
                Duration::from_millis(remaining_ms),
                Duration::from_millis(hint_ms),
            );
            retry_after_secs(remaining, LEASE, hint)
        };
        assert_eq!(secs(59_000, 1_000), 1);
        assert_eq!(secs(59_000, 1_001), 2);
        assert_eq!(secs(59_000, 2_500), 3);
        assert_eq!(secs(2_900, 5_000), 2);
        assert_eq!(secs(59_000, 0), 1);
        assert_eq!(secs(300, 5_000), 1);
    }
}
