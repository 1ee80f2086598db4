//! The outbox on PostgreSQL: [`enqueue`] through the request's
//! `PostgresTransaction`, and the
//! relay's queue over the store's pool.
//!
//! Relays in several processes claim with `FOR UPDATE SKIP LOCKED`: each
//! due row goes to one of them, and none waits for another's claim. Times are
//! the database server's clock (`clock_timestamp()`), so the app servers'
//! clocks need not agree. The statements are PostgreSQL's one set, shared
//! with the outbox over sqlx (`Outbox::sqlx_postgres`).

use deadpool_postgres::Pool;
use tokio_postgres::GenericClient;
use tokio_postgres::types::ToSql;

use super::Message;
use super::exec::{Cell, Col, Exec, Row, Value};
use super::queue::BoxFut;
use super::sql::OutboxSql;
use tower_idempotency::StoreError;

/// The outbox's table and indexes, created if missing (under an advisory
/// lock, so processes starting together do not race): run by
/// [`Outbox::postgres`](crate::Outbox::postgres).
///
/// # Errors
///
/// The database's error.
pub async fn migrate(client: &mut tokio_postgres::Client) -> Result<(), tokio_postgres::Error> {
    client.batch_execute(&OutboxSql::postgres().schema).await
}

/// Adds `message` to the outbox through `client`, the connection of the
/// request's transaction (`&*tx.client().await?` of a
/// [`PostgresTransaction`](tower_idempotency_postgres::PostgresTransaction)): it commits
/// with the handler's writes and the idempotency record, or rolls back with
/// them.
///
/// Returns `false` when a message with the same key is already in the
/// outbox (it is kept; this one is not added).
///
/// # Errors
///
/// The database's error; `relation ... does not exist` if no
/// [`Outbox::postgres`](crate::Outbox::postgres) (or [`migrate`]) has run on
/// the database.
pub async fn enqueue<C: GenericClient>(
    client: &C,
    message: &Message,
) -> Result<bool, tokio_postgres::Error> {
    let n = client
        .execute(
            &OutboxSql::postgres().enqueue,
            &[
                &message.key,
                &message.destination,
                &message.content_type,
                &message.payload,
            ],
        )
        .await?;
    Ok(n == 1)
}

/// The relay's [`Exec`]: the store's pool.
pub(super) struct PostgresExec(pub(super) Pool);

fn err(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> StoreError {
    StoreError::unavailable(e)
}

fn params(values: &[Value]) -> Vec<&(dyn ToSql + Sync)> {
    values
        .iter()
        .map(|v| -> &(dyn ToSql + Sync) {
            match v {
                Value::Int(v) => v,
                Value::Text(v) => v,
            }
        })
        .collect()
}

fn read(row: &tokio_postgres::Row, shape: &[Col]) -> Result<Row, tokio_postgres::Error> {
    let cell = |v: Option<Cell>| v.unwrap_or(Cell::Null);
    shape
        .iter()
        .enumerate()
        .map(|(i, col)| {
            Ok(match col {
                Col::Int => Cell::Int(row.try_get(i)?),
                Col::OptInt => cell(row.try_get::<_, Option<i64>>(i)?.map(Cell::Int)),
                Col::Text => Cell::Text(row.try_get(i)?),
                Col::OptText => cell(row.try_get::<_, Option<String>>(i)?.map(Cell::Text)),
                Col::Bytes => Cell::Bytes(row.try_get(i)?),
            })
        })
        .collect()
}

impl Exec for PostgresExec {
    fn batch<'a>(&'a self, sql: &'a str) -> BoxFut<'a, Result<(), StoreError>> {
        Box::pin(async move {
            let client = self.0.get().await.map_err(err)?;
            client.batch_execute(sql).await.map_err(err)
        })
    }

    fn execute<'a>(
        &'a self,
        sql: &'a str,
        values: Vec<Value>,
    ) -> BoxFut<'a, Result<u64, StoreError>> {
        Box::pin(async move {
            let client = self.0.get().await.map_err(err)?;
            let statement = client.prepare_cached(sql).await.map_err(err)?;
            client
                .execute(&statement, &params(&values))
                .await
                .map_err(err)
        })
    }

    fn fetch<'a>(
        &'a self,
        sql: &'a str,
        values: Vec<Value>,
        shape: &'static [Col],
    ) -> BoxFut<'a, Result<Vec<Row>, StoreError>> {
        Box::pin(async move {
            let client = self.0.get().await.map_err(err)?;
            let statement = client.prepare_cached(sql).await.map_err(err)?;
            let rows = client
                .query(&statement, &params(&values))
                .await
                .map_err(err)?;
            rows.iter()
                .map(|row| read(row, shape))
                .collect::<Result<_, _>>()
                .map_err(err)
        })
    }
}
