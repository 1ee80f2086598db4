//! [`WatchClaims`]: a store that shows each claim's answer to the test.

use std::sync::Arc;
use std::time::Duration;

use crate::response::StoredResponse;
use crate::store::{Claim, ClaimRequest, Completion, FencingToken, RecordId, Store, StoreError};

/// A store that passes every call to `inner` and shows each answered claim
/// to `watch` (and, with [`WatchClaims::on_renew_all`], how many claims
/// each `renew_all` carries): for tests that count what a layer asked of
/// its store (how many claims met a key in flight, say) without a store of
/// their own.
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use tower_idempotency::store::{Claim, MemoryStore, Refusal};
/// use tower_idempotency::test_util::WatchClaims;
///
/// let in_flight = Arc::new(AtomicUsize::new(0));
/// let seen = in_flight.clone();
/// let store = WatchClaims::new(MemoryStore::new(), move |claim: &Claim| {
///     if let Claim::Refused(Refusal::InFlight { .. }) = claim {
///         seen.fetch_add(1, Ordering::SeqCst);
///     }
/// });
/// # let _ = store;
/// ```
#[derive(Clone)]
pub struct WatchClaims<St, W> {
    inner: St,
    watch: W,
    renewals: Option<Arc<dyn Fn(usize) + Send + Sync>>,
}

impl<St, W> WatchClaims<St, W> {
    /// `inner`, with `watch` called on each claim it answers.
    pub fn new(inner: St, watch: W) -> Self {
        WatchClaims {
            inner,
            watch,
            renewals: None,
        }
    }

    /// Also calls `renewals` with the number of claims of each
    /// `renew_all`, before it is passed on.
    pub fn on_renew_all(mut self, renewals: impl Fn(usize) + Send + Sync + 'static) -> Self {
        self.renewals = Some(Arc::new(renewals));
        self
    }
}

impl<St, W> Store for WatchClaims<St, W>
where
    St: Store,
    W: Fn(&Claim) + Clone + Send + Sync + 'static,
{
    async fn claim(&self, request: ClaimRequest) -> Result<Claim, StoreError> {
        let claim = self.inner.claim(request).await?;
        (self.watch)(&claim);
        Ok(claim)
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        self.inner.complete(id, token, response).await
    }

    async fn release(&self, id: RecordId, token: FencingToken) -> Result<bool, StoreError> {
        self.inner.release(id, token).await
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.inner.purge_expired().await
    }

    async fn renew(
        &self,
        id: RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.inner.renew(id, token, lease).await
    }

    async fn renew_all(
        &self,
        claims: Vec<(RecordId, FencingToken)>,
        lease: Duration,
    ) -> Result<Vec<bool>, StoreError> {
        if let Some(renewals) = &self.renewals {
            renewals(claims.len());
        }
        self.inner.renew_all(claims, lease).await
    }

    fn watch(&self, id: &RecordId) -> Option<crate::store::Watch> {
        self.inner.watch(id)
    }
}
