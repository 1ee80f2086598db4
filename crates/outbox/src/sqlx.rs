//! The outbox over sqlx, on every database sqlx drives here: PostgreSQL
//! (`SqlxPostgresStore`, feature
//! `sqlx-postgres`), SQLite (`SqlxSqliteStore`,
//! `sqlx-sqlite`) and MySQL/MariaDB (`MySqlStore`,
//! `mysql`): [`enqueue`] through the request's transaction, and the relay's
//! queue over the store's pool (`Outbox::sqlx_postgres`,
//! `Outbox::sqlx_sqlite`,
//! `Outbox::mysql`).
//!
//! ```no_run
//! # #[cfg(feature = "sqlx-postgres")] mod example {
//! use tower_idempotency::key::ClaimedKey;
//! use tower_idempotency_outbox::{self as outbox, Message};
//! use tower_idempotency_sqlx::{SqlxPostgresError, SqlxPostgresTransaction};
//!
//! async fn order(tx: SqlxPostgresTransaction, claimed: ClaimedKey) -> Result<&'static str, SqlxPostgresError> {
//!     // Message 0 of this request: a retry enqueues the same key.
//!     let event = Message::new(&claimed, 0, "http://billing.internal/events",
//!         "application/json", br#"{"order":17}"#.to_vec())?;
//!     let mut conn = tx.connection().await?;
//!     sqlx::query("INSERT INTO orders (item) VALUES ('book')").execute(&mut *conn).await?;
//!     // Commits with the order and the idempotency record, or not at all.
//!     outbox::sqlx::enqueue(&mut *conn, &event).await?;
//!     Ok("ordered")
//! }
//! # }
//! ```
//!
//! The statements are the dialect's, shared with the other drivers of that
//! database (tokio-postgres, rusqlite): a table one writes, the other reads.

use sqlx::{
    ColumnIndex, Connection, Database, Decode, Encode, Executor, IntoArguments, Pool, Type,
};

use super::Message;
use super::exec::{Cell, Col, Exec, Row, Value};
use super::queue::BoxFut;
use super::sql::{ClaimSql, OutboxSql};
use tower_idempotency::StoreError;

/// A sqlx database the outbox has the SQL of.
pub(crate) trait Dialect: Database {
    fn outbox_sql() -> &'static OutboxSql;
    fn rows_affected(done: &Self::QueryResult) -> u64;
}

/// A handler on a sqlx store returns [`SqlxError`](tower_idempotency_sqlx::SqlxError):
/// `?` on [`Message::new`] gives its `Invalid` variant, a logged 500.
impl From<crate::MessageError> for tower_idempotency_sqlx::SqlxError {
    fn from(e: crate::MessageError) -> Self {
        tower_idempotency_sqlx::SqlxError::invalid(e)
    }
}

#[cfg(feature = "sqlx-postgres")]
impl Dialect for sqlx::Postgres {
    fn outbox_sql() -> &'static OutboxSql {
        OutboxSql::postgres()
    }
    fn rows_affected(done: &sqlx::postgres::PgQueryResult) -> u64 {
        done.rows_affected()
    }
}

#[cfg(feature = "sqlx-sqlite")]
impl Dialect for sqlx::Sqlite {
    fn outbox_sql() -> &'static OutboxSql {
        OutboxSql::sqlite()
    }
    fn rows_affected(done: &sqlx::sqlite::SqliteQueryResult) -> u64 {
        done.rows_affected()
    }
}

#[cfg(feature = "mysql")]
impl Dialect for sqlx::MySql {
    fn outbox_sql() -> &'static OutboxSql {
        OutboxSql::mysql()
    }
    fn rows_affected(done: &sqlx::mysql::MySqlQueryResult) -> u64 {
        done.rows_affected()
    }
}

/// The connection of a request's transaction on a database the outbox
/// knows: `sqlx::PgConnection`, `sqlx::SqliteConnection` or
/// `sqlx::MySqlConnection` (each with its feature), the stores' connection
/// guards that deref to them, and `sqlx::Transaction`s. Sealed.
pub trait OutboxConnection: sealed::Sealed + Send {}

mod sealed {
    use super::{BoxFut, Message};

    #[allow(unreachable_pub)] // sealed: nameable only inside this crate
    pub trait Sealed {
        fn enqueue<'a>(&'a mut self, message: &'a Message)
        -> BoxFut<'a, Result<bool, sqlx::Error>>;
        fn migrate(&mut self) -> BoxFut<'_, Result<(), sqlx::Error>>;
    }
}

macro_rules! outbox_connection {
    ($feature:literal, $connection:ty, $db:ty) => {
        #[cfg(feature = $feature)]
        impl OutboxConnection for $connection {}

        #[cfg(feature = $feature)]
        impl sealed::Sealed for $connection {
            fn enqueue<'a>(
                &'a mut self,
                message: &'a Message,
            ) -> BoxFut<'a, Result<bool, sqlx::Error>> {
                Box::pin(enqueue_on::<$db>(self, message))
            }

            fn migrate(&mut self) -> BoxFut<'_, Result<(), sqlx::Error>> {
                Box::pin(async move {
                    let sql = <$db as Dialect>::outbox_sql();
                    self.execute(sqlx::raw_sql(text(&sql.schema))).await?;
                    Ok(())
                })
            }
        }
    };
}

