//! PostgreSQL through sqlx (`--db postgres://... --db-driver sqlx`, a build
//! with `--features sqlx-postgres`): one `sqlx::PgPool` holds the ledger's
//! tables and, through `SqlxPostgresStore`, the idempotency records. The
//! tables are `pg.rs`'s, created under the same advisory lock, so either
//! driver can serve the same database.

use std::time::Duration;

use sqlx::Postgres;
use sqlx::postgres::PgPoolOptions;
use tower_idempotency_sqlx::SqlxPostgresStore;

use crate::db::{BoxError, REPLAY_CACHE, schema};
use crate::sqlx::{Dialect, SqlxDb};

/// One `PgPool` (16 connections, as the tokio-postgres store's pool; a
/// caller waits at most 5 s for one); the store serves the records when
/// `records` (no `--key-store`).
pub async fn open(
    url: &str,
    records: bool,
) -> Result<(SqlxDb<Postgres>, Option<SqlxPostgresStore>), BoxError> {
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(Duration::from_secs(5))
        .connect(url)
        .await?;
    let store = SqlxPostgresStore::builder(pool.clone())
        .replay_cache(REPLAY_CACHE)
        .open()
        .await?;
    let current: bool = sqlx::query_scalar(schema::POSTGRES_CURRENT)
        .fetch_one(&pool)
        .await?;
    if !current {
        let mut tx = pool.begin().await?;
        sqlx::query(schema::POSTGRES_LOCK).execute(&mut *tx).await?;
        sqlx::raw_sql(schema::POSTGRES).execute(&mut *tx).await?;
        tx.commit().await?;
    }
    Ok((SqlxDb { pool }, records.then_some(store)))
}

impl Dialect for Postgres {
    type Store = SqlxPostgresStore;

    #[cfg(feature = "outbox")]
    async fn outbox(
        store: &SqlxPostgresStore,
    ) -> Result<tower_idempotency_outbox::Outbox, tower_idempotency::StoreError> {
        tower_idempotency_outbox::Outbox::sqlx_postgres(store).await
    }

    #[cfg(feature = "outbox")]
    fn enqueue<'a>(
        conn: &'a mut Self::Connection,
        message: &'a crate::notify::Message,
    ) -> impl std::future::Future<Output = Result<bool, sqlx::Error>> + Send + 'a {
        tower_idempotency_outbox::sqlx::enqueue(conn, message)
    }
}
