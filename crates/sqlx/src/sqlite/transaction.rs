//! Transactional mode on the app's `SqlitePool`: [`SqlxSqliteTransaction`],
//! the handler's handle on the request's write transaction, and the
//! [`TransactionalStore`] impl that claims, commits and rolls back.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use sqlx::sqlite::SqliteQueryResult;
use sqlx::{Sqlite, SqliteConnection};
use tokio::sync::{MappedMutexGuard, MutexGuard};

use super::SqlxSqliteStore;
use super::claim::{claim_in, complete_in};
use tower_idempotency::response::StoredResponse;
use tower_idempotency::store::{
    ClaimRequest, Completion, FencingToken, StoreError, TransactionClaim, TransactionalStore,
};

mod hold;

pub use crate::error::SqlxSqliteError;
use crate::transaction::{Dialect, Sealed, SqlxTransaction};
use hold::{Fate, OpenCount};
use tower_idempotency::store::kit::held::HeldKey;

/// [`SqlxTransaction`] on SQLite: an open write transaction
/// (`BEGIN IMMEDIATE`) on one of the
/// app's pooled connections, in which the layer has claimed the request's
/// key. The handler runs its own statements in it through
/// [`SqlxTransaction::connection`] (a [`SqlxConnection`](crate::SqlxConnection)
/// that derefs to [`sqlx::SqliteConnection`]); the layer then completes the
/// record with the response in the same transaction and commits: the
/// handler's writes, the record and the stored response commit together, or
/// not at all. A response the policy does not store, an error, a panic or a
/// dropped request roll everything back, and the key is free at once (its
/// claim was in the rolled-back transaction).
///
/// The transaction began as a write transaction, so none of its statements
/// can fail with `SQLITE_BUSY` on a lock upgrade: it holds SQLite's write
/// lock from the claim to the commit.
///
/// # The one-writer rule
///
/// **Write only through this transaction.** While it is open, every other
/// connection's write waits for it: a statement the handler runs on the pool
/// (`execute(&pool)`) or in a transaction of its own waits for the lock its
/// own request holds, for the pool's `busy_timeout` (sqlx's default 5 s),
/// and then fails with `SQLITE_BUSY` ("database is locked"); the request is
/// then rolled back. [`SqlxSqliteError`] answers such an error as 503 and
/// logs this cause; [`SqlxSqliteStore::explain_busy`] names it for other
/// error types. Reads through the pool are fine in WAL mode, but do not see
/// this transaction's writes.
///
/// # Errors inside the transaction
///
/// Some SQLite errors end the whole transaction, the claim with it: a
/// constraint broken under `ON CONFLICT ROLLBACK` (`INSERT OR ROLLBACK`),
/// `SQLITE_FULL`, `SQLITE_IOERR`. Statements after such an error run
/// outside any transaction and commit on their own. So answer it with a
/// response the layer does not store (a 5xx, which `?` on [`SqlxSqliteError`]
/// gives): the layer then rolls back and frees the key, and nothing of the
/// request stays. A handler that swallows the error and writes on commits
/// those writes alone; its request gets 503 (the record is gone, so the
/// completion finds nothing to complete) and a retry runs again.
///
/// # Max hold time
///
/// Every other writer of the database waits while a handler runs, so a
/// request holds the transaction at most
/// the layer's max hold,
/// [`IdempotencyLayer::max_hold`](tower_idempotency::IdempotencyLayer::max_hold)
/// (default 60 s). Past that, the
/// store rolls it back (the handler's writes and the claim),
/// [`SqlxTransaction::closed`] resolves, later
/// [`SqlxTransaction::connection`] calls fail with
/// [`StoreError::Unavailable`], and the layer answers 503 with
/// `Retry-After`. A statement that is running is not interrupted: the
/// rollback waits until the handler lets go of the connection.
///
/// It reaches the handler as a request extension
/// (`req.extensions().get::<SqlxSqliteTransaction>()`) and, with the `axum`
/// feature, as an extractor. A route that takes it without being behind
/// `IdempotencyLayer::transactional()` with `require_key(true)` is answered
/// with a 500 problem, and the first such request is logged.
///
/// # Example
///
/// ```
/// use tower_idempotency_sqlx::{SqlxSqliteError, SqlxSqliteTransaction};
///
/// // An axum handler behind `IdempotencyLayer::new(store, scope).transactional()`.
/// // `SqlxSqliteError` answers as a problem (503 or 500), so `?` is enough.
/// async fn credit(tx: SqlxSqliteTransaction) -> Result<String, SqlxSqliteError> {
///     let mut conn = tx.connection().await?;
///     let balance: i64 = sqlx::query_scalar(
///         "UPDATE accounts SET balance = balance + 5 WHERE id = 1 RETURNING balance",
///     )
///     .fetch_one(&mut *conn)
///     .await?;
///     Ok(format!("balance {balance}"))
/// }
/// ```
pub type SqlxSqliteTransaction = SqlxTransaction<Sqlite>;

