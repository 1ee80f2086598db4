//! Transactional mode in two phases, for the stores whose database a fleet
//! of app servers shares (PostgreSQL through tokio-postgres or sqlx,
//! MySQL/MariaDB).
//!
//! 1. The claim commits on its own, at once, so every other server sees the
//!    key in flight with its fingerprint and lease.
//! 2. The handler's writes and the record's completion share one
//!    transaction, which commits only while the record still carries this
//!    request's fencing token.
//!
//! The lifecycle is written here once: the phase-one claim task, the guard
//! that gives a claim back when the transaction cannot be opened, the
//! max-hold timer, commit and rollback. A driver supplies [`TwoPhase`]: how
//! to open the transaction with its server-side backstop, stop a statement
//! running on it, write the completion inside it, commit and roll back.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use tokio::sync::{MappedMutexGuard, Mutex, MutexGuard, watch};

use super::fate::Fate;
use super::held::{HeldKey, HeldKeys};
use super::release::{ReleaseOnDrop, release_logged};
use crate::response::StoredResponse;
use crate::store::{
    Claim, ClaimRequest, Completion, FencingToken, RecordId, Refusal, Store, StoreError,
    TransactionClaim,
};

/// What a store supplies to run transactional mode in two phases.
pub trait TwoPhase: Store {
    /// The driver's open transaction. Dropped before it ended cleanly (a
    /// cancelled commit, a failed statement), it must leave nothing that a
    /// later request could commit: close its connection, or have the pool
    /// roll it back before the connection is used again.
    type Tx: Send + 'static;
    /// What stops a statement running on a [`TwoPhase::Tx`] from another
    /// connection (a cancel token, a backend id).
    type Cancel: Send + 'static;

    /// Whether an open [`TwoPhase::Tx`] may be dropped outside a Tokio
    /// runtime (sqlx's pool spawns a task when a connection is dropped, and
    /// panics without a runtime).
    const DROP_WITHOUT_RUNTIME: bool;

    /// The keys this process's open transactional requests hold, where the
    /// store claims inside the handler's transaction ([`one_phase`](super::one_phase));
    /// `None` (the default) where the claim commits first.
    fn one_phase(&self) -> Option<&Arc<HeldKeys>> {
        None
    }

    /// One phase: opens the transaction and claims `req`'s key inside it,
    /// a lock wait on another open transaction's claim of the key bounded
    /// by `wait` (at least 1 ms: never unbounded). Called only where
    /// [`TwoPhase::one_phase`] is `Some`; the default refuses.
    fn claim_inside(
        &self,
        hold: Duration,
        req: &ClaimRequest,
        wait: Duration,
    ) -> impl Future<Output = Result<Inside<Self>, StoreError>> + Send {
        let _ = (hold, req, wait);
        std::future::ready(Err(unavailable(
            "this store commits its claims first (TwoPhase::one_phase is None)",
        )))
    }

    /// What a commit answers when the record no longer carries the token.
    const FENCED: &'static str = "the lease ended before the commit and another request took the key over; this request's writes were rolled back";

    /// Transactions rolled back past their max hold time.
    fn held_too_long(&self) -> &AtomicU64;

    /// Opens phase two's transaction, with a server-side backstop a little
    /// past `hold` (an idle session is ended by the server).
    fn begin(
        &self,
        hold: Duration,
    ) -> impl Future<Output = Result<(Self::Tx, Self::Cancel), StoreError>> + Send;

