//! When the record of a completed request is written: after the handler's own
//! commit ([`Separate`]), or in the same transaction ([`Transactional`]).
//!
//! # Example
//!
//! ```
//! use tower_idempotency::{IdempotencyLayer, SqliteStore, scope::GlobalScope};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! let store = SqliteStore::open(dir.path().join("app.sqlite3")).await?;
//! // The handler finds a `SqliteTransaction` in its request and writes through it.
//! let layer = IdempotencyLayer::new(store, GlobalScope).transactional();
//! # Ok(()) }
//! ```
//!
//! # Separate
//!
//! The default, for every [`Store`]. The claim commits at once; the handler
//! does its work and commits it wherever it likes; then the record is
//! completed in a second write. If the process dies between the handler's
//! commit and that write, the key stays in flight until its lease ends and a
//! retry then runs the handler again: the effect happens twice.
//!
//! ## Streamed responses
//!
//! The first caller gets each frame of the response body as the inner
//! service produces it: the head goes out as soon as the body would wait
//! (a body that is ready at once, such as a buffered JSON answer, is read
//! and stored before the head, as before). The layer copies the body's data
//! into the record as it passes, up to the response limit
//! ([`IdempotencyLayer::max_response_body`](crate::IdempotencyLayer::max_response_body),
//! in bytes), and completes the record when the body ends; the caller sees
//! the end of the stream only after that write, so a repeat sent after it
//! gets the replay, byte for byte with its trailers. Then:
//!
//! - a body larger than the limit: the caller still gets every byte; the
//!   record completes without the body and repeats get 410 (the problem
//!   [`crate::problem::Rejection::ResponseNotStored`]);
//! - a caller that leaves before the end: dropping its body drops the inner
//!   body, so nothing reads the stream any more. The handler ran and its
//!   effect exists, but no complete response does: the record completes
//!   without the body, and repeats get the same 410. The key is not given
//!   back, since a retry must not run the handler a second time;
//! - a stream still running when the lease ends is recorded the same way
//!   (410 for repeats), so that no repeat takes the key over and runs the
//!   handler beside it; a stream meant to be replayed must end within the
//!   lease;
//! - a store error while completing the record cannot reach the caller, who
//!   has the bytes already: it is logged and the key stays in flight until
//!   its lease ends;
//! - the inner body fails: the key stays in flight until its lease ends.
//!
//! Outside a Tokio runtime (which the recording task needs) the body is
//! read whole before the head, as in transactional mode.
//!
//! A client that leaves before the response head does not stop the
//! handler: the claim, the handler and the head run to their end in a task
//! of their own. A body that is ready at once is then stored as usual; a
//! body that would wait has no reader, so it is dropped and recorded as
//! above (410 for repeats). To pass a stream through unrecorded, decline it
//! in the [`StorePolicy`](crate::policy::StorePolicy) (see
//! [`crate::policy`]): the key is given back and the body is untouched.
//!
//! # Transactional
//!
//! For a [`TransactionalStore`] whose database also holds the handler's
//! data. The layer claims the key, opens a transaction and hands it to the
//! handler (an axum extractor, or a request extension for a plain tower
//! service). After the handler answers, the layer completes the record with
//! the response in the same transaction and commits: the effect and the
//! completed record in ONE commit, or neither. A response the policy does not
//! store, an `Err`, a panic or a dropped request roll the effect back and give
//! the key back. If the commit fails, the first caller gets 503 instead of the
//! handler's response, since nothing happened. A transaction is held at
//! most the layer's max hold time
//! ([`IdempotencyLayer::max_hold`](crate::IdempotencyLayer::max_hold),
//! default 60 s); past it the store rolls it back and the request gets 503.
//!
//! ## Streamed responses are buffered
//!
//! The commit must come before the answer, so the layer reads the whole
//! response body (up to the response limit) before it sends the head: a
//! `text/event-stream` or any long stream reaches its caller only when it
//! ends. A body larger than the limit is committed without the body (410
//! for repeats) as soon as it passes the limit, and the rest streams. To let
//! a stream through at once, decline it in the
//! [`StorePolicy`](crate::policy::StorePolicy): the policy decides from the
//! head alone, the transaction rolls back, the key is given back, and the
//! body passes through untouched (the handler's writes through the
//! transaction are then discarded).
//!
//! After a crash before the commit, no effect exists and the retry runs
//! exactly once: at once with SQLite (whose claim was inside the rolled-back
//! transaction), after the lease with PostgreSQL (whose claim committed first,
//! so that other servers could see it in flight).

