//! A store's change feed: the signal that wakes waiting repeats on other
//! servers ([`Store::watch`](crate::store::Store::watch)), written once for
//! every store that has one (PostgreSQL `LISTEN`, Redis `SUBSCRIBE`).
//!
//! The store keeps one [`Feed`]; its completion and release announce the
//! record's [`change_key`] (a short hash of the store's namespace, the scope
//! and the key: bounded, and it names no key) to every server; one listener
//! connection per store, started when the first waiter watches
//! ([`Feed::start`]), hands each announcement to
//! [`FeedListener::deliver`]. Only keys somebody waits on are kept, at most
//! [`Feed::new`]'s `max_keys` of them: a waiter beyond that, or any waiter
//! while the listener is not connected, is woken by polling alone, so a lost
//! announcement delays a waiter and never strands it.
//!
//! A store supplies its listener's connection as a [`Subscriber`] (one
//! session: connect, subscribe, deliver until the connection ends);
//! [`Feed::start`] runs it on the first watch and runs it again, with
//! backoff, whenever its connection ends, until the last store handle is
//! dropped.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};

use std::time::Duration;

use tokio::sync::{Notify, oneshot};

use crate::fingerprint::Hasher;

/// The default cap on the keys one store's feed watches at once.
pub const DEFAULT_MAX_WATCHED_KEYS: usize = 4096;

/// The listener's first wait before it connects again; it doubles after
/// each session that did not subscribe, up to [`BACKOFF_MAX`].
pub const BACKOFF_FIRST: Duration = Duration::from_millis(100);

/// The listener's longest wait before it connects again.
pub const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// The announcement of a change to `(scope, key)` in `namespace` (a table,
/// a key prefix): the first 8 bytes of a domain-separated SHA-256.
pub fn change_key(namespace: &str, scope: &str, key: &str) -> u64 {
    let mut hasher = Hasher::new("tower-idempotency/change/v1");
    hasher
        .part(namespace.as_bytes())
        .part(scope.as_bytes())
        .part(key.as_bytes());
    let d = hasher.finish().0;
    u64::from_be_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
}

/// [`change_key`] as the store sends it: 16 lowercase hex digits.
pub fn change_payload(namespace: &str, scope: &str, key: &str) -> String {
    format!("{:016x}", change_key(namespace, scope, key))
}

struct Shared {
    keys: Mutex<HashMap<u64, Arc<Notify>>>,
    max_keys: usize,
    /// `generation * 2 + 1` while the listener is subscribed, even while not.
    state: AtomicU64,
    started: AtomicBool,
    /// Dropped with the last store handle: the listener stops.
    stop: Mutex<Option<oneshot::Sender<()>>>,
    stopped: Mutex<Option<oneshot::Receiver<()>>>,
}

/// One store's change feed: the watched keys and the listener's state.
/// Cloning shares it.
#[derive(Clone)]
pub struct Feed {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Feed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Feed")
            .field(
                "live",
                &(self.shared.state.load(Ordering::Acquire) & 1 == 1),
            )
            .finish_non_exhaustive()
    }
}

impl Feed {
    /// A feed watching at most `max_keys` keys at once.
    pub fn new(max_keys: usize) -> Feed {
        let (stop, stopped) = oneshot::channel();
        Feed {
            shared: Arc::new(Shared {
                keys: Mutex::new(HashMap::new()),
                max_keys,
                state: AtomicU64::new(0),
                started: AtomicBool::new(false),
                stop: Mutex::new(Some(stop)),
                stopped: Mutex::new(Some(stopped)),
            }),
        }
    }

    /// Starts the feed's listener once, in a task on the current Tokio
    /// runtime (outside one it does nothing, and waiters poll): a session
    /// of `subscriber()`, and another whenever one ends, after a backoff
    /// ([`BACKOFF_FIRST`] doubling to [`BACKOFF_MAX`], back to the first
    /// after a session that subscribed) during which the feed is down and
    /// waiters poll quickly. A failed session is logged at WARN. The task
    /// ends when the last store handle is dropped. `subscriber` is called
    /// only by the call that starts it.
    pub fn start<S: Subscriber>(&self, subscriber: impl FnOnce() -> S) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.start_once() {
            runtime.spawn(run(self.listener(), subscriber()));
        }
    }

    /// `true` exactly once, for the caller that starts the listener: it
    /// then runs [`Feed::listener`]'s handle in a task of its own
    /// ([`Feed::start`] does both).
    pub(crate) fn start_once(&self) -> bool {
        !self.shared.started.swap(true, Ordering::AcqRel)
    }

    /// The listener's side of the feed. It holds the feed weakly: once
    /// every store handle is gone, [`FeedListener::stopped`] resolves and
    /// [`FeedListener::deliver`] does nothing. Call it once.
    pub(crate) fn listener(&self) -> FeedListener {
        let stopped = lock(&self.shared.stopped).take();
        FeedListener {
            shared: Arc::downgrade(&self.shared),
            stopped,
        }
    }

    /// Watches the key whose announcement is `change`, or `None` when the
    /// feed already watches its maximum of keys (the waiter polls).
    pub fn watch(&self, change: u64) -> Option<Watch> {
        let mut keys = lock(&self.shared.keys);
        let notify = match keys.get(&change) {
            Some(notify) => notify.clone(),
            None if keys.len() >= self.shared.max_keys => return None,
            None => keys.entry(change).or_default().clone(),
        };
        Some(Watch {
            shared: self.shared.clone(),
            change,
            notify,
        })
    }

    /// Whether the listener is subscribed now.
    pub fn is_live(&self) -> bool {
        self.shared.state.load(Ordering::Acquire) & 1 == 1
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        drop(lock(&self.stop).take());
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The listener's handle on its [`Feed`].
pub struct FeedListener {
    shared: Weak<Shared>,
    stopped: Option<oneshot::Receiver<()>>,
}

impl std::fmt::Debug for FeedListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FeedListener").finish_non_exhaustive()
    }
}

