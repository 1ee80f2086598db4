//! What every driver shares: the ledger's writes and their SQL (written
//! once, with `$1`, `$2`, ... placeholders in order), the `Ledger` trait a
//! driver implements, and the few primitives (`Conn`) the SQL needs from a
//! connection.
//!
//! Drivers: `sqlite.rs` (rusqlite, the default), `pg.rs` (tokio-postgres),
//! and `sqlx.rs` (one implementation for sqlx) with its dialects
//! `sqlx_pg.rs`, `sqlx_sqlite.rs` and `mysql.rs`.

use std::future::Future;

use serde::Serialize;
use tower_idempotency::store::{Inspect, TransactionalStore};

#[cfg(feature = "outbox")]
use crate::notify::Message;
use crate::notify::Notify;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One database holding the ledger's tables, with the idempotency store
/// that can share its transactions.
pub trait Ledger: Clone + Send + Sync + 'static {
    /// The records in the same database (unless `--key-store`).
    type Store: TransactionalStore + Inspect;

    /// `GET /accounts/{id}`.
    fn account(&self, id: i64) -> impl Future<Output = Result<Account, LedgerError>> + Send;

    /// Runs `write` in a transaction of its own (`--mode separate`). Once
    /// `lost` resolves (the request's claim is lost: another request may
    /// run the same credit), a write not yet committed is abandoned (its
    /// connection dropped, so no `COMMIT` follows), and one whose `COMMIT`
    /// is on its way has an unknown outcome.
    fn in_transaction(
        &self,
        write: Write,
        lost: impl Future<Output = ()> + Send,
    ) -> impl Future<Output = Result<Json, LedgerError>> + Send;

    /// Runs `write` in the request's idempotency transaction (`--mode
    /// transactional`): the layer commits it with the record, or rolls it
    /// back when the answer is one it does not store (a 5xx).
    fn in_request(
        tx: &Tx<Self>,
        write: Write,
    ) -> impl Future<Output = Result<Json, LedgerError>> + Send;

    /// `--notify-url`: the outbox in this database (its table created), over
    /// `store`'s pool.
    #[cfg(feature = "outbox")]
    fn outbox(
        store: &Self::Store,
    ) -> impl Future<Output = Result<tower_idempotency_outbox::Outbox, BoxError>> + Send;
}

/// The transaction the idempotency layer opens for a request on `D`'s store.
pub type Tx<D> = <<D as Ledger>::Store as TransactionalStore>::Transaction;

/// One write of the ledger.
pub enum Op {
    CreateAccount { name: String },
    Credit { account_id: i64, amount: i64 },
}

/// A write and what runs with it in the same transaction.
pub struct Write {
    pub op: Op,
    /// In separate mode, the request's idempotency key (namespace, scope
    /// and key, hashed), kept with its credit: unique, so a credit is never
    /// made twice for one key, and a retry can find it. The index is also
    /// the fence against a cut-off holder's late write (the partition
    /// tests), so a key used again past its record's TTL is refused here
    /// (503) in separate mode. Transactional mode keeps none: the record
    /// commits with the credit, so a retry finds the record (and the unique
    /// index costs a third of SQLite's credit rate).
    pub request: Option<String>,
    /// Look for a credit made under `request` first and answer with it: the
    /// key was taken over from a request whose credit may have committed
    /// (separate mode: a crash, or a commit whose answer was lost).
    pub resolve: bool,
    /// `--notify-url`: the credit's notification, enqueued with it.
    pub notify: Option<Notify>,
    /// `X-Ledger-Fail: after-effect` (`faults.rs`): fail once it is written.
    pub fail_after_effect: bool,
}

