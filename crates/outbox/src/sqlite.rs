//! The outbox on SQLite: [`enqueue`] inside the handler's transaction
//! ([`SqliteTransaction::run`](tower_idempotency::store::SqliteTransaction::run)), and the
//! relay's queue over a connection of its own to the same file.
//!
//! Several processes may share the file, each with a relay: a claim is one
//! `UPDATE ... RETURNING` statement, which SQLite runs under its write lock,
//! so two relays never claim one message at once.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rusqlite::types::{ToSqlOutput, ValueRef};

use super::Message;
use super::exec::{Cell, Col, Exec, Row, Value};
use super::queue::BoxFut;
use super::sql::OutboxSql;
use tower_idempotency::StoreError;

/// The outbox's table and index, created if missing: run by
/// [`Outbox::sqlite`](crate::Outbox::sqlite); call it yourself only if
/// handlers enqueue before any relay of the database has started.
///
/// # Errors
///
/// SQLite's error, e.g. the database is locked past its busy timeout.
pub fn migrate(conn: &rusqlite::Connection) -> rusqlite::Result<()> {
    conn.execute_batch(&OutboxSql::sqlite().schema)
}

/// Adds `message` to the outbox in the transaction of `conn` (pass the
/// `&rusqlite::Transaction` that [`SqliteTransaction::run`] hands its
/// closure): it commits with the handler's writes and the idempotency
/// record, or rolls back with them.
///
/// Returns `false` when a message with the same key is already in the
/// outbox (it is kept, this one is not added): a key names one message.
///
/// [`SqliteTransaction::run`]: tower_idempotency::store::SqliteTransaction::run
///
/// # Errors
///
/// SQLite's error; `no such table` if no [`Outbox::sqlite`](crate::Outbox::sqlite)
/// (or [`migrate`]) has run on the database.
pub fn enqueue(conn: &rusqlite::Connection, message: &Message) -> rusqlite::Result<bool> {
    let n = conn
        .prepare_cached(&OutboxSql::sqlite().enqueue)?
        .execute((
            &message.key,
            &message.destination,
            &message.content_type,
            &message.payload,
        ))?;
    Ok(n == 1)
}

/// The relay's [`Exec`]: one connection of its own, used on Tokio's
/// blocking pool.
pub(super) struct SqliteExec(Arc<Mutex<rusqlite::Connection>>);

impl SqliteExec {
    /// A connection to the file at `path` (WAL, 5 s busy timeout).
    pub(super) async fn open(path: &Path) -> Result<SqliteExec, StoreError> {
        let path = path.to_owned();
        let conn = tokio::task::spawn_blocking(move || -> rusqlite::Result<_> {
            let conn = rusqlite::Connection::open(path)?;
            conn.busy_timeout(Duration::from_secs(5))?;
            conn.pragma_update(None, "journal_mode", "WAL")?;
            Ok(conn)
        })
        .await
        .map_err(StoreError::unavailable)?
        .map_err(StoreError::unavailable)?;
        Ok(SqliteExec(Arc::new(Mutex::new(conn))))
    }

    fn with<T, F>(&self, f: F) -> BoxFut<'_, Result<T, StoreError>>
    where
        F: FnOnce(&mut rusqlite::Connection) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let conn = self.0.clone();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || {
                let mut conn = conn.lock().unwrap_or_else(|p| p.into_inner());
                f(&mut conn)
            })
            .await
            .map_err(StoreError::unavailable)?
            .map_err(StoreError::unavailable)
        })
    }
}

impl rusqlite::ToSql for Value {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::Borrowed(match self {
            Value::Int(v) => ValueRef::Integer(*v),
            Value::Text(v) => ValueRef::Text(v.as_bytes()),
        }))
    }
}

fn read(row: &rusqlite::Row<'_>, shape: &[Col]) -> rusqlite::Result<Row> {
    shape
        .iter()
        .enumerate()
        .map(|(i, col)| {
            Ok(match col {
                Col::Int => Cell::Int(row.get(i)?),
                Col::OptInt => row.get::<_, Option<i64>>(i)?.map_or(Cell::Null, Cell::Int),
                Col::Text => Cell::Text(row.get(i)?),
                Col::OptText => row
                    .get::<_, Option<String>>(i)?
                    .map_or(Cell::Null, Cell::Text),
                Col::Bytes => Cell::Bytes(row.get(i)?),
            })
        })
        .collect()
}

impl Exec for SqliteExec {
    fn batch<'a>(&'a self, sql: &'a str) -> BoxFut<'a, Result<(), StoreError>> {
        let sql = sql.to_owned();
        self.with(move |conn| conn.execute_batch(&sql))
    }

    fn execute<'a>(
        &'a self,
        sql: &'a str,
        params: Vec<Value>,
    ) -> BoxFut<'a, Result<u64, StoreError>> {
        let sql = sql.to_owned();
        self.with(move |conn| {
            let n = conn
                .prepare_cached(&sql)?
                .execute(rusqlite::params_from_iter(params))?;
            Ok(n as u64)
        })
    }

    fn fetch<'a>(
        &'a self,
        sql: &'a str,
        params: Vec<Value>,
        shape: &'static [Col],
    ) -> BoxFut<'a, Result<Vec<Row>, StoreError>> {
        let sql = sql.to_owned();
        self.with(move |conn| {
            let mut statement = conn.prepare_cached(&sql)?;
            let rows =
                statement.query_map(rusqlite::params_from_iter(params), |row| read(row, shape))?;
            rows.collect()
        })
    }
}
