//! The ledger's tables on PostgreSQL (built with `--features postgres`),
//! sharing the idempotency store's connection pool.

use deadpool_postgres::Pool;
use tokio_postgres::GenericClient;

use crate::db::{Account, Credit, Json, LedgerError, Op, json};

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

impl From<tokio_postgres::Error> for LedgerError {
    fn from(e: tokio_postgres::Error) -> Self {
        LedgerError::Database(Box::new(e))
    }
}

impl From<deadpool_postgres::PoolError> for LedgerError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        LedgerError::Database(Box::new(e))
    }
}

#[derive(Clone)]
pub struct PgDb {
    pool: Pool,
    /// How long a `separate` mode write may take (half the lease): past it
    /// the write is abandoned and its connection closed, so a server cut
    /// off from the database never sends the `COMMIT` later, after another
    /// server has taken the key over.
    write_budget: std::time::Duration,
}

impl PgDb {
    pub async fn open(pool: Pool, write_budget: std::time::Duration) -> Result<PgDb, LedgerError> {
        let mut client = pool.get().await?;
        let tx = client.transaction().await?;
        // Ledgers starting together would race on CREATE TABLE.
        tx.execute("SELECT pg_advisory_xact_lock(7261)", &[])
            .await?;
        tx.batch_execute(SCHEMA).await?;
        tx.commit().await?;
        Ok(PgDb { pool, write_budget })
    }

    pub async fn account(&self, id: i64) -> Result<Account, LedgerError> {
        let client = self.pool.get().await?;
        let row = client
            .query_opt(
                "SELECT id, name, balance FROM accounts WHERE id = $1",
                &[&id],
            )
            .await?
            .ok_or(LedgerError::NoSuchAccount)?;
        Ok(Account {
            id: row.try_get(0)?,
            name: row.try_get(1)?,
            balance: row.try_get(2)?,
        })
    }

    /// Runs `op` in a transaction of its own (the `separate` mode's writes).
    /// Abandoned past the write budget: the connection is closed, not
    /// pooled, so statements stuck in the network are never followed by a
    /// `COMMIT`.
    pub async fn in_transaction(&self, op: Op) -> Result<Json, LedgerError> {
        let started = tokio::time::Instant::now();
        let mut client = tokio::time::timeout(self.write_budget, self.pool.get())
            .await
            .map_err(|_| LedgerError::Database("no connection within the write budget".into()))??;
        let work = async {
            let tx = client.transaction().await?;
            let value = op.on_postgres(&*tx).await?;
            tx.commit().await?;
            Ok(value)
        };
        let outcome = tokio::time::timeout_at(started + self.write_budget, work).await;
        match outcome {
            Ok(result) => result,
            Err(_) => {
                drop(deadpool_postgres::Object::take(client));
                Err(LedgerError::Database(
                    "the write did not finish within its budget (half the lease); abandoned".into(),
                ))
            }
        }
    }
}

impl Op {
    /// Runs inside the caller's PostgreSQL transaction.
    pub async fn on_postgres<C: GenericClient>(self, client: &C) -> Result<Json, LedgerError> {
        match self {
            Op::CreateAccount { name } => {
                let row = client
                    .query_one(
                        "INSERT INTO accounts (name) VALUES ($1) RETURNING id",
                        &[&name],
                    )
                    .await?;
                json(Account {
                    id: row.try_get(0)?,
                    name,
                    balance: 0,
                })
            }
            Op::Credit {
                account_id,
                amount,
                fail_after_effect,
            } => {
                let balance: i64 = client
                    .query_opt(
                        "UPDATE accounts SET balance = balance + $2 WHERE id = $1 RETURNING balance",
                        &[&account_id, &amount],
                    )
                    .await?
                    .ok_or(LedgerError::NoSuchAccount)?
                    .try_get(0)?;
                let credit_id: i64 = client
                    .query_one(
                        "INSERT INTO credits (account_id, amount) VALUES ($1, $2) RETURNING id",
                        &[&account_id, &amount],
                    )
                    .await?
                    .try_get(0)?;
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
