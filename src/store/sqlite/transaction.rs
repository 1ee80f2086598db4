//! [`SqliteTransaction`]: the handler's handle on its request's savepoint in
//! the writer's transaction, and the commands it sends the writer.

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
/// the writer at most the store's busy timeout, then gets 503.
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

impl SqliteTransaction {
    /// Runs `f` on the writer's thread and returns its result. `f` must not
    /// commit, roll back or end the transaction itself (the layer does);
    /// savepoints of its own are fine.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the transaction has already ended
    /// (committed, rolled back, or its thread died).
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
            .map_err(|_| transaction_over())?;
        answer.await.map_err(|_| transaction_over())
    }
}

crate::store::transaction_extractor!(SqliteTransaction);