/// The inside of a [`SqlxSqliteTransaction`], shared by its clones.
#[allow(unreachable_pub)] // `Dialect::Held` of `Sqlite`, a hidden item
pub struct Shared {
    open: tokio::sync::Mutex<Option<Open>>,
    /// Who ends it: the layer, or the max-hold timer.
    fate: Fate,
    /// Its sender is dropped once the transaction has ended.
    ended: tokio::sync::watch::Receiver<()>,
    /// The max-hold timer, stopped when the layer ends the transaction.
    timer: std::sync::Mutex<Option<tokio::task::AbortHandle>>,
}

/// The open transaction and what its completion needs. Dropped, the sqlx
/// transaction rolls back (sqlx sends `ROLLBACK` to the connection at once).
struct Open {
    tx: sqlx::Transaction<'static, Sqlite>,
    scope: String,
    key: String,
    token: FencingToken,
    ended: tokio::sync::watch::Sender<()>,
    count: OpenCount,
    /// Its key, marked held in this process until the transaction ends.
    held: HeldKey,
}

impl Open {
    /// Rolls back and waits for SQLite's answer; then `closed` resolves.
    async fn roll_back(self) {
        let Open {
            mut tx,
            ended,
            count,
            held,
            ..
        } = self;
        // SQLite ends a transaction by itself on some errors (SQLITE_FULL,
        // SQLITE_IOERR, ...) while sqlx still counts it open; its ROLLBACK
        // would then fail and the connection would go back to the pool
        // counted inside a transaction, so that every later BEGIN on it fails
        // (503 for each request that gets it). A savepoint first nests in a
        // transaction still open, or opens a deferred one (no lock) where
        // SQLite ended it: the ROLLBACK below ends either.
        if let Err(e) = sqlx::raw_sql("SAVEPOINT tower_idempotency_rollback")
            .execute(&mut *tx)
            .await
        {
            tracing::debug!(error = %e, "a savepoint before the rollback failed");
        }
        if let Err(e) = tx.rollback().await {
            // The connection goes back to the pool, which rolls back what
            // is left open before handing it out again.
            tracing::warn!(error = %e, "rolling back an idempotency transaction failed");
        }
        drop(count);
        drop(held);
        drop(ended);
    }
}

impl Sealed for Sqlite {}

impl Dialect for Sqlite {
    type Held = Arc<Shared>;
    const TRANSACTION: &'static str = "SqlxSqliteTransaction";

    fn misconfiguration_logged() -> &'static std::sync::Once {
        static LOGGED: std::sync::Once = std::sync::Once::new();
        &LOGGED
    }

    async fn lock(
        held: &Arc<Shared>,
    ) -> Result<MappedMutexGuard<'_, SqliteConnection>, StoreError> {
        let guard = held.open.lock().await;
        if held.fate.expired() {
            return Err(held.over());
        }
        MutexGuard::try_map(guard, |open| open.as_mut().map(|o| &mut *o.tx))
            .map_err(|_| held.over())
    }

    async fn closed(held: &Arc<Shared>) {
        let mut ended = held.ended.clone();
        while ended.changed().await.is_ok() {}
    }

    fn rows_affected(done: &SqliteQueryResult) -> u64 {
        done.rows_affected()
    }
}

fn transaction_over() -> StoreError {
    StoreError::unavailable("the idempotency transaction has already been committed or rolled back")
}

impl Shared {
    /// The error of a call after the transaction ended.
    fn over(&self) -> StoreError {
        if self.fate.expired() {
            StoreError::held_too_long(self.fate.hold)
        } else {
            transaction_over()
        }
    }
}

impl SqlxSqliteTransaction {
    fn over(&self) -> StoreError {
        self.held.over()
    }

    async fn take(&self) -> Option<Open> {
        self.held.open.lock().await.take()
    }

    fn stop_timer(&self) {
        if let Some(timer) = self.held.timer.lock().ok().and_then(|mut t| t.take()) {
            timer.abort();
        }
    }
}

impl TransactionalStore for SqlxSqliteStore {
    type Transaction = SqlxSqliteTransaction;

