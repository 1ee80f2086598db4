//! [`Relay`]: the task that claims due messages, delivers them through a
//! [`Sink`] and records each outcome.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinSet;
use tower::retry::backoff::{Backoff, ExponentialBackoffMaker, MakeBackoff};
use tower::util::rng::HasherRng;

use tower_idempotency::store::Purge;
use tower_idempotency::store::kit::purge::in_batches;

use super::Message;
use super::queue::{Claimed, Fate, Queue};
use super::sink::{Delivery, Outcome, Sink};

/// A relay's settings; every one has a default and a builder method on
/// [`Relay`].
#[derive(Debug, Clone)]
pub(super) struct Config {
    pub(super) batch_size: usize,
    pub(super) max_in_flight: usize,
    pub(super) answer_timeout: Duration,
    pub(super) lease: Duration,
    pub(super) poll_interval: Duration,
    pub(super) backoff_min: Duration,
    pub(super) backoff_max: Duration,
    pub(super) retry_after_max: Duration,
    pub(super) max_attempts: Option<u32>,
    pub(super) retention: Duration,
    /// When delivered messages past their retention are deleted, and how
    /// many one statement deletes: the stores' [`Purge`].
    pub(super) purge: Purge,
    pub(super) maintenance_every: Duration,
    /// Opens sealed payloads ([`Message::seal`](crate::Message::seal)).
    pub(super) keyring: Option<tower_idempotency::seal::Keyring>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            batch_size: 32,
            max_in_flight: 64,
            answer_timeout: Duration::from_secs(10),
            lease: Duration::from_secs(15),
            poll_interval: Duration::from_millis(250),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(3600),
            retry_after_max: Duration::from_secs(3600),
            max_attempts: Some(40),
            retention: Duration::from_secs(24 * 3600),
            purge: Purge::default(),
            maintenance_every: Duration::from_secs(10),
            keyring: None,
        }
    }
}

impl Config {
    /// How long one attempt may take: the answer timeout, but never more
    /// than three quarters of the lease, so the lease outlives the attempt.
    pub(super) fn attempt_timeout(&self) -> Duration {
        self.answer_timeout.min(self.lease - self.lease / 4)
    }
}

/// The delay before attempt `attempt + 1`, after attempt `attempt` (1 for
/// the first) failed: tower's capped exponential backoff with full jitter
/// (`min · 2^(attempt-1)` plus up to as much again at random, never above
/// `max`).
pub(super) fn backoff_delay(min: Duration, max: Duration, attempt: u32) -> Duration {
    let Ok(mut maker) = ExponentialBackoffMaker::new(min, max, 1.0, HasherRng::default()) else {
        return max;
    };
    let mut backoff = maker.make_backoff();
    // Each step doubles; past 40 steps every delay is capped anyway.
    for _ in 1..attempt.clamp(1, 40) {
        drop(backoff.next_backoff());
    }
    let sleep = backoff.next_backoff();
    sleep
        .deadline()
        .saturating_duration_since(tokio::time::Instant::now())
        .min(max)
}

/// The delay before the attempt after attempt `attempt`: the backoff's, or
/// the receiver's `Retry-After` (`asked`, capped) when that is longer.
fn retry_delay(config: &Config, attempt: u32, asked: Duration) -> Duration {
    let backoff = backoff_delay(config.backoff_min, config.backoff_max, attempt);
    backoff.max(asked.min(config.retry_after_max))
}

/// When the attempt after a wait of `after` is due, as an HTTP date (or
/// "never" past the clock's range).
fn next_attempt(after: Duration) -> String {
    std::time::SystemTime::now()
        .checked_add(after)
        .map_or_else(|| "never".to_owned(), httpdate::fmt_http_date)
}

/// What decides the relay's stop.
#[derive(Default)]
pub(super) struct Stop {
    flag: AtomicBool,
    notify: Notify,
}

/// The running relay, from [`Relay::spawn`]. Dropping it leaves the relay
/// running until the runtime shuts down.
#[derive(Debug)]
pub struct RelayHandle {
    stop: Arc<Stop>,
    task: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stop").field("flag", &self.flag).finish()
    }
}

impl RelayHandle {
    /// Stops claiming, waits for the attempts in flight to end (each is
    /// bounded by the answer timeout) and records them.
    pub async fn shutdown(self) {
        self.stop.flag.store(true, Ordering::SeqCst);
        self.stop.notify.notify_one();
        let _ = self.task.await;
    }

    /// Stops at once, like a crash: messages in flight keep their lease
    /// until it ends, and are then delivered again (by any relay).
    pub fn abort(&self) {
        self.task.abort();
    }
}