/// A parameter of the ledger's SQL.
#[derive(Clone, Copy)]
pub enum Param<'a> {
    Int(i64),
    Text(&'a str),
    /// A text that may be `NULL`.
    OptText(Option<&'a str>),
}

/// What the last statement changed (for dialects without `RETURNING`).
pub struct Done {
    pub rows: u64,
    pub id: i64,
}

/// The primitives the ledger's SQL needs from a connection that is inside a
/// transaction; each driver implements them once. Their futures are `Send`
/// so that `apply` is `Send` for any driver; a synchronous driver (rusqlite)
/// does its work when called and returns a ready future.
pub trait Conn {
    /// Whether `INSERT` and `UPDATE` take `RETURNING` (not in MySQL).
    const RETURNING: bool = true;

    /// Runs `sql`; the first column of its first row, if it returned one.
    fn fetch(
        &mut self,
        sql: &'static str,
        params: &[Param<'_>],
    ) -> impl Future<Output = Result<Option<i64>, LedgerError>> + Send;

    /// Runs `sql`, which returns no rows (asked only where `!RETURNING`).
    fn execute(
        &mut self,
        _: &'static str,
        _: &[Param<'_>],
    ) -> impl Future<Output = Result<Done, LedgerError>> + Send {
        async { Err("this dialect writes with RETURNING".into()) }
    }

    /// Runs `ACCOUNT`.
    fn account(
        &mut self,
        id: i64,
    ) -> impl Future<Output = Result<Option<Account>, LedgerError>> + Send;

    /// Enqueues an outbox message in this transaction (`--notify-url`).
    #[cfg(feature = "outbox")]
    fn enqueue(
        &mut self,
        message: &Message,
    ) -> impl Future<Output = Result<(), LedgerError>> + Send;
}

/// The ledger's tables, in each dialect.
pub mod schema {
    pub const SQLITE: &str = "
CREATE TABLE IF NOT EXISTS accounts (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    name    TEXT    NOT NULL,
    balance INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS credits (
    id            INTEGER PRIMARY KEY AUTOINCREMENT,
    account_id    INTEGER NOT NULL REFERENCES accounts (id),
    amount        INTEGER NOT NULL CHECK (amount > 0),
    request       TEXT,
    balance_after INTEGER
);
";

    /// Whether `credits` has the columns `request` and `balance_after`
    /// (a file made before them): 1 or 0.
    pub const SQLITE_HAS_REQUEST: &str =
        "SELECT count(*) FROM pragma_table_info('credits') WHERE name = 'request'";

    /// Adds them to a file made before them.
    pub const SQLITE_ADD_REQUEST: &str = "
ALTER TABLE credits ADD COLUMN request TEXT;
ALTER TABLE credits ADD COLUMN balance_after INTEGER;
";

    /// After the columns exist (SQLite): over separate mode's credits only.
    pub const REQUEST_INDEX: &str = "CREATE UNIQUE INDEX IF NOT EXISTS credits_request
        ON credits (request) WHERE request IS NOT NULL;";

    #[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
    /// Run after `POSTGRES_LOCK`, in its transaction: ledgers starting
    /// together would race on `CREATE TABLE`. Tables already there are
    /// skipped without a NOTICE at each start.
    pub const POSTGRES: &str = "
SET LOCAL client_min_messages = warning;
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
ALTER TABLE credits ADD COLUMN IF NOT EXISTS request TEXT;
ALTER TABLE credits ADD COLUMN IF NOT EXISTS balance_after BIGINT;
CREATE UNIQUE INDEX IF NOT EXISTS credits_request ON credits (request) WHERE request IS NOT NULL;
";
    #[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
    pub const POSTGRES_LOCK: &str = "SELECT pg_advisory_xact_lock(7261)";

    #[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
    /// Whether the tables are as `POSTGRES` leaves them, so a ledger that
    /// starts beside running ones skips its DDL: `ALTER TABLE` (even one
    /// that adds nothing) and `CREATE INDEX` take locks that wait for every
    /// open transaction on `credits`, and every statement on it then waits
    /// behind them (a 20 s credit would stall the fleet's credits).
    pub const POSTGRES_CURRENT: &str = "SELECT (SELECT count(*) FROM information_schema.columns
        WHERE table_schema = current_schema() AND table_name = 'credits'
          AND column_name IN ('request', 'balance_after')) = 2
        AND to_regclass('credits_request') IS NOT NULL";

    #[cfg(feature = "mysql")]
    /// InnoDB: transactions and row locks. Each `CREATE TABLE IF NOT EXISTS`
    /// is atomic, so ledgers starting together do not race.
    pub const MYSQL: [&str; 3] = [
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
        // A table made before these columns gets them; one made after
        // answers 1060 (duplicate column), which the driver ignores.
        "ALTER TABLE credits ADD COLUMN request VARCHAR(64) NULL UNIQUE,
            ADD COLUMN balance_after BIGINT NULL",
    ];

    #[cfg(feature = "mysql")]
    /// As `POSTGRES_CURRENT`: the `ALTER TABLE` above waits for a metadata
    /// lock behind every open transaction on `credits` (and `accounts`,
    /// its parent), and every statement on them then waits behind it.
    pub const MYSQL_CURRENT: &str = "SELECT COUNT(*) = 2 FROM information_schema.columns
        WHERE table_schema = DATABASE() AND table_name = 'credits'
          AND column_name IN ('request', 'balance_after')";
}

/// Completed records every store of the ledger keeps in memory for
/// replays (`replay_cache`): a repeat of a recent credit is answered without
/// a read (see BENCHMARKS.md). At most 4 MiB of responses, the stores'
/// default bound.
pub const REPLAY_CACHE: usize = 1024;

pub const ACCOUNT: &str = "SELECT id, name, balance FROM accounts WHERE id = $1";

/// `$sql` as it is, and with `RETURNING $column` for the dialects that have it.
macro_rules! returning {
    ($sql:literal, $column:literal) => {
        ($sql, concat!($sql, " RETURNING ", $column))
    };
}

/// Runs `write` on `c`, inside the caller's transaction. Any error leaves
/// the transaction to be rolled back.
pub async fn apply<C: Conn>(c: &mut C, write: Write) -> Result<Json, LedgerError> {
    let json = match write.op {
        Op::CreateAccount { name } => {
            let insert = returning!("INSERT INTO accounts (name) VALUES ($1)", "id");
            let id = insert_row(c, insert, &[Param::Text(&name)]).await?;
            json(Account {
                id,
                name,
                balance: 0,
            })?
        }
        Op::Credit { account_id, amount } => {
            let credit = (account_id, amount, write.request.as_deref());
            let found = match (write.resolve, credit.2) {
                (true, Some(request)) => made_before(c, (account_id, amount, request)).await?,
                _ => None,
            };
            if let Some(made) = found {
                // Its effects (the balance, a notification) came with it.
                return json(made);
            }
            json(self::credit(c, credit).await?)?
        }
    };
    if let Some(notify) = &write.notify {
        let message = notify.message(&json)?;
        #[cfg(feature = "outbox")]
        c.enqueue(&message).await?;
        #[cfg(not(feature = "outbox"))]
        match message {}
    }
    if write.fail_after_effect {
        return Err(LedgerError::InjectedFailure);
    }
    Ok(json)
}

/// The credit made under `request` by an earlier run, if one committed.
async fn made_before<C: Conn>(
    c: &mut C,
    (account_id, amount, request): (i64, i64, &str),
) -> Result<Option<Credit>, LedgerError> {
    let request = [Param::Text(request)];
    let Some(credit_id) = c
        .fetch("SELECT id FROM credits WHERE request = $1", &request)
        .await?
    else {
        return Ok(None);
    };
    let balance = c
        .fetch(
            "SELECT balance_after FROM credits WHERE request = $1",
            &request,
        )
        .await?
        .ok_or("a credit without its balance")?;
    // The same key and fingerprint: the same account and amount.
    Ok(Some(Credit {
        credit_id,
        account_id,
        amount,
        balance,
    }))
}

/// Writes the credit (with its request and the balance after it) and the
/// account's new balance.
async fn credit<C: Conn>(
    c: &mut C,
    (account_id, amount, request): (i64, i64, Option<&str>),
) -> Result<Credit, LedgerError> {
    let (id, amt) = (Param::Int(account_id), Param::Int(amount));
    let (add, add_returning) = returning!(
        "UPDATE accounts SET balance = balance + $1 WHERE id = $2",
        "balance"
    );
    let balance = if C::RETURNING {
        c.fetch(add_returning, &[amt, id]).await?
    } else if c.execute(add, &[amt, id]).await?.rows > 0 {
        // The UPDATE holds the row's lock: this reads this transaction's own balance.
        c.fetch("SELECT balance FROM accounts WHERE id = $1", &[id])
            .await?
    } else {
        None
    };
    let balance = balance.ok_or(LedgerError::NoSuchAccount)?;
    let insert = returning!(
        "INSERT INTO credits (account_id, amount, request, balance_after) VALUES ($1, $2, $3, $4)",
        "id"
    );
    let params = [id, amt, Param::OptText(request), Param::Int(balance)];
    let credit_id = insert_row(c, insert, &params).await?;
    Ok(Credit {
        credit_id,
        account_id,
        amount,
        balance,
    })
}

/// Runs an INSERT; the new row's id.
async fn insert_row<C: Conn>(
    c: &mut C,
    (sql, sql_returning): (&'static str, &'static str),
    params: &[Param<'_>],
) -> Result<i64, LedgerError> {
    if C::RETURNING {
        c.fetch(sql_returning, params)
            .await?
            .ok_or_else(|| "INSERT returned no row".into())
    } else {
        Ok(c.execute(sql, params).await?.id)
    }
}

/// Runs a future that never waits (a `Conn` over a synchronous driver,
/// rusqlite) to its end, on this thread.
pub fn now<F: Future>(future: F) -> F::Output {
    use std::task::{Context, Poll, Waker};
    match std::pin::pin!(future).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(output) => output,
        Poll::Pending => unreachable!("a synchronous driver never waits"),
    }
}

/// The JSON text of `value`, members in the struct's field order.
pub fn json<T: Serialize>(value: T) -> Result<Json, LedgerError> {
    serde_json::to_string(&value)
        .map(Json)
        .map_err(LedgerError::database)
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
    Database(BoxError),
    /// The `COMMIT` was sent, and its answer lost (the connection died, the
    /// claim was lost meanwhile): the credit may or may not exist. Only
    /// over a network: a SQLite file's commit is always answered.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "sqlx-postgres", feature = "mysql")),
        allow(dead_code)
    )]
    OutcomeUnknown(BoxError),
}

impl LedgerError {
    pub fn database(e: impl Into<BoxError>) -> Self {
        LedgerError::Database(e.into())
    }

    /// As an error of the set-up.
    pub fn boxed(self) -> BoxError {
        match self {
            LedgerError::Database(e) | LedgerError::OutcomeUnknown(e) => e,
            other => other.to_string().into(),
        }
    }
}

impl std::fmt::Display for LedgerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LedgerError::NoSuchAccount => f.write_str("no such account"),
            LedgerError::InjectedFailure => f.write_str("injected failure"),
            LedgerError::Database(e) => write!(f, "database: {e}"),
            LedgerError::OutcomeUnknown(e) => write!(f, "database, commit unanswered: {e}"),
        }
    }
}

/// Every driver's error (and a message) is a database error of the ledger.
/// (So `LedgerError` is not itself a `std::error::Error`, as `anyhow::Error`.)
impl<E: Into<BoxError>> From<E> for LedgerError {
    fn from(e: E) -> Self {
        LedgerError::Database(e.into())
    }
}
