//! Transactional mode on PostgreSQL through sqlx: [`SqlxPostgresTransaction`],
//! the handler's connection inside the request's transaction, and the
//! [`TransactionalStore`] impl that claims, commits and rolls back.

use std::sync::Arc;
use std::time::Duration;

use sqlx::{PgConnection, Postgres};

use super::sql::checked;
use super::{SqlxPostgresStore, unavailable};
use crate::response::StoredResponse;
use crate::store::duration_ms;
use crate::store::{
    Claim, ClaimRequest, Completion, FencingToken, RecordId, Store, StoreError, TransactionClaim,
    TransactionalStore,
};
use hold::Fate;

mod error;
mod hold;

pub use error::SqlxPostgresError;

/// An open `sqlx::Transaction<'static, Postgres>` of the store's pool in
/// which the layer has claimed the request's key. The handler runs its own
/// statements in it through [`SqlxPostgresTransaction::connection`]; the layer
/// commits them with the record and the stored response, or rolls
/// everything back.
///
/// It reaches the handler as a request extension
/// (`req.extensions().get::<SqlxPostgresTransaction>()`) and, with the
/// `axum` feature, as an extractor. A route whose layer is not
/// `.transactional()` (or lacks `require_key(true)`) answers a handler that
/// takes it with a 500 problem saying so, logged once per process;
/// `Option<SqlxPostgresTransaction>` is `None` instead.
///
/// # Max hold time
///
/// The transaction holds a connection of the pool, and the row locks of the
/// handler's writes, until the layer commits or rolls back. So it is held at
/// most [`SqlxPostgresStoreBuilder::max_hold`](super::SqlxPostgresStoreBuilder::max_hold)
/// (default 30 s) or the layer's lease, whichever is shorter (past its lease
/// another request may take the key over anyway, and this commit would be
/// fenced). Past that, the store cancels a statement still running on it
/// (`pg_cancel_backend`, from a connection of its own), rolls it back, gives
/// the key back and the connection to the pool;
/// [`SqlxPostgresTransaction::closed`] resolves, the handler's later
/// [`SqlxPostgresTransaction::connection`] calls fail with
/// [`StoreError::Unavailable`], and the layer answers the request 503 with
/// `Retry-After` (or passes on a response its policy does not store). A
/// handler that keeps a [`SqlxPostgresConnection`] without running a
/// statement delays that rollback until it lets go; as a backstop the
/// transaction sets PostgreSQL's `idle_in_transaction_session_timeout` to
/// the hold time plus 1 s, after which the server ends the session.
///
/// # Example
///
/// ```no_run
/// use tower_idempotency::store::{SqlxPostgresError, SqlxPostgresTransaction};
///
/// // `accounts` is the application's own table, in the store's database.
/// // `SqlxPostgresError` answers as a problem (503 for the store, 500 for
/// // the SQL, which is logged and not sent), so `?` is enough.
/// async fn credit(tx: SqlxPostgresTransaction) -> Result<String, SqlxPostgresError> {
///     let mut conn = tx.connection().await?;
///     let balance: i64 = sqlx::query_scalar(
///         "UPDATE accounts SET balance = balance + 5 WHERE id = 1 RETURNING balance",
///     )
///     .fetch_one(&mut *conn)
///     .await?;
///     Ok(format!("balance {balance}"))
/// }
/// ```
#[derive(Clone)]
pub struct SqlxPostgresTransaction {
    connection: Arc<tokio::sync::Mutex<Option<TxConnection>>>,
    /// Who ends it: the layer, or the max-hold timer.
    fate: Arc<Fate>,
    /// Its sender is dropped once the transaction has ended and its key is
    /// given back (if it is to be).
    ended: tokio::sync::watch::Receiver<()>,
}

/// The open transaction and what ending it needs. Dropped before its
/// transaction ended cleanly (a cancelled commit, a failed statement), the
/// `sqlx::Transaction` queues a `ROLLBACK` on its connection, which the pool
/// runs (and waits for) before it hands the connection out again: no later
/// request can commit these writes.
struct TxConnection {
    tx: Option<sqlx::Transaction<'static, Postgres>>,
    scope: String,
    key: String,
    token: FencingToken,
    /// The max-hold timer, stopped when the transaction ends first.
    timer: Option<tokio::task::AbortHandle>,
    /// Dropped when the transaction has ended: `closed` resolves.
    ended: Option<tokio::sync::watch::Sender<()>>,
}

impl TxConnection {
    fn conn(&mut self) -> Result<&mut PgConnection, StoreError> {
        self.tx.as_deref_mut().ok_or_else(transaction_over)
    }
}

impl Drop for TxConnection {
    fn drop(&mut self) {
        if let Some(timer) = self.timer.take() {
            timer.abort();
        }
    }
}

impl std::fmt::Debug for SqlxPostgresTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlxPostgresTransaction")
            .finish_non_exhaustive()
    }
}

/// The connection of an open [`SqlxPostgresTransaction`]: derefs to
/// [`sqlx::PgConnection`], so `&mut *conn` is an executor, as with a
/// `sqlx::Transaction`. Statements run inside the transaction; do not
/// `COMMIT` or `ROLLBACK` (the layer does).
pub struct SqlxPostgresConnection<'a> {
    guard: tokio::sync::MappedMutexGuard<'a, PgConnection>,
}

impl std::fmt::Debug for SqlxPostgresConnection<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlxPostgresConnection")
            .finish_non_exhaustive()
    }
}

impl std::ops::Deref for SqlxPostgresConnection<'_> {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.guard
    }
}

impl std::ops::DerefMut for SqlxPostgresConnection<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.guard
    }
}

