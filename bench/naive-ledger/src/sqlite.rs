//! SQLite: WAL, `synchronous = FULL`, an r2d2 pool of 8, every call on
//! Tokio's blocking pool, one `BEGIN IMMEDIATE` transaction per write.

use std::time::Duration;

use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::{OptionalExtension, TransactionBehavior, params};

use crate::{Account, Credit, Error};

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

#[derive(Clone)]
pub struct Db {
    pool: r2d2::Pool<SqliteConnectionManager>,
}

fn db_error(e: impl std::fmt::Display) -> Error {
    Error::Database(e.to_string())
}

impl Db {
    pub fn open(path: &str) -> Result<Db, Box<dyn std::error::Error>> {
        let conn = rusqlite::Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.execute_batch(SCHEMA)?;
        let manager = SqliteConnectionManager::file(path).with_init(|c| {
            c.busy_timeout(Duration::from_secs(5))?;
            c.pragma_update(None, "synchronous", "FULL")?;
            c.pragma_update(None, "foreign_keys", "ON")
        });
        let pool = r2d2::Pool::builder().max_size(8).build(manager)?;
        Ok(Db { pool })
    }

    async fn run<T, F>(&self, f: F) -> Result<T, Error>
    where
        F: FnOnce(&mut rusqlite::Connection) -> Result<T, Error> + Send + 'static,
        T: Send + 'static,
    {
        let pool = self.pool.clone();
        tokio::task::spawn_blocking(move || f(&mut *pool.get().map_err(db_error)?))
            .await
            .map_err(db_error)?
    }

    pub async fn account(&self, id: i64) -> Result<Account, Error> {
        self.run(move |conn| {
            conn.query_row(
                "SELECT id, name, balance FROM accounts WHERE id = ?1",
                params![id],
                |r| {
                    Ok(Account {
                        id: r.get(0)?,
                        name: r.get(1)?,
                        balance: r.get(2)?,
                    })
                },
            )
            .optional()
            .map_err(db_error)?
            .ok_or(Error::NoSuchAccount)
        })
        .await
    }

    pub async fn create_account(&self, name: String) -> Result<Account, Error> {
        self.run(move |conn| {
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(db_error)?;
            let id = tx
                .query_row(
                    "INSERT INTO accounts (name) VALUES (?1) RETURNING id",
                    params![name],
                    |r| r.get(0),
                )
                .map_err(db_error)?;
            tx.commit().map_err(db_error)?;
            Ok(Account {
                id,
                name,
                balance: 0,
            })
        })
        .await
    }

    pub async fn credit(&self, account_id: i64, amount: i64) -> Result<Credit, Error> {
        self.run(move |conn| {
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(db_error)?;
            let balance: i64 = tx
                .query_row(
                    "UPDATE accounts SET balance = balance + ?2 WHERE id = ?1 RETURNING balance",
                    params![account_id, amount],
                    |r| r.get(0),
                )
                .optional()
                .map_err(db_error)?
                .ok_or(Error::NoSuchAccount)?;
            let credit_id = tx
                .query_row(
                    "INSERT INTO credits (account_id, amount) VALUES (?1, ?2) RETURNING id",
                    params![account_id, amount],
                    |r| r.get(0),
                )
                .map_err(db_error)?;
            tx.commit().map_err(db_error)?;
            Ok(Credit {
                credit_id,
                account_id,
                amount,
                balance,
            })
        })
        .await
    }
}
