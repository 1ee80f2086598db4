//! The ledger on MySQL/MariaDB (built with `--features mysql`): its tables
//! share the idempotency store's pool, and in transactional mode a credit
//! runs on the request's `MySqlTransaction`.

use tower_idempotency::MySqlStore;
use tower_idempotency::sqlx::mysql::{MySqlConnection, MySqlPool};
use tower_idempotency::sqlx::{self, Executor, Row};

use crate::db::{Account, Credit, Json, LedgerError, Op, json};
use crate::{Built, Db, Mode, admin_router, layered, redis_writes};

/// InnoDB: transactions and row locks. Each `CREATE TABLE IF NOT EXISTS` is
/// atomic, so ledgers starting together do not race.
const SCHEMA: [&str; 2] = [
    "CREATE TABLE IF NOT EXISTS accounts (
        id      BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
        name    TEXT CHARACTER SET utf8mb4 NOT NULL,
        balance BIGINT NOT NULL DEFAULT 0
    ) ENGINE=InnoDB",
    "CREATE TABLE IF NOT EXISTS credits (
        id         BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
        account_id BIGINT NOT NULL,
        amount     BIGINT NOT NULL CHECK (amount > 0),
        FOREIGN KEY (account_id) REFERENCES accounts (id)
    ) ENGINE=InnoDB",
];

#[derive(Clone)]
pub struct MyDb {
    pool: MySqlPool,
}

impl MyDb {
    pub async fn open(pool: MySqlPool) -> Result<MyDb, LedgerError> {
        for statement in SCHEMA {
            pool.execute(statement).await?;
        }
        Ok(MyDb { pool })
    }

    pub async fn account(&self, id: i64) -> Result<Account, LedgerError> {
        let row = sqlx::query("SELECT id, name, balance FROM accounts WHERE id = ?")
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

    /// Runs `op` in a transaction of its own (the `separate` mode's writes).
    pub async fn in_transaction(&self, op: Op) -> Result<Json, LedgerError> {
        let mut tx = self.pool.begin().await?;
        let value = op.on_mysql(&mut tx).await?;
        tx.commit().await?;
        Ok(value)
    }
}

impl Op {
    /// Runs inside the caller's MySQL transaction.
    pub async fn on_mysql(self, conn: &mut MySqlConnection) -> Result<Json, LedgerError> {
        match self {
            Op::CreateAccount { name } => {
                let done = sqlx::query("INSERT INTO accounts (name) VALUES (?)")
                    .bind(&name)
                    .execute(&mut *conn)
                    .await?;
                json(Account {
                    id: i64::try_from(done.last_insert_id())
                        .map_err(|e| LedgerError::Database(Box::new(e)))?,
                    name,
                    balance: 0,
                })
            }
            Op::Credit {
                account_id,
                amount,
                fail_after_effect,
            } => {
                // The UPDATE takes the account's row lock; the SELECT then
                // reads this transaction's own balance.
                let updated = sqlx::query("UPDATE accounts SET balance = balance + ? WHERE id = ?")
                    .bind(amount)
                    .bind(account_id)
                    .execute(&mut *conn)
                    .await?;
                if updated.rows_affected() == 0 {
                    return Err(LedgerError::NoSuchAccount);
                }
                let balance: i64 = sqlx::query_scalar("SELECT balance FROM accounts WHERE id = ?")
                    .bind(account_id)
                    .fetch_one(&mut *conn)
                    .await?;
                let done = sqlx::query("INSERT INTO credits (account_id, amount) VALUES (?, ?)")
                    .bind(account_id)
                    .bind(amount)
                    .execute(&mut *conn)
                    .await?;
                if fail_after_effect {
                    return Err(LedgerError::InjectedFailure);
                }
                json(Credit {
                    credit_id: i64::try_from(done.last_insert_id())
                        .map_err(|e| LedgerError::Database(Box::new(e)))?,
                    account_id,
                    amount,
                    balance,
                })
            }
        }
    }
}

/// The ledger on `--db mysql://...`: records in a `MySqlStore`, the
/// ledger's tables in the same database (or records in Redis with
/// `--key-store`, separate mode).
pub async fn mysql_app(
    url: &str,
    mode: Mode,
    args: &crate::Args,
) -> Result<Built, Box<dyn std::error::Error>> {
    let store = MySqlStore::open(url).await?;
    let db = Db::MySql(MyDb::open(store.pool().clone()).await?);
    let writes = match &args.key_store {
        Some(redis) => redis_writes(redis, args).await?,
        None => {
            let admin = admin_router(&store, args);
            (layered(mode, store, args.lease), admin)
        }
    };
    Ok((db, writes))
}
