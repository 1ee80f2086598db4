//! Repeats that wait for the first request instead of taking 409
//! ([`IdempotencyLayer::wait_in_flight`](crate::IdempotencyLayer::wait_in_flight)).
//!
//! A repeat that meets its key in flight takes a place among the layer's
//! waiters and claims again when it is woken, until its bound passes. It is
//! woken by:
//!
//! - **the completion itself**, when the first request runs in this process
//!   behind the same layer: the end of its hold (completed, released, rolled
//!   back or abandoned) wakes every waiter of its key at once;
//! - **the store**, for a first request on another server, when the store
//!   has a signal ([`Store::watch`](crate::store::Store::watch)):
//!   `PostgresStore` and `SqlxPostgresStore` with `notify_waiters(true)`
//!   (`LISTEN`/`NOTIFY`) and `RedisStore` on one server (pub/sub) announce
//!   every completion and release; one listener connection per store wakes
//!   the waiters of that key. Measured (`bench/wake`, loopback, 200 runs): p50 0.30 ms / p99
//!   0.50 ms after the first request's client has its answer on PostgreSQL,
//!   p50 0.27 ms / p99 0.41 ms on Redis (BENCHMARKS.md);
//! - **polling**, always, as the backstop: the waiter claims again after
//!   5 ms, then at doubling intervals up to 100 ms (p50 36 ms / p99 99 ms
//!   in the same measurement) — or, while the store's signal is live and
//!   saw no reconnect since the claim, every
//!   [`signalled_poll_interval`](crate::IdempotencyLayer::signalled_poll_interval)
//!   (1 s) — and never later than the end of the first request's lease,
//!   when the key may be taken over. A lost announcement (a listener that
//!   reconnects, a full feed) delays a waiter, never strands it.
//!
//! A waiter holds no database connection and no writer slot: between its
//! claims it holds only its buffered request, which counts against the
//! layer's waiting bytes.

use std::collections::HashMap;
use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::store::{RecordId, Watch};

/// The default cap on repeats waiting at once behind one layer.
pub const DEFAULT_MAX_WAITERS: usize = 256;
/// The default cap on the request bytes that waiting repeats hold, 16 MiB.
pub const DEFAULT_MAX_WAITING_BYTES: usize = 16 * 1024 * 1024;

/// The first interval between a waiter's claims.
const POLL_FIRST: Duration = Duration::from_millis(5);
/// The default interval between a waiter's claims while the store's signal
/// is live (`IdempotencyLayer::signalled_poll_interval`).
pub const DEFAULT_SIGNALLED_POLL: Duration = Duration::from_secs(1);
/// The longest interval between a waiter's claims without a live signal.
const POLL_MAX: Duration = Duration::from_millis(100);

/// The waiters of one layer: how long each may wait, how many may wait at
/// once and how many request bytes they may hold, and one wake-up per key
/// that someone waits on.
pub(crate) struct Waiting {
    pub(crate) bound: Duration,
    max_waiters: usize,
    max_bytes: usize,
    keys: Mutex<HashMap<RecordId, Arc<Notify>>>,
    count: AtomicUsize,
    bytes: AtomicUsize,
}

impl std::fmt::Debug for Waiting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiting")
            .field("bound", &self.bound)
            .field("max_waiters", &self.max_waiters)
            .field("max_bytes", &self.max_bytes)
            .finish_non_exhaustive()
    }
}

impl Waiting {
    pub(crate) fn new(bound: Duration, max_waiters: usize, max_bytes: usize) -> Self {
        Waiting {
            bound,
            max_waiters,
            max_bytes,
            keys: Mutex::new(HashMap::new()),
            count: AtomicUsize::new(0),
            bytes: AtomicUsize::new(0),
        }
    }

    /// A place among the waiters for a repeat of `id` holding `bytes` of
    /// request, or `None` when the waiters are full (the repeat gets 409).
    pub(crate) fn enter(self: &Arc<Self>, id: &RecordId, bytes: usize) -> Option<Waiter> {
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        let held = self.bytes.load(Ordering::Relaxed);
        if self.count.load(Ordering::Relaxed) >= self.max_waiters
            || held.saturating_add(bytes) > self.max_bytes
        {
            return None;
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        let notify = keys.entry(id.clone()).or_default().clone();
        Some(Waiter {
            waiting: self.clone(),
            id: id.clone(),
            notify,
            bytes,
        })
    }

    /// Wakes every waiter of `id`: its first request's hold has ended.
    pub(crate) fn wake(&self, id: &RecordId) {
        if self.count.load(Ordering::Relaxed) == 0 {
            return;
        }
        let keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(notify) = keys.get(id) {
            notify.notify_waiters();
        }
    }

    /// How many repeats wait now (for tests).
    #[cfg(test)]
    fn waiters(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }
}

/// One waiting repeat's place; dropped, it frees the place, and the key's
/// wake-up when it was the last to wait on it.
pub(crate) struct Waiter {
    waiting: Arc<Waiting>,
    id: RecordId,
    notify: Arc<Notify>,
    bytes: usize,
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let mut keys = self.waiting.keys.lock().unwrap_or_else(|e| e.into_inner());
        self.waiting.count.fetch_sub(1, Ordering::Relaxed);
        self.waiting.bytes.fetch_sub(self.bytes, Ordering::Relaxed);
        // The map's Arc and this one: nobody else waits on the key.
        if Arc::strong_count(&self.notify) == 2 {
            keys.remove(&self.id);
        }
    }
}

