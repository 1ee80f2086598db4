//! Transactional mode in one phase, for the shared SQL stores (PostgreSQL
//! through tokio-postgres and sqlx, MySQL/MariaDB): the claim is written inside the handler's
//! transaction, so it commits with the handler's writes and the completion,
//! or vanishes with them.
//!
//! * A crash, a dropped connection or a rollback frees the key at once: the
//!   database rolls the claim back with the work. No lease, renewal or
//!   takeover is needed for these claims.
//! * Another server's claim of the key meets the uncommitted row and waits
//!   on it in the database, at most its own bound
//!   ([`ClaimRequest::wait_in_flight`]; the layer's first claim never
//!   waits, so without `wait_in_flight` that is the least a lock wait is
//!   bounded by: 100 ms on PostgreSQL, enough for the table's own brief
//!   locks ([`IN_TRANSACTION_CLAIM_MIN_WAIT`](super::pg_sql::IN_TRANSACTION_CLAIM_MIN_WAIT)),
//!   1 s on MySQL): then it finds the completed record (a replay,
//!   or 422 for another fingerprint), or a free key (the first rolled back),
//!   or it is refused as in flight (409).
//! * This process's own claims of a held key are answered before they take
//!   a connection, through [`HeldKeys`]: 422 at once for another
//!   fingerprint, a bounded wait for the holder otherwise.
//!
//! The rest of the lifecycle (the max-hold timer, commit, rollback) is
//! [`two_phase`](super::two_phase)'s, unchanged; a rollback gives nothing
//! back, since the claim is gone with the transaction. A store opts in
//! through [`TwoPhase::one_phase`] and supplies [`TwoPhase::claim_inside`].

use std::sync::Arc;
use std::time::Duration;

use super::held::HeldKeys;
use super::two_phase::{Held, Inside, TwoPhase, hand_over};
use crate::store::{ClaimRequest, Refusal, StoreError, TransactionClaim};

/// [`TransactionalStore::claim_in_transaction`](crate::store::TransactionalStore::claim_in_transaction)
/// for a [`TwoPhase`] store: in one phase where it claims inside the
/// handler's transaction ([`TwoPhase::one_phase`]), else in two
/// ([`two_phase::claim`](super::two_phase::claim)).
pub async fn claim<D: TwoPhase>(
    store: &D,
    req: ClaimRequest,
) -> Result<TransactionClaim<Held<D>>, StoreError> {
    match store.one_phase() {
        Some(keys) => inside(store, keys.clone(), req).await,
        None => super::two_phase::claim(store, req).await,
    }
}

async fn inside<D: TwoPhase>(
    store: &D,
    keys: Arc<HeldKeys>,
    req: ClaimRequest,
) -> Result<TransactionClaim<Held<D>>, StoreError> {
    let started = tokio::time::Instant::now();
    // 1. Held in this process: 422 at once, or a wait that takes no
    //    connection.
    if let Some(refused) = keys.wait_for(&req, req.wait_in_flight).await {
        return Ok(TransactionClaim::Refused(refused));
    }
    // 2. The transaction and the claim inside it, any wait in the database
    //    bounded by what is left of the claim's own.
    let (id, token, hold) = (req.record_id(), req.token, req.hold());
    let wait = req.wait_in_flight.saturating_sub(started.elapsed());
    let (tx, cancel, taken_over) = match store.claim_inside(hold, &req, wait).await? {
        Inside::Claimed {
            tx,
            cancel,
            taken_over,
        } => (tx, cancel, taken_over),
        Inside::Refused(refused) => return Ok(TransactionClaim::Refused(refused)),
        // The holder has run at least as long as this claim waited, and is
        // rolled back at its max hold (the same layer's, as far as this
        // server can tell): that is what is true to say of its end.
        Inside::Busy => {
            let lease_remaining = hold
                .saturating_sub(started.elapsed())
                .max(Duration::from_secs(1));
            return Ok(TransactionClaim::Refused(Refusal::InFlight {
                lease_remaining,
            }));
        }
    };
    // 3. Marked held for this process's other claims until it ends.
    let holding = keys.hold(&id, req.fingerprint, hold);
    let held = hand_over(store, (tx, cancel), (id, token), hold, Some(holding)).await;
    Ok(TransactionClaim::Acquired {
        transaction: held,
        taken_over,
    })
}

/// The two [`TwoPhase`] items of a store that claims in one phase, inside
/// its `impl TwoPhase` block: [`TwoPhase::one_phase`] from the store's
/// field `one_phase: Option<Arc<HeldKeys>>` (`None` where it commits its
/// claims first), and [`TwoPhase::claim_inside`] by the driver's function
/// `$claim(&store, hold, &req, wait)`.
#[macro_export]
#[doc(hidden)]
macro_rules! __claims_inside {
    ($claim:path) => {
        fn one_phase(
            &self,
        ) -> ::core::option::Option<&::std::sync::Arc<$crate::store::kit::held::HeldKeys>> {
            self.one_phase.as_ref()
        }

        async fn claim_inside(
            &self,
            hold: ::std::time::Duration,
            req: &$crate::store::ClaimRequest,
            wait: ::std::time::Duration,
        ) -> ::core::result::Result<
            $crate::store::kit::two_phase::Inside<Self>,
            $crate::store::StoreError,
        > {
            $claim(self, hold, req, wait).await
        }
    };
}

pub use crate::__claims_inside as claims_inside;
