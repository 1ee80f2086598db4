//! PostgreSQL: tokio-postgres over a deadpool pool of 16, one transaction per
//! write, each statement prepared once per connection (deadpool's
//! `prepare_cached`), as the ledger example prepares its own.

use deadpool_postgres::{Manager, Pool};

use crate::{Account, Credit, Error};

pub const SCHEMA: &str = "
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

#[derive(Clone)]
pub struct Db {
    pool: Pool,
}

fn db_error(e: impl std::fmt::Display) -> Error {
    Error::Database(e.to_string())
}

impl Db {
    pub async fn open(url: &str) -> Result<Db, Box<dyn std::error::Error>> {
        let config: tokio_postgres::Config = url.parse()?;
        let manager = Manager::new(config, tokio_postgres::NoTls);
        let pool = Pool::builder(manager).max_size(16).build()?;
        pool.get().await?.batch_execute(SCHEMA).await?;
        Ok(Db { pool })
    }

    pub async fn account(&self, id: i64) -> Result<Account, Error> {
        let client = self.pool.get().await.map_err(db_error)?;
        let select = client
            .prepare_cached("SELECT id, name, balance FROM accounts WHERE id = $1")
            .await
            .map_err(db_error)?;
        let row = client
            .query_opt(&select, &[&id])
            .await
            .map_err(db_error)?
            .ok_or(Error::NoSuchAccount)?;
        Ok(Account {
            id: row.get(0),
            name: row.get(1),
            balance: row.get(2),
        })
    }

    pub async fn create_account(&self, name: String) -> Result<Account, Error> {
        let client = self.pool.get().await.map_err(db_error)?;
        let insert = client
            .prepare_cached("INSERT INTO accounts (name) VALUES ($1) RETURNING id")
            .await
            .map_err(db_error)?;
        let row = client
            .query_one(&insert, &[&name])
            .await
            .map_err(db_error)?;
        Ok(Account {
            id: row.get(0),
            name,
            balance: 0,
        })
    }

    pub async fn credit(&self, account_id: i64, amount: i64) -> Result<Credit, Error> {
        let mut client = self.pool.get().await.map_err(db_error)?;
        let tx = client.transaction().await.map_err(db_error)?;
        let add = tx
            .prepare_cached(
                "UPDATE accounts SET balance = balance + $2 WHERE id = $1 RETURNING balance",
            )
            .await
            .map_err(db_error)?;
        let insert = tx
            .prepare_cached("INSERT INTO credits (account_id, amount) VALUES ($1, $2) RETURNING id")
            .await
            .map_err(db_error)?;
        let balance: i64 = tx
            .query_opt(&add, &[&account_id, &amount])
            .await
            .map_err(db_error)?
            .ok_or(Error::NoSuchAccount)?
            .get(0);
        let credit_id: i64 = tx
            .query_one(&insert, &[&account_id, &amount])
            .await
            .map_err(db_error)?
            .get(0);
        tx.commit().await.map_err(db_error)?;
        Ok(Credit {
            credit_id,
            account_id,
            amount,
            balance,
        })
    }
}
