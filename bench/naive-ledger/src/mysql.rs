//! MySQL/MariaDB (a `mysql://` URL): sqlx over a `MySqlPool` of 16, one
//! transaction per write, with the SQL the ledger's MySQL backend runs
//! (`examples/ledger/mysql.rs`): no `RETURNING`, so a credit updates, reads
//! the balance back under the row lock and takes the credit's id from
//! `LAST_INSERT_ID()`. The server's default isolation level (the ledger's
//! store sets READ COMMITTED on its own pool; these statements lock by
//! primary key, the same rows at either level).

use std::time::Duration;

use sqlx::Executor;
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};

use crate::{Account, Credit, Error};

/// The ledger's tables in MySQL (`schema::MYSQL` there), without its
/// idempotency table.
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
pub struct Db {
    pool: MySqlPool,
}

fn db_error(e: impl std::fmt::Display) -> Error {
    Error::Database(e.to_string())
}

impl Db {
    /// 16 connections and a 5 s wait for one, as the ledger's `MySqlStore`.
    pub async fn open(url: &str) -> Result<Db, Box<dyn std::error::Error>> {
        let pool = MySqlPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(5))
            .connect(url)
            .await?;
        for statement in SCHEMA {
            pool.execute(statement).await?;
        }
        Ok(Db { pool })
    }

    pub async fn account(&self, id: i64) -> Result<Account, Error> {
        let (id, name, balance) =
            sqlx::query_as("SELECT id, name, balance FROM accounts WHERE id = ?")
                .bind(id)
                .fetch_optional(&self.pool)
                .await
                .map_err(db_error)?
                .ok_or(Error::NoSuchAccount)?;
        Ok(Account { id, name, balance })
    }

    pub async fn create_account(&self, name: String) -> Result<Account, Error> {
        let id = sqlx::query("INSERT INTO accounts (name) VALUES (?)")
            .bind(&name)
            .execute(&self.pool)
            .await
            .map_err(db_error)?
            .last_insert_id() as i64;
        Ok(Account {
            id,
            name,
            balance: 0,
        })
    }

    /// An error drops the transaction, which rolls it back.
    pub async fn credit(&self, account_id: i64, amount: i64) -> Result<Credit, Error> {
        let mut tx = self.pool.begin().await.map_err(db_error)?;
        let updated = sqlx::query("UPDATE accounts SET balance = balance + ? WHERE id = ?")
            .bind(amount)
            .bind(account_id)
            .execute(&mut *tx)
            .await
            .map_err(db_error)?
            .rows_affected();
        if updated == 0 {
            return Err(Error::NoSuchAccount);
        }
        // The UPDATE holds the row's lock: this reads this transaction's own balance.
        let balance: i64 = sqlx::query_scalar("SELECT balance FROM accounts WHERE id = ?")
            .bind(account_id)
            .fetch_one(&mut *tx)
            .await
            .map_err(db_error)?;
        let credit_id = sqlx::query("INSERT INTO credits (account_id, amount) VALUES (?, ?)")
            .bind(account_id)
            .bind(amount)
            .execute(&mut *tx)
            .await
            .map_err(db_error)?
            .last_insert_id() as i64;
        tx.commit().await.map_err(db_error)?;
        Ok(Credit {
            credit_id,
            account_id,
            amount,
            balance,
        })
    }
}