impl FeedListener {
    /// Wakes the waiters of the key announced by `payload` (as
    /// [`change_payload`] wrote it; anything else is ignored).
    pub fn deliver(&self, payload: &str) {
        let (Some(shared), Ok(change)) = (self.shared.upgrade(), u64::from_str_radix(payload, 16))
        else {
            return;
        };
        if let Some(notify) = lock(&shared.keys).get(&change) {
            notify.notify_waiters();
        }
    }

    /// The listener is subscribed: from now on every announcement reaches
    /// [`FeedListener::deliver`], and waiters trust it (they poll slowly).
    pub fn set_live(&self) {
        if let Some(shared) = self.shared.upgrade() {
            let state = shared.state.load(Ordering::Acquire);
            shared.state.store((state | 1) + 2, Ordering::Release);
        }
    }

    /// The listener lost its subscription: announcements may be missed
    /// until [`FeedListener::set_live`]; waiters poll quickly meanwhile.
    pub fn set_down(&self) {
        if let Some(shared) = self.shared.upgrade() {
            shared.state.fetch_and(!1, Ordering::AcqRel);
        }
    }

    /// Polled by the listener: ready once every store handle is gone.
    pub fn poll_stopped(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        match &mut self.stopped {
            Some(rx) => Pin::new(rx).poll(cx).map(|_| ()),
            None => Poll::Ready(()),
        }
    }

    /// Resolves once every store handle is gone: the listener stops.
    pub async fn stopped(&mut self) {
        std::future::poll_fn(|cx| self.poll_stopped(cx)).await;
    }

    /// The count of [`FeedListener::set_live`] calls so far (`None` once
    /// the store is gone).
    fn generation(&self) -> Option<u64> {
        let shared = self.shared.upgrade()?;
        Some(shared.state.load(Ordering::Acquire) >> 1)
    }
}

/// How a [`Subscriber`]'s session ended without an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// [`FeedListener::poll_stopped`] was ready: every store handle is
    /// gone, and the listener stops.
    Stopped,
    /// The connection closed: the listener connects again after its
    /// backoff.
    Closed,
}

/// A store's listener connection, run by [`Feed::start`].
pub trait Subscriber: Send + 'static {
    /// A failed session: logged, then the listener connects again after
    /// its backoff.
    type Error: std::fmt::Display + Send;

    /// What the log calls the connection (`"LISTEN"`, `"pub/sub"`).
    const CONNECTION: &'static str;

    /// One session: connects and subscribes, calls
    /// [`FeedListener::set_live`] once subscribed, then hands every
    /// announcement to [`FeedListener::deliver`] until the connection ends
    /// ([`Ended::Closed`], or the error) or
    /// [`FeedListener::poll_stopped`] is ready ([`Ended::Stopped`]; poll it
    /// no more after that). [`Feed::start`] marks the feed down after each
    /// session.
    fn session(
        &mut self,
        feed: &mut FeedListener,
    ) -> impl Future<Output = Result<Ended, Self::Error>> + Send;
}

