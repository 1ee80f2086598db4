//! [`SqliteTransaction`]: the handler's handle on its request's savepoint in
//! the writer's transaction, and the commands it sends the writer.

use std::time::Duration;

use crate::store::kit::held::HeldKey;
use crate::store::{Completion, StoreError};

/// An open SQLite transaction in which the layer has claimed the request's
/// key. The handler runs its own SQL in it with [`SqliteTransaction::run`];
/// the layer commits (with the stored response) or rolls back after the
/// handler answers.
///
/// # Group commit
///
/// Transactional requests on one store go through one writer thread, which
/// owns a connection and SQLite's write lock. Each request runs in a
/// savepoint of the writer's open transaction: its claim, its handler's SQL
/// and its stored response, one request at a time (SQLite has one writer
/// anyway). When a request's handler answers, its savepoint is released into
/// the transaction; when no request waits for the writer, or
/// [`SqliteStoreBuilder::group_commit`](super::SqliteStoreBuilder::group_commit) requests have joined, the writer
/// commits them all at once: one fsync for the batch instead of one per
/// request.
///
/// Nothing is answered before it is durable: a request's response, and a
/// replay or 422 that depends on a record written in the batch, are sent
/// only after the batch has committed. If the commit fails, every request in
/// the batch gets 503 and nothing of the batch happened, so each retry runs
/// again. A request whose own SQL fails the commit (a deferred foreign key)
/// therefore fails its batch mates too: they get 503 and their retries run.
/// A request that rolls back (a response that is not stored, an error, a
/// panic, a dropped request) rolls back only its savepoint.
///
/// By default one request at a time is open on the writer: between two
/// requests' SQL, the writer waits for the first one's handler to answer.
/// [`SqliteStoreBuilder::concurrent_transactions`](super::SqliteStoreBuilder::concurrent_transactions)
/// lets several be open at once, each in a savepoint of its own stacked on
/// the ones before, their SQL run back to back; a request that rolls back
/// then also rolls back (503) the requests whose SQL ran after its own
/// savepoint.
///
/// Async worker threads never block on the transaction. A request waits for
/// the writer at most the store's busy timeout, then gets 503; when
/// [`SqliteStoreBuilder::writer_queue`](super::SqliteStoreBuilder::writer_queue)
/// requests already wait, a new claim gets 503 at once.
///
/// # Max hold time
///
/// While a handler runs, its request holds the writer, and every other
/// write of the store waits. So a request holds it at most
/// the layer's max hold, [`IdempotencyLayer::max_hold`](crate::IdempotencyLayer::max_hold)
/// (default 60 s). Past
/// that, the writer rolls the request's savepoint back (its SQL and its
/// claim), [`SqliteTransaction::closed`] resolves, the handler's later
/// [`SqliteTransaction::run`] calls fail with [`StoreError::Unavailable`],
/// and the layer answers the request 503 with `Retry-After` (or passes on a
/// response its policy does not store); a retry runs afresh. The time is
/// checked between the handler's calls: one `run` closure is not
/// interrupted.
///
/// It reaches the handler as a request extension
/// (`req.extensions().get::<SqliteTransaction>()`) and, with the `axum`
/// feature, as an extractor.
///
/// # Example
///
/// ```
/// use tower_idempotency::store::{SqliteTransaction, TransactionError};
///
/// // An axum handler behind `IdempotencyLayer::new(store, scope).transactional()`.
/// // `TransactionError` answers as a problem (503 or 500), so `?` is enough.
/// async fn credit(tx: SqliteTransaction) -> Result<String, TransactionError> {
///     let balance: i64 = tx
///         .run(|tx| {
///             tx.execute("UPDATE accounts SET balance = balance + 5 WHERE id = 1", [])?;
///             tx.query_row("SELECT balance FROM accounts WHERE id = 1", [], |r| r.get(0))
///         })
///         .await?;
///     Ok(format!("balance {balance}"))
/// }
/// ```
#[derive(Clone)]
pub struct SqliteTransaction {
    pub(super) handle: std::sync::Arc<Handle>,
    /// Why the transaction ended; its sender is dropped when it ends.
    pub(super) ended: tokio::sync::watch::Receiver<Ended>,
}

