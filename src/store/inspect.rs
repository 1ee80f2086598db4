//! [`Inspect`]: what an operator sees of a store (stuck records, counts).

use std::future::Future;

#[cfg(all(doc, feature = "sqlite"))]
use super::SqliteStore;
#[cfg(doc)]
use super::{ClaimRequest, Clock, MemoryStore};
use super::{Kind, RecordId, Store, StoreError};
use crate::fingerprint::Fingerprint;

/// What an operator sees of a store: records stuck in flight, and how many
/// records of each kind it holds (`admin::router`, feature `admin`, serves
/// them over HTTP).
///
/// Every answer is judged by the store's clock, as [`Store::claim`] judges
/// leases and TTLs: the [`Clock`] of [`MemoryStore`] and `SqliteStore`, the
/// database server's clock for `PostgresStore`, the Redis server's `TIME` for
/// `RedisStore`. A record is in exactly one of the four kinds of
/// [`RecordCounts`] at a given instant; [`RecordCounts::expired`] is what
/// [`Store::purge_expired`] would delete at that instant.
///
/// Both calls read every record (no store keeps an index on the lease): they
/// are for an operator's occasional look, not for each request.
///
/// A record whose lease deadline the clock stepped back from (further ahead
/// than one lease) counts as in flight here, not stuck: records keep their
/// deadline, not the lease that set it, and `Inspect` is not given a lease,
/// so it cannot tell such a deadline from a long lease. The next claim of
/// its key still takes it over (see [`ClaimRequest::lease`]).
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::fingerprint::Fingerprint;
/// use tower_idempotency::store::{ClaimRequest, FencingToken, Inspect, MemoryStore, RecordCounts, RecordId, Store};
/// use tower_idempotency::test_util::ManualClock; // feature `test-util`
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let clock = ManualClock::new(1_000_000);
/// let store = MemoryStore::with_clock(clock.clone());
/// let id = RecordId::new("alice", "k-1");
/// store.claim(
///     ClaimRequest::new(id, Fingerprint([7; 32]), FencingToken::random())
///         .with_lease(Duration::from_secs(60))
///         .with_ttl(Duration::from_secs(86_400)),
/// ).await.unwrap();
/// // The holder crashed: 90 s later its lease has been over for 30 s.
/// clock.advance(Duration::from_secs(90));
/// let stuck = store.stuck(10).await.unwrap();
/// assert_eq!(stuck[0].key, "k-1");
/// assert_eq!(stuck[0].lease_ended_ms_ago, 30_000);
/// assert_eq!(stuck[0].ttl_remaining_ms, 86_310_000);
/// assert_eq!(store.counts().await.unwrap(), RecordCounts { in_flight: 0, stuck: 1, completed: 0, expired: 0 });
/// # }
/// ```
pub trait Inspect: Store {
    /// Up to `limit` in-flight records whose lease has ended and whose TTL
    /// has not: their holder is gone or overran its lease, and the next
    /// retry with the same key and request takes them over. Oldest lease
    /// end first (ties by scope, then key).
    fn stuck(
        &self,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<RecordSummary>, StoreError>> + Send;

    /// How many records of each kind the store holds now.
    fn counts(&self) -> impl Future<Output = Result<RecordCounts, StoreError>> + Send;
}

/// One in-flight record whose lease has ended, from [`Inspect::stuck`].
///
/// `#[non_exhaustive]`: it may show more of the record later. A store built
/// outside this crate makes one with [`RecordSummary::new`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordSummary {
    /// Who the key belongs to (see [`crate::scope`]).
    pub scope: String,
    /// The idempotency key.
    pub key: String,
    /// The fingerprint of the request that claimed it.
    pub fingerprint: Fingerprint,
    /// Milliseconds since the lease ended, by the store's clock (0: it ended
    /// this millisecond).
    pub lease_ended_ms_ago: u64,
    /// Milliseconds until the record's TTL ends and it counts as absent, by
    /// the store's clock (at least 1).
    pub ttl_remaining_ms: u64,
}

impl RecordSummary {
    /// The record's [`RecordId`], e.g. to release it by hand.
    pub fn record_id(&self) -> RecordId {
        RecordId::new(self.scope.clone(), self.key.clone())
    }

    /// The fingerprint as 64 lowercase hexadecimal digits.
    pub fn fingerprint_hex(&self) -> String {
        self.fingerprint
            .0
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// The summary of the record `id`, claimed by a request with
    /// `fingerprint`, whose lease ended `lease_ended_ms_ago` milliseconds ago
    /// and whose TTL ends in `ttl_remaining_ms` milliseconds (both by the
    /// store's clock).
    pub fn new(
        id: RecordId,
        fingerprint: Fingerprint,
        lease_ended_ms_ago: u64,
        ttl_remaining_ms: u64,
    ) -> Self {
        let (scope, key) = id.into_parts();
        RecordSummary {
            scope,
            key,
            fingerprint,
            lease_ended_ms_ago,
            ttl_remaining_ms,
        }
    }

    /// A summary from a record's deadlines and the store's `now`, all Unix
    /// milliseconds by the store's clock, as a store reads them from its
    /// rows: a deadline already passed counts 0.
    pub fn from_deadlines(
        scope: String,
        key: String,
        fingerprint: Fingerprint,
        lease_until: i64,
        expires_at: i64,
        now: i64,
    ) -> Self {
        let non_negative = |ms: i64| u64::try_from(ms).unwrap_or(0);
        RecordSummary {
            scope,
            key,
            fingerprint,
            lease_ended_ms_ago: non_negative(now.saturating_sub(lease_until)),
            ttl_remaining_ms: non_negative(expires_at.saturating_sub(now)),
        }
    }
}

/// How many records of each kind a store holds, from [`Inspect::counts`].
/// Each record is in exactly one kind, judged by the store's clock.
///
/// Not `#[non_exhaustive]`: the four kinds partition the records, so a new
/// kind would change what the existing counts mean (a breaking change
/// either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RecordCounts {
    /// In flight, lease alive: a request is (or should be) running.
    pub in_flight: u64,
    /// In flight, lease over, TTL not: the records [`Inspect::stuck`] lists.
    pub stuck: u64,
    /// Completed, TTL not over: repeats are replayed.
    pub completed: u64,
    /// Past the TTL (either state): ignored by every lookup, deleted by the
    /// next [`Store::purge_expired`].
    pub expired: u64,
}

impl RecordCounts {
    pub(crate) fn add(&mut self, kind: Kind) {
        match kind {
            Kind::InFlight => self.in_flight += 1,
            Kind::Stuck => self.stuck += 1,
            Kind::Completed => self.completed += 1,
            Kind::Expired => self.expired += 1,
        }
    }
}
