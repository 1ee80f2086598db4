//! Transactional mode on PostgreSQL: [`PostgresTransaction`], the handler's
//! connection inside the request's transaction, and the
//! [`TransactionalStore`] impl that claims, commits and rolls back.

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Object;

use super::{PostgresStore, cached, unavailable};
use crate::response::StoredResponse;
use crate::store::duration_ms;
use crate::store::{
    Claim, ClaimRequest, Completion, FencingToken, RecordId, Store, StoreError, TransactionClaim,
    TransactionalStore,
};
use hold::Fate;

/// An open PostgreSQL transaction in which the layer has claimed the
/// request's key. The handler runs its own statements on it through
/// [`PostgresTransaction::client`]; the layer commits them with the record
/// and the stored response, or rolls everything back.
///
/// It reaches the handler as a request extension
/// (`req.extensions().get::<PostgresTransaction>()`) and, with the `axum`
/// feature, as an extractor.
///
/// # Max hold time
///
/// The transaction holds a pooled connection, and the row locks of the
/// handler's writes, until the layer commits or rolls back. So it is held
/// at most [`PostgresStoreBuilder::max_hold`](super::PostgresStoreBuilder::max_hold)
/// (default 30 s) or the layer's lease, whichever is shorter (past its
/// lease another request may take the key over anyway, and this commit
/// would be fenced). Past that, the store cancels a statement still running
/// on it, rolls it back, gives the key back and the connection to the pool;
/// [`PostgresTransaction::closed`] resolves, the handler's later
/// [`PostgresTransaction::client`] calls fail with
/// [`StoreError::Unavailable`], and the layer answers the request 503 with
/// `Retry-After` (or passes on a response its policy does not store). A
/// handler that keeps a [`TransactionClient`] borrowed without running a
/// statement delays that rollback until it lets go; as a backstop the
/// transaction sets PostgreSQL's `idle_in_transaction_session_timeout` to
/// the hold time plus 1 s, after which the server ends the session.
///
/// # Example
///
/// ```no_run
/// use axum::http::StatusCode;
/// use axum::response::{IntoResponse, Response};
/// use tower_idempotency::store::PostgresTransaction;
///
/// // `accounts` is the application's own table, in the store's database.
/// async fn credit(tx: PostgresTransaction) -> Result<String, Response> {
///     // A StoreError answers as the layer's problem (503 with Retry-After).
///     let client = tx.client().await.map_err(IntoResponse::into_response)?;
///     let row = client
///         .query_one("UPDATE accounts SET balance = balance + 5 WHERE id = 1 RETURNING balance", &[])
///         .await
///         .map_err(|e| {
///             // A 5xx is not stored: the transaction rolls back and the key
///             // is free for a retry. Log the cause; do not send it.
///             tracing::error!(error = %e, "crediting failed");
///             StatusCode::INTERNAL_SERVER_ERROR.into_response()
///         })?;
///     Ok(format!("balance {}", row.get::<_, i64>(0)))
/// }
/// ```
#[derive(Clone)]
pub struct PostgresTransaction {
    connection: Arc<tokio::sync::Mutex<Option<TxConnection>>>,
    /// Who ends it: the layer, or the max-hold timer.
    fate: Arc<Fate>,
    /// Its sender is dropped once the transaction has ended and its key is
    /// given back (if it is to be).
    ended: tokio::sync::watch::Receiver<()>,
}

/// A pooled connection inside an open transaction. Dropped before its
/// transaction ended cleanly (a cancelled commit, a failed `BEGIN`), it is
/// taken out of the pool and closed, so the server rolls the transaction back
/// and no later request can ever commit it.
struct TxConnection {
    client: Option<Object>,
    scope: String,
    key: String,
    token: FencingToken,
    /// The max-hold timer, stopped when the transaction ends first.
    timer: Option<tokio::task::AbortHandle>,
    /// Dropped when the transaction has ended: `closed` resolves.
    ended: Option<tokio::sync::watch::Sender<()>>,
}

impl TxConnection {
    fn client(&self) -> Result<&Object, StoreError> {
        self.client.as_ref().ok_or_else(transaction_over)
    }

    /// The transaction ended (`COMMIT` or `ROLLBACK` answered): the
    /// connection may go back to the pool.
    fn ended(mut self) {
        drop(self.client.take());
    }
}

impl Drop for TxConnection {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            drop(Object::take(client));
        }
        if let Some(timer) = self.timer.take() {
            timer.abort();
        }
    }
}

impl std::fmt::Debug for PostgresTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresTransaction")
            .finish_non_exhaustive()
    }
}

/// The connection of an open [`PostgresTransaction`]; derefs to
/// [`tokio_postgres::Client`]. Statements run inside the transaction; do not
/// `COMMIT` or `ROLLBACK` (the layer does).
pub struct TransactionClient<'a> {
    guard: tokio::sync::MappedMutexGuard<'a, Object>,
}