/// The writer's queue and the request's id there. Dropped with the last
/// clone of the transaction: a request still open then rolls back.
pub(super) struct Handle {
    pub(super) events: Box<dyn Mailbox>,
    pub(super) id: u64,
    /// The request's mark on its key, shared with the writer.
    pub(super) key: std::sync::Arc<KeyMark>,
}

/// Where a handle's commands go: the writer's queue (`queue.rs`). A trait,
/// so that this file needs nothing of the writer's.
pub(super) trait Mailbox: Send + Sync {
    /// Posts `command` for the open request `id`; `false` when the writer
    /// is gone.
    fn post(&self, id: u64, command: Command) -> bool;
}

impl Handle {
    pub(super) fn send(&self, command: Command) -> Result<(), ()> {
        if self.events.post(self.id, command) {
            Ok(())
        } else {
            Err(())
        }
    }

    /// Posts the request's rollback (ignored by the writer when the request
    /// has ended already), then frees its key: see [`KeyMark`].
    pub(super) fn roll_back(&self) {
        let _ = self.send(Command::Rollback);
        self.key.free();
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.roll_back();
    }
}

/// A transactional request's mark on its key in the store's
/// [`HeldKeys`](crate::store::kit::held::HeldKeys), which a claim of the key
/// reads before it is queued for the writer (422 or 409 at once while the
/// key is held). Shared by the writer's record of the request and its
/// handle: whichever ends the request first frees the key. The writer, when
/// it commits or rolls the request back (before anyone hears of it); or the
/// handle, right after it has posted the request's rollback (the layer rolls
/// back on a panic, a dropped request or an answer it does not store; or the
/// last handle is dropped).
///
/// So a claim that finds the key free is queued after that rollback: the
/// writer takes its queue in order, rolls the request back, then runs the
/// claim, which finds nothing of it. A client that sees its request end
/// without a stored answer (a 5xx, the connection closed by a panic) and
/// retries at once is never met by its own dead request as in flight (409),
/// however long the writer takes to get to the rollback. The writer frees a
/// key only after its request has ended in the batch, so a key it frees is
/// free there too.
#[derive(Default)]
pub(super) struct KeyMark(std::sync::Mutex<Mark>);

#[derive(Default)]
enum Mark {
    /// The writer has not marked the key yet.
    #[default]
    Unmarked,
    /// Marked: dropping the guard frees the key.
    Held { _guard: HeldKey },
    /// The request has ended, or its rollback is posted: never marked again.
    Freed,
}

impl KeyMark {
    fn state(&self) -> std::sync::MutexGuard<'_, Mark> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Marks the key held (`hold` makes the guard), unless the request's
    /// rollback was posted meanwhile: then the key is never marked at all.
    pub(super) fn hold(&self, hold: impl FnOnce() -> HeldKey) {
        let mut state = self.state();
        if let Mark::Unmarked = *state {
            *state = Mark::Held { _guard: hold() };
        }
    }

    /// Frees the key, for good.
    pub(super) fn free(&self) {
        let freed = std::mem::replace(&mut *self.state(), Mark::Freed);
        // The guard drops here, outside the lock.
        drop(freed);
    }
}

/// The writer's side of a [`KeyMark`]: dropped with the request's record
/// when the request ends, it frees the key.
pub(super) struct Marked(pub(super) std::sync::Arc<KeyMark>);

impl Drop for Marked {
    fn drop(&mut self) {
        self.0.free();
    }
}

/// How a transaction ended, as far as its handle can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ended {
    /// Still open, or committed or rolled back by the layer.
    Open,
    /// Rolled back by the writer: it held the writer this long.
    HeldTooLong(Duration),
    /// Rolled back because a request it ran after in the same batch rolled
    /// back (see [`SqliteStoreBuilder::concurrent_transactions`](super::SqliteStoreBuilder::concurrent_transactions)).
    BatchMateRolledBack,
}

impl std::fmt::Debug for SqliteTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteTransaction").finish_non_exhaustive()
    }
}

