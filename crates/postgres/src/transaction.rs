//! Transactional mode on PostgreSQL: [`PostgresTransaction`], the handler's
//! connection inside the request's transaction, and the
//! [`TwoPhase`] steps on which the store kit runs transactional mode.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use deadpool_postgres::Object;
use tokio_postgres::{CancelToken, NoTls, Statement};

use super::tx::PgTx;
use super::{PostgresStore, cached, unavailable};
use tower_idempotency::response::StoredResponse;
use tower_idempotency::store::kit::two_phase::{Finished, Held, TwoPhase, two_phase_store};
use tower_idempotency::store::{FencingToken, RecordId, StoreError};

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
/// at most the layer's max hold,
/// [`IdempotencyLayer::max_hold`](tower_idempotency::IdempotencyLayer::max_hold)
/// (default 60 s). Past that, the store cancels a statement still running
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
/// use tower_idempotency_postgres::PostgresTransaction;
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
    held: Held<PostgresStore>,
}

/// The connection of an open [`PostgresTransaction`]; derefs to
/// [`tokio_postgres::Client`]. Statements run inside the transaction; do not
/// `COMMIT` or `ROLLBACK` (the layer does).
///
/// A statement given as text is prepared anew each time: one more round
/// trip, while the transaction holds its locks.
/// [`TransactionClient::prepare_cached`] prepares it once per pooled
/// connection:
///
/// ```no_run
/// # async fn credit(tx: tower_idempotency_postgres::PostgresTransaction) -> Result<(), Box<dyn std::error::Error>> {
/// let client = tx.client().await?;
/// let add = client
///     .prepare_cached("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
///     .await?;
/// client.execute(&add, &[&5_i64, &1_i64]).await?;
/// # Ok(())
/// # }
/// ```
pub struct TransactionClient<'a> {
    guard: tokio::sync::MappedMutexGuard<'a, Object>,
}

impl std::ops::Deref for TransactionClient<'_> {
    type Target = tokio_postgres::Client;

    fn deref(&self) -> &tokio_postgres::Client {
        &self.guard
    }
}

impl TransactionClient<'_> {
    /// `sql` prepared on this connection, from the connection's statement
    /// cache (deadpool's) if it was prepared on it before.
    ///
    /// # Errors
    ///
    /// The server's, for a statement that does not prepare.
    pub async fn prepare_cached(&self, sql: &str) -> Result<Statement, tokio_postgres::Error> {
        self.guard.prepare_cached(sql).await
    }

    /// The connection's statement cache, for code written over
    /// [`tokio_postgres::GenericClient`] that prepares through it
    /// (`cache.prepare(client.client(), sql)`).
    pub fn statement_cache(&self) -> &deadpool_postgres::StatementCache {
        &self.guard.statement_cache
    }
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
        let guard = self.held.lock(PgTx::client_mut).await?;
        Ok(TransactionClient { guard })
    }

    /// Resolves once the transaction has ended: committed, rolled back, or
    /// rolled back by the store past its max hold time (see "Max hold
    /// time"; then the key has been given back too). A handler doing long
    /// work can `select!` on it to stop early.
    pub async fn closed(&self) {
        self.held.closed().await;
    }
}

impl TwoPhase for PostgresStore {
    type Tx = PgTx;
    type Cancel = CancelToken;
    const DROP_WITHOUT_RUNTIME: bool = true;

    fn held_too_long(&self) -> &AtomicU64 {
        &self.limits.held_too_long
    }

    tower_idempotency::store::kit::one_phase::claims_inside!(super::inside::claim);

    async fn begin(&self, hold: Duration) -> Result<(PgTx, CancelToken), StoreError> {
        let tx = PgTx::new(self.client().await?);
        tx.client()
            .batch_execute(&tower_idempotency::store::kit::pg_sql::begin_with_backstop(
                hold,
            ))
            .await
            .map_err(unavailable)?;
        let cancel = tx.client().cancel_token();
        Ok((tx, cancel))
    }

    async fn cancel(&self, cancel: &CancelToken) -> Result<(), StoreError> {
        cancel.cancel_query(NoTls).await.map_err(unavailable)
    }

    async fn complete_in(
        &self,
        tx: &mut PgTx,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<bool, StoreError> {
        let client = tx.client();
        let completion = super::finish::CompletionArgs::new(self, id, token, response, false);
        let statement = cached(client, completion.statement).await?;
        let updated = client
            .execute(&statement, &completion.params())
            .await
            .map_err(unavailable)?;
        Ok(updated == 1)
    }

    /// Sent together, in one round trip (`finish.rs`).
    async fn complete_and_commit(
        &self,
        tx: PgTx,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Finished<Self> {
        super::finish::complete_and_commit(self, tx, id, token, response).await
    }

    async fn commit_tx(tx: PgTx) -> Result<(), StoreError> {
        match tx.client().batch_execute("COMMIT").await {
            Ok(()) => {
                tx.ended();
                Ok(())
            }
            // The connection is closed (dropped).
            Err(e) => Err(unavailable(e)),
        }
    }

    async fn roll_back_tx(tx: PgTx) {
        if !tx.is_open() {
            return;
        }
        // If `ROLLBACK` fails, dropping the connection closes it.
        if tx.client().batch_execute("ROLLBACK").await.is_ok() {
            tx.ended();
        }
    }

    /// Closes the connection (the server rolls back): tokio-postgres sends
    /// a cancel without waiting for the server to act on it, so one still
    /// on its way would stop the statement of the next request to use this
    /// backend. A new connection is a new backend, with a new cancel key.
    async fn discard_tx(tx: PgTx) {
        drop(tx);
    }
}

two_phase_store!(PostgresStore, PostgresTransaction);
tower_idempotency::store::kit::transaction_extractor!(PostgresTransaction);

impl std::fmt::Debug for PostgresTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresTransaction")
            .finish_non_exhaustive()
    }
}