/// The delivering side of an [`Outbox`](crate::Outbox): from
/// [`Outbox::relay`](crate::Outbox::relay), configured with the methods
/// below, started with [`Relay::spawn`].
///
/// Each round it claims up to [`batch_size`](Relay::batch_size) due messages
/// (never more than its free [`max_in_flight`](Relay::max_in_flight)
/// slots) under a [`lease`](Relay::lease), and delivers each in a task of
/// its own:
///
/// * [`Outcome::Delivered`]: marked done, never sent again; purged
///   [`retention`](Relay::retention) later.
/// * [`Outcome::Retry`], or no answer within the
///   [`answer_timeout`](Relay::answer_timeout): due again after a capped,
///   jittered exponential [`backoff`](Relay::backoff) (tower's
///   `ExponentialBackoff`), unless it was attempt
///   [`max_attempts`](Relay::max_attempts): then a dead letter. Each retry
///   is logged at INFO with the error (an HTTP status, say) and the time of
///   the next attempt.
/// * [`Outcome::RetryAfter`] (the receiver's `Retry-After`): the same, but
///   due no earlier than the receiver asked, capped at
///   [`retry_after_max`](Relay::retry_after_max).
/// * [`Outcome::Reject`]: a dead letter.
///
/// # The default schedule
///
/// A message that keeps failing is retried for about a day before it
/// becomes a dead letter, long enough to ride out a receiver's outage of a
/// day (Stripe retries webhooks for three days; Standard Webhooks' example
/// schedule spans about 27 hours). The delay after attempt `n` is
/// `100 ms · 2^(n-1)` plus up to as much again at random, never more than
/// 1 h, and never less than a `Retry-After` (capped at 1 h):
///
/// | after attempt | delay (seconds) | time since the first attempt |
/// |---|---|---|
/// | 1, 2, 3 | 0.1–0.2, 0.2–0.4, 0.4–0.8 | under 2 s |
/// | 10 | 51–102 | 1.7–3.4 min |
/// | 15 | 1,638–3,277 | 0.9–1.8 h |
/// | 16 | 3,277–3,600 | 1.8–2.8 h |
/// | 17 to 39 | 3,600 each | |
/// | 40 | (a dead letter) | 24.8–25.8 h |
///
/// A partner that recovers gets its backlog within the hour. Shorter
/// schedules: [`backoff`](Relay::backoff) and
/// [`max_attempts`](Relay::max_attempts); `max_attempts(None)` never gives
/// up.
///
/// When nothing is due it waits [`poll_interval`](Relay::poll_interval)
/// (or until [`Outbox::wake`](crate::Outbox::wake)).
pub struct Relay {
    pub(super) queue: Arc<dyn Queue>,
    pub(super) sink: Arc<dyn Sink>,
    pub(super) wake: Arc<Notify>,
    pub(super) config: Config,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Relay {
    /// Messages claimed per round, at least 1 (default 32).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.config.batch_size = n.max(1);
        self
    }

    /// Attempts under way at once, at least 1 (default 64).
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.config.max_in_flight = n.max(1);
        self
    }

    /// How long an attempt may wait for the sink's answer (default 10 s),
    /// capped at three quarters of the lease; past it the attempt counts as
    /// a retryable failure.
    pub fn answer_timeout(mut self, d: Duration) -> Self {
        self.config.answer_timeout = d;
        self
    }

    /// How long a claim holds a message (default 15 s, at least 1 s). A
    /// relay that dies holding messages delays them this long; another
    /// relay then claims them. No relay claims a message while another's
    /// lease on it lasts.
    pub fn lease(mut self, d: Duration) -> Self {
        self.config.lease = d.max(Duration::from_secs(1));
        self
    }

    /// How long an idle relay waits before it looks for due messages again
    /// (default 250 ms, at least 10 ms).
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.config.poll_interval = d.max(Duration::from_millis(10));
        self
    }

    /// The retry delays: `min` after the first failure, doubling, with up
    /// to as much again of random jitter, never above `max` (default
    /// 100 ms and 1 h). `max` is at least 1 ms; `min` at most `max`.
    pub fn backoff(mut self, min: Duration, max: Duration) -> Self {
        let max = max.max(Duration::from_millis(1));
        self.config.backoff_min = min.min(max);
        self.config.backoff_max = max;
        self
    }

    /// The longest wait a receiver's `Retry-After` may impose before the
    /// next attempt (default 1 h). Longer requests are cut to it; the
    /// backoff's delay still applies when it is longer.
    pub fn retry_after_max(mut self, d: Duration) -> Self {
        self.config.retry_after_max = d;
        self
    }

    /// The attempts a message gets before it becomes a dead letter
    /// (default `Some(40)`: about a day, see [the default
    /// schedule](Relay#the-default-schedule)); `None`: retried without
    /// limit.
    pub fn max_attempts(mut self, n: Option<u32>) -> Self {
        self.config.max_attempts = n.map(|n| n.max(1));
        self
    }

    /// How long delivered messages are kept before the relay deletes them
    /// (default 24 h, as the records' TTL). Dead letters are never deleted
    /// by the relay.
    pub fn retention(mut self, d: Duration) -> Self {
        self.config.retention = d;
        self
    }

    /// When the relay deletes delivered messages past their
    /// [`retention`](Relay::retention), in statements of at most how many
    /// rows: the same setting, with the same default, as the stores' own
    /// `purge` of expired records (every 60 s, 1,000 rows a statement;
    /// `Purge::off()`: the application calls
    /// [`Outbox::purge_delivered`](crate::Outbox::purge_delivered)).
    pub fn purge(mut self, purge: Purge) -> Self {
        self.config.purge = purge;
        self
    }

    /// The keys that open sealed payloads
    /// ([`Message::seal`](crate::Message::seal)): the same keyring as the
    /// layer's `encrypt_at_rest`, rotation included (the first key seals,
    /// every key opens). A sealed payload this relay cannot open (no keys,
    /// or none of the key it names) is not delivered: it is retried on the
    /// relay's schedule, so a relay that has the key may take it, and
    /// becomes a dead letter when its attempts run out.
    pub fn keyring(mut self, keyring: tower_idempotency::seal::Keyring) -> Self {
        self.config.keyring = Some(keyring);
        self
    }

    /// Starts the relay on the current Tokio runtime.
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime.
    pub fn spawn(self) -> RelayHandle {
        let stop = Arc::new(Stop::default());
        let task = tokio::spawn(run(self, stop.clone()));
        RelayHandle { stop, task }
    }
}

