//! A bounded cache of completed records, so that a replay is answered
//! from memory, without a read of the database.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use tower_idempotency::store::kit::replay_cache::ReplayCache;
//! # use tower_idempotency::{fingerprint::Fingerprint, StoredResponse, store::Refusal};
//! # let response = StoredResponse::capture(http::StatusCode::CREATED, &http::HeaderMap::new(), bytes::Bytes::from_static(b"{}"), None);
//! let cache = ReplayCache::new(1024, 4 << 20);
//! let deadline = Instant::now() + Duration::from_secs(60);
//! cache.insert("scope", "key", &[7; 32], deadline, &response, 2);
//! let hit = cache.refusal("scope", "key", &Fingerprint([7; 32]), Instant::now());
//! assert!(matches!(hit, Some(Refusal::Completed(_))));
//! ```
//!
//! It is safe because a completed record does not change until its TTL
//! ends, in this process or in any other one sharing the database: a claim
//! replaces a completed record only once it has expired (see `decide`),
//! `complete` and `release` touch only records in flight, and purges delete
//! only expired records. So a cached record, used only before the deadline
//! it was cached with, gives the answer the database would give.
//!
//! The deadline is on whatever clock the store judges with (`D`): the
//! SQLite store's [`Clock`](crate::store::Clock) in Unix ms; a store whose
//! server judges TTLs on its own clock (PostgreSQL, MySQL, Redis) uses an
//! [`Instant`]: the instant
//! its read was sent plus the TTL left that the read returned, which is
//! never later than the database's own deadline, whatever the skew between
//! the two machines' clocks.
//!
//! Bounds: a number of records (0 turns the cache off) and bytes of encoded
//! responses in all ([`DEFAULT_BYTES`] unless set), no entry larger than a
//! quarter of those bytes; the oldest entry goes first. A hit hands out the
//! cached body without a copy (`Bytes`).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use std::time::Instant;

use crate::fingerprint::Fingerprint;
use crate::response::StoredResponse;
use crate::store::Refusal;

/// Bytes of encoded responses cached in all, unless the builder sets it
/// (4 MiB).
pub const DEFAULT_BYTES: usize = 4 << 20;

type Id = (String, String);

struct Entry<D> {
    fingerprint: [u8; 32],
    /// Past it the entry is never used.
    expires_at: D,
    response: StoredResponse,
    size: usize,
}

struct Inner<D> {
    entries: HashMap<Id, Entry<D>>,
    /// Insertion order, oldest first.
    order: VecDeque<Id>,
    bytes: usize,
}

/// Completed records by scope and key, each until its deadline on the
/// clock `D` (see the module docs).
pub struct ReplayCache<D = Instant> {
    inner: Mutex<Inner<D>>,
    /// At most this many records; 0: nothing is cached.
    capacity: usize,
    /// At most this many bytes of encoded responses in all.
    max_bytes: usize,
}

impl<D> std::fmt::Debug for ReplayCache<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayCache")
            .field("capacity", &self.capacity)
            .field("max_bytes", &self.max_bytes)
            .finish_non_exhaustive()
    }
}

impl<D: Copy + PartialOrd> ReplayCache<D> {
    /// At most `capacity` records (0: the cache is off) and `max_bytes`
    /// bytes of encoded responses.
    pub fn new(capacity: usize, max_bytes: usize) -> Self {
        ReplayCache {
            inner: Mutex::new(Inner {
                entries: HashMap::new(),
                order: VecDeque::new(),
                bytes: 0,
            }),
            capacity,
            max_bytes,
        }
    }

    /// A response whose encoding is larger than this (bytes) is not cached,
    /// so that one entry never pushes out more than a quarter of the rest.
    fn max_entry(&self) -> usize {
        self.max_bytes / 4
    }

    /// Whether it caches anything at all.
    pub fn is_on(&self) -> bool {
        self.capacity > 0
    }

    /// The refusal for a claim of `(scope, key)` with `fingerprint` at `now`,
    /// if a live completed record of it is cached: its stored response for
    /// the same fingerprint, [`Refusal::Mismatch`] (422) for another.
    pub fn refusal(
        &self,
        scope: &str,
        key: &str,
        fingerprint: &Fingerprint,
        now: D,
    ) -> Option<Refusal> {
        if self.capacity == 0 {
            return None;
        }
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner.entries.is_empty() {
            return None;
        }
        let entry = inner.entries.get(&(scope.to_owned(), key.to_owned()))?;
        if entry.expires_at <= now {
            return None;
        }
        Some(if entry.fingerprint == fingerprint.0 {
            Refusal::Completed(entry.response.clone())
        } else {
            Refusal::Mismatch
        })
    }

    /// Caches a completed record read from the database, until
    /// `expires_at`; `size` is its encoded response's length in bytes. A
    /// fingerprint that is not 32 bytes long is not cached.
    pub fn insert(
        &self,
        scope: &str,
        key: &str,
        fingerprint: &[u8],
        expires_at: D,
        response: &StoredResponse,
        size: usize,
    ) {
        let Ok(fingerprint) = <[u8; 32]>::try_from(fingerprint) else {
            return;
        };
        if size > self.max_entry() || self.capacity == 0 {
            return;
        }
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let id = (scope.to_owned(), key.to_owned());
        if inner.entries.contains_key(&id) {
            return;
        }
        while inner.entries.len() >= self.capacity || inner.bytes + size > self.max_bytes {
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            if let Some(gone) = inner.entries.remove(&oldest) {
                inner.bytes -= gone.size;
            }
        }
        inner.bytes += size;
        inner.order.push_back(id.clone());
        inner.entries.insert(
            id,
            Entry {
                fingerprint,
                expires_at,
                response: response.clone(),
                size,
            },
        );
    }
}