    /// Stops the statement running on the transaction, from elsewhere.
    fn cancel(&self, cancel: &Self::Cancel) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Completes the record inside `tx`: `true` when it still carried
    /// `token` and now holds `response`.
    fn complete_in(
        &self,
        tx: &mut Self::Tx,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// `COMMIT`. An error's outcome is unknown: the key waits for its lease.
    fn commit_tx(tx: Self::Tx) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The completion inside `tx` ([`TwoPhase::complete_in`]), then
    /// `COMMIT` ([`TwoPhase::commit_tx`]) only if it matched. By default
    /// the two run one after the other. A driver that can send both at once
    /// (tokio-postgres pipelines them: one round trip fewer while the
    /// handler's row locks are held) overrides it, and must then make a
    /// completion that does not match fail inside the transaction, so that
    /// the `COMMIT` sent behind it commits nothing.
    fn complete_and_commit(
        &self,
        mut tx: Self::Tx,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> impl Future<Output = Finished<Self>> + Send {
        async move {
            match self.complete_in(&mut tx, id, token, response).await {
                Ok(true) => match Self::commit_tx(tx).await {
                    Ok(()) => Finished::Committed,
                    Err(e) => Finished::Unknown(e),
                },
                // The lease ended and another request took the key over (or
                // the record expired): this request's writes must not count.
                Ok(false) => Finished::NotCompleted(tx, unavailable(Self::FENCED)),
                // E.g. the handler's own statement failed and the database
                // aborted the transaction.
                Err(e) => Finished::NotCompleted(tx, e),
            }
        }
    }

    /// `ROLLBACK`; a failure leaves it to the `Tx`'s drop.
    fn roll_back_tx(tx: Self::Tx) -> impl Future<Output = ()> + Send;

    /// Ends a transaction held past its max hold time, after the timer may
    /// have sent [`TwoPhase::cancel`]. A driver whose cancel is sent without
    /// waiting for the server to act on it (tokio-postgres) must not hand
    /// the connection to another request: a cancel still on its way would
    /// stop that request's statement. By default, [`TwoPhase::roll_back_tx`]
    /// (the cancel has been acted on when [`TwoPhase::cancel`] returned).
    fn discard_tx(tx: Self::Tx) -> impl Future<Output = ()> + Send {
        Self::roll_back_tx(tx)
    }
}

/// What [`TwoPhase::complete_and_commit`] did.
pub enum Finished<D: TwoPhase> {
    /// The record is completed and the transaction committed.
    Committed,
    /// Nothing was committed: the completion did not match (the error says
    /// why). The transaction, which the database may have ended already, is
    /// handed back to be rolled back.
    NotCompleted(D::Tx, StoreError),
    /// The completion matched but `COMMIT` failed: its outcome is unknown,
    /// and the key waits for its lease.
    Unknown(StoreError),
}

/// What [`TwoPhase::claim_inside`] answers (one phase, [`one_phase`](super::one_phase)).
pub enum Inside<D: TwoPhase> {
    /// The key is claimed inside the open transaction.
    Claimed {
        /// The open transaction, holding the claim.
        tx: D::Tx,
        /// What stops a statement running on it.
        cancel: D::Cancel,
        /// A committed in-flight record whose lease had ended was taken over
        /// (one left by a separate-mode claim, or by a server that commits
        /// its claims first).
        taken_over: bool,
    },
    /// Refused; the store has ended the transaction it opened, if any.
    Refused(Refusal),
    /// The wait on another open transaction's claim of the key reached its
    /// bound; the store has ended its transaction.
    Busy,
}

/// An open phase-two transaction: the inside of each store's public
/// transaction handle. Clones share it.
pub struct Held<D: TwoPhase> {
    open: Arc<Mutex<Option<Open<D>>>>,
    /// Who ends it: the layer, or the max-hold timer.
    fate: Arc<Fate>,
    /// Its sender is dropped once the transaction has ended and its key is
    /// given back (if it is to be).
    ended: watch::Receiver<()>,
    /// Held by the max-hold timer from before it expires the transaction
    /// until its cancel has been delivered. The layer, ending a transaction
    /// the timer expired, takes it before its rollback hands the connection
    /// back to the pool: a cancel still on its way could otherwise stop the
    /// statement of the next request on that connection.
    cancelling: Arc<Mutex<()>>,
}

impl<D: TwoPhase> Clone for Held<D> {
    fn clone(&self) -> Self {
        Held {
            open: self.open.clone(),
            fate: self.fate.clone(),
            ended: self.ended.clone(),
            cancelling: self.cancelling.clone(),
        }
    }
}

/// The transaction while it is open, and what ending it needs.
struct Open<D: TwoPhase> {
    tx: Option<D::Tx>,
    id: RecordId,
    token: FencingToken,
    /// The max-hold timer, stopped when the transaction ends first.
    timer: Option<tokio::task::AbortHandle>,
    /// Dropped when the transaction has ended: `closed` resolves.
    ended: Option<watch::Sender<()>>,
    /// Whether a rollback gives the key back: where the claim committed
    /// first. A claim inside the transaction vanishes with it.
    release: bool,
    /// One phase: the key as this process's other claims see it held,
    /// until the transaction has ended.
    _holding: Option<HeldKey>,
}

impl<D: TwoPhase> Drop for Open<D> {
    fn drop(&mut self) {
        if let Some(timer) = self.timer.take() {
            timer.abort();
        }
    }
}

pub(super) fn unavailable(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> StoreError {
    StoreError::unavailable(e)
}

fn transaction_over() -> StoreError {
    unavailable("the idempotency transaction has already been committed or rolled back")
}

impl<D: TwoPhase> Held<D> {
    /// The open transaction, mapped to what the handler writes through.
    /// Calls from clones take turns.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] once the transaction has ended.
    pub async fn lock<'a, T: ?Sized + 'a>(
        &'a self,
        map: impl FnOnce(&mut D::Tx) -> &mut T,
    ) -> Result<MappedMutexGuard<'a, T>, StoreError> {
        let guard = self.open.lock().await;
        if self.fate.expired() {
            return Err(self.over());
        }
        MutexGuard::try_map(guard, |open| open.as_mut()?.tx.as_mut().map(map))
            .map_err(|_| self.over())
    }

    /// Resolves once the transaction has ended: committed, rolled back, or
    /// rolled back past its max hold time (then the key is free again).
    pub async fn closed(&self) {
        let mut ended = self.ended.clone();
        while ended.changed().await.is_ok() {}
    }

    /// The error of a call after the transaction ended.
    fn over(&self) -> StoreError {
        if self.fate.expired() {
            StoreError::held_too_long(self.fate.hold)
        } else {
            transaction_over()
        }
    }

    async fn take(&self) -> Option<Open<D>> {
        self.open.lock().await.take()
    }
}

/// [`TransactionalStore::claim_in_transaction`](crate::store::TransactionalStore::claim_in_transaction)
/// in two phases: phase one, then phase two's transaction and its max-hold
/// timer.
pub async fn claim<D: TwoPhase>(
    store: &D,
    req: ClaimRequest,
) -> Result<TransactionClaim<Held<D>>, StoreError> {
    let (id, token, hold, lease) = (req.record_id(), req.token, req.hold(), req.lease);
    // Phase one runs in a task of its own: if this request is cancelled
    // while the claim is under way, the task gives a committed claim back
    // instead of leaving the key in flight for the whole lease.
    let (answer, claimed) = tokio::sync::oneshot::channel();
    let phase_one = store.clone();
    let abandoned = id.clone();
    tokio::spawn(async move {
        let unanswered = answer.send(phase_one.claim(req).await);
        if let Err(Ok(Claim::Acquired { .. })) = unanswered {
            release_logged(&phase_one, abandoned, token, "an abandoned key").await;
        }
    });
    // The answer may arrive after this request was cancelled but before
    // its receiver is dropped: the receiver's guard gives that claim back.
    let mut answer = AnswerGuard {
        answer: claimed,
        release: Some((store.clone(), id.clone(), token)),
    };
    let claimed = (&mut answer.answer)
        .await
        .map_err(|_| unavailable("the claim task ended without an answer"))?;
    let taken_over = match claimed? {
        Claim::Acquired { taken_over } => taken_over,
        Claim::Refused(refused) => return Ok(TransactionClaim::Refused(refused)),
    };
    // Until the transaction is handed over, a cancelled or failed open
    // gives the key back.
    let guard = ReleaseOnDrop::new(store.clone(), id.clone(), token);
    let (tx, cancel) = kept_alive(store, (&id, token), lease, store.begin(hold)).await?;
    let held = hand_over(store, (tx, cancel), (id, token), hold, None).await;
    guard.disarm();
    Ok(TransactionClaim::Acquired {
        transaction: held,
        taken_over,
    })
}

/// The open transaction, holding the claim of `id` with `token`, handed to
/// the layer: its max-hold timer started. `holding` is a one-phase claim's
/// mark in this process's held keys (dropped once the transaction ended);
/// a two-phase claim (`None`) is given back after a rollback.
pub(super) async fn hand_over<D: TwoPhase>(
    store: &D,
    (tx, cancel): (D::Tx, D::Cancel),
    (id, token): (RecordId, FencingToken),
    hold: Duration,
    holding: Option<HeldKey>,
) -> Held<D> {
    let (ended, watch) = watch::channel(());
    let held = Held {
        open: Arc::new(Mutex::new(Some(Open {
            tx: Some(tx),
            id,
            token,
            timer: None,
            ended: Some(ended),
            release: holding.is_none(),
            _holding: holding,
        }))),
        fate: Arc::new(Fate::new(hold)),
        ended: watch,
        cancelling: Arc::default(),
    };
    let timer = tokio::spawn(end_past(store.clone(), held.clone(), cancel));
    // Unless the timer has already ended it (a zero hold).
    if let Some(open) = held.open.lock().await.as_mut() {
        open.timer = Some(timer.abort_handle());
    }
    held
}

/// Waits for `open` (phase two's transaction, which may wait for a pooled
/// connection while every connection is held by a running request) while
/// the committed claim keeps its lease: renewed every third of a lease
/// ([`Store::renew_all`], which the SQL stores run on a connection of their
/// own). So the claim is handed to the layer confirmed within the last third
/// of a lease, however long the pool kept it waiting.
async fn kept_alive<D: TwoPhase, T>(
    store: &D,
    (id, token): (&RecordId, FencingToken),
    lease: Duration,
    open: impl Future<Output = T>,
) -> T {
    let mut open = std::pin::pin!(open);
    let every = (lease / 3).max(Duration::from_millis(1));
    loop {
        match tokio::time::timeout(every, &mut open).await {
            Ok(opened) => return opened,
            Err(_) => {
                let renewed = store.renew_all(vec![(id.clone(), token)], lease);
                if let Ok(Err(e)) = tokio::time::timeout(every, renewed).await {
                    tracing::warn!(error = %e, "renewing a claim waiting for its transaction failed");
                }
            }
        }
    }
}

/// The receiving end of phase one's answer. Dropped before the answer was
/// read (the request was cancelled), it stops the claim task from
/// answering, so that task gives back a claim it has yet to answer, and
/// gives back a claim that was answered but not read.
struct AnswerGuard<D: TwoPhase> {
    answer: tokio::sync::oneshot::Receiver<Result<Claim, StoreError>>,
    release: Option<(D, RecordId, FencingToken)>,
}

impl<D: TwoPhase> Drop for AnswerGuard<D> {
    fn drop(&mut self) {
        // After `close`, the claim task's `send` fails (and it releases);
        // an answer sent before is still here to read.
        self.answer.close();
        if let Ok(Ok(Claim::Acquired { .. })) = self.answer.try_recv()
            && let Some((store, id, token)) = self.release.take()
        {
            drop(ReleaseOnDrop::new(store, id, token));
        }
    }
}

/// [`TransactionalStore::commit`](crate::store::TransactionalStore::commit):
/// the completion, fenced by the token, then `COMMIT`. Anything short of
/// that rolls back and gives the key back.
pub async fn commit<D: TwoPhase>(
    store: &D,
    held: &Held<D>,
    response: StoredResponse,
) -> Result<Completion, StoreError> {
    let Some(mut open) = held.take().await else {
        // Ended already: by the max-hold timer, which may still be rolling
        // back and giving the key back. Answer once it has, so that a retry
        // sent on this answer finds the key free.
        held.closed().await;
        return Err(held.over());
    };
    // `closed` resolves once the key is given back, if it is.
    let ended = open.ended.take();
    if !held.fate.end() {
        // The max hold time passed first: roll back, as its timer would,
        // once its cancel (if any) has been delivered.
        let _cancelled = held.cancelling.lock().await;
        roll_back_and_release(store, open, true).await;
        drop(ended);
        return Err(held.over());
    }
    // Cancelled from here on, the `Tx` is dropped (see `TwoPhase::Tx`), and
    // the key waits for its lease.
    let tx = open.tx.take().ok_or_else(transaction_over)?;
    let finished = store
        .complete_and_commit(tx, &open.id, open.token, &response)
        .await;
    let answer = match finished {
        Finished::Committed => Ok(Completion::Stored),
        Finished::Unknown(e) => Err(e),
        Finished::NotCompleted(tx, e) => {
            // Nothing was committed: give the key back (token-checked, so a
            // request that took it over keeps it).
            open.tx = Some(tx);
            roll_back_and_release(store, open, false).await;
            Err(e)
        }
    };
    drop(ended);
    answer
}

/// [`TransactionalStore::rollback`](crate::store::TransactionalStore::rollback).
pub fn rollback<D: TwoPhase>(store: &D, held: &Held<D>) {
    drop(spawn_rollback(store, held));
}

/// [`TransactionalStore::roll_back_and_wait`](crate::store::TransactionalStore::roll_back_and_wait).
pub async fn roll_back_and_wait<D: TwoPhase>(store: &D, held: &Held<D>) {
    if let Some(task) = spawn_rollback(store, held) {
        // The task goes on if this future is dropped: the key is still
        // given back.
        let _ = task.await;
    }
}

/// Rolls the transaction back and gives the key back, in a task of its
/// own. Without a runtime the `Tx` is dropped where that is safe (see
/// [`TwoPhase::DROP_WITHOUT_RUNTIME`]), else left to its last handle; the
/// claim then waits for its lease.
fn spawn_rollback<D: TwoPhase>(store: &D, held: &Held<D>) -> Option<tokio::task::JoinHandle<()>> {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        if D::DROP_WITHOUT_RUNTIME {
            drop(held.open.try_lock().ok().and_then(|mut open| open.take()));
        }
        return None;
    };
    let (store, held) = (store.clone(), held.clone());
    Some(runtime.spawn(async move {
        if let Some(mut open) = held.take().await {
            let ended = open.ended.take();
            // Past the max hold time, after the timer's cancel (if any).
            let expired = !held.fate.end();
            let _cancelled = if expired {
                Some(held.cancelling.lock().await)
            } else {
                None
            };
            // Give the key back, so a retry runs at once.
            roll_back_and_release(&store, open, expired).await;
            drop(ended);
        } else {
            // Ended by the max-hold timer: done once it has given the key
            // back (`roll_back_and_wait` answers after that).
            held.closed().await;
        }
    }))
}

/// Rolls back (past the max hold time, through [`TwoPhase::discard_tx`]),
/// then gives the key back (token-checked, so a request that took it over
/// keeps it).
async fn roll_back_and_release<D: TwoPhase>(store: &D, mut open: Open<D>, expired: bool) {
    if let Some(tx) = open.tx.take() {
        if expired {
            D::discard_tx(tx).await;
        } else {
            D::roll_back_tx(tx).await;
        }
    }
    if open.release {
        release_logged(store, open.id.clone(), open.token, "a rolled-back key").await;
    }
}

/// The max-hold timer: once the hold has passed (unless the layer is ending
/// the transaction already), counts it, stops a statement still running on
/// the transaction, rolls it back and gives the key back, then lets
/// `closed` resolve. Aborted when the transaction ends first.
async fn end_past<D: TwoPhase>(store: D, held: Held<D>, cancel: D::Cancel) {
    let hold = held.fate.hold;
    tokio::time::sleep(hold).await;
    // Taken before the expiry, so a layer that sees it expired waits for
    // the cancel below to be delivered.
    let cancelling = held.cancelling.lock().await;
    if !held.fate.expire() {
        return;
    }
    store.held_too_long().fetch_add(1, Relaxed);
    tracing::warn!(
        max_hold_ms = hold.as_millis() as u64,
        "an idempotency transaction was held past its max hold time; rolling it back"
    );
    let mut guard = match held.open.try_lock() {
        Ok(guard) => guard,
        Err(_) => {
            // The handler is using the connection: stop its statement.
            if let Err(e) = store.cancel(&cancel).await {
                tracing::warn!(error = %e, "stopping a statement past the max hold time failed");
            }
            drop(cancelling);
            held.open.lock().await
        }
    };
    // Taken already: the layer's commit or rollback sees the expiry and
    // rolls back itself.
    let Some(mut open) = guard.take() else {
        return;
    };
    drop(guard);
    // This task ends the transaction itself: dropping `open` must not abort
    // it halfway.
    open.timer = None;
    let ended = open.ended.take();
    roll_back_and_release(&store, open, true).await;
    drop(ended);
}

/// Implements [`TransactionalStore`](crate::store::TransactionalStore) for
/// `$store` through this module, with `$handle` (a struct whose `held`
/// field is a [`Held`]) as its transaction. The handle's `Debug` and its
/// extractor ([`transaction_extractor!`](crate::store::kit::transaction_extractor))
/// are the store crate's: a handle generic over its database implements
/// them once for every database.
#[doc(hidden)]
#[macro_export]
macro_rules! __two_phase_store {
    ($store:ty, $handle:ident) => {
        impl $crate::store::TransactionalStore for $store {
            type Transaction = $handle;
            const CLAIM_COMMITS_FIRST: bool = true;

            fn claim_commits_first(&self) -> bool {
                $crate::store::kit::two_phase::TwoPhase::one_phase(self).is_none()
            }

            async fn claim_in_transaction(
                &self,
                req: $crate::store::ClaimRequest,
            ) -> Result<$crate::store::TransactionClaim<$handle>, $crate::store::StoreError> {
                use $crate::store::TransactionClaim::{Acquired, Refused};
                Ok(
                    match $crate::store::kit::one_phase::claim(self, req).await? {
                        Acquired {
                            transaction,
                            taken_over,
                        } => Acquired {
                            transaction: $handle { held: transaction },
                            taken_over,
                        },
                        Refused(refused) => Refused(refused),
                    },
                )
            }

            async fn commit(
                &self,
                transaction: &$handle,
                response: $crate::response::StoredResponse,
            ) -> Result<$crate::store::Completion, $crate::store::StoreError> {
                $crate::store::kit::two_phase::commit(self, &transaction.held, response).await
            }

            fn rollback(&self, transaction: &$handle) {
                $crate::store::kit::two_phase::rollback(self, &transaction.held)
            }

            async fn roll_back_and_wait(&self, transaction: &$handle) {
                $crate::store::kit::two_phase::roll_back_and_wait(self, &transaction.held).await
            }

            async fn ended(&self, transaction: &$handle) {
                transaction.held.closed().await
            }
        }
    };
}
#[doc(inline)]
pub use crate::__two_phase_store as two_phase_store;
