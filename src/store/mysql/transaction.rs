//! Transactional mode on MySQL/MariaDB: [`MySqlTransaction`], the
//! handler's connection inside the request's transaction, and the
//! [`TransactionalStore`] impl that claims, commits and rolls back.

use std::sync::Arc;
use std::time::Duration;

use sqlx::mysql::{MySql, MySqlConnection};
use sqlx::{AssertSqlSafe, Executor};

use super::hold::Fate;
use super::{MySqlStore, q, record_key, unavailable};
use crate::response::StoredResponse;
use crate::store::{
    Claim, ClaimRequest, Completion, FencingToken, RecordId, Store, StoreError, TransactionClaim,
    TransactionalStore,
};

/// An open MySQL/MariaDB transaction in which the layer has claimed the
/// request's key. The handler runs its own statements on it through
/// [`MySqlTransaction::connection`]; the layer commits them with the record
/// and the stored response, or rolls everything back.
///
/// It reaches the handler as a request extension
/// (`req.extensions().get::<MySqlTransaction>()`) and, with the `axum`
/// feature, as an extractor.
///
/// # Errors inside the transaction
///
/// InnoDB ends the whole transaction on a deadlock (error 1213), and later
/// statements on the connection would run outside it. Answer such an error
/// with a response the layer does not store (a 5xx): everything rolls back
/// and the key is free for a retry. On MariaDB the completion also checks
/// `@@in_transaction`, so a handler that swallowed such an error and
/// answered 2xx gets 503, and no record is stored.
///
/// # Max hold time
///
/// The transaction holds a pooled connection, and the row locks of the
/// handler's writes, until the layer commits or rolls back: at most
/// [`MySqlStoreBuilder::max_hold`](super::MySqlStoreBuilder::max_hold)
/// (default 30 s) or the layer's lease, whichever is shorter. Past it the
/// store stops a statement still running on it (`KILL QUERY`), rolls it
/// back, gives the key back; [`MySqlTransaction::closed`] resolves, later
/// [`MySqlTransaction::connection`] calls fail with
/// [`StoreError::Unavailable`], and the layer answers 503. As a backstop
/// (a handler keeps the connection borrowed without running anything, or
/// this app server is cut off from the database) the session's
/// `wait_timeout` is the hold time plus 1 s (whole seconds, rounded up):
/// the server closes an idle session past it, which rolls the transaction
/// back and frees its locks.
///
/// # Example
///
/// ```no_run
/// use axum::http::StatusCode;
/// use axum::response::{IntoResponse, Response};
/// use tower_idempotency::store::MySqlTransaction;
///
/// // `accounts` is the application's own table, in the store's database.
/// async fn credit(tx: MySqlTransaction) -> Result<String, Response> {
///     let mut conn = tx.connection().await.map_err(IntoResponse::into_response)?;
///     tower_idempotency::sqlx::query("UPDATE accounts SET balance = balance + 5 WHERE id = 1")
///         .execute(&mut *conn)
///         .await
///         .map_err(|e| {
///             tracing::error!(error = %e, "crediting failed");
///             StatusCode::INTERNAL_SERVER_ERROR.into_response()
///         })?;
///     Ok("credited".into())
/// }
/// ```
#[derive(Clone)]
pub struct MySqlTransaction {
    pub(super) connection: Arc<tokio::sync::Mutex<Option<TxConnection>>>,
    /// Who ends it: the layer, or the max-hold timer.
    pub(super) fate: Arc<Fate>,
    /// Its sender is dropped once the transaction has ended and its key is
    /// given back (if it is to be).
    ended: tokio::sync::watch::Receiver<()>,
}

/// The open transaction. Dropped unfinished, sqlx rolls it back before the
/// connection is used again.
pub(super) struct TxConnection {
    tx: Option<sqlx::Transaction<'static, MySql>>,
    scope: String,
    key: String,
    token: FencingToken,
    /// The max-hold timer, stopped when the transaction ends first.
    pub(super) timer: Option<tokio::task::AbortHandle>,
    /// Dropped when the transaction has ended: `closed` resolves.
    pub(super) ended: Option<tokio::sync::watch::Sender<()>>,
}

impl TxConnection {
    fn tx(&mut self) -> Result<&mut sqlx::Transaction<'static, MySql>, StoreError> {
        self.tx.as_mut().ok_or_else(transaction_over)
    }
}

