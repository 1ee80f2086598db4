//! A small bounded cache of completed records, so that a replay is answered
//! without a trip to the blocking pool and a read.
//!
//! It is safe because a completed record does not change until it expires:
//! a claim replaces a completed record only once it has expired (see
//! `decide`), and purges delete only expired records, in this process or in
//! another one sharing the file. Every hit is checked against the store's
//! clock, and an expired entry is never used (the claim then reads the
//! database). Bounds: the builder's number of records (0, the default,
//! turns it off) and bytes of encoded responses in all ([`DEFAULT_BYTES`]
//! unless set), none larger than a quarter of those bytes; the oldest entry
//! goes first. A hit hands out the cached body without a copy (`Bytes`).

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use crate::fingerprint::Fingerprint;
use crate::response::StoredResponse;
use crate::store::Refusal;

/// Bytes of encoded responses cached in all, unless the builder sets it.
pub(super) const DEFAULT_BYTES: usize = 4 << 20;

type Id = (String, String);

struct Entry {
    fingerprint: [u8; 32],
    /// Unix ms.
    expires_at: i64,
    response: StoredResponse,
    size: usize,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<Id, Entry>,
    /// Insertion order, oldest first.
    order: VecDeque<Id>,
    bytes: usize,
}

pub(super) struct Completed {
    inner: Mutex<Inner>,
    /// At most this many records; 0: nothing is cached.
    capacity: usize,
    /// At most this many bytes of encoded responses in all.
    max_bytes: usize,
}

impl Completed {
    pub(super) fn new(capacity: usize, max_bytes: usize) -> Self {
        Completed {
            inner: Mutex::default(),
            capacity,
            max_bytes,
        }
    }

    /// A response whose encoding is larger than this (bytes) is not cached,
    /// so that one entry never pushes out more than a quarter of the rest.
    fn max_entry(&self) -> usize {
        self.max_bytes / 4
    }

    /// The refusal for a claim of `(scope, key)` with `fingerprint` at `now`
    /// (Unix ms), if a live completed record of it is cached.
    pub(super) fn refusal(
        &self,
        scope: &str,
        key: &str,
        fingerprint: &Fingerprint,
        now: i64,
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

    /// Caches a completed record read from the database.
    pub(super) fn insert(
        &self,
        scope: &str,
        key: &str,
        fingerprint: &[u8],
        expires_at: i64,
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
        let cache = Completed::new(4, DEFAULT_BYTES);
        let fp = Fingerprint([7; 32]);
        cache.insert("s", "k", &fp.0, 1_000, &response(b"one"), 3);
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
        let cache = Completed::new(0, DEFAULT_BYTES);
        let fp = Fingerprint([7; 32]);
        cache.insert("s", "k", &fp.0, i64::MAX, &response(b"one"), 3);
        assert!(cache.refusal("s", "k", &fp, 0).is_none());
    }

    #[test]
    fn it_holds_at_most_its_bounds_and_drops_the_oldest_first() {
        const MAX_ENTRIES: usize = 1024;
        const MAX_BYTES: usize = 1 << 20;
        const MAX_ENTRY: usize = MAX_BYTES / 4;
        let cache = Completed::new(MAX_ENTRIES, MAX_BYTES);
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
