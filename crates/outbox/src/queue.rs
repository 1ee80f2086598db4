//! What a relay asks of the outbox table, whichever database holds it, and
//! the shapes of the operators' views.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use super::Message;
use tower_idempotency::StoreError;

/// A boxed future, as [`Queue`]'s methods return.
#[cfg_attr(not(feature = "test-util"), allow(unreachable_pub))]
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A message a relay has claimed: it holds the lease until it finishes it
/// or the lease ends. `attempt` (1 for the first) and `lease_until_ms` (the
/// claim's lease deadline, which every claim sets anew) fence the finish:
/// attempts alone restart at 1 after a requeue.
#[derive(Debug)]
#[cfg_attr(not(feature = "test-util"), allow(unreachable_pub))]
pub struct Claimed {
    /// The message's row id.
    pub id: i64,
    /// This attempt's number, 1 for the first.
    pub attempt: u32,
    /// The claim's lease deadline, in milliseconds since the Unix epoch.
    pub lease_until_ms: i64,
    /// What to deliver.
    pub message: Message,
}

/// How an attempt ended, as the relay records it.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "test-util"), allow(unreachable_pub))]
pub enum Fate {
    /// Delivered: never sent again.
    Done,
    /// Failed: due again `after` from now.
    Retry {
        /// How long until the next attempt.
        after: Duration,
        /// Why it failed.
        error: String,
    },
    /// A dead letter: never sent again until requeued.
    Dead {
        /// Why.
        error: String,
    },
}

/// Which messages [`Outbox::list`](crate::Outbox::list) shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum View {
    /// Not delivered yet and held by no relay (waiting for their first
    /// attempt or their next retry).
    Pending,
    /// Held by a relay whose lease has not ended: being delivered now.
    InFlight,
    /// Dead letters: refused by the receiver, or out of attempts. Never
    /// retried until [`Outbox::requeue`](crate::Outbox::requeue).
    Dead,
}

/// One message as the operators see it (its payload left out).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The row's id: what [`Outbox::requeue`](crate::Outbox::requeue) takes.
    pub id: i64,
    /// The message's idempotency key.
    pub key: String,
    /// Where it goes.
    pub destination: String,
    /// Attempts started so far.
    pub attempts: u32,
    /// Milliseconds since it was enqueued.
    pub age_ms: u64,
    /// Milliseconds until its next attempt is due (0: due now).
    pub due_in_ms: u64,
    /// Milliseconds left of the lease of the relay holding it, if one does.
    pub lease_remaining_ms: Option<u64>,
    /// Why the last attempt failed, if one did.
    pub last_error: Option<String>,
}

/// How many messages are in each state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counts {
    /// Waiting for an attempt ([`View::Pending`]).
    pub pending: u64,
    /// Being delivered ([`View::InFlight`]).
    pub in_flight: u64,
    /// Dead letters ([`View::Dead`]).
    pub dead: u64,
    /// Delivered and not yet purged.
    pub done: u64,
    /// Milliseconds since the oldest undelivered message (pending or in
    /// flight) was enqueued; `None` when there is none.
    pub oldest_pending_age_ms: Option<u64>,
}

/// The outbox table of one database.
#[cfg_attr(not(feature = "test-util"), allow(unreachable_pub))]
pub trait Queue: Send + Sync + 'static {
    /// Claims up to `limit` due messages for `owner`, for `lease`.
    fn claim(
        &self,
        owner: &str,
        limit: usize,
        lease: Duration,
    ) -> BoxFut<'_, Result<Vec<Claimed>, StoreError>>;
    /// Records how attempt `attempt` of message `id` ended; `false` when
    /// the row was not changed (done already, or reclaimed after the lease).
    fn finish(
        &self,
        id: i64,
        attempt: u32,
        lease_until_ms: i64,
        fate: Fate,
    ) -> BoxFut<'_, Result<bool, StoreError>>;
    /// Deletes up to `limit` messages delivered more than `older_than` ago.
    fn purge(&self, older_than: Duration, limit: usize) -> BoxFut<'_, Result<u64, StoreError>>;
    /// Up to `limit` messages in the state `view`, oldest first.
    fn list(&self, view: View, limit: usize) -> BoxFut<'_, Result<Vec<Entry>, StoreError>>;
    /// Makes dead letter `id` pending again; `false` when it is not one.
    fn requeue(&self, id: i64) -> BoxFut<'_, Result<bool, StoreError>>;
    /// How many messages are in each state.
    fn counts(&self) -> BoxFut<'_, Result<Counts, StoreError>>;
}