/// A builder's bounds for its replay cache: records (0, the default, turns
/// it off) and bytes of encoded responses ([`DEFAULT_BYTES`]).
#[derive(Debug, Clone, Copy)]
pub struct CacheBounds {
    /// At most this many completed records cached for replays (0: none).
    pub records: usize,
    /// At most this many bytes of encoded responses in the cache.
    pub bytes: usize,
}

impl Default for CacheBounds {
    fn default() -> Self {
        CacheBounds {
            records: 0,
            bytes: DEFAULT_BYTES,
        }
    }
}

impl CacheBounds {
    /// The cache a store opened with these bounds shares among its clones.
    pub fn open(self) -> std::sync::Arc<ReplayCache> {
        std::sync::Arc::new(ReplayCache::new(self.records, self.bytes))
    }
}

/// Now on the clock of a store whose database judges TTLs (the monotonic
/// clock), moved by `offset_ms` as the test clock moves the database's.
pub fn offset_instant(offset_ms: i64) -> Instant {
    let now = Instant::now();
    let shift = std::time::Duration::from_millis(offset_ms.unsigned_abs());
    match offset_ms >= 0 {
        true => now.checked_add(shift),
        false => now.checked_sub(shift),
    }
    .unwrap_or(now)
}

/// The setters `replay_cache` and `replay_cache_bytes` of `$builder`, whose
/// field at `$($bounds).+` is a [`CacheBounds`]: one documentation for every
/// store that has the cache.
#[doc(hidden)]
#[macro_export]
macro_rules! __replay_cache_settings {
    ($builder:ty, $($bounds:ident).+) => {
        impl $builder {
            /// Answer replays of up to `records` completed records from
            /// memory (default 0: off). A record is cached when a replay
            /// reads it, until the instant its read was sent plus the TTL
            /// it had left on the database's clock, so a cached replay is
            /// the one the database would give, whatever the clocks' skew:
            /// a completed record does not change before its TTL ends. See
            /// `store::kit::replay_cache`. Each cached record costs its
            /// encoded response's bytes (bounded by `replay_cache_bytes`).
            pub fn replay_cache(mut self, records: usize) -> Self {
                self.$($bounds).+.records = records;
                self
            }

            /// The replay cache's bound in bytes of encoded responses (the
            /// body and headers; default 4 MiB). A response larger than a
            /// quarter of it is never cached.
            pub fn replay_cache_bytes(mut self, bytes: usize) -> Self {
                self.$($bounds).+.bytes = bytes;
                self
            }

        }
    };
}
#[doc(inline)]
pub use crate::__replay_cache_settings as replay_cache_settings;

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http::StatusCode;

    fn response(body: &'static [u8]) -> StoredResponse {
        StoredResponse::capture(
            StatusCode::CREATED,
            &http::HeaderMap::new(),
            Bytes::from_static(body),
            None,
        )
    }

    #[test]
    fn a_hit_replays_or_refuses_and_an_expired_entry_is_never_used() {
        let cache = ReplayCache::new(4, DEFAULT_BYTES);
        let fp = Fingerprint([7; 32]);
        cache.insert("s", "k", &fp.0, 1_000i64, &response(b"one"), 3);
        match cache.refusal("s", "k", &fp, 999) {
            Some(Refusal::Completed(r)) => assert_eq!(r, response(b"one")),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            cache.refusal("s", "k", &Fingerprint([8; 32]), 999),
            Some(Refusal::Mismatch)
        ));
        assert!(cache.refusal("s", "k", &fp, 1_000).is_none());
        assert!(cache.refusal("s", "other", &fp, 0).is_none());
    }

    #[test]
    fn a_capacity_of_zero_caches_nothing() {
        let cache = ReplayCache::<i64>::new(0, DEFAULT_BYTES);
        let fp = Fingerprint([7; 32]);
        cache.insert("s", "k", &fp.0, i64::MAX, &response(b"one"), 3);
        assert!(cache.refusal("s", "k", &fp, 0).is_none());
    }

    #[test]
    fn it_holds_at_most_its_bounds_and_drops_the_oldest_first() {
        const MAX_ENTRIES: usize = 1024;
        const MAX_BYTES: usize = 1 << 20;
        const MAX_ENTRY: usize = MAX_BYTES / 4;
        let cache = ReplayCache::<i64>::new(MAX_ENTRIES, MAX_BYTES);
        let fp = Fingerprint([1; 32]);
        for i in 0..MAX_ENTRIES + 10 {
            cache.insert("s", &i.to_string(), &fp.0, i64::MAX, &response(b"x"), 1);
        }
        let inner = cache.inner.lock().unwrap();
        assert_eq!(inner.entries.len(), MAX_ENTRIES);
        assert_eq!(inner.bytes, MAX_ENTRIES);
        assert!(!inner.entries.contains_key(&("s".into(), "9".into())));
        assert!(inner.entries.contains_key(&("s".into(), "10".into())));
        drop(inner);
        cache.insert("s", "big", &fp.0, i64::MAX, &response(b"x"), MAX_ENTRY + 1);
        assert!(cache.refusal("s", "big", &fp, 0).is_none());
        cache.insert("s", "quarter", &fp.0, i64::MAX, &response(b"x"), MAX_ENTRY);
        assert!(cache.refusal("s", "quarter", &fp, 0).is_some());
        for i in 0..8 {
            let name = format!("half-{i}");
            cache.insert("s", &name, &fp.0, i64::MAX, &response(b"x"), MAX_BYTES / 4);
        }
        assert!(cache.inner.lock().unwrap().bytes <= MAX_BYTES);
    }
}
