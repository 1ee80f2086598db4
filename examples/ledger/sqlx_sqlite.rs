//! SQLite through the app's own `sqlx::SqlitePool` (`--db-driver sqlx` with
//! a SQLite path; a build with `--features sqlx-sqlite`): its tables and the
//! idempotency records in one file, through one pool, with
//! `SqlxSqliteStore` in either mode.

use std::future::Future;
use std::path::Path;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Pool, Sqlite};
use tower_idempotency_sqlx::SqlxSqliteStore;

use crate::db::{BoxError, schema};
use crate::sqlx::{Dialect, SqlxDb};

/// The pool as `SqlxSqliteStore` wants it: WAL (readers never wait for the
/// writer), a 5 s busy timeout, `synchronous=FULL`, foreign keys on. The
/// store serves the records when `records` (no `--key-store`).
pub async fn open(
    path: &Path,
    records: bool,
) -> Result<(SqlxDb<Sqlite>, Option<SqlxSqliteStore>), BoxError> {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(5))
        .synchronous(SqliteSynchronous::Full)
        .foreign_keys(true);
    let pool = SqlitePoolOptions::new()
        .max_connections(16)
        .connect_with(options)
        .await?;
    // Ledgers starting together on one file: the write lock orders them.
    let mut tx = Sqlite::begin(&pool).await?;
    sqlx::raw_sql(schema::SQLITE).execute(&mut *tx).await?;
    let has_request: i64 = sqlx::query_scalar(schema::SQLITE_HAS_REQUEST)
        .fetch_one(&mut *tx)
        .await?;
    if has_request == 0 {
        sqlx::raw_sql(schema::SQLITE_ADD_REQUEST)
            .execute(&mut *tx)
            .await?;
    }
    sqlx::raw_sql(schema::REQUEST_INDEX)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    let store = match records {
        true => Some(SqlxSqliteStore::from_pool(pool.clone()).await?),
        false => None,
    };
    Ok((SqlxDb { pool }, store))
}

impl Dialect for Sqlite {
    type Store = SqlxSqliteStore;

    const COMMIT_MAY_BE_LOST: bool = false;

    #[cfg(feature = "outbox")]
    async fn outbox(
        store: &SqlxSqliteStore,
    ) -> Result<tower_idempotency_outbox::Outbox, tower_idempotency::StoreError> {
        tower_idempotency_outbox::Outbox::sqlx_sqlite(store).await
    }

    #[cfg(feature = "outbox")]
    fn enqueue<'a>(
        conn: &'a mut Self::Connection,
        message: &'a crate::notify::Message,
    ) -> impl std::future::Future<Output = Result<bool, sqlx::Error>> + Send + 'a {
        tower_idempotency_outbox::sqlx::enqueue(conn, message)
    }

    /// Takes the write lock at once.
    fn begin(
        pool: &Pool<Sqlite>,
    ) -> impl Future<Output = Result<sqlx::Transaction<'static, Sqlite>, sqlx::Error>> + Send {
        pool.begin_with("BEGIN IMMEDIATE")
    }
}
