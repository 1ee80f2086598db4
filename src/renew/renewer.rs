//! The layer's one renewal task. A request registers its claim and drops
//! its [`Renewal`] when it answers; the task sleeps until the earliest claim
//! is due (a third of a lease after its last confirmation), then renews every
//! claim due within the next twelfth of a lease in one call to
//! [`Store::renew_all`]. A request that answers before its first renewal
//! costs one insertion and one removal in a map: no task, no timer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::{Instant, timeout_at};

use super::LeaseSignal;
use crate::hooks::{EventKind, Hooks};
use crate::store::{FencingToken, RecordId, Store};

/// The most claims one call to [`Store::renew_all`] carries.
const MAX_BATCH: usize = 500;

/// A claim to keep renewed while its request runs.
pub(crate) struct Claimed {
    pub(crate) id: RecordId,
    pub(crate) token: FencingToken,
    pub(crate) lease: Duration,
    /// When the claim was sent: its max hold counts from here.
    pub(crate) at: Instant,
    /// Until when the store has confirmed the claim (its first lease, or a
    /// renewal's), counted from before the request was sent: the next
    /// renewal comes a third of a lease after that confirmation.
    pub(crate) confirmed_until: Instant,
    pub(crate) max_hold: Duration,
    pub(crate) signal: Arc<LeaseSignal>,
    /// The layer's event hook hears of a lost lease.
    pub(crate) hooks: Hooks,
}

/// The renewals of one layer's claims, whatever its store.
pub(crate) trait Renew: Send + Sync {
    /// Keeps `claim` renewed until the returned [`Renewal`] is dropped.
    fn register(&self, claim: Claimed) -> Renewal;
}

/// The [`Renew`] of a layer over store `St`.
pub(crate) struct Renewer<St> {
    store: St,
    shared: Arc<Shared>,
}

impl<St> Renewer<St> {
    pub(crate) fn new(store: St) -> Self {
        Renewer {
            store,
            shared: Arc::default(),
        }
    }
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    /// Wakes the sleeping task for a claim due before it would wake.
    wake: Notify,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[derive(Default)]
struct State {
    claims: HashMap<u64, Entry>,
    next_slot: u64,
    /// The running task's number, if one runs: it ends when no claim is
    /// left, or with its runtime.
    task: Option<u64>,
    next_task: u64,
    /// When the sleeping task wakes.
    wakes_at: Option<Instant>,
}

struct Entry {
    claim: Claimed,
    /// When it is renewed next (past its max hold: when its lease ends).
    due: Instant,
    /// What the store has confirmed: the first lease, then each renewal's,
    /// counted from before each request was sent.
    confirmed_until: Instant,
}

impl Entry {
    fn hold_end(&self) -> Instant {
        self.claim.at + self.claim.max_hold
    }

    fn every(&self) -> Duration {
        (self.claim.lease / 3).max(Duration::from_millis(1))
    }

    /// How much earlier than its due time a claim is renewed, with the
    /// claim whose renewal woke the task: a quarter of its period.
    fn slack(&self) -> Duration {
        self.every() / 4
    }

    /// After a failed renewal, the next try: a third of its period later,
    /// more than its slack, so a store that fails at once is not asked again
    /// at once.
    fn retry(&self, now: Instant) -> Instant {
        now + (self.every() / 3).max(Duration::from_millis(10))
    }
}

/// A registered claim. Dropped (the request has answered), it is renewed
/// no more: a renewal under way finishes, and nothing more is reported.
pub(crate) struct Renewal {
    shared: Arc<Shared>,
    slot: u64,
}

impl Drop for Renewal {
    fn drop(&mut self) {
        self.shared.lock().claims.remove(&self.slot);
    }
}

impl<St: Store> Renew for Renewer<St> {
    fn register(&self, claim: Claimed) -> Renewal {
        let confirmed_until = claim.confirmed_until;
        let mut entry = Entry {
            claim,
            due: confirmed_until,
            confirmed_until,
        };
        // A third of a lease after the confirmation.
        entry.due = confirmed_until - 2 * entry.every();
        let wake = entry.due;
        let mut state = self.shared.lock();
        let slot = state.next_slot;
        state.next_slot += 1;
        state.claims.insert(slot, entry);
        if state.task.is_none() {
            let task = state.next_task;
            state.next_task += 1;
            state.task = Some(task);
            let running = Running {
                shared: self.shared.clone(),
                task,
            };
            tokio::spawn(run(self.store.clone(), running));
        } else if state.wakes_at.is_some_and(|at| wake < at) {
            self.shared.wake.notify_one();
        }
        Renewal {
            shared: self.shared.clone(),
            slot,
        }
    }
}

/// Claims whose renewal is due, asked at one instant for one extension.
struct Batch {
    asked: Instant,
    extend: Duration,
    claims: Vec<(u64, RecordId, FencingToken)>,
    /// The earliest end of their confirmed leases: no answer past it counts.
    deadline: Instant,
}

const TAKEN_OVER: &str =
    "the record no longer carries this request's token: the key was taken over";
const UNCONFIRMED: &str =
    "no renewal was confirmed before the lease ended (is the store reachable?)";
const PAST_MAX_HOLD: &str = "the request was held past its max hold time";

/// The running task, as [`State::task`] names it. Dropped (the task ended,
/// or its runtime shut down and dropped it), it is no longer the running
/// task, so the next registration starts another.
struct Running {
    shared: Arc<Shared>,
    task: u64,
}

impl Drop for Running {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        if state.task == Some(self.task) {
            state.task = None;
            state.wakes_at = None;
        }
    }
}

