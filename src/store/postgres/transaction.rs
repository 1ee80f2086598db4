//! Transactional mode on PostgreSQL: [`PostgresTransaction`], the handler's
//! connection inside the request's transaction, and the
//! [`TransactionalStore`] impl that claims, commits and rolls back.

use std::sync::Arc;

use deadpool_postgres::Object;

use super::{PostgresStore, unavailable};
use crate::response::StoredResponse;
use crate::store::{
    Claim, ClaimRequest, Completion, FencingToken, RecordId, Store, StoreError, TransactionClaim,
    TransactionalStore,
};

/// An open PostgreSQL transaction in which the layer has claimed the
/// request's key. The handler runs its own statements on it through
/// [`PostgresTransaction::client`]; the layer commits them with the record
/// and the stored response, or rolls everything back.
///
/// It reaches the handler as a request extension
/// (`req.extensions().get::<PostgresTransaction>()`) and, with the `axum`
/// feature, as an extractor.
///
/// # Example
///
/// ```no_run
/// use tower_idempotency::store::PostgresTransaction;
///
/// async fn credit(tx: PostgresTransaction) -> Result<String, String> {
///     let client = tx.client().await.map_err(|e| e.to_string())?;
///     let row = client
///         .query_one("UPDATE accounts SET balance = balance + 5 WHERE id = 1 RETURNING balance", &[])
///         .await
///         .map_err(|e| e.to_string())?;
///     Ok(format!("balance {}", row.get::<_, i64>(0)))
/// }
/// ```
#[derive(Clone)]
pub struct PostgresTransaction {
    connection: Arc<tokio::sync::Mutex<Option<TxConnection>>>,
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

impl PostgresTransaction {
    /// The transaction's connection, for the handler's statements. Calls
    /// from clones of this handle take turns.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the transaction has already ended.
    pub async fn client(&self) -> Result<TransactionClient<'_>, StoreError> {
        let guard = self.connection.lock().await;
        tokio::sync::MutexGuard::try_map(guard, |connection| {
            connection.as_mut().and_then(|c| c.client.as_mut())
        })
        .map(|guard| TransactionClient { guard })
        .map_err(|_| transaction_over())
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
    type Transaction = PostgresTransaction;

    async fn claim_in_transaction(
        &self,
        req: ClaimRequest,
    ) -> Result<TransactionClaim<PostgresTransaction>, StoreError> {
        let (scope, key, token) = (req.scope.clone(), req.key.clone(), req.token);
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
        let connection = TxConnection {
            client: Some(self.client().await?),
            scope,
            key,
            token,
        };
        connection
            .client()?
            .batch_execute("BEGIN")
            .await
            .map_err(unavailable)?;
        claim.disarm();
        Ok(TransactionClaim::Acquired {
            transaction: PostgresTransaction {
                connection: Arc::new(tokio::sync::Mutex::new(Some(connection))),
            },
            taken_over,
        })
    }

    async fn commit(
        &self,
        transaction: &PostgresTransaction,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        let connection = transaction.take().await.ok_or_else(transaction_over)?;
        // Cancelled from here on, the connection closes (its `Drop`): the
        // server rolls back, and the key waits for its lease.
        let blob = response.encode();
        let (scope, key, token) = (
            connection.scope.clone(),
            connection.key.clone(),
            connection.token,
        );
        let completed = connection
            .client()?
            .execute(&self.sql.complete, &[&scope, &key, &token.0, &blob])
            .await;
        let failure = match completed {
            Ok(1) => None,
            // The lease ended and another request took the key over (or the
            // record expired): this request's writes must not count.
            Ok(_) => Some(unavailable(
                "the lease ended before the commit and another request took the key over; this request's writes were rolled back",
            )),
            // E.g. the handler's own statement failed and PostgreSQL aborted
            // the transaction.
            Err(e) => Some(unavailable(e)),
        };
        if let Some(e) = failure {
            roll_back(connection).await;
            // Nothing was committed: give the key back (token-checked, so a
            // request that took it over keeps it).
            if let Err(release) = self.release(RecordId::new(scope, key), token).await {
                tracing::error!(error = %release, "releasing a rolled-back key failed; it stays in flight until its lease ends");
            }
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
                if let Some(connection) = transaction.take().await {
                    let (scope, key, token) =
                        (connection.scope.clone(), connection.key.clone(), connection.token);
                    roll_back(connection).await;
                    // Give the key back, so a retry runs at once.
                    if let Err(e) = store.release(RecordId::new(scope, key), token).await {
                        tracing::error!(error = %e, "releasing a rolled-back key failed; it stays in flight until its lease ends");
                    }
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
