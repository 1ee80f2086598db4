//! Giving a claimed key back: [`release_logged`], and [`ReleaseOnDrop`] for
//! a claim whose request may be cancelled before it is handed on.

use crate::store::{FencingToken, RecordId, Store};

/// [`Store::release`], logged when it fails: then the key stays in flight
/// until its lease ends. `what` names the key in the log (`"an abandoned
/// key"`).
pub async fn release_logged<S: Store>(store: &S, id: RecordId, token: FencingToken, what: &str) {
    if let Err(e) = store.release(id, token).await {
        tracing::error!(error = %e, "releasing {what} failed; it stays in flight until its lease ends");
    }
}

/// Releases a claim when dropped armed (a cancelled or failed step between
/// the claim and the hand-over), from a spawned task. Without a Tokio
/// runtime the key waits for its lease.
pub struct ReleaseOnDrop<S: Store>(Option<(S, RecordId, FencingToken)>);

impl<S: Store> ReleaseOnDrop<S> {
    /// Armed: dropped before [`ReleaseOnDrop::disarm`], it releases `id`
    /// if the record still carries `token`.
    pub fn new(store: S, id: RecordId, token: FencingToken) -> Self {
        ReleaseOnDrop(Some((store, id, token)))
    }

    /// The claim was handed on: dropping the guard does nothing.
    pub fn disarm(mut self) {
        self.0 = None;
    }
}

impl<S: Store> Drop for ReleaseOnDrop<S> {
    fn drop(&mut self) {
        if let Some((store, id, token)) = self.0.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(async move {
                release_logged(&store, id, token, "an abandoned key").await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::store::{Claim, ClaimRequest, MemoryStore};

    async fn claimed(store: &MemoryStore, token: FencingToken) -> Claim {
        let request = ClaimRequest::new(RecordId::new("s", "k"), Fingerprint([1; 32]), token)
            .with_lease(Duration::from_secs(60));
        store.claim(request).await.unwrap()
    }

    #[tokio::test]
    async fn an_armed_guard_gives_the_key_back_and_a_disarmed_one_does_not() {
        let store = MemoryStore::new();
        let first = FencingToken::random();
        assert_eq!(
            claimed(&store, first).await,
            Claim::Acquired { taken_over: false }
        );
        drop(ReleaseOnDrop::new(
            store.clone(),
            RecordId::new("s", "k"),
            first,
        ));
        // The release runs in a task: wait until it has (bounded).
        let mut second = None;
        for _ in 0..1_000 {
            tokio::task::yield_now().await;
            let token = FencingToken::random();
            if let Claim::Acquired { taken_over } = claimed(&store, token).await {
                second = Some((token, taken_over));
                break;
            }
        }
        let (second, taken_over) = second.expect("the armed guard released the key");
        assert!(!taken_over, "released, not taken over");

        ReleaseOnDrop::new(store.clone(), RecordId::new("s", "k"), second).disarm();
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert!(
            matches!(
                claimed(&store, FencingToken::random()).await,
                Claim::Refused(_)
            ),
            "the disarmed guard left the key in flight"
        );
    }
}