async fn run<St: Store>(store: St, running: Running) {
    let shared = &running.shared;
    loop {
        let (batches, lost, next) = {
            let mut state = shared.lock();
            if state.claims.is_empty() {
                // `running` is dropped under no lock, on return.
                state.task = None;
                return;
            }
            let due = state.due(Instant::now());
            state.wakes_at = due.0.is_empty().then_some(due.2);
            due
        };
        report(lost);
        if batches.is_empty() {
            let _ = timeout_at(next, shared.wake.notified()).await;
            continue;
        }
        for batch in batches {
            let answer = timeout_at(
                batch.deadline,
                store.renew_all(
                    batch
                        .claims
                        .iter()
                        .map(|(_, id, t)| (id.clone(), *t))
                        .collect(),
                    batch.extend,
                ),
            )
            .await;
            let renewed = match answer {
                Ok(Ok(renewed)) if renewed.len() == batch.claims.len() => Ok(renewed),
                Ok(Ok(_)) => Err("the store answered for another number of claims".to_string()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("no answer before the earliest lease ended".to_string()),
            };
            let lost = shared.lock().answered(&batch, renewed);
            report(lost);
        }
    }
}

impl State {
    /// The batches due at `now`, the claims lost past their max hold, and
    /// when the next claim is due.
    fn due(&mut self, now: Instant) -> (Vec<Batch>, Vec<(Claimed, &'static str)>, Instant) {
        let mut next = now + Duration::from_secs(3600);
        let mut due: Vec<(Duration, u64, Instant)> = Vec::new();
        let mut past_hold = Vec::new();
        for (&slot, entry) in &mut self.claims {
            if now >= entry.hold_end() {
                // No more renewals: the lease runs out, and is lost if the
                // request is still running when it does.
                if now >= entry.confirmed_until {
                    past_hold.push(slot);
                } else {
                    entry.due = entry.confirmed_until;
                    next = next.min(entry.due);
                }
            } else if entry.due <= now + entry.slack() {
                let extend = entry.claim.lease.min(entry.hold_end() - now);
                due.push((extend, slot, entry.confirmed_until));
            } else {
                next = next.min(entry.due);
            }
        }
        let lost = past_hold
            .into_iter()
            .filter_map(|slot| self.claims.remove(&slot))
            .map(|entry| (entry.claim, PAST_MAX_HOLD))
            .collect();
        // Claims asking for the same extension go together, at most
        // `MAX_BATCH` at a time.
        due.sort_by_key(|(extend, slot, _)| (*extend, *slot));
        let mut batches: Vec<Batch> = Vec::new();
        for (extend, slot, confirmed_until) in due {
            let claim = &self.claims[&slot].claim;
            let claim = (slot, claim.id.clone(), claim.token);
            match batches.last_mut() {
                Some(b) if b.extend == extend && b.claims.len() < MAX_BATCH => {
                    b.claims.push(claim);
                    b.deadline = b.deadline.min(confirmed_until);
                }
                _ => batches.push(Batch {
                    asked: now,
                    extend,
                    claims: vec![claim],
                    deadline: confirmed_until,
                }),
            }
        }
        (batches, lost, next)
    }

    /// Takes the store's answer to `batch`: each renewed claim is confirmed
    /// one extension from when it was asked; a claim the store refused is
    /// lost; on no answer, a claim whose lease has ended is lost and the
    /// others are tried again soon. Claims dropped meanwhile are skipped.
    fn answered(
        &mut self,
        batch: &Batch,
        renewed: Result<Vec<bool>, String>,
    ) -> Vec<(Claimed, &'static str)> {
        let mut lost = Vec::new();
        let now = Instant::now();
        if let Err(e) = &renewed {
            tracing::warn!(error = %e, claims = batch.claims.len(), "renewing idempotency leases failed");
        }
        for (i, (slot, _, _)) in batch.claims.iter().enumerate() {
            let Some(entry) = self.claims.get_mut(slot) else {
                continue;
            };
            match renewed.as_ref().map(|renewed| renewed[i]) {
                Ok(true) => {
                    entry.confirmed_until = batch.asked + batch.extend;
                    entry.claim.signal.confirmed(entry.confirmed_until);
                    entry.due = batch.asked + entry.every();
                    #[cfg(feature = "metrics")]
                    metrics::counter!("tower_idempotency_lease_renewals_total").increment(1);
                    continue;
                }
                Err(_) if now < entry.confirmed_until => {
                    entry.due = entry.retry(now);
                    continue;
                }
                Ok(false) => lost.push((*slot, TAKEN_OVER)),
                Err(_) => lost.push((*slot, UNCONFIRMED)),
            }
        }
        lost.into_iter()
            .filter_map(|(slot, why)| Some((self.claims.remove(&slot)?.claim, why)))
            .collect()
    }
}

/// Tells each request, the event hook, the log and the metrics that a
/// lease was lost while its request ran.
fn report(lost: Vec<(Claimed, &'static str)>) {
    for (claim, why) in lost {
        claim.signal.set_lost();
        claim.hooks.emit(EventKind::LeaseLost, Some(&claim.id));
        tracing::warn!(
            why,
            "an idempotency lease was lost while its request ran: another request may take the key over"
        );
        #[cfg(feature = "metrics")]
        metrics::counter!("tower_idempotency_leases_lost_total").increment(1);
    }
}