/// A handler's closure, run on the writer: `false` when it panicked (the
/// writer then rolls the request back and ends its transaction).
pub(super) type Job = Box<dyn FnOnce(&rusqlite::Transaction<'_>) -> bool + Send>;

pub(super) enum Command {
    Run(Job),
    Commit {
        response: Vec<u8>,
        reply: tokio::sync::oneshot::Sender<Result<Completion, StoreError>>,
    },
    Rollback,
}

pub(super) fn transaction_over() -> StoreError {
    StoreError::unavailable("the idempotency transaction has already been committed or rolled back")
}

/// The error of a call on a transaction that has ended.
pub(super) fn ended(state: Ended) -> StoreError {
    match state {
        Ended::Open => transaction_over(),
        Ended::HeldTooLong(hold) => StoreError::held_too_long(hold),
        Ended::BatchMateRolledBack => StoreError::unavailable(
            "the idempotency transaction was rolled back with a request it ran after in the same SQLite batch; nothing of it happened",
        ),
    }
}

impl SqliteTransaction {
    /// Runs `f` on the writer's thread and returns its result. `f` must not
    /// commit, roll back or end the transaction itself (the layer does);
    /// savepoints of its own are fine.
    ///
    /// An `Err` from `f` does not roll anything back by itself: the handler
    /// answers, and an answer the layer does not store (a 5xx, by default)
    /// rolls the request's transaction back. A domain error that is not a
    /// `rusqlite::Error` can travel inside `T` (`Ok(Err(..))`).
    ///
    /// # Errors
    ///
    /// [`TransactionError::Sql`] with the error `f` returned;
    /// [`TransactionError::Store`] ([`StoreError::Unavailable`]) when the
    /// transaction has already ended (committed, rolled back, rolled back
    /// past its max hold time, or its thread died).
    ///
    /// # Panics
    ///
    /// When `f` panics, with `f`'s panic: the request's transaction is
    /// rolled back first, and the store's writer goes on serving other
    /// requests.
    pub async fn run<T, F>(&self, f: F) -> Result<T, TransactionError>
    where
        F: FnOnce(&rusqlite::Transaction<'_>) -> Result<T, rusqlite::Error> + Send + 'static,
        T: Send + 'static,
    {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move |tx| {
            // A panic in `f` must not take the writer thread (and with it
            // every later request on the store) down: it is caught here and
            // resumed in the handler below, where it would have happened had
            // `f` run inline.
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(tx)));
            let ran = outcome.is_ok();
            let _ = reply.send(outcome);
            ran
        });
        self.handle
            .send(Command::Run(job))
            .map_err(|()| self.over())?;
        match answer.await.map_err(|_| self.over())? {
            Ok(result) => Ok(result?),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }

    /// Resolves once the transaction has ended for this request: committed
    /// into the writer's batch, rolled back, or rolled back by the writer
    /// past its max hold time (see "Max hold time"). A handler doing long
    /// work can `select!` on it to stop early.
    pub async fn closed(&self) {
        let mut ended = self.ended.clone();
        while ended.changed().await.is_ok() {}
    }

    /// The error of a call after the transaction ended.
    pub(super) fn over(&self) -> StoreError {
        ended(*self.ended.borrow())
    }
}

/// The error of [`SqliteTransaction::run`]: the transaction could not run the
/// closure, or the closure's SQL failed.
///
/// With the `axum` feature it is a response: `Store` as the store's problem
/// (503 `store-unavailable` with `Retry-After`), `Sql` as a 500 problem whose
/// detail does not echo the SQL error (it is logged instead). So a handler
/// can return `Result<_, TransactionError>` and use `?`.
#[derive(Debug)]
#[non_exhaustive]
pub enum TransactionError {
    /// The transaction has ended or its writer is gone: see [`StoreError`].
    Store(StoreError),
    /// The closure returned this error.
    Sql(rusqlite::Error),
}

impl From<StoreError> for TransactionError {
    fn from(e: StoreError) -> Self {
        TransactionError::Store(e)
    }
}

impl From<rusqlite::Error> for TransactionError {
    fn from(e: rusqlite::Error) -> Self {
        TransactionError::Sql(e)
    }
}

