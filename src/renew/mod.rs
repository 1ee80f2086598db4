//! Lease renewal while a request runs
//! ([`IdempotencyLayer::renew_lease`](crate::IdempotencyLayer::renew_lease)):
//! a task that extends the claim's lease every third of a lease, fenced by
//! its token, for at most the max hold, and reports a lost lease.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::{Instant, timeout, timeout_at};

use crate::hooks::{EventKind, Hooks};
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

/// The running renewal of one claim. Dropped (the request has answered),
/// it stops: a renewal under way finishes, and nothing more is reported.
pub(crate) struct Renewal {
    stop: watch::Sender<bool>,
}

impl Drop for Renewal {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

/// What one renewal task needs.
pub(crate) struct Lease<St> {
    pub(crate) store: St,
    pub(crate) id: RecordId,
    pub(crate) token: FencingToken,
    pub(crate) lease: Duration,
    pub(crate) max_hold: Duration,
    pub(crate) signal: Arc<LeaseSignal>,
    /// The layer's event hook hears of a lost lease.
    pub(crate) hooks: Hooks,
}

/// Starts renewing the lease of a claim made just now.
pub(crate) fn start<St: Store>(lease: Lease<St>) -> Renewal {
    let (stop, stopped) = watch::channel(false);
    tokio::spawn(renew(lease, stopped));
    Renewal { stop }
}

async fn renew<St: Store>(lease: Lease<St>, mut stopped: watch::Receiver<bool>) {
    let claimed = Instant::now();
    let hold_end = claimed + lease.max_hold;
    // What the store has confirmed: the claim's own lease, then each renewal's.
    let mut confirmed_until = claimed + lease.lease;
    let every = (lease.lease / 3).max(Duration::from_millis(1));
    loop {
        // A third of a lease, unless the layer stops it first.
        if timeout(every, stopped.wait_for(|stop| *stop)).await.is_ok() {
            return;
        }
        let asked = Instant::now();
        if asked >= hold_end {
            // Past the max hold: no more renewals; the lease runs out.
            let stop = stopped.wait_for(|stop| *stop);
            if timeout_at(confirmed_until, stop).await.is_ok() {
                return;
            }
            return lost(
                &lease,
                &stopped,
                "the request was held past its max hold time",
            );
        }
        // Never past the max hold.
        let extend = lease.lease.min(hold_end - asked);
        let renewed = timeout_at(
            confirmed_until,
            lease.store.renew(lease.id.clone(), lease.token, extend),
        )
        .await;
        match renewed {
            Ok(Ok(true)) => {
                confirmed_until = asked + extend;
                lease.signal.confirmed(confirmed_until);
                #[cfg(feature = "metrics")]
                metrics::counter!("tower_idempotency_lease_renewals_total").increment(1);
            }
            Ok(Ok(false)) => {
                return lost(
                    &lease,
                    &stopped,
                    "the record no longer carries this request's token: the key was taken over",
                );
            }
            Ok(Err(e)) if Instant::now() < confirmed_until => {
                tracing::warn!(error = %e, "renewing an idempotency lease failed; trying again");
            }
            Ok(Err(_)) | Err(_) => {
                return lost(
                    &lease,
                    &stopped,
                    "no renewal was confirmed before the lease ended (is the store's connection pool exhausted?)",
                );
            }
        }
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

/// Reports a lost lease, unless the request answered meanwhile (a renewal
/// that met the record completed is no loss).
fn lost<St>(lease: &Lease<St>, stopped: &watch::Receiver<bool>, why: &'static str) {
    if *stopped.borrow() {
        return;
    }
    lease.signal.set_lost();
    lease.hooks.emit(EventKind::LeaseLost, Some(&lease.id));
    tracing::warn!(
        why,
        "an idempotency lease was lost while its request ran: another request may take the key over"
    );
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_idempotency_leases_lost_total").increment(1);
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
