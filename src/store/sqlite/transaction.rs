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
/// Async worker threads never block on the transaction. A request waits for
/// the writer at most the store's busy timeout, then gets 503; when
/// [`SqliteStoreBuilder::writer_queue`](super::SqliteStoreBuilder::writer_queue)
/// requests already wait, a new claim gets 503 at once.
///
/// # Max hold time
///
/// While a handler runs, its request holds the writer, and every other
/// write of the store waits. So a request holds it at most
/// [`SqliteStoreBuilder::max_hold`](super::SqliteStoreBuilder::max_hold)
/// (default 30 s) or the layer's lease, whichever is shorter (a holder past
/// its lease has lost its key by the contract of [`crate::store`]). Past
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
/// use tower_idempotency::store::SqliteTransaction;
///
/// // An axum handler behind `IdempotencyLayer::new(store, scope).transactional()`.
/// async fn credit(tx: SqliteTransaction) -> Result<String, String> {
///     let balance = tx
///         .run(|tx| {
///             tx.execute("UPDATE accounts SET balance = balance + 5 WHERE id = 1", [])?;
///             tx.query_row("SELECT balance FROM accounts WHERE id = 1", [], |r| r.get::<_, i64>(0))
///         })
///         .await
///         .map_err(|e| e.to_string())?
///         .map_err(|e: tower_idempotency::rusqlite::Error| e.to_string())?;
///     Ok(format!("balance {balance}"))
/// }
/// ```
#[derive(Clone)]
pub struct SqliteTransaction {
    pub(super) commands: std::sync::mpsc::Sender<Command>,
    /// Why the transaction ended; its sender is dropped when it ends.
    pub(super) ended: tokio::sync::watch::Receiver<Ended>,
}

/// How a transaction ended, as far as its handle can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ended {
    /// Still open, or committed or rolled back by the layer.
    Open,
    /// Rolled back by the writer: it held the writer this long.
    HeldTooLong(Duration),
}

impl std::fmt::Debug for SqliteTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteTransaction").finish_non_exhaustive()
    }
}

pub(super) type Job = Box<dyn FnOnce(&rusqlite::Transaction<'_>) + Send>;

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
        Ended::HeldTooLong(hold) => StoreError::unavailable(format!(
            "the idempotency transaction was rolled back: it held the SQLite writer past its max hold time ({} ms)",
            hold.as_millis()
        )),
    }
}

impl SqliteTransaction {
    /// Runs `f` on the writer's thread and returns its result. `f` must not
    /// commit, roll back or end the transaction itself (the layer does);
    /// savepoints of its own are fine.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the transaction has already ended
    /// (committed, rolled back, rolled back past its max hold time, or its
    /// thread died).
    pub async fn run<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(&rusqlite::Transaction<'_>) -> T + Send + 'static,
        T: Send + 'static,
    {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move |tx| {
            let _ = reply.send(f(tx));
        });
        self.commands
            .send(Command::Run(job))
            .map_err(|_| self.over())?;
        answer.await.map_err(|_| self.over())
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

crate::store::transaction_extractor!(SqliteTransaction);
