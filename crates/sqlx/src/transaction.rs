//! [`SqlxTransaction`]: the handler's handle on the request's transaction,
//! one type for every database of this crate, as `sqlx::Transaction` is
//! one type for every sqlx driver; [`SqlxConnection`], its connection; and
//! [`Dialect`], what each database supplies to it.
//!
//! # Example
//!
//! One axum handler for every store of this crate: it writes through
//! whichever database's transaction the layer opened.
//!
//! ```
//! # #[cfg(all(feature = "axum", feature = "postgres", feature = "sqlite"))]
//! # mod example {
//! use axum::{Router, routing::post};
//! use tower_idempotency::{IdempotencyLayer, scope::GlobalScope};
//! use tower_idempotency::store::TransactionalStore;
//! use tower_idempotency_sqlx::{Dialect, SqlxError, SqlxTransaction};
//!
//! // `accounts` is the application's own table, in the store's database.
//! async fn credit<DB: Dialect>(tx: SqlxTransaction<DB>) -> Result<String, SqlxError>
//! where
//!     for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
//! {
//!     let mut conn = tx.connection().await?;
//!     let done = sqlx::raw_sql("UPDATE accounts SET balance = balance + 5 WHERE id = 1")
//!         .execute(&mut *conn)
//!         .await?;
//!     Ok(format!("{} account credited\n", DB::rows_affected(&done)))
//! }
//!
//! /// The same routes on any sqlx store: `SqlxPostgresStore`,
//! /// `SqlxSqliteStore` or `MySqlStore`.
//! pub fn app<DB, S>(store: S) -> Router
//! where
//!     DB: Dialect,
//!     for<'c> &'c mut DB::Connection: sqlx::Executor<'c, Database = DB>,
//!     S: TransactionalStore<Transaction = SqlxTransaction<DB>> + Clone,
//! {
//!     Router::new().route("/credits", post(credit::<DB>)).route_layer(
//!         IdempotencyLayer::new(store, GlobalScope).require_key(true).transactional(),
//!     )
//! }
//!
//! pub fn both(pg: tower_idempotency_sqlx::SqlxPostgresStore, lite: tower_idempotency_sqlx::SqlxSqliteStore) -> Router {
//!     Router::new().nest("/pg", app(pg)).nest("/lite", app(lite))
//! }
//! # }
//! ```

use std::future::Future;

use tokio::sync::MappedMutexGuard;
use tower_idempotency::store::StoreError;

mod sealed {
    pub trait Sealed {}
}

/// A database with a store in this crate: `sqlx::Postgres`
/// (`SqlxPostgresStore`), `sqlx::MySql` (`MySqlStore`) and
/// `sqlx::Sqlite` (`SqlxSqliteStore`), each under its feature. It names
/// the inside of [`SqlxTransaction`] for that database; the claim, the lock
/// step and the statement cancel stay with each store, where they differ.
///
/// Sealed: a store for another database implements the core's
/// `TransactionalStore` with a transaction type of its own.
pub trait Dialect: sqlx::Database + sealed::Sealed {
    /// The open transaction behind a [`SqlxTransaction`], shared by its
    /// clones.
    #[doc(hidden)]
    type Held: Clone + Send + Sync + 'static;

    /// The transaction's name for this database, as errors say it.
    #[doc(hidden)]
    const TRANSACTION: &'static str;

    /// Whether a route that takes this database's transaction without one
    /// has been logged (once per process and database).
    #[doc(hidden)]
    fn misconfiguration_logged() -> &'static std::sync::Once;

    /// The transaction's connection, while it is open.
    #[doc(hidden)]
    fn lock(
        held: &Self::Held,
    ) -> impl Future<Output = Result<MappedMutexGuard<'_, Self::Connection>, StoreError>> + Send;

    /// Resolves once the transaction has ended.
    #[doc(hidden)]
    fn closed(held: &Self::Held) -> impl Future<Output = ()> + Send;

    /// The rows a statement changed, whatever the database's result type.
    fn rows_affected(done: &Self::QueryResult) -> u64;
}

/// Implements the sealed [`Dialect`] for a database whose store runs on the
/// store kit's two phases (`Held` of the store).
#[cfg(any(feature = "postgres", feature = "mysql"))]
macro_rules! two_phase_dialect {
    ($db:ty, $store:ty, $name:literal) => {
        impl $crate::transaction::Sealed for $db {}

        impl $crate::transaction::Dialect for $db {
            type Held = tower_idempotency::store::kit::two_phase::Held<$store>;
            const TRANSACTION: &'static str = $name;

            fn misconfiguration_logged() -> &'static std::sync::Once {
                static LOGGED: std::sync::Once = std::sync::Once::new();
                &LOGGED
            }

            async fn lock(
                held: &Self::Held,
            ) -> Result<
                tokio::sync::MappedMutexGuard<'_, Self::Connection>,
                tower_idempotency::store::StoreError,
            > {
                held.lock(|tx| &mut **tx).await
            }

            async fn closed(held: &Self::Held) {
                held.closed().await
            }

            fn rows_affected(done: &Self::QueryResult) -> u64 {
                done.rows_affected()
            }
        }
    };
}
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use two_phase_dialect;

