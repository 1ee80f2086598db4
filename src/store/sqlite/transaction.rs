//! [`SqliteTransaction`]: the handler's handle on its request's savepoint in
//! the writer's transaction, and the commands it sends the writer.

use std::time::Duration;

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
}

impl Drop for Handle {
    fn drop(&mut self) {
        // Ignored by the writer when the request has ended already.
        let _ = self.send(Command::Rollback);
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