outbox_connection!("sqlx-postgres", sqlx::PgConnection, sqlx::Postgres);
outbox_connection!("sqlx-sqlite", sqlx::SqliteConnection, sqlx::Sqlite);
outbox_connection!("mysql", sqlx::MySqlConnection, sqlx::MySql);

/// The guard of a store's transaction, or a `sqlx::Transaction`, as the
/// connection it derefs to: `enqueue(&mut conn, ..)` works as
/// `enqueue(&mut *conn, ..)` does.
macro_rules! outbox_guard {
    ($feature:literal, $guard:ty) => {
        #[cfg(feature = $feature)]
        impl OutboxConnection for $guard {}

        #[cfg(feature = $feature)]
        impl sealed::Sealed for $guard {
            fn enqueue<'a>(
                &'a mut self,
                message: &'a Message,
            ) -> BoxFut<'a, Result<bool, sqlx::Error>> {
                sealed::Sealed::enqueue(&mut **self, message)
            }

            fn migrate(&mut self) -> BoxFut<'_, Result<(), sqlx::Error>> {
                sealed::Sealed::migrate(&mut **self)
            }
        }
    };
}

outbox_guard!(
    "sqlx-postgres",
    tower_idempotency_sqlx::SqlxConnection<'_, sqlx::Postgres>
);
outbox_guard!(
    "sqlx-sqlite",
    tower_idempotency_sqlx::SqlxConnection<'_, sqlx::Sqlite>
);
outbox_guard!(
    "mysql",
    tower_idempotency_sqlx::SqlxConnection<'_, sqlx::MySql>
);
outbox_guard!("sqlx-postgres", sqlx::Transaction<'_, sqlx::Postgres>);
outbox_guard!("sqlx-sqlite", sqlx::Transaction<'_, sqlx::Sqlite>);
outbox_guard!("mysql", sqlx::Transaction<'_, sqlx::MySql>);

/// Adds `message` to the outbox through `conn`, the connection of the
/// request's transaction (`&mut *tx.connection().await?` of a
/// `tower_idempotency_sqlx::SqlxTransaction` on any of its databases): it
/// commits with
/// the handler's writes and the idempotency record, or rolls back with
/// them.
///
/// Returns `false` when a message with the same key is already in the
/// outbox (it is kept; this one is not added): a key names one message.
///
/// # Errors
///
/// The database's error; a missing table if no relay's
/// [`Outbox`](crate::Outbox) (or [`migrate`]) has opened the database yet.
pub async fn enqueue<C: OutboxConnection>(
    conn: &mut C,
    message: &Message,
) -> Result<bool, sqlx::Error> {
    sealed::Sealed::enqueue(conn, message).await
}

/// Creates the outbox's table and indexes if missing, as opening the
/// relay's [`Outbox`](crate::Outbox) does: call it yourself only if handlers
/// enqueue before any relay has opened the database. Call it outside a
/// transaction: on MySQL and MariaDB `CREATE TABLE` commits the transaction
/// it runs in.
///
/// # Errors
///
/// The database's error.
pub async fn migrate<C: OutboxConnection>(conn: &mut C) -> Result<(), sqlx::Error> {
    sealed::Sealed::migrate(conn).await
}

/// `sql` as sqlx takes text it did not see at compile time. The outbox's
/// statements are fixed text: every value is a parameter.
fn text(sql: &str) -> sqlx::AssertSqlSafe<String> {
    sqlx::AssertSqlSafe(sql.to_owned())
}

fn err(e: sqlx::Error) -> StoreError {
    StoreError::unavailable(e)
}

async fn enqueue_on<DB>(conn: &mut DB::Connection, message: &Message) -> Result<bool, sqlx::Error>
where
    DB: Dialect,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    for<'q> String: Encode<'q, DB> + Type<DB>,
    for<'q> Vec<u8>: Encode<'q, DB> + Type<DB>,
{
    let sql = DB::outbox_sql();
    let done = sqlx::query::<DB>(text(&sql.enqueue))
        .bind(message.key.clone())
        .bind(message.destination.clone())
        .bind(message.content_type.clone())
        .bind(message.payload.clone())
        .execute(conn)
        .await?;
    Ok(DB::rows_affected(&done) == 1)
}

/// The relay's [`Exec`]: the store's pool.
pub(crate) struct SqlxExec<DB: Database>(pub(crate) Pool<DB>);

fn bind<'q, DB>(
    mut query: sqlx::query::Query<'q, DB, DB::Arguments>,
    params: Vec<Value>,
) -> sqlx::query::Query<'q, DB, DB::Arguments>
where
    DB: Database,
    for<'a> i64: Encode<'a, DB> + Type<DB>,
    for<'a> String: Encode<'a, DB> + Type<DB>,
    for<'a> Vec<u8>: Encode<'a, DB> + Type<DB>,
{
    for param in params {
        query = match param {
            Value::Int(v) => query.bind(v),
            Value::Text(v) => query.bind(v),
        };
    }
    query
}

fn read<DB>(row: &DB::Row, shape: &[Col]) -> Result<Row, sqlx::Error>
where
    DB: Database,
    usize: ColumnIndex<DB::Row>,
    for<'r> i64: Decode<'r, DB> + Type<DB>,
    for<'r> String: Decode<'r, DB> + Type<DB>,
    for<'r> Vec<u8>: Decode<'r, DB> + Type<DB>,
{
    use sqlx::Row as _;
    let cell = |v: Option<Cell>| v.unwrap_or(Cell::Null);
    shape
        .iter()
        .enumerate()
        .map(|(i, col)| {
            Ok(match col {
                Col::Int => Cell::Int(row.try_get(i)?),
                Col::OptInt => cell(row.try_get::<Option<i64>, _>(i)?.map(Cell::Int)),
                Col::Text => Cell::Text(row.try_get(i)?),
                Col::OptText => cell(row.try_get::<Option<String>, _>(i)?.map(Cell::Text)),
                Col::Bytes => Cell::Bytes(row.try_get(i)?),
            })
        })
        .collect()
}

impl<DB> Exec for SqlxExec<DB>
where
    DB: Dialect,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    DB::Arguments: IntoArguments<DB>,
    usize: ColumnIndex<DB::Row>,
    for<'a> i64: Encode<'a, DB> + Decode<'a, DB> + Type<DB>,
    for<'a> String: Encode<'a, DB> + Decode<'a, DB> + Type<DB>,
    for<'a> Vec<u8>: Encode<'a, DB> + Decode<'a, DB> + Type<DB>,
{
    fn batch<'a>(&'a self, sql: &'a str) -> BoxFut<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let mut conn = self.0.acquire().await.map_err(err)?;
            conn.execute(sqlx::raw_sql(text(sql))).await.map_err(err)?;
            Ok(())
        })
    }

    fn execute<'a>(
        &'a self,
        sql: &'a str,
        params: Vec<Value>,
    ) -> BoxFut<'a, Result<u64, StoreError>> {
        Box::pin(async move {
            let mut conn = self.0.acquire().await.map_err(err)?;
            let done = bind(sqlx::query::<DB>(text(sql)), params)
                .execute(&mut *conn)
                .await
                .map_err(err)?;
            Ok(DB::rows_affected(&done))
        })
    }

    fn fetch<'a>(
        &'a self,
        sql: &'a str,
        params: Vec<Value>,
        shape: &'static [Col],
    ) -> BoxFut<'a, Result<Vec<Row>, StoreError>> {
        Box::pin(async move {
            let mut conn = self.0.acquire().await.map_err(err)?;
            let rows = bind(sqlx::query::<DB>(text(sql)), params)
                .fetch_all(&mut *conn)
                .await
                .map_err(err)?;
            rows.iter()
                .map(|row| read::<DB>(row, shape))
                .collect::<Result<_, _>>()
                .map_err(err)
        })
    }

    fn claim_locked<'a>(
        &'a self,
        sql: &'a ClaimSql,
        owner: String,
        lease_ms: i64,
        limit: i64,
    ) -> BoxFut<'a, Result<Vec<Row>, StoreError>> {
        Box::pin(async move {
            let ClaimSql::LockThenUpdate {
                now,
                lock,
                update,
                select,
            } = sql
            else {
                return Err(StoreError::config(
                    "this dialect claims with UPDATE ... RETURNING",
                ));
            };
            let mut conn = self.0.acquire().await.map_err(err)?;
            let mut tx = conn.begin().await.map_err(err)?;
            let now: i64 = sqlx::query_scalar::<DB, i64>(text(now))
                .fetch_one(&mut *tx)
                .await
                .map_err(err)?;
            let ids: Vec<i64> = sqlx::query_scalar::<DB, i64>(text(lock))
                .bind(now)
                .bind(now)
                .bind(lease_ms)
                .bind(limit)
                .fetch_all(&mut *tx)
                .await
                .map_err(err)?;
            if ids.is_empty() {
                tx.commit().await.map_err(err)?;
                return Ok(Vec::new());
            }
            let list = vec!["?"; ids.len()].join(", ");
            let mut params = vec![Value::Text(owner), Value::Int(now + lease_ms)];
            params.extend(ids.iter().map(|id| Value::Int(*id)));
            bind(
                sqlx::query::<DB>(text(&update.replace("{ids}", &list))),
                params,
            )
            .execute(&mut *tx)
            .await
            .map_err(err)?;
            let params = ids.iter().map(|id| Value::Int(*id)).collect();
            let rows = bind(
                sqlx::query::<DB>(text(&select.replace("{ids}", &list))),
                params,
            )
            .fetch_all(&mut *tx)
            .await
            .map_err(err)?;
            tx.commit().await.map_err(err)?;
            rows.iter()
                .map(|row| read::<DB>(row, super::exec::CLAIMED))
                .collect::<Result<_, _>>()
                .map_err(err)
        })
    }
}