#[cfg(any(feature = "postgres", feature = "mysql", feature = "sqlite"))]
pub(crate) use sealed::Sealed;

/// An open transaction of the store's pool in which the layer has claimed
/// the request's key: `SqlxTransaction<sqlx::Postgres>`
/// (`SqlxPostgresTransaction`), `SqlxTransaction<sqlx::MySql>`
/// (`MySqlTransaction`) or `SqlxTransaction<sqlx::Sqlite>`
/// (`SqlxSqliteTransaction`). The handler runs its own statements in it
/// through [`SqlxTransaction::connection`]; the layer then completes the
/// record with the response in the same transaction and commits, only
/// while the record still carries this request's fencing token, or rolls
/// everything back (a response the policy does not store, an error, a
/// panic, a dropped request), and the key is free again.
///
/// It reaches the handler as a request extension
/// (`req.extensions().get::<SqlxPostgresTransaction>()`) and, with the
/// `axum` feature, as an extractor. A route whose layer is not
/// `.transactional()` (or lacks `require_key(true)`) answers a handler that
/// takes it with a 500 problem saying so, logged once per process;
/// `Option<SqlxTransaction<_>>` is `None` instead.
///
/// Each store's page says what differs: how long a transaction may be held
/// (the layer's `max_hold`, default 60 s)
/// and what happens past it, and the database's own rules (SQLite's one
/// writer, InnoDB's deadlocks).
///
/// The handler's error is [`SqlxError`](crate::SqlxError) on every
/// database: `?` works on [`SqlxTransaction::connection`], on sqlx's
/// statements and on the outbox's `Message::new`.
pub struct SqlxTransaction<DB: Dialect> {
    pub(crate) held: DB::Held,
}

impl<DB: Dialect> std::fmt::Debug for SqlxTransaction<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct(DB::TRANSACTION).finish_non_exhaustive()
    }
}

// With the `axum` feature, an extractor on every database, so a handler
// generic over `DB` is one too.
tower_idempotency::store::kit::transaction_extractor!(
    [DB: Dialect] SqlxTransaction<DB>,
    DB::TRANSACTION,
    DB::misconfiguration_logged()
);

impl<DB: Dialect> Clone for SqlxTransaction<DB> {
    fn clone(&self) -> Self {
        SqlxTransaction {
            held: self.held.clone(),
        }
    }
}

/// The connection of an open [`SqlxTransaction`]: derefs (mutably) to the
/// database's connection (`sqlx::PgConnection`, `sqlx::MySqlConnection`,
/// `sqlx::SqliteConnection`), so `&mut *conn` is an executor, as with a
/// `sqlx::Transaction`. Statements run inside the transaction; do not
/// `COMMIT` or `ROLLBACK` (the layer does). While it is held, the store's
/// max-hold rollback and the handle's other clones wait.
pub struct SqlxConnection<'a, DB: Dialect> {
    guard: MappedMutexGuard<'a, DB::Connection>,
}

impl<DB: Dialect> std::fmt::Debug for SqlxConnection<'_, DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlxConnection").finish_non_exhaustive()
    }
}

impl<DB: Dialect> std::ops::Deref for SqlxConnection<'_, DB> {
    type Target = DB::Connection;

    fn deref(&self) -> &DB::Connection {
        &self.guard
    }
}

impl<DB: Dialect> std::ops::DerefMut for SqlxConnection<'_, DB> {
    fn deref_mut(&mut self) -> &mut DB::Connection {
        &mut self.guard
    }
}

impl<DB: Dialect> SqlxTransaction<DB> {
    /// The transaction's connection, for the handler's statements
    /// (`.execute(&mut *conn)`). Calls from clones of this handle take
    /// turns: the next waits until the previous connection is dropped.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the transaction has already ended
    /// (committed, rolled back, or rolled back past its max hold time).
    pub async fn connection(&self) -> Result<SqlxConnection<'_, DB>, StoreError> {
        let guard = DB::lock(&self.held).await?;
        Ok(SqlxConnection { guard })
    }

    /// Resolves once the transaction has ended: committed, rolled back, or
    /// rolled back by the store past its max hold time (then the key has
    /// been given back too). A handler doing long work can `select!` on it
    /// to stop early.
    pub async fn closed(&self) {
        DB::closed(&self.held).await;
    }
}
