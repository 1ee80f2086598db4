//! PostgreSQL through tokio-postgres (`--db postgres://...`, a build with
//! `--features postgres`): the ledger's tables share the idempotency
//! store's connection pool.

use deadpool_postgres::{Object, Pool, StatementCache};
use tokio_postgres::types::ToSql;
use tokio_postgres::{GenericClient, Statement};
use tower_idempotency_postgres::PostgresStore;
use tower_idempotency_postgres::PostgresTransaction;

use crate::db::{
    ACCOUNT, Account, BoxError, Conn, Json, Ledger, LedgerError, Param, REPLAY_CACHE, Write, apply,
    schema,
};
#[cfg(feature = "outbox")]
use crate::notify::Message;

#[derive(Clone)]
pub struct Postgres {
    pool: Pool,
}

/// Opens the store (its pool holds the ledger's tables too); it serves the
/// records when `records` (no `--key-store`).
pub async fn open(url: &str, records: bool) -> Result<(Postgres, Option<PostgresStore>), BoxError> {
    let store = PostgresStore::builder(url)
        .replay_cache(REPLAY_CACHE)
        .open()
        .await?;
    let pool = store.pool().clone();
    let mut client = pool.get().await?;
    let current: bool = client
        .query_one(schema::POSTGRES_CURRENT, &[])
        .await?
        .get(0);
    if !current {
        let tx = client.transaction().await?;
        tx.execute(schema::POSTGRES_LOCK, &[]).await?;
        tx.batch_execute(schema::POSTGRES).await?;
        tx.commit().await?;
    }
    let db = Postgres { pool };
    Ok((db, records.then_some(store)))
}

impl Ledger for Postgres {
    type Store = PostgresStore;

    #[cfg(feature = "outbox")]
    async fn outbox(store: &PostgresStore) -> Result<tower_idempotency_outbox::Outbox, BoxError> {
        Ok(tower_idempotency_outbox::Outbox::postgres(store).await?)
    }

    async fn account(&self, id: i64) -> Result<Account, LedgerError> {
        let client = self.pool.get().await?;
        pg(&client)
            .account(id)
            .await?
            .ok_or(LedgerError::NoSuchAccount)
    }

    /// Runs as long as the claim holds (renewed, it outlasts a credit that
    /// waits for a row lock); once the claim is lost the write is abandoned
    /// and its connection closed, not pooled, so statements stuck in the
    /// network are never followed by a `COMMIT` after another server took
    /// the key over. A `COMMIT` sent and unanswered has an unknown outcome.
    async fn in_transaction(
        &self,
        write: Write,
        lost: impl Future<Output = ()> + Send,
    ) -> Result<Json, LedgerError> {
        let mut lost = std::pin::pin!(lost);
        let mut client = tokio::select! {
            client = self.pool.get() => client?,
            // Nothing was written.
            () = &mut lost => return Err("the request's claim was lost before it had a connection".into()),
        };
        let committed = {
            let work = async {
                let tx = client.transaction().await?;
                let mut conn = Pg {
                    client: &*tx,
                    statements: &tx.statement_cache,
                };
                let json = apply(&mut conn, write).await?;
                let commit = tx.commit().await;
                Ok::<_, LedgerError>(commit.map(|()| json))
            };
            tokio::select! {
                written = work => Some(written),
                () = &mut lost => None,
            }
        };
        match committed {
            Some(Ok(Ok(json))) => Ok(json),
            Some(Ok(Err(e))) => Err(LedgerError::OutcomeUnknown(e.into())),
            Some(Err(e)) => Err(e),
            None => {
                drop(deadpool_postgres::Object::take(client));
                Err(claim_lost("while it was written; abandoned"))
            }
        }
    }

    async fn in_request(tx: &PostgresTransaction, write: Write) -> Result<Json, LedgerError> {
        let client = tx.client().await?;
        let mut conn = Pg {
            client: &*client,
            statements: client.statement_cache(),
        };
        apply(&mut conn, write).await
    }
}

/// The write's claim was lost while it was written: another request may
/// run the credit, and this one's `COMMIT` may have been on its way.
fn claim_lost(when: &str) -> LedgerError {
    LedgerError::OutcomeUnknown(format!("the request's claim was lost {when}").into())
}

/// A tokio-postgres client or transaction, and its connection's statement
/// cache: each statement is prepared once per connection, not once per use
/// (a round trip more, while a credit holds its account's row lock).
struct Pg<'a, C> {
    client: &'a C,
    statements: &'a StatementCache,
}

/// A pooled connection, outside a transaction.
fn pg(client: &Object) -> Pg<'_, tokio_postgres::Client> {
    Pg {
        client,
        statements: &client.statement_cache,
    }
}

impl<C: GenericClient + Sync> Pg<'_, C> {
    async fn prepared(&self, sql: &str) -> Result<Statement, tokio_postgres::Error> {
        self.statements.prepare(self.client.client(), sql).await
    }
}

fn params<'a>(params: &'a [Param<'_>]) -> Vec<&'a (dyn ToSql + Sync)> {
    let one = |p: &'a Param<'_>| -> &'a (dyn ToSql + Sync) {
        match p {
            Param::Int(i) => i,
            Param::Text(s) => s,
            Param::OptText(s) => s,
        }
    };
    params.iter().map(one).collect()
}

impl<C: GenericClient + Sync> Conn for Pg<'_, C> {
    async fn fetch(
        &mut self,
        sql: &'static str,
        params_: &[Param<'_>],
    ) -> Result<Option<i64>, LedgerError> {
        let sql = self.prepared(sql).await?;
        let row = self.client.query_opt(&sql, &params(params_)).await?;
        Ok(row.map(|row| row.try_get(0)).transpose()?)
    }

    async fn account(&mut self, id: i64) -> Result<Option<Account>, LedgerError> {
        let account = self.prepared(ACCOUNT).await?;
        let Some(row) = self.client.query_opt(&account, &[&id]).await? else {
            return Ok(None);
        };
        Ok(Some(Account {
            id: row.try_get(0)?,
            name: row.try_get(1)?,
            balance: row.try_get(2)?,
        }))
    }

    #[cfg(feature = "outbox")]
    async fn enqueue(&mut self, message: &Message) -> Result<(), LedgerError> {
        tower_idempotency_outbox::postgres::enqueue(self.client, message).await?;
        Ok(())
    }
}
