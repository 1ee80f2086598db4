//! The keys held by this process's open transactional requests, for stores
//! whose claim lives in the request's uncommitted transaction (SQLite): no
//! other connection sees such a claim, so the store itself must know that
//! the key is held, by whom, and for how long at most.
//!
//! Three rules follow from it, written here once:
//!
//! * a claim with **another fingerprint** is refused at once (422), before
//!   it waits for anything ([`HeldKeys::wait_for`]);
//! * a claim of a held key **waits** for the holder to end, at most its own
//!   bound ([`ClaimRequest::wait_in_flight`]: zero, 409 at once, unless the
//!   layer lets repeats wait; never past the store's own bound), and
//!   at most [`MAX_WAITERS`] claims wait per key; past either it is refused
//!   as in flight (409), with the holder's remaining hold as its
//!   `lease_remaining`;
//! * a holder is **alive** while its guard ([`HeldKey`]) lives: the store
//!   rolls it back at its max hold, so its record's lease is no judge, and
//!   a claim that meets its uncommitted record never takes it over.
//!
//! ```
//! use std::time::Duration;
//! use tower_idempotency::fingerprint::Fingerprint;
//! use tower_idempotency::store::kit::held::HeldKeys;
//! use tower_idempotency::store::{ClaimRequest, FencingToken, RecordId, Refusal};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let held = std::sync::Arc::new(HeldKeys::default());
//! let id = RecordId::new("alice", "k-1");
//! let guard = held.hold(&id, Fingerprint([7; 32]), Duration::from_secs(30));
//! // Another body under the held key: refused at once.
//! let other = ClaimRequest::new(id.clone(), Fingerprint([8; 32]), FencingToken::random());
//! assert_eq!(held.wait_for(&other, Duration::ZERO).await, Some(Refusal::Mismatch));
//! // The same body waits at most its bound, then is told the key is in flight.
//! let repeat = ClaimRequest::new(id.clone(), Fingerprint([7; 32]), FencingToken::random())
//!     .with_wait_in_flight(Duration::from_millis(10));
//! assert!(matches!(
//!     held.wait_for(&repeat, Duration::from_secs(5)).await,
//!     Some(Refusal::InFlight { .. })
//! ));
//! // Once the holder has ended, the repeat claims (and finds its record).
//! drop(guard);
//! assert_eq!(held.wait_for(&repeat, Duration::from_secs(5)).await, None);
//! # }
//! ```

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::fingerprint::Fingerprint;
use crate::store::{ClaimRequest, RecordId, Refusal};

/// The most claims of one key that wait for its holder at once; the next is
/// refused as in flight at once. The same as the layer's default cap on
/// waiting repeats ([`IdempotencyLayer::wait_in_flight`](crate::IdempotencyLayer::wait_in_flight)).
pub const MAX_WAITERS: usize = crate::wait::DEFAULT_MAX_WAITERS;

/// An open transactional request, as other claims of its key see it.
#[derive(Debug, Clone, Copy)]
pub struct Holder {
    /// Its request's fingerprint.
    pub fingerprint: Fingerprint,
    /// When the store rolls it back (its max hold), where representable.
    deadline: Option<Instant>,
    /// Its max hold.
    hold: Duration,
}

impl Holder {
    /// How much longer it may hold the key: at most its max hold from when
    /// it claimed.
    pub fn remaining(&self) -> Duration {
        self.deadline
            .map_or(self.hold, |d| d.saturating_duration_since(Instant::now()))
    }
}

struct Entry {
    holder: Holder,
    /// Which hold this is (a key held again is another entry).
    generation: u64,
    /// Closed when the hold ends: every waiter wakes.
    ended: tokio::sync::watch::Receiver<()>,
    waiters: usize,
}

/// The keys held by open transactional requests of one store, in this
/// process. Cheap to share: keep it in an `Arc`.
#[derive(Default)]
pub struct HeldKeys {
    keys: Mutex<HashMap<RecordId, Entry>>,
    generations: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for HeldKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldKeys")
            .field("held", &self.lock().len())
            .finish()
    }
}

/// The hold of one key: dropped, the key is free and its waiters wake.
#[must_use = "the key is held only while the guard lives"]
pub struct HeldKey {
    keys: Arc<HeldKeys>,
    id: RecordId,
    generation: u64,
    _ended: tokio::sync::watch::Sender<()>,
}

impl std::fmt::Debug for HeldKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldKey").field("id", &self.id).finish()
    }
}

impl Drop for HeldKey {
    fn drop(&mut self) {
        let mut keys = self.keys.lock();
        if keys
            .get(&self.id)
            .is_some_and(|e| e.generation == self.generation)
        {
            keys.remove(&self.id);
        }
        // `_ended` drops after this: the waiters find the key free.
    }
}