use std::future::Future;

use http::Extensions;

use crate::response::StoredResponse;
use crate::store::{
    Claim, ClaimRequest, Completion, FencingToken, RecordId, Refusal, Store, StoreError,
    TransactionClaim, TransactionalStore,
};

/// The record is completed in its own write after the handler (the default).
///
/// A streamed response reaches its caller frame by frame and is recorded as
/// it passes; a caller that leaves mid-stream stops the stream, and repeats
/// then get 410 (see [the module docs](crate::mode#streamed-responses)).
#[derive(Debug, Clone, Copy, Default)]
pub struct Separate;

/// The handler's writes, the record and the response commit together.
///
/// The response body is read in full (up to the response limit) before the
/// commit and then sent: streams are buffered. Decline them in the
/// [`StorePolicy`](crate::policy::StorePolicy) to pass them through (see
/// [the module docs](crate::mode#streamed-responses-are-buffered)).
#[derive(Debug, Clone, Copy, Default)]
pub struct Transactional;

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Separate {}
    impl Sealed for super::Transactional {}
}

/// How a layer claims keys and finishes records: [`Separate`] or
/// [`Transactional`]. Sealed: its methods are the layer's internals.
pub trait Mode<St>: sealed::Sealed + Clone + Send + Sync + 'static {
    /// The claim while the inner service runs.
    #[doc(hidden)]
    type Hold: Hold;

    /// Whether the claim, the handler and the completion run in a task of
    /// their own, so that a cancelled request still completes.
    #[doc(hidden)]
    const DETACHED: bool;

    /// Claims the key: the hold and whether an expired lease was taken over,
    /// or why the request is refused.
    #[doc(hidden)]
    fn claim(
        store: &St,
        request: ClaimRequest,
    ) -> impl Future<Output = Result<Result<(Self::Hold, bool), Refusal>, StoreError>> + Send;
}

/// A held claim. Dropped without [`Hold::complete`] or [`Hold::release`]
/// (a cancelled request, a panic), it gives the key back.
#[doc(hidden)]
pub trait Hold: Send + 'static {
    /// Whether a failed completion means the handler's effect did not happen.
    const ATOMIC: bool;

    /// Whether the claim's lease is renewed while the request runs:
    /// wherever the claim is committed before the handler runs.
    fn renews(&self) -> bool;

    /// Makes the claim available to the handler.
    fn attach(&self, extensions: &mut Extensions);

    /// The handler has answered with a response the policy stores.
    fn answered(&mut self);

    /// Stores `response` and finishes the record.
    fn complete(
        self,
        response: StoredResponse,
    ) -> impl Future<Output = Result<Completion, StoreError>> + Send;

    /// Gives the key back, so a retry runs at once. On an error the key
    /// stays in flight until its lease ends.
    fn release(self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Resolves if the store ends the claim on its own before the layer
    /// does (a transaction rolled back past its max hold time); never for a
    /// separate-mode claim.
    fn ended(&mut self) -> impl Future<Output = ()> + Send {
        std::future::pending()
    }
}

impl<St: Store> Mode<St> for Separate {
    type Hold = SeparateHold<St>;
    // The handler's effect commits on its own and may outlive a cancelled
    // future: only finishing the request keeps the record true to it.
    const DETACHED: bool = true;

    async fn claim(
        store: &St,
        request: ClaimRequest,
    ) -> Result<Result<(Self::Hold, bool), Refusal>, StoreError> {
        let (id, token) = (request.record_id(), request.token);
        Ok(match store.claim(request).await? {
            Claim::Acquired { taken_over } => {
                Ok((SeparateHold::new(store.clone(), id, token), taken_over))
            }
            Claim::Refused(refusal) => Err(refusal),
        })
    }
}

/// A claim whose record was committed at once. Dropped while armed (the
/// request was cancelled, or the handler panicked), it releases the record
/// from a spawned task, so a retry runs at once instead of waiting for the
/// lease. Never panics.
#[doc(hidden)]
pub struct SeparateHold<St: Store> {
    store: St,
    id: RecordId,
    token: FencingToken,
    armed: bool,
}

