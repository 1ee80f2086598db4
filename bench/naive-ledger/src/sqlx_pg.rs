//! PostgreSQL through sqlx (a `postgres://` URL with `--db-driver sqlx`): a
//! `PgPool` of 16 (the ledger's sqlx pool), one transaction per write, with
//! the same tables and SQL as `pg.rs`.

use std::time::Duration;

use sqlx::postgres::{PgPool, PgPoolOptions};

use crate::{Account, Credit, Error};

#[derive(Clone)]
pub struct Db {
    pool: PgPool,
}

fn db_error(e: impl std::fmt::Display) -> Error {
    Error::Database(e.to_string())
}

impl Db {
    /// 16 connections and a 5 s wait for one, as the ledger's sqlx pool.
    pub async fn open(url: &str) -> Result<Db, Box<dyn std::error::Error>> {
        let pool = PgPoolOptions::new()
            .max_connections(16)
            .acquire_timeout(Duration::from_secs(5))
            .connect(url)
            .await?;
        sqlx::raw_sql(crate::pg::SCHEMA).execute(&pool).await?;
        Ok(Db { pool })
    }

    pub async fn account(&self, id: i64) -> Result<Account, Error> {
        let (id, name, balance) =
            sqlx::query_as("SELECT id, name, balance FROM accounts WHERE id = $1")
                .bind(id)
                .fetch_optional(&self.pool)
                .await
                .map_err(db_error)?
                .ok_or(Error::NoSuchAccount)?;
        Ok(Account { id, name, balance })
    }

    pub async fn create_account(&self, name: String) -> Result<Account, Error> {
        let id = sqlx::query_scalar("INSERT INTO accounts (name) VALUES ($1) RETURNING id")
            .bind(&name)
            .fetch_one(&self.pool)
            .await
            .map_err(db_error)?;
        Ok(Account {
            id,
            name,
            balance: 0,
        })
    }

    /// An error drops the transaction, which rolls it back.
    pub async fn credit(&self, account_id: i64, amount: i64) -> Result<Credit, Error> {
        let mut tx = self.pool.begin().await.map_err(db_error)?;
        let balance = sqlx::query_scalar(
            "UPDATE accounts SET balance = balance + $2 WHERE id = $1 RETURNING balance",
        )
        .bind(account_id)
        .bind(amount)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error)?
        .ok_or(Error::NoSuchAccount)?;
        let credit_id = sqlx::query_scalar(
            "INSERT INTO credits (account_id, amount) VALUES ($1, $2) RETURNING id",
        )
        .bind(account_id)
        .bind(amount)
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error)?;
        tx.commit().await.map_err(db_error)?;
        Ok(Credit {
            credit_id,
            account_id,
            amount,
            balance,
        })
    }
}