impl Drop for TxConnection {
    fn drop(&mut self) {
        if let Some(timer) = self.timer.take() {
            timer.abort();
        }
    }
}

impl std::fmt::Debug for MySqlTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlTransaction").finish_non_exhaustive()
    }
}

/// The connection of an open [`MySqlTransaction`]; derefs (mutably) to
/// sqlx's [`MySqlConnection`], so `&mut *conn` is an executor. Statements
/// run inside the transaction; do not `COMMIT` or `ROLLBACK` (the layer
/// does).
pub struct MySqlTransactionConnection<'a> {
    guard: tokio::sync::MappedMutexGuard<'a, sqlx::Transaction<'static, MySql>>,
}

impl std::ops::Deref for MySqlTransactionConnection<'_> {
    type Target = MySqlConnection;

    fn deref(&self) -> &MySqlConnection {
        &self.guard
    }
}

impl std::ops::DerefMut for MySqlTransactionConnection<'_> {
    fn deref_mut(&mut self) -> &mut MySqlConnection {
        &mut self.guard
    }
}

fn transaction_over() -> StoreError {
    unavailable("the idempotency transaction has already been committed or rolled back")
}

pub(super) fn held_too_long(hold: Duration) -> StoreError {
    unavailable(format!(
        "the idempotency transaction was rolled back: it was held past its max hold time ({} ms)",
        hold.as_millis()
    ))
}

impl MySqlTransaction {
    /// The transaction's connection, for the handler's statements. Calls
    /// from clones of this handle take turns.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the transaction has already ended
    /// (committed, rolled back, or rolled back past its max hold time).
    pub async fn connection(&self) -> Result<MySqlTransactionConnection<'_>, StoreError> {
        let guard = self.connection.lock().await;
        if self.fate.expired() {
            return Err(self.over());
        }
        tokio::sync::MutexGuard::try_map(guard, |connection| {
            connection.as_mut().and_then(|c| c.tx.as_mut())
        })
        .map(|guard| MySqlTransactionConnection { guard })
        .map_err(|_| self.over())
    }

    /// Resolves once the transaction has ended: committed, rolled back, or
    /// rolled back by the store past its max hold time (then the key has
    /// been given back too).
    pub async fn closed(&self) {
        let mut ended = self.ended.clone();
        while ended.changed().await.is_ok() {}
    }

    /// The error of a call after the transaction ended.
    pub(super) fn over(&self) -> StoreError {
        if self.fate.expired() {
            held_too_long(self.fate.hold)
        } else {
            transaction_over()
        }
    }

    pub(super) async fn take(&self) -> Option<TxConnection> {
        self.connection.lock().await.take()
    }
}

/// The session's `wait_timeout` back to the server's default, before the
/// transaction ends (a `SET` is not transactional). A failure is left to
/// the statements that follow.
async fn restore_wait_timeout(tx: &mut sqlx::Transaction<'static, MySql>) {
    let _ = tx
        .execute("SET SESSION wait_timeout = @@GLOBAL.wait_timeout")
        .await;
}

impl MySqlStore {
    /// Rolls back, then gives the key back (token-checked, so a request that
    /// took it over keeps it). A failed `ROLLBACK` leaves it to sqlx, which
    /// rolls back (or closes the connection) before the connection is reused.
    pub(super) async fn roll_back_and_release(&self, mut connection: TxConnection) {
        if let Some(mut tx) = connection.tx.take() {
            restore_wait_timeout(&mut tx).await;
            let _ = tx.rollback().await;
        }
        let id = RecordId::new(
            std::mem::take(&mut connection.scope),
            std::mem::take(&mut connection.key),
        );
        if let Err(e) = self.release(id, connection.token).await {
            tracing::error!(error = %e, "releasing a rolled-back key failed; it stays in flight until its lease ends");
        }
    }