impl std::fmt::Display for TransactionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TransactionError::Store(e) => e.fmt(f),
            TransactionError::Sql(e) => write!(f, "SQL in the idempotency transaction failed: {e}"),
        }
    }
}

impl std::error::Error for TransactionError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TransactionError::Store(e) => Some(e),
            TransactionError::Sql(e) => Some(e),
        }
    }
}

#[cfg(feature = "axum")]
impl axum_core::response::IntoResponse for TransactionError {
    fn into_response(self) -> axum_core::response::Response {
        match self {
            TransactionError::Store(e) => e.into_response(),
            TransactionError::Sql(e) => {
                tracing::error!(error = %e, "a handler's SQL failed; answering 500");
                crate::extract::internal_error(
                    "a database statement failed while this request was processed",
                )
            }
        }
    }
}

crate::store::kit::transaction_extractor!(SqliteTransaction);

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::SqliteTransaction;
    use crate::fingerprint::Fingerprint;
    use crate::store::sqlite::SqliteStore;
    use crate::store::{
        ClaimRequest, FencingToken, RecordId, TransactionClaim, TransactionalStore,
    };

    fn claim(key: &str, body: u8) -> ClaimRequest {
        let id = RecordId::new("s", key);
        ClaimRequest::new(id, Fingerprint([body; 32]), FencingToken::random())
    }

    async fn acquire(store: &SqliteStore, key: &str) -> SqliteTransaction {
        match store.claim_in_transaction(claim(key, 1)).await.unwrap() {
            TransactionClaim::Acquired { transaction, .. } => transaction,
            TransactionClaim::Refused(refusal) => panic!("{refusal:?}"),
        }
    }

    /// How a request's transaction ends without the writer's doing.
    #[derive(Clone, Copy, Debug)]
    enum End {
        /// The layer rolls it back (its hold dropped: a panic, a dropped
        /// request) while the handler still has a clone.
        LayerRollsBack,
        /// Its last handle is dropped.
        LastHandleDropped,
    }

    /// Ends the request holding `k` while the writer is busy with another
    /// request's closure (so it has not run the rollback yet), then claims
    /// `k` again with `body`: the claim must be queued behind the rollback
    /// and acquire the key. Before, it met the key still marked held (the
    /// writer frees it only once it has run the rollback) and was refused
    /// at once: 409 for the same body, 422 for another.
    async fn claim_after(end: End, body: u8) {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::builder(dir.path().join("s.sqlite3"))
            .concurrent_transactions(2)
            .open()
            .await
            .unwrap();
        let busy = acquire(&store, "busy").await;
        let held = acquire(&store, "k").await;
        // The writer runs `busy`'s closure until it is told to go on.
        let (started, running) = tokio::sync::oneshot::channel();
        let (go_on, wait) = std::sync::mpsc::channel::<()>();
        let blocked = tokio::spawn(async move {
            busy.run(move |_| {
                let _ = started.send(());
                let _ = wait.recv();
                Ok(())
            })
            .await
        });
        running.await.unwrap();
        let kept = match end {
            End::LayerRollsBack => {
                store.rollback(&held);
                Some(held)
            }
            End::LastHandleDropped => {
                drop(held);
                None
            }
        };
        let again = tokio::spawn({
            let store = store.clone();
            async move { store.claim_in_transaction(claim("k", body)).await }
        });
        // The claim is queued for the writer, or (before) answered at once.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while store.transactions_waiting() == 0 && !again.is_finished() {
            assert!(tokio::time::Instant::now() < deadline, "{end:?}: no answer");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        go_on.send(()).unwrap();
        match again.await.unwrap().unwrap() {
            TransactionClaim::Acquired { .. } => {}
            TransactionClaim::Refused(refusal) => {
                panic!(
                    "{end:?}, body {body}: the claim after the rollback was refused: {refusal:?}"
                )
            }
        }
        blocked.await.unwrap().unwrap();
        drop(kept);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_after_a_posted_rollback_finds_the_key_free() {
        for end in [End::LayerRollsBack, End::LastHandleDropped] {
            for body in [1, 2] {
                claim_after(end, body).await;
            }
        }
    }
}