    async fn claim_in_transaction(
        &self,
        req: ClaimRequest,
    ) -> Result<TransactionClaim<SqlxSqliteTransaction>, StoreError> {
        // A key an open request of this store holds: 422 at once for
        // another body; else wait for it, bounded (`store::kit::held`). The
        // claim's BEGIN IMMEDIATE would wait for its write lock instead,
        // bounded only by the busy timeout.
        if let Some(refusal) = self.held.wait_for(&req, self.busy_timeout).await {
            return Ok(TransactionClaim::Refused(refusal));
        }
        // Counted while it waits for the lock, too: a SQLITE_BUSY meanwhile
        // names the requests of this store as the likely holders.
        let count = OpenCount::new(&self.counters);
        let mut tx = self.begin_immediate().await?;
        // After the lock is held: a claim that waited must not start its
        // lease in the past.
        let now = self.clock.now_ms();
        let found = claim_in(&mut tx, &req, now)
            .await
            .map_err(|e| self.error(e))?;
        let taken_over = match found.decode()? {
            Ok(taken_over) => taken_over,
            Err(refusal) => {
                // Nothing was written; no transaction stays open.
                tx.rollback().await.map_err(|e| self.error(e))?;
                return Ok(TransactionClaim::Refused(refusal));
            }
        };
        let hold = req.hold();
        let (ended, watch) = tokio::sync::watch::channel(());
        let held = self.held.hold(&req.record_id(), req.fingerprint, hold);
        let open = Open {
            tx,
            scope: req.scope,
            key: req.key,
            token: req.token,
            ended,
            count,
            held,
        };
        let transaction = SqlxSqliteTransaction {
            held: Arc::new(Shared {
                open: tokio::sync::Mutex::new(Some(open)),
                fate: Fate::new(hold),
                ended: watch,
                timer: std::sync::Mutex::new(None),
            }),
        };
        let timer = tokio::spawn(self.clone().end_past(transaction.clone()));
        if let Ok(mut slot) = transaction.held.timer.lock() {
            *slot = Some(timer.abort_handle());
        }
        Ok(TransactionClaim::Acquired {
            transaction,
            taken_over,
        })
    }

    async fn commit(
        &self,
        transaction: &SqlxSqliteTransaction,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        let Some(open) = transaction.take().await else {
            // The max-hold timer took it: answer once its rollback is done
            // and the key is free, so that a retry sent on this answer runs.
            transaction.closed().await;
            return Err(transaction.over());
        };
        transaction.stop_timer();
        if !transaction.held.fate.end() {
            // The max hold time passed first: roll back, as its timer would.
            open.roll_back().await;
            return Err(transaction.over());
        }
        let Open {
            mut tx,
            scope,
            key,
            token,
            ended,
            count,
            held,
        } = open;
        let blob = response.encode();
        let failure = match complete_in(&mut *tx, &scope, &key, token, &blob).await {
            Ok(Completion::Stored) => None,
            // Cannot happen while the write lock is held (no one else could
            // have written the record); refused rather than committed.
            Ok(_) => Some(StoreError::unavailable(
                "the record no longer carried this request's token; its writes were rolled back",
            )),
            Err(e) => Some(self.error(e)),
        };
        if let Some(e) = failure {
            Open {
                tx,
                scope,
                key,
                token,
                ended,
                count,
                held,
            }
            .roll_back()
            .await;
            return Err(e);
        }
        // A failed COMMIT leaves the transaction open: sqlx rolls it back
        // when `tx` is dropped, before the connection is used again.
        let committed = tx.commit().await.map_err(|e| self.error(e));
        drop(count);
        drop(held);
        drop(ended);
        committed.map(|()| Completion::Stored)
    }

    fn rollback(&self, transaction: &SqlxSqliteTransaction) {
        transaction.stop_timer();
        transaction.held.fate.end();
        match transaction.held.open.try_lock() {
            // Dropping the sqlx transaction sends its ROLLBACK at once.
            Ok(mut open) => drop(open.take()),
            // The handler is using the connection: roll back once it lets go.
            Err(_) => {
                if let Ok(handle) = tokio::runtime::Handle::try_current() {
                    let transaction = transaction.clone();
                    handle.spawn(async move { drop(transaction.take().await) });
                }
            }
        }
    }

    async fn roll_back_and_wait(&self, transaction: &SqlxSqliteTransaction) {
        transaction.stop_timer();
        transaction.held.fate.end();
        if let Some(open) = transaction.take().await {
            open.roll_back().await;
        }
    }

    async fn ended(&self, transaction: &SqlxSqliteTransaction) {
        transaction.closed().await;
    }
}

impl SqlxSqliteStore {
    /// The max-hold timer: once the hold has passed (unless the layer is
    /// ending the transaction already), counts it, waits for the handler to
    /// let go of the connection, rolls the transaction back and lets
    /// `closed` resolve. Aborted when the layer ends the transaction first.
    async fn end_past(self, transaction: SqlxSqliteTransaction) {
        let hold = transaction.held.fate.hold;
        tokio::time::sleep(hold).await;
        if !transaction.held.fate.expire() {
            return;
        }
        self.counters.held_too_long.fetch_add(1, Relaxed);
        tracing::warn!(
            max_hold_ms = hold.as_millis() as u64,
            "an idempotency transaction held SQLite's write lock past its max hold time; rolling it back"
        );
        if let Some(open) = transaction.take().await {
            open.roll_back().await;
        }
    }
}