impl std::ops::Deref for TransactionClient<'_> {
    type Target = tokio_postgres::Client;

    fn deref(&self) -> &tokio_postgres::Client {
        &self.guard
    }
}

fn transaction_over() -> StoreError {
    unavailable("the idempotency transaction has already been committed or rolled back")
}

mod hold;

fn held_too_long(hold: Duration) -> StoreError {
    unavailable(format!(
        "the idempotency transaction was rolled back: it was held past its max hold time ({} ms)",
        hold.as_millis()
    ))
}

impl PostgresTransaction {
    /// The transaction's connection, for the handler's statements. Calls
    /// from clones of this handle take turns.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the transaction has already ended
    /// (committed, rolled back, or rolled back past its max hold time).
    pub async fn client(&self) -> Result<TransactionClient<'_>, StoreError> {
        let guard = self.connection.lock().await;
        if self.fate.expired() {
            return Err(self.over());
        }
        tokio::sync::MutexGuard::try_map(guard, |connection| {
            connection.as_mut().and_then(|c| c.client.as_mut())
        })
        .map(|guard| TransactionClient { guard })
        .map_err(|_| self.over())
    }

    /// Resolves once the transaction has ended: committed, rolled back, or
    /// rolled back by the store past its max hold time (see "Max hold
    /// time"; then the key has been given back too). A handler doing long
    /// work can `select!` on it to stop early.
    pub async fn closed(&self) {
        let mut ended = self.ended.clone();
        while ended.changed().await.is_ok() {}
    }

    /// The error of a call after the transaction ended.
    fn over(&self) -> StoreError {
        if self.fate.expired() {
            held_too_long(self.fate.hold)
        } else {
            transaction_over()
        }
    }

    async fn take(&self) -> Option<TxConnection> {
        self.connection.lock().await.take()
    }
}

/// Rolls back; if `ROLLBACK` fails, dropping the connection closes it.
async fn roll_back(connection: TxConnection) {
    let rolled_back = match connection.client() {
        Ok(client) => client.batch_execute("ROLLBACK").await.is_ok(),
        Err(_) => false,
    };
    if rolled_back {
        connection.ended();
    }
}

impl TransactionalStore for PostgresStore {
    async fn ended(&self, transaction: &Self::Transaction) {
        transaction.closed().await;
    }

    type Transaction = PostgresTransaction;

    async fn claim_in_transaction(
        &self,
        req: ClaimRequest,
    ) -> Result<TransactionClaim<PostgresTransaction>, StoreError> {
        let (scope, key, token, lease) = (req.scope.clone(), req.key.clone(), req.token, req.lease);
        // Phase one: the claim commits on its own, so that every other
        // server sees the key in flight, with its fingerprint and lease.
        // It runs in a task of its own: if this request is cancelled while
        // the claim is under way, the task gives a committed claim back
        // instead of leaving the key in flight for the whole lease.
        let (answer, claimed) = tokio::sync::oneshot::channel();
        let store = self.clone();
        tokio::spawn(async move {
            let (scope, key, token) = (req.scope.clone(), req.key.clone(), req.token);
            let unanswered = answer.send(store.claim(req).await);
            if let Err(Ok(Claim::Acquired { .. })) = unanswered
                && let Err(e) = store.release(RecordId::new(scope, key), token).await
            {
                tracing::error!(error = %e, "releasing an abandoned key failed; it stays in flight until its lease ends");
            }
        });
        let claimed = claimed
            .await
            .map_err(|_| unavailable("the claim task ended without an answer"))?;
        let taken_over = match claimed? {
            Claim::Acquired { taken_over } => taken_over,
            Claim::Refused(refused) => return Ok(TransactionClaim::Refused(refused)),
        };
        // Until the transaction is handed over, a cancelled or failed open
        // gives the key back.
        let claim = ReleaseOnDrop::new(self.clone(), scope.clone(), key.clone(), token);
        // Phase two: the handler's writes and the completion, in one
        // transaction that commits only if the record still carries our token.
        let (ended, watch) = tokio::sync::watch::channel(());
        let connection = TxConnection {
            client: Some(self.client().await?),
            scope,
            key,
            token,
            timer: None,
            ended: Some(ended),
        };
        let hold = self.max_hold.min(lease);
        let backstop_ms = duration_ms(hold).saturating_add(1_000);
        connection
            .client()?
            .batch_execute(&format!(
                "BEGIN; SET LOCAL idle_in_transaction_session_timeout = {backstop_ms}"
            ))
            .await
            .map_err(unavailable)?;
        let cancel = connection.client()?.cancel_token();
        let transaction = PostgresTransaction {
            connection: Arc::new(tokio::sync::Mutex::new(Some(connection))),
            fate: Arc::new(Fate::new(hold)),
            ended: watch,
        };
        let timer = tokio::spawn(self.clone().end_past(transaction.clone(), cancel));
        // Unless the timer has already ended it (a zero hold).
        if let Some(connection) = transaction.connection.lock().await.as_mut() {
            connection.timer = Some(timer.abort_handle());
        }
        claim.disarm();
        Ok(TransactionClaim::Acquired {
            transaction,
            taken_over,
        })
    }