/// A random name for this relay's claims (shown nowhere but the table).
fn owner() -> String {
    let mut b = [0u8; 8];
    let _ = getrandom::fill(&mut b);
    b.iter().map(|b| format!("{b:02x}")).collect()
}

async fn run(relay: Relay, stop: Arc<Stop>) {
    let owner = owner();
    let config = Arc::new(relay.config.clone());
    let slots = Arc::new(Semaphore::new(config.max_in_flight));
    let mut tasks = JoinSet::new();
    let mut next_maintenance = tokio::time::Instant::now();
    let mut next_purge = config.purge.period().map(|every| next_maintenance + every);
    while !stop.flag.load(Ordering::SeqCst) {
        while tasks.try_join_next().is_some() {}
        let now = tokio::time::Instant::now();
        if next_purge.is_some_and(|at| now >= at) {
            purge(&*relay.queue, &config).await;
            next_purge = config.purge.period().map(|every| now + every);
        }
        if now >= next_maintenance {
            maintain(&*relay.queue).await;
            next_maintenance = tokio::time::Instant::now() + config.maintenance_every;
        }
        let free = slots.available_permits().min(config.batch_size);
        if free == 0 {
            tokio::select! {
                _ = tasks.join_next() => {}
                _ = stop.notify.notified() => {}
            }
            continue;
        }
        match relay.queue.claim(&owner, free, config.lease).await {
            Ok(claimed) => {
                let full = claimed.len() == free;
                for c in claimed {
                    let Ok(permit) = slots.clone().try_acquire_owned() else {
                        break;
                    };
                    let (queue, sink, config) =
                        (relay.queue.clone(), relay.sink.clone(), config.clone());
                    tasks.spawn(async move {
                        attempt(&*queue, &*sink, &config, c).await;
                        drop(permit);
                    });
                }
                if full {
                    continue;
                }
            }
            Err(e) => tracing::warn!(error = %e, "outbox relay: claiming messages failed"),
        }
        tokio::select! {
            _ = tokio::time::sleep(config.poll_interval) => {}
            _ = relay.wake.notified() => {}
            _ = stop.notify.notified() => {}
        }
    }
    while tasks.join_next().await.is_some() {}
}

/// Deletes delivered messages past their retention, in bounded batches.
async fn purge(queue: &dyn Queue, config: &Config) {
    let purged = in_batches(config.purge.batch_rows(), |rows| {
        queue.purge(config.retention, rows as usize)
    });
    match purged.await {
        Ok(n) if n > 0 => tracing::debug!(purged = n, "outbox relay: purged delivered messages"),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "outbox relay: purging delivered messages failed"),
    }
}

/// Sets the gauge of the oldest pending message's age (with the `metrics`
/// feature; nothing without it).
async fn maintain(queue: &dyn Queue) {
    #[cfg(feature = "metrics")]
    if let Ok(counts) = queue.counts().await {
        let age = counts.oldest_pending_age_ms.unwrap_or(0) as f64 / 1000.0;
        metrics::gauge!(super::METRIC_OLDEST_PENDING).set(age);
    }
    #[cfg(not(feature = "metrics"))]
    let _ = queue;
}

