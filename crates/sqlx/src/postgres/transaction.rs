//! Transactional mode on PostgreSQL through sqlx: [`SqlxPostgresTransaction`]
//! (the crate's [`SqlxTransaction`] on PostgreSQL) and the
//! [`TwoPhase`] steps on which the store kit runs transactional mode.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use sqlx::{Connection, PgConnection, Postgres};

use super::sql::checked;
use super::{SqlxPostgresStore, unavailable};
use tower_idempotency::response::StoredResponse;
use tower_idempotency::store::kit::two_phase::{TwoPhase, two_phase_store};
use tower_idempotency::store::{Completion, FencingToken, RecordId, StoreError};

pub use crate::error::SqlxPostgresError;
use crate::transaction::SqlxTransaction;

/// [`SqlxTransaction`] on PostgreSQL: an open `sqlx::Transaction<'static,
/// Postgres>` of the store's pool in which the layer has claimed the
/// request's key, reached through [`SqlxTransaction::connection`] (a
/// [`SqlxConnection`](crate::SqlxConnection) that derefs to [`sqlx::PgConnection`]).
///
/// # Max hold time
///
/// The transaction holds a connection of the pool, and the row locks of the
/// handler's writes, until the layer commits or rolls back. So it is held at
/// most the layer's max hold,
/// [`IdempotencyLayer::max_hold`](tower_idempotency::IdempotencyLayer::max_hold)
/// (default 60 s). Past that, the store cancels a statement still running on it
/// (`pg_cancel_backend`, from a connection of its own), rolls it back, gives
/// the key back and the connection to the pool;
/// [`SqlxTransaction::closed`] resolves, the handler's later
/// [`SqlxTransaction::connection`] calls fail with
/// [`StoreError::Unavailable`], and the layer answers the request 503 with
/// `Retry-After` (or passes on a response its policy does not store). A
/// handler that keeps a [`SqlxConnection`](crate::SqlxConnection) without running a
/// statement delays that rollback until it lets go; as a backstop the
/// transaction sets PostgreSQL's `idle_in_transaction_session_timeout` to
/// the hold time plus 1 s, after which the server ends the session.
///
/// # Example
///
/// ```no_run
/// use tower_idempotency_sqlx::{SqlxPostgresError, SqlxPostgresTransaction};
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
pub type SqlxPostgresTransaction = SqlxTransaction<Postgres>;

crate::transaction::two_phase_dialect!(Postgres, SqlxPostgresStore, "SqlxPostgresTransaction");

impl TwoPhase for SqlxPostgresStore {
    /// Dropped before it ended cleanly, a `sqlx::Transaction` queues a
    /// `ROLLBACK` on its connection, which the pool runs (and waits for)
    /// before it hands the connection out again.
    type Tx = sqlx::Transaction<'static, Postgres>;
    /// The backend's `pid`.
    type Cancel = i32;
    const DROP_WITHOUT_RUNTIME: bool = false;

    fn held_too_long(&self) -> &AtomicU64 {
        &self.limits.held_too_long
    }

    tower_idempotency::store::kit::one_phase::claims_inside!(super::inside::claim);

    async fn begin(&self, hold: Duration) -> Result<(Self::Tx, i32), StoreError> {
        let mut tx = self
            .pool
            .begin_with(checked(
                tower_idempotency::store::kit::pg_sql::begin_with_backstop(hold),
            ))
            .await
            .map_err(unavailable)?;
        // The backend, for cancelling a statement past the max hold time.
        let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *tx)
            .await
            .map_err(unavailable)?;
        Ok((tx, pid))
    }

    /// Cancels the statement running on backend `pid`, from a connection of
    /// its own made with the pool's options (the pool itself may have no
    /// connection to spare), as PostgreSQL's cancel request would.
    async fn cancel(&self, pid: &i32) -> Result<(), StoreError> {
        let options = self.pool.connect_options();
        let mut conn = PgConnection::connect_with(&options)
            .await
            .map_err(unavailable)?;
        sqlx::query("SELECT pg_cancel_backend($1)")
            .bind(pid)
            .execute(&mut conn)
            .await
            .map_err(unavailable)?;
        conn.close().await.map_err(unavailable)
    }

    async fn complete_in(
        &self,
        tx: &mut Self::Tx,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<bool, StoreError> {
        // With `notify_waiters` the announcement is delivered at the commit.
        let completed = self
            .complete_on(tx, id.scope(), id.key(), token, response)
            .await
            .map_err(unavailable)?;
        Ok(completed == Completion::Stored)
    }

    async fn commit_tx(tx: Self::Tx) -> Result<(), StoreError> {
        tx.commit().await.map_err(unavailable)
    }

    async fn roll_back_tx(tx: Self::Tx) {
        // A failure leaves sqlx to close the connection.
        if let Err(e) = tx.rollback().await {
            tracing::debug!(error = %e, "rolling back an idempotency transaction failed");
        }
    }
}

two_phase_store!(SqlxPostgresStore, SqlxPostgresTransaction);