    async fn commit(
        &self,
        transaction: &PostgresTransaction,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        let mut connection = transaction.take().await.ok_or_else(|| transaction.over())?;
        // `closed` resolves once the key is given back, if it is.
        let ended = connection.ended.take();
        if !transaction.fate.end() {
            // The max hold time passed first: roll back, as its timer would.
            self.roll_back_and_release(connection).await;
            drop(ended);
            return Err(transaction.over());
        }
        // Cancelled from here on, the connection closes (its `Drop`): the
        // server rolls back, and the key waits for its lease.
        let blob = response.encode();
        let (scope, key, token) = (
            connection.scope.clone(),
            connection.key.clone(),
            connection.token,
        );
        let client = connection.client()?;
        let completed = match cached(client, &self.sql.complete).await {
            Ok(statement) => client
                .execute(&statement, &[&scope, &key, &token.0, &blob])
                .await
                .map_err(unavailable),
            Err(e) => Err(e),
        };
        let failure = match completed {
            Ok(1) => None,
            // The lease ended and another request took the key over (or the
            // record expired): this request's writes must not count.
            Ok(_) => Some(unavailable(
                "the lease ended before the commit and another request took the key over; this request's writes were rolled back",
            )),
            // E.g. the handler's own statement failed and PostgreSQL aborted
            // the transaction.
            Err(e) => Some(e),
        };
        if let Some(e) = failure {
            // Nothing was committed: give the key back (token-checked, so a
            // request that took it over keeps it).
            self.roll_back_and_release(connection).await;
            drop(ended);
            return Err(e);
        }
        match connection.client()?.batch_execute("COMMIT").await {
            Ok(()) => {
                connection.ended();
                Ok(Completion::Stored)
            }
            // The outcome of a failed COMMIT is unknown: the connection is
            // closed (dropped) and the key waits for its lease.
            Err(e) => Err(unavailable(e)),
        }
    }

    fn rollback(&self, transaction: &PostgresTransaction) {
        drop(self.spawn_rollback(transaction));
    }

    async fn roll_back_and_wait(&self, transaction: &PostgresTransaction) {
        if let Some(task) = self.spawn_rollback(transaction) {
            // The task goes on if this future is dropped: the key is still
            // given back.
            let _ = task.await;
        }
    }
}

impl PostgresStore {
    /// Rolls back (`roll_back`), then gives the key back (token-checked,
    /// so a request that took it over keeps it).
    async fn roll_back_and_release(&self, connection: TxConnection) {
        let (scope, key, token) = (
            connection.scope.clone(),
            connection.key.clone(),
            connection.token,
        );
        roll_back(connection).await;
        if let Err(e) = self.release(RecordId::new(scope, key), token).await {
            tracing::error!(error = %e, "releasing a rolled-back key failed; it stays in flight until its lease ends");
        }
    }

    /// Rolls the transaction back and gives the key back, in a task of its
    /// own. Without a runtime, dropping the connection closes it, which
    /// rolls the transaction back; the claim then waits for its lease.
    fn spawn_rollback(
        &self,
        transaction: &PostgresTransaction,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let (store, transaction) = (self.clone(), transaction.clone());
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => Some(handle.spawn(async move {
                if let Some(mut connection) = transaction.take().await {
                    transaction.fate.end();
                    let ended = connection.ended.take();
                    // Give the key back, so a retry runs at once.
                    store.roll_back_and_release(connection).await;
                    drop(ended);
                }
            })),
            Err(_) => {
                drop(
                    transaction
                        .connection
                        .try_lock()
                        .ok()
                        .and_then(|mut guard| guard.take()),
                );
                None
            }
        }
    }
}

/// Releases a phase-one claim when dropped armed (a cancelled or failed
/// transaction open), from a spawned task.
struct ReleaseOnDrop {
    store: PostgresStore,
    scope: String,
    key: String,
    token: FencingToken,
    armed: bool,
}

impl ReleaseOnDrop {
    fn new(store: PostgresStore, scope: String, key: String, token: FencingToken) -> Self {
        ReleaseOnDrop {
            store,
            scope,
            key,
            token,
            armed: true,
        }
    }

    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let store = self.store.clone();
        let (scope, key, token) = (
            std::mem::take(&mut self.scope),
            std::mem::take(&mut self.key),
            self.token,
        );
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                if let Err(e) = store.release(RecordId::new(scope, key), token).await {
                    tracing::error!(error = %e, "releasing an abandoned key failed; it stays in flight until its lease ends");
                }
            });
        }
    }
}

crate::store::transaction_extractor!(PostgresTransaction);
