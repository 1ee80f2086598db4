//! The ledger on PostgreSQL through sqlx (`--db postgres://... --db-driver
//! sqlx`, a build with `--features sqlx-postgres`): one `sqlx::PgPool` holds
//! the ledger's tables and, through `SqlxPostgresStore`, the idempotency
//! records. The tables are `pg.rs`'s, created under the same advisory lock,
//! so either driver can serve the same database.

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};
use tower_idempotency::SqlxPostgresStore;
use tower_idempotency::store::SqlxPostgresTransaction;

use crate::db::{Account, Credit, Json, LedgerError, Op, json};
use crate::{Args, Built, Db, Mode, admin_router, layered, redis_writes};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS accounts (
    id      BIGSERIAL PRIMARY KEY,
    name    TEXT   NOT NULL,
    balance BIGINT NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS credits (
    id         BIGSERIAL PRIMARY KEY,
    account_id BIGINT NOT NULL REFERENCES accounts (id),
    amount     BIGINT NOT NULL CHECK (amount > 0)
);
";

/// The ledger's tables, reached through the application's pool.
#[derive(Clone)]
pub struct SqlxPgDb {
    pool: PgPool,
}

impl SqlxPgDb {
    pub async fn open(pool: PgPool) -> Result<SqlxPgDb, LedgerError> {
        let mut tx = pool.begin().await?;
        // Ledgers starting together would race on CREATE TABLE (the lock
        // `pg.rs` takes too).
        sqlx::query("SELECT pg_advisory_xact_lock(7261)")
            .execute(&mut *tx)
            .await?;
        sqlx::raw_sql(SCHEMA).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(SqlxPgDb { pool })
    }

    pub async fn account(&self, id: i64) -> Result<Account, LedgerError> {
        let (id, name, balance) = sqlx::query_as::<_, (i64, String, i64)>(
            "SELECT id, name, balance FROM accounts WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await?
        .ok_or(LedgerError::NoSuchAccount)?;
        Ok(Account { id, name, balance })
    }

    /// Runs `op` in a transaction of its own (the `separate` mode's writes).
    pub async fn in_transaction(&self, op: Op) -> Result<Json, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let value = on_sqlx(op, &mut tx).await?;
        tx.commit().await?;
        Ok(value)
    }
}

/// Runs `op` inside the request's idempotency transaction (the
/// `transactional` mode's writes): the layer commits it with the record.
pub async fn in_idempotency_tx(tx: &SqlxPostgresTransaction, op: Op) -> Result<Json, LedgerError> {
    let mut conn = tx
        .connection()
        .await
        .map_err(|e| LedgerError::Database(Box::new(e)))?;
    on_sqlx(op, &mut conn).await
}

/// Runs `op` on `conn`, inside the caller's transaction.
async fn on_sqlx(op: Op, conn: &mut PgConnection) -> Result<Json, LedgerError> {
    match op {
        Op::CreateAccount { name } => {
            let id: i64 =
                sqlx::query_scalar("INSERT INTO accounts (name) VALUES ($1) RETURNING id")
                    .bind(&name)
                    .fetch_one(&mut *conn)
                    .await?;
            json(Account {
                id,
                name,
                balance: 0,
            })
        }
        Op::Credit {
            account_id,
            amount,
            fail_after_effect,
        } => {
            let balance: i64 = sqlx::query_scalar(
                "UPDATE accounts SET balance = balance + $2 WHERE id = $1 RETURNING balance",
            )
            .bind(account_id)
            .bind(amount)
            .fetch_optional(&mut *conn)
            .await?
            .ok_or(LedgerError::NoSuchAccount)?;
            let credit_id: i64 = sqlx::query_scalar(
                "INSERT INTO credits (account_id, amount) VALUES ($1, $2) RETURNING id",
            )
            .bind(account_id)
            .bind(amount)
            .fetch_one(&mut *conn)
            .await?;
            if fail_after_effect {
                return Err(LedgerError::InjectedFailure);
            }
            json(Credit {
                credit_id,
                account_id,
                amount,
                balance,
            })
        }
    }
}

/// The ledger and its idempotency records on one `PgPool` (16 connections,
/// as the tokio-postgres store's pool; a caller waits at most 5 s for one).
pub async fn app(url: &str, mode: Mode, args: &Args) -> Result<Built, Box<dyn std::error::Error>> {
    let pool = PgPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(Duration::from_secs(5))
        .connect(url)
        .await?;
    let store = SqlxPostgresStore::from_pool(pool.clone()).await?;
    let db = Db::SqlxPg(SqlxPgDb::open(pool).await?);
    let writes = match &args.key_store {
        Some(redis) => redis_writes(redis, args).await?,
        None => {
            let admin = admin_router(&store, args);
            (layered(mode, store, args.lease), admin)
        }
    };
    Ok((db, writes))
}
