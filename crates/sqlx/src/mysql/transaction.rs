//! Transactional mode on MySQL/MariaDB: [`MySqlTransaction`] (the crate's
//! [`SqlxTransaction`] on MySQL) and the
//! [`TwoPhase`] steps on which the store kit runs transactional mode.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use sqlx::mysql::{MySql, MySqlConnection};
use sqlx::{AssertSqlSafe, Executor};

use super::{Backstop, MySqlStore, q, record_key, unavailable};
use tower_idempotency::response::StoredResponse;
use tower_idempotency::store::kit::two_phase::{TwoPhase, two_phase_store};

use crate::transaction::SqlxTransaction;
use tower_idempotency::store::{FencingToken, RecordId, StoreError};

/// [`SqlxTransaction`] on MySQL/MariaDB: an open transaction of the
/// store's pool in which the layer has claimed the request's key, reached
/// through [`SqlxTransaction::connection`] (a [`SqlxConnection`](crate::SqlxConnection) that derefs
/// to [`sqlx::MySqlConnection`]).
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
/// [`IdempotencyLayer::max_hold`](tower_idempotency::IdempotencyLayer::max_hold)
/// (default 60 s). Past it the
/// store stops a statement still running on it (`KILL QUERY`), rolls it
/// back, gives the key back; [`SqlxTransaction::closed`] resolves, later
/// [`SqlxTransaction::connection`] calls fail with
/// [`StoreError::Unavailable`], and the layer answers 503. As a backstop
/// (a handler keeps the connection borrowed without running anything, or
/// this app server is cut off from the database) the server ends the
/// session once it has sat idle for the hold time plus 1 s (whole seconds,
/// rounded up), which rolls the transaction back and frees its locks. On
/// MariaDB this is `idle_transaction_timeout`, which acts only inside a
/// transaction and stays set on the pooled connection (so a transaction of
/// the application's own on the store's pool that sits idle that long is
/// ended too); on MySQL it is `wait_timeout`, set back before the
/// transaction ends.
///
/// # Example
///
/// ```no_run
/// use tower_idempotency_sqlx::{MySqlTransaction, SqlxError};
///
/// // `accounts` is the application's own table, in the store's database.
/// // `SqlxError` answers as a problem (503 for the store, 500 for the SQL,
/// // which is logged and not sent), so `?` is enough.
/// async fn credit(tx: MySqlTransaction) -> Result<&'static str, SqlxError> {
///     let mut conn = tx.connection().await?;
///     sqlx::query("UPDATE accounts SET balance = balance + 5 WHERE id = 1")
///         .execute(&mut *conn)
///         .await?;
///     Ok("credited")
/// }
/// ```
pub type MySqlTransaction = SqlxTransaction<MySql>;

crate::transaction::two_phase_dialect!(MySql, MySqlStore, "MySqlTransaction");

/// The session's `wait_timeout` (and `innodb_lock_wait_timeout`, which a
/// one-phase claim bounds) back to the server's defaults, before the
/// transaction ends (a `SET` is not transactional). MariaDB's backstop
/// (`Sql::backstop`) acts only inside a transaction and stays set. A
/// failure is left to the statements that follow.
async fn restore_timeouts(tx: &mut sqlx::Transaction<'static, MySql>) {
    let _ = tx
        .execute(
            "SET SESSION wait_timeout = @@GLOBAL.wait_timeout, innodb_lock_wait_timeout = DEFAULT",
        )
        .await;
}

impl TwoPhase for MySqlStore {
    /// Dropped unfinished, sqlx rolls it back before the connection is used
    /// again.
    type Tx = sqlx::Transaction<'static, MySql>;
    /// The session's `CONNECTION_ID()`.
    type Cancel = u64;
    const DROP_WITHOUT_RUNTIME: bool = false;
    const FENCED: &'static str = "the record no longer carries this request's token (its lease ended and another request took the key over), or the database already ended the transaction; this request's writes were rolled back";

    fn held_too_long(&self) -> &AtomicU64 {
        &self.limits.held_too_long
    }

    tower_idempotency::store::kit::one_phase::claims_inside!(super::inside::claim);

    /// `BEGIN`, with the session's backstop (`Sql::backstop`) at the hold
    /// time plus 1 s (whole seconds, rounded up).
    async fn begin(&self, hold: Duration) -> Result<(Self::Tx, u64), StoreError> {
        let backstop_s = hold.as_secs() + u64::from(hold.subsec_nanos() > 0) + 1;
        let mut tx = self.pool.begin().await.map_err(unavailable)?;
        tx.execute(AssertSqlSafe(format!(
            "SET SESSION {} = {backstop_s}",
            self.sql.backstop.variable()
        )))
        .await
        .map_err(unavailable)?;
        let connection_id: u64 = sqlx::query_scalar("SELECT CONNECTION_ID()")
            .fetch_one(&mut *tx)
            .await
            .map_err(unavailable)?;
        Ok((tx, connection_id))
    }

    /// `KILL QUERY` from a connection of its own, made with the pool's
    /// options: the pool may have no connection to spare (the transaction
    /// to stop may hold the last one), and a statement must be stopped at
    /// its max hold time, not once a pooled connection is free.
    async fn cancel(&self, connection_id: &u64) -> Result<(), StoreError> {
        use sqlx::Connection;
        let options = self.pool.connect_options();
        let mut conn = MySqlConnection::connect_with(&options)
            .await
            .map_err(unavailable)?;
        let kill = format!("KILL QUERY {connection_id}");
        let killed = conn.execute(AssertSqlSafe(kill)).await.map(drop);
        let _ = conn.close().await;
        killed.map_err(unavailable)
    }

    /// On MariaDB the completion also checks `@@in_transaction`: InnoDB may
    /// have ended the transaction already (a deadlock the handler swallowed).
    async fn complete_in(
        &self,
        tx: &mut Self::Tx,
        id: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<bool, StoreError> {
        let complete = if self.sql.in_transaction_check {
            &self.sql.complete_in_transaction
        } else {
            &self.sql.complete
        };
        // MariaDB's backstop acts only inside a transaction and may stay
        // set; `innodb_lock_wait_timeout` was lifted before the handler.
        if self.sql.backstop == Backstop::WaitTimeout {
            restore_timeouts(tx).await;
        }
        let done = q(complete)
            .bind(response.encode())
            .bind(record_key(id.scope(), id.key()))
            .bind(token.0)
            .execute(&mut **tx)
            .await
            .map_err(unavailable)?;
        Ok(done.rows_affected() == 1)
    }

    async fn commit_tx(tx: Self::Tx) -> Result<(), StoreError> {
        tx.commit().await.map_err(unavailable)
    }

    /// A failed `ROLLBACK` leaves it to sqlx, which rolls back (or closes
    /// the connection) before the connection is reused.
    async fn roll_back_tx(mut tx: Self::Tx) {
        // The rollback of a claim that failed before its lock-wait bound
        // was lifted, too.
        restore_timeouts(&mut tx).await;
        let _ = tx.rollback().await;
    }
}

two_phase_store!(MySqlStore, MySqlTransaction);
