//! The ledger on any sqlx database: one pool holds the ledger's tables and
//! the idempotency records. What differs between PostgreSQL
//! (`sqlx_pg.rs`), SQLite (`sqlx_sqlite.rs`) and MySQL (`mysql.rs`) is a
//! `Dialect`.

use std::future::Future;

use sqlx::{Database, Encode, Executor, FromRow, IntoArguments, Pool, SqlSafeStr, Type};
#[cfg(feature = "outbox")]
use tower_idempotency::store::StoreError;
use tower_idempotency::store::{Inspect, TransactionalStore};
use tower_idempotency_sqlx::SqlxTransaction;

#[cfg(feature = "outbox")]
use crate::db::BoxError;
use crate::db::{ACCOUNT, Account, Conn, Done, Json, Ledger, LedgerError, Param, Write, apply};
#[cfg(feature = "outbox")]
use crate::notify::Message;

/// What the ledger needs to know of one sqlx database, beyond what the
/// store crate's own `Dialect` says (its transaction type).
pub trait Dialect: tower_idempotency_sqlx::Dialect {
    type Store: TransactionalStore<Transaction = SqlxTransaction<Self>> + Inspect;

    /// Whether `INSERT` and `UPDATE` take `RETURNING`.
    const RETURNING: bool = true;

    /// Whether a failed `COMMIT` may have committed (its answer lost with a
    /// network connection); not for a local file.
    const COMMIT_MAY_BE_LOST: bool = true;

    /// The ledger's SQL (`$1` placeholders) in this database's spelling.
    fn sql(sql: &'static str) -> impl SqlSafeStr {
        sql
    }

    /// The rows a statement changed and the id it inserted (asked only
    /// where `!RETURNING`).
    fn done(_: &Self::QueryResult) -> Done {
        unreachable!("only asked without RETURNING")
    }

    /// Begins a write transaction of its own (`--mode separate`).
    fn begin(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<sqlx::Transaction<'static, Self>, sqlx::Error>> + Send {
        pool.begin()
    }

    /// `--notify-url`: the outbox in this database, over the store's pool.
    #[cfg(feature = "outbox")]
    fn outbox(
        store: &Self::Store,
    ) -> impl Future<Output = Result<tower_idempotency_outbox::Outbox, StoreError>> + Send;

    /// `outbox::sqlx::enqueue` on a connection of this database.
    #[cfg(feature = "outbox")]
    fn enqueue<'a>(
        conn: &'a mut Self::Connection,
        message: &'a Message,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a;
}

/// The ledger's tables on a sqlx pool.
pub struct SqlxDb<DB: Database> {
    pub pool: Pool<DB>,
}

impl<DB: Database> Clone for SqlxDb<DB> {
    fn clone(&self) -> Self {
        SqlxDb {
            pool: self.pool.clone(),
        }
    }
}

impl<DB: Dialect> Ledger for SqlxDb<DB>
where
    for<'c> Sqlx<'c, DB>: Conn,
{
    type Store = DB::Store;

    async fn account(&self, id: i64) -> Result<Account, LedgerError> {
        let mut conn = self.pool.acquire().await?;
        Sqlx::<DB>(&mut conn)
            .account(id)
            .await?
            .ok_or(LedgerError::NoSuchAccount)
    }

    /// An error drops the transaction, which rolls it back. Once the claim
    /// is lost the write is abandoned (dropped, so no `COMMIT` follows); a
    /// `COMMIT` sent and unanswered over a network has an unknown outcome.
    async fn in_transaction(
        &self,
        write: Write,
        lost: impl Future<Output = ()> + Send,
    ) -> Result<Json, LedgerError> {
        let work = async {
            let mut tx = DB::begin(&self.pool).await?;
            let json = apply(&mut Sqlx::<DB>(&mut tx), write).await?;
            match tx.commit().await {
                Ok(()) => Ok(json),
                Err(e) if DB::COMMIT_MAY_BE_LOST => Err(LedgerError::OutcomeUnknown(e.into())),
                Err(e) => Err(e.into()),
            }
        };
        tokio::select! {
            written = work => written,
            () = lost => Err(LedgerError::OutcomeUnknown(
                "the request's claim was lost while its credit was written; abandoned".into(),
            )),
        }
    }

    /// Never through the pool: on SQLite it would wait for the very write
    /// lock this request's transaction holds.
    async fn in_request(tx: &SqlxTransaction<DB>, write: Write) -> Result<Json, LedgerError> {
        let mut conn = tx.connection().await?;
        apply(&mut Sqlx::<DB>(&mut conn), write).await
    }

    #[cfg(feature = "outbox")]
    async fn outbox(store: &DB::Store) -> Result<tower_idempotency_outbox::Outbox, BoxError> {
        Ok(DB::outbox(store).await?)
    }
}

/// `$query` with `$params` bound in order.
macro_rules! bind {
    ($query:expr, $params:expr) => {
        $params.iter().fold($query, |query, param| match *param {
            Param::Int(i) => query.bind(i),
            Param::Text(s) => query.bind(s.to_owned()),
            Param::OptText(s) => query.bind(s.map(str::to_owned)),
        })
    };
}

/// A sqlx connection inside a transaction.
pub struct Sqlx<'c, DB: Database>(pub &'c mut DB::Connection);

impl<DB: Dialect> Conn for Sqlx<'_, DB>
where
    for<'e> &'e mut DB::Connection: Executor<'e, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> i64: Encode<'q, DB> + Type<DB>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    for<'q> Option<String>: Encode<'q, DB> + Type<DB>,
    (i64,): for<'r> FromRow<'r, DB::Row>,
    (i64, String, i64): for<'r> FromRow<'r, DB::Row>,
{
    const RETURNING: bool = DB::RETURNING;

    async fn fetch(
        &mut self,
        sql: &'static str,
        params: &[Param<'_>],
    ) -> Result<Option<i64>, LedgerError> {
        let query = bind!(sqlx::query_scalar(DB::sql(sql)), params);
        Ok(query.fetch_optional(&mut *self.0).await?)
    }

    async fn execute(
        &mut self,
        sql: &'static str,
        params: &[Param<'_>],
    ) -> Result<Done, LedgerError> {
        let query = bind!(sqlx::query(DB::sql(sql)), params);
        Ok(DB::done(&query.execute(&mut *self.0).await?))
    }

    async fn account(&mut self, id: i64) -> Result<Option<Account>, LedgerError> {
        let row: Option<(i64, String, i64)> = sqlx::query_as(DB::sql(ACCOUNT))
            .bind(id)
            .fetch_optional(&mut *self.0)
            .await?;
        Ok(row.map(|(id, name, balance)| Account { id, name, balance }))
    }

    #[cfg(feature = "outbox")]
    async fn enqueue(&mut self, message: &Message) -> Result<(), LedgerError> {
        DB::enqueue(self.0, message).await?;
        Ok(())
    }
}
