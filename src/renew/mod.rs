//! Lease renewal while a request runs, up to its max hold
//! ([`IdempotencyLayer::max_hold`](crate::IdempotencyLayer::max_hold)):
//! the layer's one renewal task ([`renewer`]) extends each claim's lease
//! every third of a lease, fenced by its token, and reports a lost lease
//! through the request's [`LeaseSignal`]; [`Confirmer`] answers
//! `ClaimedKey::confirm`.

mod renewer;

pub(crate) use renewer::{Claimed, Renew, Renewal, Renewer};

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::mode::Hold;
use crate::response::StoredResponse;
use crate::store::{Completion, FencingToken, RecordId, Store, StoreError};
use crate::wait::WakeOnEnd;

/// Whether the lease of a request's claim was lost; shared by the renewal
/// task and the request's [`ClaimedKey`](crate::key::ClaimedKey).
///
/// It also keeps the instant until which the store has confirmed the claim
/// (its first lease, then each renewal's), counted from before each request
/// was sent, so that it is never later than the store's own deadline.
#[derive(Debug, Default)]
pub(crate) struct LeaseSignal {
    lost: watch::Sender<bool>,
    confirmed_until: std::sync::Mutex<Option<Instant>>,
}

impl LeaseSignal {
    pub(crate) fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    pub(crate) async fn lost(&self) {
        let mut lost = self.lost.subscribe();
        // The sender lives as long as `self`: `wait_for` cannot fail.
        let _ = lost.wait_for(|lost| *lost).await;
    }

    fn set_lost(&self) {
        self.lost.send_replace(true);
    }

    /// The store confirmed the claim until `until` (never moved back).
    pub(crate) fn confirmed(&self, until: Instant) {
        let mut confirmed = self
            .confirmed_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *confirmed = Some(confirmed.map_or(until, |t| t.max(until)));
    }

    fn confirmed_until(&self) -> Option<Instant> {
        *self
            .confirmed_until
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Why [`ClaimedKey::confirm`](crate::key::ClaimedKey::confirm) could not
/// confirm that the request still holds its key. Either way, do not start
/// the effect.
#[derive(Debug)]
#[non_exhaustive]
pub enum NotConfirmed {
    /// The key was taken over by another request (this one's lease ended
    /// unrenewed), released or completed, or the request's max hold has
    /// passed: another request may run the operation.
    Lost,
    /// The store did not answer: whether the claim holds is unknown.
    Store(crate::store::StoreError),
}

impl std::fmt::Display for NotConfirmed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotConfirmed::Lost => f.write_str(
                "this request no longer holds its idempotency key: another request may run the operation",
            ),
            NotConfirmed::Store(e) => write!(f, "the idempotency claim could not be confirmed: {e}"),
        }
    }
}

impl std::error::Error for NotConfirmed {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            NotConfirmed::Lost => None,
            NotConfirmed::Store(e) => Some(e),
        }
    }
}

/// What [`ClaimedKey::confirm`](crate::key::ClaimedKey::confirm) asks of
/// the store for one claim: a renewal fenced by its token, never past its
/// hold, whose success is the proof that the claim still holds.
pub(crate) struct Confirmer(Box<dyn Fn() -> Confirmation + Send + Sync>);

/// One confirmation under way.
type Confirmation =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Duration, NotConfirmed>> + Send>>;

impl std::fmt::Debug for Confirmer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Confirmer")
    }
}

impl Confirmer {
    /// A claim whose effect commits with its record (transactional mode):
    /// the commit is the fence, so nothing to ask; it holds for `left`.
    pub(crate) fn atomic(hold_end: Instant) -> Self {
        Confirmer(Box::new(move || {
            let left = hold_end.saturating_duration_since(Instant::now());
            Box::pin(std::future::ready(Ok(left)))
        }))
    }

    /// A claim committed on its own (separate mode): a renewal of `lease`
    /// (never past `hold_end`) fenced by `token`, unless the store has
    /// confirmed the claim for at least half a lease more already (its first
    /// lease, a renewal): then it answers at once, at no cost, so a request
    /// shorter than half its lease never pays a round trip. A holder paused
    /// past its lease finds that confirmation run out, and asks the store.
    pub(crate) fn renewing<St: Store>(
        store: St,
        (id, token): (RecordId, FencingToken),
        lease: Duration,
        hold_end: Instant,
        signal: Arc<LeaseSignal>,
    ) -> Self {
        Confirmer(Box::new(move || {
            let (store, id, signal) = (store.clone(), id.clone(), signal.clone());
            Box::pin(async move {
                let sent = Instant::now();
                if signal.is_lost() {
                    return Err(NotConfirmed::Lost);
                }
                let left = signal
                    .confirmed_until()
                    .map(|until| until.saturating_duration_since(sent));
                if let Some(left) = left.filter(|left| *left >= lease / 2) {
                    return Ok(left);
                }
                let extend = lease.min(hold_end.saturating_duration_since(sent));
                if extend.is_zero() {
                    return Err(NotConfirmed::Lost);
                }
                match store.renew(id, token, extend).await {
                    Ok(true) => {
                        signal.confirmed(sent + extend);
                        Ok(extend.saturating_sub(sent.elapsed()))
                    }
                    Ok(false) => {
                        signal.set_lost();
                        Err(NotConfirmed::Lost)
                    }
                    Err(e) => Err(NotConfirmed::Store(e)),
                }
            })
        }))
    }

    pub(crate) async fn confirm(&self) -> Result<Duration, NotConfirmed> {
        (self.0)().await
    }
}

/// A hold whose lease is renewed until the layer finishes it: the renewal
/// stops just before the completion or the release (a renewal racing a
/// commit must not read the committed record as a lost lease).
///
/// It also carries the wake-up of the key's waiting repeats (`wait_in_flight`),
/// dropped with it once the hold has ended.
pub(crate) struct Renewed<H> {
    pub(crate) hold: H,
    pub(crate) renewal: Option<Renewal>,
    pub(crate) wake: Option<WakeOnEnd>,
}

impl<H: Hold> Hold for Renewed<H> {
    const ATOMIC: bool = H::ATOMIC;

    fn renews(&self) -> bool {
        self.hold.renews()
    }

    fn attach(&self, extensions: &mut http::Extensions) {
        self.hold.attach(extensions);
    }

    fn answered(&mut self) {
        self.hold.answered();
    }

    async fn complete(self, response: StoredResponse) -> Result<Completion, StoreError> {
        drop(self.renewal);
        let completed = self.hold.complete(response).await;
        drop(self.wake);
        completed
    }

    async fn release(self) -> Result<(), StoreError> {
        drop(self.renewal);
        let released = self.hold.release().await;
        drop(self.wake);
        released
    }

    async fn ended(&mut self) {
        self.hold.ended().await;
    }
}
