//! While the first request is in flight: its lease renewed
//! ([`crate::renew`](super)), and repeats that wait for it instead of
//! taking 409.

use std::sync::Arc;
use std::time::Duration;

use super::IdempotencyLayer;
use crate::wait::Waiting;

impl<St, Sc, F, P, M> IdempotencyLayer<St, Sc, F, P, M> {
    /// The longest a request may hold its key, counted from its claim
    /// (default [`DEFAULT_MAX_HOLD`](crate::DEFAULT_MAX_HOLD), 60 s): the one
    /// cap on a running request, on every store and mode. While the request
    /// runs, the layer renews its claim's lease every third of a
    /// [`lease`](Self::lease), fenced by the claim's token
    /// ([`Store::renew_all`](crate::store::Store::renew_all)), so a crashed
    /// process's keys are free within one short lease while a handler slower
    /// than the lease keeps its key.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, scope::GlobalScope};
    ///
    /// // Crashed holders free their keys within 5 s; a live handler may
    /// // hold its key for up to 10 minutes.
    /// let layer = IdempotencyLayer::new(MemoryStore::new(), GlobalScope)
    ///     .lease(Duration::from_secs(5))
    ///     .max_hold(Duration::from_secs(600));
    /// # let _ = layer;
    /// ```
    ///
    /// - **Past the max hold.** Renewals stop; the lease then runs out and a
    ///   repeat may take the key over. A transactional store rolls the
    ///   request's transaction back at the max hold (503 `held-too-long`).
    ///   No store setting caps it further.
    /// - **A lost lease** (a renewal finds the record carrying another
    ///   token, or the store could not confirm one before the lease ended)
    ///   is logged at WARN, counted (`tower_idempotency_leases_lost_total` with the
    ///   `metrics` feature), and signalled to the handler through
    ///   [`ClaimedKey::lease_lost`](crate::key::ClaimedKey::lease_lost). In
    ///   transactional mode the commit is fenced by the token: a request
    ///   whose key was taken over never commits (503).
    /// - **Where renewal applies.** Separate mode on every store, and
    ///   transactional mode where the claim commits before the handler runs
    ///   (PostgreSQL, MySQL). SQLite's transactional claim lives inside the
    ///   open transaction, vanishes with a crash, and needs no renewal.
    /// - **What it costs.** Nothing for a request that ends before its first
    ///   renewal (a third of a lease): no task or timer per request. One task
    ///   per layer renews every claim due in one call to the store, which the
    ///   PostgreSQL and MySQL stores run as one statement on a connection of
    ///   their own, so renewals never wait for the request pool.
    /// - **Streams.** Renewal goes on until the record is stored, so a
    ///   streamed first response is stored if it ends within the max hold.
    pub fn max_hold(mut self, max_hold: Duration) -> Self {
        self.config.settings.max_hold = max_hold;
        self
    }

    /// A repeat that arrives while the first request with its key is in
    /// flight waits up to `max_wait` for it to finish, then gets the first
    /// request's answer: its replay (or 422 for another fingerprint, or,
    /// when the first gave its key back or lost its lease, a run of its
    /// own). Past `max_wait`, or when the waiters are full (see
    /// [`max_waiters`](Self::max_waiters)), it gets 409 as without this
    /// option. Off by default: `Duration::ZERO` answers 409 at once, the
    /// IETF draft's rule (§2.6).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, scope::GlobalScope};
    ///
    /// // Concurrent duplicates of a request that takes 200 ms get its
    /// // replay, not 409.
    /// let layer = IdempotencyLayer::new(MemoryStore::new(), GlobalScope)
    ///     .wait_in_flight(Duration::from_secs(2));
    /// # let _ = layer;
    /// ```
    ///
    /// - **Woken by the completion.** A first request in this process,
    ///   behind this layer (or a clone of it), wakes its waiters when its
    ///   record completes or its key is given back.
    /// - **Woken by the store for other servers.** A store with a signal
    ///   ([`Store::watch`](crate::store::Store::watch)) wakes a waiter when
    ///   a first request on another server completes or gives its key back:
    ///   `PostgresStore` and `SqlxPostgresStore` with
    ///   `notify_waiters(true)` (PostgreSQL `LISTEN`/`NOTIFY`, off by
    ///   default: it costs commit throughput) and
    ///   `RedisStore` on one server (pub/sub). Measured on loopback
    ///   (`bench/wake`, 200 runs): a waiter on another server answers
    ///   0.4 ms (PostgreSQL) or 0.6 ms (Redis) after the first request's
    ///   client has its response at the median, under 12 ms at worst;
    ///   polling alone: 29 ms at the median, 97 ms at worst.
    /// - **Polling as the backstop.** A waiter also claims again after
    ///   5 ms, then at doubling intervals up to 100 ms (without a live
    ///   signal: the memory and SQLite stores, MySQL, a PostgreSQL store
    ///   without `notify_waiters`, a Redis Cluster, or while the store's
    ///   listener reconnects),
    ///   or every [`signalled_poll_interval`](Self::signalled_poll_interval)
    ///   (default 1 s) while the signal is live; and at the end of the first
    ///   request's lease. Without a signal a first request on another server
    ///   is seen within 100 ms of its completion.
    /// - **Holds nothing.** A waiter holds no store connection and no writer
    ///   slot while it waits; each claim is one short store call, as a
    ///   client's retry would be.
    /// - **Cancelled with its caller.** A waiter whose client goes away
    ///   stops at its next claim and never runs the handler.
    pub fn wait_in_flight(mut self, max_wait: Duration) -> Self {
        let (count, bytes) = self.config.settings.waiter_limits;
        self.config.settings.wait =
            (!max_wait.is_zero()).then(|| Arc::new(Waiting::new(max_wait, count, bytes)));
        self
    }

    /// How often a waiting repeat claims again while its store's signal is
    /// live (see [`wait_in_flight`](Self::wait_in_flight)): the backstop
    /// for an announcement the store lost. Default 1 s; never later than
    /// the end of the first request's lease.
    pub fn signalled_poll_interval(mut self, interval: Duration) -> Self {
        self.config.settings.signalled_poll = interval;
        self
    }

    /// Caps the repeats that wait at once behind this layer (see
    /// [`wait_in_flight`](Self::wait_in_flight)): at most `count` of them
    /// (default [`DEFAULT_MAX_WAITERS`](crate::DEFAULT_MAX_WAITERS), 256), holding at most `bytes` of
    /// buffered request bodies between them (default
    /// [`DEFAULT_MAX_WAITING_BYTES`](crate::DEFAULT_MAX_WAITING_BYTES), 16 MiB). A repeat beyond either cap
    /// gets 409 at once.
    pub fn max_waiters(mut self, count: usize, bytes: usize) -> Self {
        if let Some(wait) = &self.config.settings.wait {
            self.config.settings.wait = Some(Arc::new(Waiting::new(wait.bound, count, bytes)));
        }
        self.config.settings.waiter_limits = (count, bytes);
        self
    }
}
