//! The ledger on the app's own `sqlx::SqlitePool` (`--db-driver sqlx` with a
//! SQLite path; a build with `--features sqlx-sqlite`): its tables and the
//! idempotency records in one file, through one pool, with
//! `tower_idempotency::store::SqlxSqliteStore` in either mode.

use std::path::Path;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Row, SqliteConnection, SqlitePool};
use tower_idempotency::store::{SqlxSqliteStore, SqlxSqliteTransaction};

use crate::db::{Account, Credit, Json, LedgerError, Op, json};
use crate::{Args, Built, Db, Mode, admin_router, layered, redis_writes};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS accounts (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    name    TEXT    NOT NULL,
    balance INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS credits (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    account_id INTEGER NOT NULL REFERENCES accounts (id),
    amount     INTEGER NOT NULL CHECK (amount > 0)
);
";

/// The ledger's tables through the app's pool.
#[derive(Clone)]
pub struct SqlxDb {
    pool: SqlitePool,
}

impl SqlxDb {
    /// The pool as `SqlxSqliteStore` wants it: WAL (readers never wait for
    /// the writer), a 5 s busy timeout, `synchronous=FULL`, foreign keys on.
    pub async fn open(path: &Path) -> Result<SqlxDb, LedgerError> {
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
        let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
        sqlx::raw_sql(SCHEMA).execute(&mut *tx).await?;
        tx.commit().await?;
        Ok(SqlxDb { pool })
    }

    pub async fn account(&self, id: i64) -> Result<Account, LedgerError> {
        let row = sqlx::query("SELECT id, name, balance FROM accounts WHERE id = ?1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or(LedgerError::NoSuchAccount)?;
        Ok(Account {
            id: row.try_get(0)?,
            name: row.try_get(1)?,
            balance: row.try_get(2)?,
        })
    }

    /// Runs `op` in a write transaction of its own (separate mode); an
    /// error drops it, which rolls it back.
    pub async fn in_transaction(&self, op: Op) -> Result<Json, LedgerError> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let value = op.on_sqlx(&mut tx).await?;
        tx.commit().await?;
        Ok(value)
    }
}

/// Runs `op` through the request's idempotency transaction (transactional
/// mode): never through the pool, which would wait for this very lock.
pub async fn in_request(tx: &SqlxSqliteTransaction, op: Op) -> Result<Json, LedgerError> {
    let mut conn = tx
        .connection()
        .await
        .map_err(|e| LedgerError::Database(Box::new(e)))?;
    op.on_sqlx(&mut conn).await
}

impl Op {
    /// Runs inside the caller's transaction on `conn`.
    pub async fn on_sqlx(self, conn: &mut SqliteConnection) -> Result<Json, LedgerError> {
        match self {
            Op::CreateAccount { name } => {
                let id: i64 =
                    sqlx::query_scalar("INSERT INTO accounts (name) VALUES (?1) RETURNING id")
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
                    "UPDATE accounts SET balance = balance + ?2 WHERE id = ?1 RETURNING balance",
                )
                .bind(account_id)
                .bind(amount)
                .fetch_optional(&mut *conn)
                .await?
                .ok_or(LedgerError::NoSuchAccount)?;
                let credit_id: i64 = sqlx::query_scalar(
                    "INSERT INTO credits (account_id, amount) VALUES (?1, ?2) RETURNING id",
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
}

/// The ledger's tables and the idempotency records on one pool (or the
/// records in Redis with `--key-store`).
pub async fn app(
    path: &Path,
    mode: Mode,
    args: &Args,
) -> Result<Built, Box<dyn std::error::Error>> {
    let db = SqlxDb::open(path).await?;
    let writes = match &args.key_store {
        Some(redis) => redis_writes(redis, args).await?,
        None => {
            let store = SqlxSqliteStore::from_pool(db.pool.clone()).await?;
            let admin = admin_router(&store, args);
            (layered(mode, store, args.lease), admin)
        }
    };
    Ok((Db::SqlxSqlite(db), writes))
}