impl<St: Store> SeparateHold<St> {
    fn new(store: St, id: RecordId, token: FencingToken) -> Self {
        SeparateHold {
            store,
            id,
            token,
            armed: true,
        }
    }

    /// The record's id, leaving an empty one behind (no allocation): for
    /// the calls that end the hold.
    fn take_id(&mut self) -> RecordId {
        std::mem::replace(&mut self.id, RecordId::new(String::new(), String::new()))
    }

    fn disarm(&mut self) {
        self.armed = false;
    }

    /// Releases the record now (token-checked). If this future is dropped
    /// midway, the hold is still armed and releases from `Drop`.
    async fn release(mut self) -> Result<(), StoreError> {
        let released = self.store.release(self.id.clone(), self.token).await;
        self.armed = false;
        released.map(drop)
    }

    async fn complete(mut self, response: StoredResponse) -> Result<Completion, StoreError> {
        self.armed = false;
        let id = self.take_id();
        self.store.complete(id, self.token, response).await
    }
}

impl<St: Store> Drop for SeparateHold<St> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (store, token) = (self.store.clone(), self.token);
        let id = self.take_id();
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(async move {
                    if let Err(e) = store.release(id, token).await {
                        tracing::error!(error = %e, "releasing an abandoned key failed; it stays in flight until its lease ends");
                    }
                });
            }
            Err(_) => tracing::error!(
                "an abandoned key could not be released outside a Tokio runtime; it stays in flight until its lease ends"
            ),
        }
    }
}

impl<St: Store> Hold for SeparateHold<St> {
    const ATOMIC: bool = false;

    fn renews(&self) -> bool {
        true
    }

    fn attach(&self, _extensions: &mut Extensions) {}

    fn answered(&mut self) {
        // From here on the handler's effect may exist: a cancelled request
        // must not release the key; the lease decides.
        self.disarm();
    }

    fn complete(
        self,
        response: StoredResponse,
    ) -> impl Future<Output = Result<Completion, StoreError>> + Send {
        SeparateHold::complete(self, response)
    }

    fn release(self) -> impl Future<Output = Result<(), StoreError>> + Send {
        SeparateHold::release(self)
    }
}

impl<St: TransactionalStore> Mode<St> for Transactional {
    type Hold = TransactionHold<St>;
    // Nothing commits until the layer commits: a cancelled request rolls
    // back cleanly and frees the writer at once.
    const DETACHED: bool = false;

    async fn claim(
        store: &St,
        request: ClaimRequest,
    ) -> Result<Result<(Self::Hold, bool), Refusal>, StoreError> {
        Ok(match store.claim_in_transaction(request).await? {
            TransactionClaim::Acquired {
                transaction,
                taken_over,
            } => Ok((
                TransactionHold {
                    store: store.clone(),
                    transaction: Some(transaction),
                },
                taken_over,
            )),
            TransactionClaim::Refused(refusal) => Err(refusal),
        })
    }
}

/// A claim made inside an open transaction. Dropped unfinished, it rolls the
/// transaction back, even if the handler kept a clone of it.
#[doc(hidden)]
pub struct TransactionHold<St: TransactionalStore> {
    store: St,
    transaction: Option<St::Transaction>,
}

impl<St: TransactionalStore> Hold for TransactionHold<St> {
    const ATOMIC: bool = true;

    fn renews(&self) -> bool {
        self.store.claim_commits_first()
    }

    fn attach(&self, extensions: &mut Extensions) {
        if let Some(transaction) = &self.transaction {
            extensions.insert(transaction.clone());
        }
    }

    fn answered(&mut self) {}

    async fn complete(mut self, response: StoredResponse) -> Result<Completion, StoreError> {
        match self.transaction.take() {
            Some(transaction) => self.store.commit(&transaction, response).await,
            None => Ok(Completion::Fenced),
        }
    }

    async fn release(mut self) -> Result<(), StoreError> {
        if let Some(transaction) = self.transaction.take() {
            self.store.roll_back_and_wait(&transaction).await;
        }
        Ok(())
    }

    async fn ended(&mut self) {
        match &self.transaction {
            Some(transaction) => self.store.ended(transaction).await,
            None => std::future::pending().await,
        }
    }
}

impl<St: TransactionalStore> Drop for TransactionHold<St> {
    fn drop(&mut self) {
        if let Some(transaction) = self.transaction.take() {
            self.store.rollback(&transaction);
        }
    }
}