impl Waiter {
    /// Runs `claim` until it stops answering "in flight" (`None`), waiting
    /// between claims as the module docs say: woken by this layer's
    /// completion, by the store's `watch` of the key, or by the poll timer
    /// (`signalled_poll` apart while the watch is live and saw no
    /// reconnect since the claim, else 5 ms doubling to 100 ms). Returns the
    /// last answer, and `None` only if the waiter gives up first (its bound
    /// passed, or `abandoned` was set because the caller went away).
    pub(crate) async fn claim_until<T, Fut>(
        &self,
        deadline: Instant,
        abandoned: &AtomicBool,
        (watch, signalled_poll): (Option<&Watch>, Duration),
        mut claim: impl FnMut() -> Fut,
        mut in_flight: impl FnMut(&T) -> Option<Duration>,
    ) -> Result<T, Option<T>>
    where
        Fut: std::future::Future<Output = T>,
    {
        let mut interval = POLL_FIRST;
        let mut last = None;
        loop {
            // Registered before the claim, so that a completion between the
            // claim and the wait is not missed.
            let mut woken = pin!(self.notify.notified());
            woken.as_mut().enable();
            let mut changed = pin!(watch.map(Watch::changed));
            if let Some(changed) = changed.as_mut().as_pin_mut() {
                changed.enable();
            }
            let live = watch.and_then(Watch::live);
            if abandoned.load(Ordering::Relaxed) {
                return Err(last);
            }
            let answer = claim().await;
            let Some(lease_remaining) = in_flight(&answer) else {
                return Ok(answer);
            };
            last = Some(answer);
            // The store's signal was live through the claim: no change was
            // missed, so polling is only the backstop.
            let trusted = live.is_some() && watch.and_then(Watch::live) == live;
            let wait = if trusted { signalled_poll } else { interval };
            // The key may be taken over at the end of its lease: claim then.
            let next = (Instant::now() + wait.min(lease_remaining)).min(deadline);
            let either = std::future::poll_fn(|cx| {
                let signalled = match changed.as_mut().as_pin_mut() {
                    Some(changed) => changed.poll(cx).is_ready(),
                    None => false,
                };
                if signalled || woken.as_mut().poll(cx).is_ready() {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            });
            let _ = tokio::time::timeout_at(next, either).await;
            if !trusted {
                interval = (interval * 2).min(POLL_MAX);
            }
            if Instant::now() >= deadline || abandoned.load(Ordering::Relaxed) {
                return Err(last);
            }
        }
    }
}

/// Wakes the waiters of a key when the first request's hold ends, however
/// it ends: completed, released, rolled back, or dropped.
pub(crate) struct WakeOnEnd {
    pub(crate) waiting: Arc<Waiting>,
    pub(crate) id: RecordId,
}

impl Drop for WakeOnEnd {
    fn drop(&mut self) {
        self.waiting.wake(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(key: &str) -> RecordId {
        RecordId::new("s", key)
    }

    #[test]
    fn places_are_bounded_in_number_and_bytes_and_freed_on_drop() {
        let waiting = Arc::new(Waiting::new(Duration::from_secs(1), 2, 100));
        let a = waiting.enter(&id("k"), 40).unwrap();
        let b = waiting.enter(&id("k"), 40).unwrap();
        assert!(waiting.enter(&id("j"), 1).is_none(), "a third waiter");
        drop(b);
        assert!(waiting.enter(&id("j"), 61).is_none(), "40 + 61 bytes > 100");
        let c = waiting.enter(&id("j"), 60).unwrap();
        assert_eq!(waiting.waiters(), 2);
        drop((a, c));
        assert_eq!(waiting.waiters(), 0);
        assert_eq!(waiting.bytes.load(Ordering::Relaxed), 0);
        assert!(waiting.keys.lock().unwrap().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_completion_wakes_its_waiter_before_the_poll_interval() {
        let waiting = Arc::new(Waiting::new(Duration::from_secs(10), 8, 1024));
        let waiter = waiting.enter(&id("k"), 0).unwrap();
        let claims = AtomicUsize::new(0);
        let done = AtomicBool::new(false);
        let never = AtomicBool::new(false);
        let start = Instant::now();
        let wake = async {
            // The first claim answered "in flight"; the holder ends.
            tokio::task::yield_now().await;
            done.store(true, Ordering::Relaxed);
            drop(WakeOnEnd {
                waiting: waiting.clone(),
                id: id("k"),
            });
        };
        let claim = waiter.claim_until(
            start + Duration::from_secs(10),
            &never,
            (None, DEFAULT_SIGNALLED_POLL),
            || {
                claims.fetch_add(1, Ordering::Relaxed);
                let finished = done.load(Ordering::Relaxed);
                async move { finished }
            },
            |finished| (!finished).then_some(Duration::from_secs(60)),
        );
        let (answer, ()) = tokio::join!(claim, wake);
        assert_eq!(answer, Ok(true));
        assert_eq!(claims.load(Ordering::Relaxed), 2);
        // Woken, not polled: the paused clock did not move.
        assert_eq!(Instant::now(), start);
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_wake_it_polls_with_backoff_and_gives_up_at_the_bound() {
        let waiting = Arc::new(Waiting::new(Duration::from_millis(300), 8, 1024));
        let waiter = waiting.enter(&id("k"), 0).unwrap();
        let start = Instant::now();
        let times = Mutex::new(Vec::new());
        let never = AtomicBool::new(false);
        let answer = waiter
            .claim_until(
                start + Duration::from_millis(300),
                &never,
                (None, DEFAULT_SIGNALLED_POLL),
                || {
                    times.lock().unwrap().push(start.elapsed().as_millis());
                    async {}
                },
                |()| Some(Duration::from_secs(60)),
            )
            .await;
        assert_eq!(answer, Err(Some(())));
        // 5, 10, 20, 40, 80, then 100 ms apart; the bound cuts the last wait.
        assert_eq!(*times.lock().unwrap(), [0, 5, 15, 35, 75, 155, 255]);
        assert_eq!(start.elapsed(), Duration::from_millis(300));
    }

    #[tokio::test(start_paused = true)]
    async fn it_claims_again_when_the_lease_ends_and_stops_when_abandoned() {
        let waiting = Arc::new(Waiting::new(Duration::from_secs(10), 8, 1024));
        let waiter = waiting.enter(&id("k"), 0).unwrap();
        let start = Instant::now();
        let abandoned = AtomicBool::new(false);
        let claims = AtomicUsize::new(0);
        let answer = waiter
            .claim_until(
                start + Duration::from_secs(10),
                &abandoned,
                (None, DEFAULT_SIGNALLED_POLL),
                || {
                    let n = claims.fetch_add(1, Ordering::Relaxed);
                    if n == 1 {
                        abandoned.store(true, Ordering::Relaxed);
                    }
                    async {}
                },
                // The lease ends in 2 ms: claim again then, not at 5 ms.
                |()| Some(Duration::from_millis(2)),
            )
            .await;
        assert_eq!(answer, Err(Some(())));
        assert_eq!(claims.load(Ordering::Relaxed), 2);
        assert_eq!(start.elapsed(), Duration::from_millis(4));
    }

    #[tokio::test(start_paused = true)]
    async fn a_live_store_signal_wakes_the_waiter_and_slows_its_polling() {
        use crate::store::kit::feed::{Feed, change_key, change_payload};
        let waiting = Arc::new(Waiting::new(Duration::from_secs(120), 8, 1024));
        let waiter = waiting.enter(&id("k"), 0).unwrap();
        let feed = Feed::new(8);
        let listener = feed.listener();
        listener.set_live();
        let watch = feed.watch(change_key("t", "s", "k")).unwrap();
        let times = Mutex::new(Vec::new());
        let done = AtomicBool::new(false);
        let never = AtomicBool::new(false);
        let start = Instant::now();
        let announce = async {
            // Two polls a minute apart, then another server completes.
            tokio::time::sleep(Duration::from_secs(90)).await;
            done.store(true, Ordering::Relaxed);
            listener.deliver(&change_payload("t", "s", "k"));
        };
        let claim = waiter.claim_until(
            start + Duration::from_secs(120),
            &never,
            (Some(&watch), Duration::from_secs(60)),
            || {
                times.lock().unwrap().push(start.elapsed().as_secs());
                let finished = done.load(Ordering::Relaxed);
                async move { finished }
            },
            |finished| (!finished).then_some(Duration::from_secs(600)),
        );
        let (answer, ()) = tokio::join!(claim, announce);
        assert_eq!(answer, Ok(true));
        assert_eq!(*times.lock().unwrap(), [0, 60, 90]);
    }
}