impl HeldKeys {
    fn lock(&self) -> MutexGuard<'_, HashMap<RecordId, Entry>> {
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Marks `id` held by a request with `fingerprint` for at most `hold`
    /// (its max hold), until the guard is dropped. Call it once the claim
    /// is acquired, and drop the guard once the transaction has ended
    /// (committed or rolled back), so that waiters find the outcome.
    pub fn hold(
        self: &Arc<Self>,
        id: &RecordId,
        fingerprint: Fingerprint,
        hold: Duration,
    ) -> HeldKey {
        let (sender, ended) = tokio::sync::watch::channel(());
        let generation = self
            .generations
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let holder = Holder {
            fingerprint,
            deadline: Instant::now().checked_add(hold),
            hold,
        };
        let entry = Entry {
            holder,
            generation,
            ended,
            waiters: 0,
        };
        self.lock().insert(id.clone(), entry);
        HeldKey {
            keys: self.clone(),
            id: id.clone(),
            generation,
            _ended: sender,
        }
    }

    /// The open request holding `id`, if one does.
    pub fn holder(&self, id: &RecordId) -> Option<Holder> {
        self.lock().get(id).map(|e| e.holder)
    }

    /// What a claim `req` must be answered before it touches the database,
    /// given the keys held in this process: `None` when its key is free (or
    /// its holder ended while it waited): claim it. Otherwise the refusal:
    /// [`Refusal::Mismatch`] at once for another fingerprint, else
    /// [`Refusal::InFlight`] once its wait ends
    /// ([`ClaimRequest::wait_in_flight`], at most `default`, the store's
    /// own bound) or at once when it may not wait or [`MAX_WAITERS`] claims
    /// already wait.
    pub async fn wait_for(&self, req: &ClaimRequest, default: Duration) -> Option<Refusal> {
        let id = req.record_id();
        let deadline = tokio::time::Instant::now() + req.wait_in_flight.min(default);
        loop {
            let (mut ended, holder, generation) = {
                let mut keys = self.lock();
                let entry = keys.get_mut(&id)?;
                let holder = entry.holder;
                if holder.fingerprint != req.fingerprint {
                    return Some(Refusal::Mismatch);
                }
                if entry.waiters >= MAX_WAITERS || tokio::time::Instant::now() >= deadline {
                    return Some(in_flight(holder));
                }
                entry.waiters += 1;
                (entry.ended.clone(), holder, entry.generation)
            };
            let waited = tokio::time::timeout_at(deadline, ended.changed()).await;
            if let Some(entry) = self.lock().get_mut(&id)
                && entry.generation == generation
            {
                entry.waiters -= 1;
            }
            if waited.is_err() {
                return Some(in_flight(holder));
            }
        }
    }
}

fn in_flight(holder: Holder) -> Refusal {
    Refusal::InFlight {
        lease_remaining: holder.remaining(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::FencingToken;

    fn claim(fp: u8, wait_ms: u64) -> ClaimRequest {
        ClaimRequest::new(
            RecordId::new("s", "k"),
            Fingerprint([fp; 32]),
            FencingToken::random(),
        )
        .with_wait_in_flight(Duration::from_millis(wait_ms))
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_wakes_when_the_hold_ends_within_its_bound() {
        let held = Arc::new(HeldKeys::default());
        let guard = held.hold(
            &RecordId::new("s", "k"),
            Fingerprint([1; 32]),
            Duration::from_secs(30),
        );
        let waiter = {
            let held = held.clone();
            tokio::spawn(async move {
                held.wait_for(&claim(1, 10_000), Duration::from_secs(60))
                    .await
            })
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        drop(guard);
        assert_eq!(waiter.await.unwrap(), None);
        assert!(held.holder(&RecordId::new("s", "k")).is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn the_bound_is_the_smaller_of_the_claims_and_the_stores() {
        let held = Arc::new(HeldKeys::default());
        let _guard = held.hold(
            &RecordId::new("s", "k"),
            Fingerprint([1; 32]),
            Duration::from_secs(30),
        );
        let start = tokio::time::Instant::now();
        let answer = held.wait_for(&claim(1, 200), Duration::from_secs(5)).await;
        assert!(matches!(answer, Some(Refusal::InFlight { .. })));
        assert_eq!(start.elapsed(), Duration::from_millis(200));
        let start = tokio::time::Instant::now();
        let answer = held
            .wait_for(&claim(1, 60_000), Duration::from_secs(5))
            .await;
        assert!(matches!(answer, Some(Refusal::InFlight { .. })));
        assert_eq!(start.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn waiters_past_the_cap_are_refused_at_once() {
        let held = Arc::new(HeldKeys::default());
        let id = RecordId::new("s", "k");
        let guard = held.hold(&id, Fingerprint([1; 32]), Duration::from_secs(30));
        let waiters: Vec<_> = (0..MAX_WAITERS + 3)
            .map(|_| {
                let held = held.clone();
                tokio::spawn(async move {
                    held.wait_for(&claim(1, 10_000), Duration::from_secs(60))
                        .await
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(1)).await;
        drop(guard);
        let mut refused = 0;
        for waiter in waiters {
            match waiter.await.unwrap() {
                None => {}
                Some(Refusal::InFlight { .. }) => refused += 1,
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(refused, 3);
    }
}
