//! The end of a transactional request: the record's completion and
//! `COMMIT`, sent together (tokio-postgres pipelines requests issued
//! together on one connection), so the handler's row locks are held one
//! round trip less than with the two in turn.
//!
//! What keeps it safe: the completion fails when it completes no record
//! (`PgSql::complete_or_fail`, SQLSTATE
//! [`NOT_COMPLETED`]), and a failed statement aborts the transaction, so
//! the `COMMIT` queued behind it ends the transaction with nothing
//! committed. The `COMMIT` is queued only once the completion is on its
//! way: a completion that fails before it is sent (its parameters not
//! encoded, the connection closed) is never followed by a `COMMIT`.

use std::future::Future;
use std::pin::pin;
use std::task::Poll;

use tokio_postgres::types::ToSql;
use tower_idempotency::response::StoredResponse;
use tower_idempotency::store::kit::pg_sql::NOT_COMPLETED;
use tower_idempotency::store::kit::two_phase::{Finished, TwoPhase};
use tower_idempotency::store::{FencingToken, RecordId, StoreError};

use super::tx::PgTx;
use super::{PostgresStore, cached, unavailable};

/// [`TwoPhase::complete_and_commit`].
pub(crate) async fn complete_and_commit(
    store: &PostgresStore,
    tx: PgTx,
    id: &RecordId,
    token: FencingToken,
    response: &StoredResponse,
) -> Finished<PostgresStore> {
    let (done, committed) = match send(store, &tx, id, token, response).await {
        Ok(Sent::Both(done, committed)) => (done, committed),
        Ok(Sent::Alone(e)) => return Finished::NotCompleted(tx, not_completed(e)),
        Err(e) => return Finished::NotCompleted(tx, e),
    };
    match (done, committed) {
        (Ok(_), Ok(())) => {
            tx.ended();
            Finished::Committed
        }
        // The connection is closed (the `PgTx` dropped).
        (Ok(_), Err(e)) => Finished::Unknown(unavailable(e)),
        // The aborted transaction's `COMMIT` was answered (PostgreSQL ends
        // it with a rollback): nothing is left to roll back.
        (Err(e), Ok(())) => {
            tx.ended();
            Finished::NotCompleted(PgTx::over(), not_completed(e))
        }
        (Err(e), Err(_)) => Finished::NotCompleted(tx, not_completed(e)),
    }
}

/// What was sent.
enum Sent {
    /// The completion's answer and the `COMMIT`'s.
    Both(
        Result<u64, tokio_postgres::Error>,
        Result<(), tokio_postgres::Error>,
    ),
    /// The completion failed at once; no `COMMIT` was sent.
    Alone(tokio_postgres::Error),
}

/// Sends the completion, and `COMMIT` behind it once it is on its way.
async fn send(
    store: &PostgresStore,
    tx: &PgTx,
    id: &RecordId,
    token: FencingToken,
    response: &StoredResponse,
) -> Result<Sent, StoreError> {
    let client = tx.client();
    let completion = CompletionArgs::new(store, id, token, response, true);
    let statement = cached(client, completion.statement).await?;
    let params = completion.params();
    let mut done = pin!(client.execute(&statement, &params));
    // Its first poll encodes the completion and queues it on the
    // connection, then waits for the answer.
    let first = std::future::poll_fn(|cx| Poll::Ready(done.as_mut().poll(cx))).await;
    Ok(match first {
        Poll::Pending => {
            let (done, committed) = tokio::join!(done, client.batch_execute("COMMIT"));
            Sent::Both(done, committed)
        }
        // Answered at once: `COMMIT` only after a completed record.
        Poll::Ready(Ok(n)) => Sent::Both(Ok(n), client.batch_execute("COMMIT").await),
        Poll::Ready(Err(e)) => Sent::Alone(e),
    })
}

/// Why the completion failed: the record no longer carries the token
/// ([`TwoPhase::FENCED`]), or anything else.
fn not_completed(e: tokio_postgres::Error) -> StoreError {
    match e.code() {
        Some(code) if code.code() == NOT_COMPLETED => unavailable(PostgresStore::FENCED),
        _ => unavailable(e),
    }
}

/// The completion's statement and parameters `($1 scope, $2 key, $3 token,
/// $4 response[, $5 payload])`.
pub(crate) struct CompletionArgs<'a> {
    pub(crate) statement: &'a str,
    scope: &'a str,
    key: &'a str,
    token: i64,
    blob: Vec<u8>,
    /// With `notify_waiters`, the announcement's payload (delivered at the
    /// commit).
    payload: Option<String>,
}

impl<'a> CompletionArgs<'a> {
    /// `or_fail`: the statement that fails when it completes no record.
    pub(crate) fn new(
        store: &'a PostgresStore,
        id: &'a RecordId,
        token: FencingToken,
        response: &StoredResponse,
        or_fail: bool,
    ) -> Self {
        let (statement, payload) = store.completion(id, or_fail);
        CompletionArgs {
            statement,
            scope: id.scope(),
            key: id.key(),
            token: token.0,
            blob: response.encode(),
            payload,
        }
    }

    pub(crate) fn params(&self) -> Vec<&(dyn ToSql + Sync)> {
        let mut params: Vec<&(dyn ToSql + Sync)> =
            vec![&self.scope, &self.key, &self.token, &self.blob];
        if let Some(payload) = &self.payload {
            params.push(payload);
        }
        params
    }
}
