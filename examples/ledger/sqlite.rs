//! The default driver: rusqlite. The ledger's tables and (unless
//! `--key-store`) the idempotency records in one SQLite file, every call on
//! a blocking thread.

use std::future::{Future, ready};
use std::path::{Path, PathBuf};
use std::time::Duration;

use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::types::ToSqlOutput;
use rusqlite::{OptionalExtension, ToSql, TransactionBehavior};
use tower_idempotency::SqliteStore;
use tower_idempotency::store::SqliteTransaction;

use crate::db::{
    ACCOUNT, Account, BoxError, Conn, Json, Ledger, LedgerError, Param, REPLAY_CACHE, Write, apply,
    now, schema,
};
#[cfg(feature = "outbox")]
use crate::notify::Message;

#[derive(Clone)]
pub struct Sqlite {
    pool: r2d2::Pool<SqliteConnectionManager>,
}

/// Opens the file's tables, and its store when `records` (no `--key-store`).
pub async fn open(path: &Path, records: bool) -> Result<(Sqlite, Option<SqliteStore>), BoxError> {
    let db = Sqlite::open(path).await?;
    let store = match records {
        // Credits are short and rarely fail: let up to 32 run their SQL back
        // to back in one batch (see BENCHMARKS.md).
        true => Some(
            SqliteStore::builder(path)
                .concurrent_transactions(32)
                .replay_cache(REPLAY_CACHE)
                .open()
                .await?,
        ),
        false => None,
    };
    Ok((db, store))
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

impl Sqlite {
    async fn open(path: &Path) -> Result<Sqlite, BoxError> {
        // WAL belongs to the file: set it once, not per pooled connection.
        let file: PathBuf = path.to_owned();
        tokio::task::spawn_blocking(move || {
            let conn = rusqlite::Connection::open(file)?;
            conn.busy_timeout(Duration::from_secs(5))?;
            conn.pragma_update(None, "journal_mode", "WAL")
        })
        .await??;
        let manager = SqliteConnectionManager::file(path).with_init(|c| {
            c.busy_handler(Some(wait_for_write_lock))?;
            c.pragma_update(None, "synchronous", "FULL")?;
            c.pragma_update(None, "foreign_keys", "ON")
        });
        let db = Sqlite {
            pool: r2d2::Pool::builder().max_size(8).build_unchecked(manager),
        };
        db.run(|conn| {
            // Ledgers starting together on one file: the write lock orders them.
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            tx.execute_batch(schema::SQLITE)?;
            let has_request: i64 = tx.query_row(schema::SQLITE_HAS_REQUEST, [], |r| r.get(0))?;
            if has_request == 0 {
                tx.execute_batch(schema::SQLITE_ADD_REQUEST)?;
            }
            tx.execute_batch(schema::REQUEST_INDEX)?;
            Ok(tx.commit()?)
        })
        .await
        .map_err(LedgerError::boxed)?;
        Ok(db)
    }

    /// Runs `f` on a pooled connection, on a blocking thread.
    async fn run<T, F>(&self, f: F) -> Result<T, LedgerError>
    where
        F: FnOnce(&mut rusqlite::Connection) -> Result<T, LedgerError> + Send + 'static,
        T: Send + 'static,
    {
        let pool = self.pool.clone();
        tokio::task::spawn_blocking(move || f(&mut *pool.get()?)).await?
    }
}

impl Ledger for Sqlite {
    type Store = SqliteStore;

    #[cfg(feature = "outbox")]
    async fn outbox(store: &SqliteStore) -> Result<tower_idempotency_outbox::Outbox, BoxError> {
        Ok(tower_idempotency_outbox::Outbox::sqlite(store.path()).await?)
    }

    async fn account(&self, id: i64) -> Result<Account, LedgerError> {
        self.run(move |conn| now(Rusqlite(conn).account(id))?.ok_or(LedgerError::NoSuchAccount))
            .await
    }

    /// A local file: the commit's outcome is always known, and the write
    /// is short (SQLite's write lock, at most about 5 s), so it is not
    /// raced against the claim (`lost`).
    async fn in_transaction(
        &self,
        write: Write,
        _lost: impl Future<Output = ()> + Send,
    ) -> Result<Json, LedgerError> {
        self.run(|conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let json = now(apply(&mut Rusqlite(&tx), write))?;
            tx.commit()?;
            Ok(json)
        })
        .await
    }

    async fn in_request(tx: &SqliteTransaction, write: Write) -> Result<Json, LedgerError> {
        // The ledger's error travels inside the `Ok` (`SqliteTransaction::run`).
        tx.run(|tx| Ok(now(apply(&mut Rusqlite(tx), write))))
            .await?
    }
}

/// A rusqlite connection inside a transaction: every call is done when it
/// returns (see `db::now`).
struct Rusqlite<'a>(&'a rusqlite::Connection);

impl ToSql for Param<'_> {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        match self {
            Param::Int(i) => i.to_sql(),
            Param::Text(s) => s.to_sql(),
            Param::OptText(s) => s.to_sql(),
        }
    }
}

impl Rusqlite<'_> {
    /// The first row `sql` returns, read by `row`.
    fn row<T>(
        &self,
        sql: &str,
        params: &[Param<'_>],
        row: impl FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    ) -> Result<Option<T>, LedgerError> {
        let mut statement = self.0.prepare_cached(sql)?;
        Ok(statement
            .query_row(rusqlite::params_from_iter(params), row)
            .optional()?)
    }
}

impl Conn for Rusqlite<'_> {
    fn fetch(
        &mut self,
        sql: &'static str,
        params: &[Param<'_>],
    ) -> impl Future<Output = Result<Option<i64>, LedgerError>> + Send {
        ready(self.row(sql, params, |r| r.get(0)))
    }

    fn account(
        &mut self,
        id: i64,
    ) -> impl Future<Output = Result<Option<Account>, LedgerError>> + Send {
        ready(self.row(ACCOUNT, &[Param::Int(id)], |r| {
            Ok(Account {
                id: r.get(0)?,
                name: r.get(1)?,
                balance: r.get(2)?,
            })
        }))
    }

    #[cfg(feature = "outbox")]
    fn enqueue(
        &mut self,
        message: &Message,
    ) -> impl Future<Output = Result<(), LedgerError>> + Send {
        let done = tower_idempotency_outbox::sqlite::enqueue(self.0, message);
        ready(done.map(drop).map_err(LedgerError::from))
    }
}
