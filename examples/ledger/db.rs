//! The ledger's own tables: accounts and credits, in the same database as
//! the idempotency records. SQLite here (every call on Tokio's blocking
//! pool); PostgreSQL in `pg.rs`.

use std::path::Path;
use std::time::Duration;

use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::{OptionalExtension, TransactionBehavior, params};
use serde::Serialize;

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
pub struct SqliteDb {
    pool: r2d2::Pool<SqliteConnectionManager>,
}

/// One write of the ledger, runnable on either database.
pub enum Op {
    CreateAccount {
        name: String,
    },
    /// With `fail_after_effect`, the credit is written and then the op fails,
    /// so its transaction rolls back.
    Credit {
        account_id: i64,
        amount: i64,
        fail_after_effect: bool,
    },
}

impl Op {
    /// Runs inside the caller's SQLite transaction.
    pub fn on_sqlite(self, conn: &rusqlite::Connection) -> Result<Json, LedgerError> {
        match self {
            Op::CreateAccount { name } => json(create_account(conn, name)?),
            Op::Credit {
                account_id,
                amount,
                fail_after_effect,
            } => {
                let credit = credit(conn, account_id, amount)?;
                if fail_after_effect {
                    return Err(LedgerError::InjectedFailure);
                }
                json(credit)
            }
        }
    }
}

/// The JSON text of `value`, members in the struct's field order.
pub fn json<T: Serialize>(value: T) -> Result<Json, LedgerError> {
    serde_json::to_string(&value)
        .map(Json)
        .map_err(|e| LedgerError::Database(Box::new(e)))
}

/// A JSON document, serialized.
pub struct Json(pub String);

#[derive(Debug, Serialize)]
pub struct Account {
    pub id: i64,
    pub name: String,
    pub balance: i64,
}

#[derive(Debug, Serialize)]
pub struct Credit {
    pub credit_id: i64,
    pub account_id: i64,
    pub amount: i64,
    pub balance: i64,
}

#[derive(Debug)]
pub enum LedgerError {
    NoSuchAccount,
    /// `X-Ledger-Fail: after-effect`: the credit was written, then rolled back.
    InjectedFailure,
    Database(Box<dyn std::error::Error + Send + Sync>),
}

impl std::fmt::Display for LedgerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LedgerError::NoSuchAccount => f.write_str("no such account"),
            LedgerError::InjectedFailure => f.write_str("injected failure"),
            LedgerError::Database(e) => write!(f, "database: {e}"),
        }
    }
}

impl std::error::Error for LedgerError {}

impl From<rusqlite::Error> for LedgerError {
    fn from(e: rusqlite::Error) -> Self {
        LedgerError::Database(Box::new(e))
    }
}

impl From<r2d2::Error> for LedgerError {
    fn from(e: r2d2::Error) -> Self {
        LedgerError::Database(Box::new(e))
    }
}

/// The busy handler of the ledger's own connections: waits for SQLite's
/// write lock in steps of 100 µs, for at most about 5 s (50,000 tries).
/// In separate mode the store's writer shares the file and holds the lock
/// for one commit at a time (about one fsync); SQLite's default handler
/// (`busy_timeout`) sleeps 1, 2, 5, 10 ms and more between tries, so each
/// collision would cost a credit a millisecond or more.
fn wait_for_write_lock(tries: i32) -> bool {
    std::thread::sleep(Duration::from_micros(100));
    tries < 50_000
}

impl SqliteDb {
    pub async fn open(path: &Path) -> Result<SqliteDb, LedgerError> {
        // WAL belongs to the file: set it once, not per pooled connection.
        let path_owned = path.to_owned();
        tokio::task::spawn_blocking(move || {
            let conn = rusqlite::Connection::open(path_owned)?;
            conn.busy_timeout(Duration::from_secs(5))?;
            conn.pragma_update(None, "journal_mode", "WAL")
        })
        .await
        .map_err(|e| LedgerError::Database(Box::new(e)))??;
        let manager = SqliteConnectionManager::file(path).with_init(|c| {
            c.busy_handler(Some(wait_for_write_lock))?;
            c.pragma_update(None, "synchronous", "FULL")?;
            c.pragma_update(None, "foreign_keys", "ON")
        });
        let db = SqliteDb {
            pool: r2d2::Pool::builder().max_size(8).build_unchecked(manager),
        };
        db.run(|conn| conn.execute_batch(SCHEMA).map_err(Into::into))
            .await?;
        Ok(db)
    }

    async fn run<T, F>(&self, f: F) -> Result<T, LedgerError>
    where
        F: FnOnce(&mut rusqlite::Connection) -> Result<T, LedgerError> + Send + 'static,
        T: Send + 'static,
    {
        let pool = self.pool.clone();
        tokio::task::spawn_blocking(move || f(&mut *pool.get()?))
            .await
            .map_err(|e| LedgerError::Database(Box::new(e)))?
    }

    /// Runs `f` in a transaction of its own, committed when `f` succeeds
    /// (the `separate` mode's writes).
    pub async fn in_transaction<T, F>(&self, f: F) -> Result<T, LedgerError>
    where
        F: FnOnce(&rusqlite::Connection) -> Result<T, LedgerError> + Send + 'static,
        T: Send + 'static,
    {
        self.run(|conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let value = f(&tx)?;
            tx.commit()?;
            Ok(value)
        })
        .await
    }

    pub async fn account(&self, id: i64) -> Result<Account, LedgerError> {
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
            .optional()?
            .ok_or(LedgerError::NoSuchAccount)
        })
        .await
    }
}

pub fn create_account(conn: &rusqlite::Connection, name: String) -> Result<Account, LedgerError> {
    let id = conn.query_row(
        "INSERT INTO accounts (name) VALUES (?1) RETURNING id",
        params![name],
        |r| r.get(0),
    )?;
    Ok(Account {
        id,
        name,
        balance: 0,
    })
}

/// Writes the credit and the account's new balance (inside the caller's
/// transaction).
pub fn credit(
    conn: &rusqlite::Connection,
    account_id: i64,
    amount: i64,
) -> Result<Credit, LedgerError> {
    let balance: Option<i64> = conn
        .query_row(
            "UPDATE accounts SET balance = balance + ?2 WHERE id = ?1 RETURNING balance",
            params![account_id, amount],
            |r| r.get(0),
        )
        .optional()?;
    let balance = balance.ok_or(LedgerError::NoSuchAccount)?;
    let credit_id = conn.query_row(
        "INSERT INTO credits (account_id, amount) VALUES (?1, ?2) RETURNING id",
        params![account_id, amount],
        |r| r.get(0),
    )?;
    Ok(Credit {
        credit_id,
        account_id,
        amount,
        balance,
    })
}