    /// Rolls the transaction back and gives the key back, in a task of its
    /// own. Without a runtime, dropping the transaction rolls it back; the
    /// claim then waits for its lease.
    fn spawn_rollback(
        &self,
        transaction: &MySqlTransaction,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let (store, transaction) = (self.clone(), transaction.clone());
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => Some(handle.spawn(async move {
                if let Some(mut connection) = transaction.take().await {
                    transaction.fate.end();
                    let ended = connection.ended.take();
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

impl TransactionalStore for MySqlStore {
    type Transaction = MySqlTransaction;

    async fn ended(&self, transaction: &MySqlTransaction) {
        transaction.closed().await;
    }

    async fn claim_in_transaction(
        &self,
        req: ClaimRequest,
    ) -> Result<TransactionClaim<MySqlTransaction>, StoreError> {
        let (scope, key, token, lease) = (req.scope.clone(), req.key.clone(), req.token, req.lease);
        // Phase one: the claim commits on its own, so every other server
        // sees the key in flight. In a task of its own: if this request is
        // cancelled meanwhile, the task gives a committed claim back.
        let (answer, claimed) = tokio::sync::oneshot::channel();
        let store = self.clone();
        tokio::spawn(async move {
            let id = req.record_id();
            let token = req.token;
            let unanswered = answer.send(store.claim(req).await);
            if let Err(Ok(Claim::Acquired { .. })) = unanswered
                && let Err(e) = store.release(id, token).await
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
        let claim = ReleaseOnDrop(Some((
            self.clone(),
            RecordId::new(scope.clone(), key.clone()),
            token,
        )));
        // Phase two: the handler's writes and the completion, in one
        // transaction that commits only if the record still carries our token.
        let hold = self.max_hold.min(lease);
        let backstop_s = hold.as_secs() + u64::from(hold.subsec_nanos() > 0) + 1;
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        tx.execute(AssertSqlSafe(format!(
            "SET SESSION wait_timeout = {backstop_s}"
        )))
        .await
        .map_err(unavailable)?;
        let connection_id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
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
        let transaction = MySqlTransaction {
            connection: Arc::new(tokio::sync::Mutex::new(Some(connection))),
            fate: Arc::new(Fate::new(hold)),
            ended: watch,
        };
        let timer = tokio::spawn(self.clone().end_past(transaction.clone(), connection_id));
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
        transaction: &MySqlTransaction,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        let mut connection = transaction.take().await.ok_or_else(|| transaction.over())?;
        let ended = connection.ended.take();
        if !transaction.fate.end() {
            // The max hold time passed first: roll back, as its timer would.
            self.roll_back_and_release(connection).await;
            drop(ended);
            return Err(transaction.over());
        }
        let blob = response.encode();
        let id = record_key(&connection.scope, &connection.key);
        let token = connection.token;
        let complete = if self.sql.in_transaction_check {
            &self.sql.complete_in_transaction
        } else {
            &self.sql.complete
        };
        let tx = connection.tx()?;
        restore_wait_timeout(tx).await;
        let completed = q(complete)
            .bind(blob)
            .bind(id)
            .bind(token.0)
            .execute(&mut **tx)
            .await;
        let failure = match completed {
            Ok(done) if done.rows_affected() == 1 => None,
            // The lease ended and another request took the key over, the
            // record expired, or (MariaDB) InnoDB already ended the
            // transaction: this request's writes must not count.
            Ok(_) => Some(unavailable(
                "the record no longer carries this request's token (its lease ended and another request took the key over), or the database already ended the transaction; this request's writes were rolled back",
            )),
            Err(e) => Some(unavailable(e)),
        };
        if let Some(e) = failure {
            self.roll_back_and_release(connection).await;
            drop(ended);
            return Err(e);
        }
        let tx = connection.tx.take().ok_or_else(transaction_over)?;
        // A failed COMMIT has an unknown outcome: the key waits for its lease.
        tx.commit().await.map_err(unavailable)?;
        drop(ended);
        Ok(Completion::Stored)
    }

    fn rollback(&self, transaction: &MySqlTransaction) {
        drop(self.spawn_rollback(transaction));
    }

    async fn roll_back_and_wait(&self, transaction: &MySqlTransaction) {
        if let Some(task) = self.spawn_rollback(transaction) {
            // The task goes on if this future is dropped.
            let _ = task.await;
        }
    }
}

/// Releases a phase-one claim when dropped armed (a cancelled or failed
/// transaction open), from a spawned task.
struct ReleaseOnDrop(Option<(MySqlStore, RecordId, FencingToken)>);

impl ReleaseOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        if let Some((store, id, token)) = self.0.take()
            && let Ok(handle) = tokio::runtime::Handle::try_current()
        {
            handle.spawn(async move {
                if let Err(e) = store.release(id, token).await {
                    tracing::error!(error = %e, "releasing an abandoned key failed; it stays in flight until its lease ends");
                }
            });
        }
    }
}

crate::store::transaction_extractor!(MySqlTransaction);