fn transaction_over() -> StoreError {
    unavailable("the idempotency transaction has already been committed or rolled back")
}

fn held_too_long(hold: Duration) -> StoreError {
    unavailable(format!(
        "the idempotency transaction was rolled back: it was held past its max hold time ({} ms)",
        hold.as_millis()
    ))
}

impl SqlxPostgresTransaction {
    /// The transaction's connection, for the handler's statements
    /// (`.execute(&mut *conn)`). Calls from clones of this handle take
    /// turns: the next waits until the previous connection is dropped.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the transaction has already ended
    /// (committed, rolled back, or rolled back past its max hold time).
    pub async fn connection(&self) -> Result<SqlxPostgresConnection<'_>, StoreError> {
        let guard = self.connection.lock().await;
        if self.fate.expired() {
            return Err(self.over());
        }
        tokio::sync::MutexGuard::try_map(guard, |connection| {
            connection.as_mut().and_then(|c| c.tx.as_deref_mut())
        })
        .map(|guard| SqlxPostgresConnection { guard })
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

/// Rolls back; a `ROLLBACK` that fails leaves sqlx to close the connection.
async fn roll_back(mut connection: TxConnection) {
    if let Some(tx) = connection.tx.take()
        && let Err(e) = tx.rollback().await
    {
        tracing::debug!(error = %e, "rolling back an idempotency transaction failed");
    }
}

impl TransactionalStore for SqlxPostgresStore {
    type Transaction = SqlxPostgresTransaction;

    async fn ended(&self, transaction: &Self::Transaction) {
        transaction.closed().await;
    }

    async fn claim_in_transaction(
        &self,
        req: ClaimRequest,
    ) -> Result<TransactionClaim<SqlxPostgresTransaction>, StoreError> {
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
        let hold = self.max_hold.min(lease);
        let backstop_ms = duration_ms(hold).saturating_add(1_000);
        let mut tx = self
            .pool
            .begin_with(checked(format!(
                "BEGIN; SET LOCAL idle_in_transaction_session_timeout = {backstop_ms}"
            )))
            .await
            .map_err(unavailable)?;
        // The backend, for cancelling a statement past the max hold time.
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await
            .map_err(unavailable)?;
        let (ended, watch) = tokio::sync::watch::channel(());
        let connection = TxConnection {
            tx: Some(tx),
            scope,
            key,
            token,
            timer: None,
            ended: Some(ended),
        };
        let transaction = SqlxPostgresTransaction {
            connection: Arc::new(tokio::sync::Mutex::new(Some(connection))),
            fate: Arc::new(Fate::new(hold)),
            ended: watch,
        };
        let timer = tokio::spawn(self.clone().end_past(transaction.clone(), pid));
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
        transaction: &SqlxPostgresTransaction,
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
        // Cancelled from here on, the transaction is dropped and rolls back
        // (see `TxConnection`), and the key waits for its lease.
        let (scope, key, token) = (
            connection.scope.clone(),
            connection.key.clone(),
            connection.token,
        );
        let completed = self
            .complete_on(connection.conn()?, &scope, &key, token, &response)
            .await;
        let failure = match completed {
            Ok(Completion::Stored) => None,
            // The lease ended and another request took the key over (or the
            // record expired and was purged): this request's writes must
            // not count.
            Ok(_) => Some(unavailable(
                "the lease ended before the commit and another request took the key over; this request's writes were rolled back",
            )),
            // E.g. the handler's own statement failed and PostgreSQL aborted
            // the transaction.
            Err(e) => Some(unavailable(e)),
        };
        if let Some(e) = failure {
            // Nothing was committed: give the key back (token-checked, so a
            // request that took it over keeps it).
            self.roll_back_and_release(connection).await;
            drop(ended);
            return Err(e);
        }
        let tx = connection.tx.take().ok_or_else(transaction_over)?;
        // A failed COMMIT's outcome is unknown: the key waits for its lease.
        tx.commit().await.map_err(unavailable)?;
        Ok(Completion::Stored)
    }

    fn rollback(&self, transaction: &SqlxPostgresTransaction) {
        drop(self.spawn_rollback(transaction));
    }

    async fn roll_back_and_wait(&self, transaction: &SqlxPostgresTransaction) {
        if let Some(task) = self.spawn_rollback(transaction) {
            // The task goes on if this future is dropped: the key is still
            // given back.
            let _ = task.await;
        }
    }
}

impl SqlxPostgresStore {
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
    /// own. Without a Tokio runtime nothing is done here: the transaction
    /// rolls back when its last handle is dropped (sqlx needs a runtime
    /// then), and the claim waits for its lease.
    fn spawn_rollback(
        &self,
        transaction: &SqlxPostgresTransaction,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let (store, transaction) = (self.clone(), transaction.clone());
        let handle = tokio::runtime::Handle::try_current().ok()?;
        Some(handle.spawn(async move {
            if let Some(mut connection) = transaction.take().await {
                transaction.fate.end();
                let ended = connection.ended.take();
                // Give the key back, so a retry runs at once.
                store.roll_back_and_release(connection).await;
                drop(ended);
            }
        }))
    }
}

/// Releases a phase-one claim when dropped armed (a cancelled or failed
/// transaction open), from a spawned task.
struct ReleaseOnDrop {
    store: SqlxPostgresStore,
    scope: String,
    key: String,
    token: FencingToken,
    armed: bool,
}

impl ReleaseOnDrop {
    fn new(store: SqlxPostgresStore, scope: String, key: String, token: FencingToken) -> Self {
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

crate::store::transaction_extractor!(SqlxPostgresTransaction);