/// Hands `message` to the sink, at most the attempt's timeout.
async fn deliver(sink: &dyn Sink, config: &Config, message: Message, attempt: u32) -> Outcome {
    let delivery = Delivery {
        key: message.key,
        destination: message.destination,
        content_type: message.content_type,
        payload: Bytes::from(message.payload),
        attempt,
    };
    let timeout = config.attempt_timeout();
    match tokio::time::timeout(timeout, sink.deliver(delivery)).await {
        Ok(outcome) => outcome,
        Err(_) => Outcome::Retry(format!("no answer within {} ms", timeout.as_millis())),
    }
}

/// One attempt at one claimed message, and its record.
async fn attempt(queue: &dyn Queue, sink: &dyn Sink, config: &Config, mut c: Claimed) {
    let outcome = match crate::message::open(&mut c.message, config.keyring.as_ref()) {
        Ok(()) => deliver(sink, config, c.message, c.attempt).await,
        Err(error) => Outcome::Retry(error),
    };
    let (error, asked) = match outcome {
        Outcome::Delivered => (None, Duration::ZERO),
        Outcome::Retry(error) => (Some(Ok(error)), Duration::ZERO),
        Outcome::RetryAfter { error, after } => (Some(Ok(error)), after),
        Outcome::Reject(error) => (Some(Err(error)), Duration::ZERO),
    };
    let fate = match error {
        None => Fate::Done,
        Some(Ok(error)) if config.max_attempts.is_some_and(|max| c.attempt >= max) => Fate::Dead {
            error: format!("{error} (attempt {}, the last allowed)", c.attempt),
        },
        Some(Ok(error)) => Fate::Retry {
            after: retry_delay(config, c.attempt, asked),
            error,
        },
        Some(Err(error)) => Fate::Dead { error },
    };
    count(&fate);
    match &fate {
        Fate::Done => tracing::debug!(id = c.id, attempt = c.attempt, "outbox: delivered"),
        Fate::Retry { after, error } => tracing::info!(
            id = c.id,
            attempt = c.attempt,
            %error,
            retry_in_ms = after.as_millis() as u64,
            next_attempt = %next_attempt(*after),
            "outbox: attempt failed; retrying"
        ),
        Fate::Dead { error } => {
            tracing::warn!(id = c.id, attempt = c.attempt, %error, "outbox: message is a dead letter")
        }
    }
    // The record is retried a few times; if it still fails, the lease ends
    // and the message is delivered again (at least once).
    for pause in [0u64, 100, 400, 1600] {
        if pause > 0 {
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
        match queue
            .finish(c.id, c.attempt, c.lease_until_ms, fate.clone())
            .await
        {
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(id = c.id, error = %e, "outbox relay: recording an attempt failed")
            }
        }
    }
}

#[cfg(feature = "metrics")]
fn count(fate: &Fate) {
    let name = match fate {
        Fate::Done => super::METRIC_DELIVERIES,
        Fate::Retry { .. } => super::METRIC_RETRIES,
        Fate::Dead { .. } => super::METRIC_DEAD_LETTERS,
    };
    metrics::counter!(name).increment(1);
}

#[cfg(not(feature = "metrics"))]
fn count(_: &Fate) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn backoff_doubles_and_is_capped() {
        let (min, max) = (Duration::from_millis(100), Duration::from_secs(2));
        for _ in 0..50 {
            let first = backoff_delay(min, max, 1);
            assert!(
                first >= Duration::from_millis(99) && first <= Duration::from_millis(200),
                "{first:?}"
            );
            let third = backoff_delay(min, max, 3);
            assert!(
                third >= Duration::from_millis(399) && third <= Duration::from_millis(800),
                "{third:?}"
            );
            assert!(backoff_delay(min, max, 30) <= max);
            assert!(backoff_delay(min, max, u32::MAX) <= max);
        }
    }

    /// The documented default schedule: a dead letter no sooner than 24 h
    /// (24.8 h at the least, 25.8 h at the most, attempts' own time aside).
    #[tokio::test]
    async fn the_default_schedule_rides_out_a_day() {
        let config = Config::default();
        let last = config.max_attempts.unwrap();
        assert_eq!(last, 40);
        for _ in 0..20 {
            let total: Duration = (1..last)
                .map(|attempt| retry_delay(&config, attempt, Duration::ZERO))
                .sum();
            let hours = total.as_secs_f64() / 3600.0;
            assert!((24.8..=25.9).contains(&hours), "{hours} h");
        }
        // Past the clock's range the next attempt is "never", not a panic.
        assert_eq!(next_attempt(Duration::MAX), "never");
        // A `Retry-After` longer than the backoff wins, up to its cap.
        let asked = |secs| retry_delay(&config, 1, Duration::from_secs(secs));
        assert_eq!(asked(120), Duration::from_secs(120));
        assert_eq!(asked(86_400), Duration::from_secs(3600));
    }
}