/// The listener's task: sessions of `subscriber`, with backoff between
/// them, until the store is gone.
async fn run<S: Subscriber>(mut feed: FeedListener, mut subscriber: S) {
    let mut backoff = BACKOFF_FIRST;
    loop {
        let before = feed.generation();
        match subscriber.session(&mut feed).await {
            Ok(Ended::Stopped) => return,
            Ok(Ended::Closed) => {}
            Err(e) => tracing::warn!(
                error = %e,
                "the idempotency store's {} connection failed; waiters poll until it is back",
                S::CONNECTION
            ),
        }
        // A session that subscribed was a working connection: the next is
        // tried soon; one that did not keeps the backoff growing.
        if feed.generation() != before {
            backoff = BACKOFF_FIRST;
        }
        feed.set_down();
        if tokio::time::timeout(backoff, feed.stopped()).await.is_ok() {
            return;
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// A waiter's watch on one key: [`Watch::changed`] is woken by the store's
/// announcement of that key's completion or release. Dropped, the feed
/// forgets the key when nobody else watches it.
pub struct Watch {
    shared: Arc<Shared>,
    change: u64,
    notify: Arc<Notify>,
}

impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch")
            .field("live", &self.live())
            .finish_non_exhaustive()
    }
}

impl Watch {
    /// The next announcement of the key. Enable it (or poll it once) before
    /// the claim that might miss the change, as with
    /// [`Notify::notified`].
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.notify.notified()
    }

    /// `Some(generation)` while the listener is subscribed. The same value
    /// before a claim and after it means no announcement in between was
    /// missed.
    pub fn live(&self) -> Option<u64> {
        let state = self.shared.state.load(Ordering::Acquire);
        (state & 1 == 1).then_some(state >> 1)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let mut keys = lock(&self.shared.keys);
        // The map's Arc and this one: nobody else watches the key.
        if Arc::strong_count(&self.notify) == 2 {
            keys.remove(&self.change);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_announcement_wakes_the_watchers_of_its_key_only() {
        let feed = Feed::new(2);
        let listener = feed.listener();
        let a = feed.watch(change_key("t", "s", "a")).unwrap();
        let a2 = feed.watch(change_key("t", "s", "a")).unwrap();
        let b = feed.watch(change_key("t", "s", "b")).unwrap();
        assert!(feed.watch(change_key("t", "s", "c")).is_none(), "full");
        assert_eq!(a.live(), None);
        listener.set_live();
        assert_eq!(a.live(), Some(1));
        {
            let mut woken_a = std::pin::pin!(a.changed());
            woken_a.as_mut().enable();
            let mut woken_b = std::pin::pin!(b.changed());
            woken_b.as_mut().enable();
            listener.deliver(&change_payload("t", "s", "a"));
            listener.deliver("not hex");
            woken_a.await;
            assert!(
                futures_poll_once(woken_b.as_mut()).is_pending(),
                "b was not announced"
            );
        }
        listener.set_down();
        assert_eq!(a.live(), None);
        listener.set_live();
        assert_eq!(a.live(), Some(2), "a new generation after a reconnect");
        drop((a, a2));
        assert!(feed.watch(change_key("t", "s", "c")).is_some(), "a freed");
    }

    #[tokio::test]
    async fn the_listener_stops_with_the_last_store_handle() {
        let feed = Feed::new(1);
        assert!(feed.start_once());
        assert!(!feed.clone().start_once());
        let mut listener = feed.listener();
        drop(feed);
        listener.stopped().await;
    }

    /// A subscriber that plays `script`, one step a session, then waits
    /// for the store to go; it reports each session's start (the paused
    /// clock's instant, and whether the feed was live then).
    struct Scripted {
        script: std::collections::VecDeque<Step>,
        sessions: tokio::sync::mpsc::UnboundedSender<(tokio::time::Instant, bool)>,
    }

    #[derive(Clone, Copy)]
    enum Step {
        Closed { subscribed: bool },
        Failed,
    }

    impl Subscriber for Scripted {
        type Error = &'static str;
        const CONNECTION: &'static str = "scripted";

        async fn session(&mut self, feed: &mut FeedListener) -> Result<Ended, &'static str> {
            let live = feed
                .shared
                .upgrade()
                .is_some_and(|s| s.state.load(Ordering::Acquire) & 1 == 1);
            self.sessions
                .send((tokio::time::Instant::now(), live))
                .unwrap();
            match self.script.pop_front() {
                Some(Step::Closed { subscribed }) => {
                    if subscribed {
                        feed.set_live();
                    }
                    Ok(Ended::Closed)
                }
                Some(Step::Failed) => Err("refused"),
                None => {
                    feed.set_live();
                    feed.stopped().await;
                    Ok(Ended::Stopped)
                }
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_listener_reconnects_with_backoff_reset_by_a_subscribed_session() {
        let feed = Feed::new(1);
        let (tx, mut sessions) = tokio::sync::mpsc::unbounded_channel();
        let script = [
            Step::Closed { subscribed: false },
            Step::Failed,
            Step::Closed { subscribed: true },
            Step::Closed { subscribed: false },
        ];
        let t0 = tokio::time::Instant::now();
        feed.start(|| Scripted {
            script: script.into(),
            sessions: tx.clone(),
        });
        feed.start(|| -> Scripted { unreachable!("started once") });
        drop(tx);
        let mut at = Vec::new();
        for _ in 0..5 {
            let (instant, live) = sessions.recv().await.unwrap();
            assert!(!live, "down between sessions");
            at.push((instant - t0).as_millis());
        }
        // 100 ms, doubled to 200 after two sessions that never subscribed;
        // back to 100 after one that did, then 200 again.
        assert_eq!(at, [0, 100, 300, 400, 600]);
        let watch = feed.watch(change_key("t", "s", "k")).unwrap();
        eventually_live(&watch).await;
        drop(watch);
        drop(feed);
        assert!(sessions.recv().await.is_none(), "the task ended");
    }

    async fn eventually_live(watch: &Watch) {
        while watch.live().is_none() {
            tokio::task::yield_now().await;
        }
    }

    fn futures_poll_once<F: Future>(f: Pin<&mut F>) -> Poll<F::Output> {
        let waker = std::task::Waker::noop();
        f.poll(&mut Context::from_waker(waker))
    }
}
