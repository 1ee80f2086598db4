//! Transactional mode in one phase (the default; the kit's
//! `kit::one_phase`): the claim is written inside the handler's
//! transaction, and every lock wait it meets is bounded by the claim's own
//! wait, then lifted before the handler runs.
//!
//! A new key costs, after the read-first `SELECT`, one round trip: `BEGIN`
//! with its backstop and the wait's bound, the insert, and the bound lifted
//! again, sent together (tokio-postgres pipelines requests issued together
//! on one connection).

use std::time::Duration;

use tokio_postgres::types::ToSql;
use tower_idempotency::store::kit::claim::{ClaimSteps, Found, Met, claim_in};
use tower_idempotency::store::kit::pg_sql::{LOCK_NOT_AVAILABLE, begin_with_backstop, lock_wait};
use tower_idempotency::store::kit::release::release_logged;
use tower_idempotency::store::kit::two_phase::{Inside, TwoPhase};
use tower_idempotency::store::{ClaimRequest, StoreError, duration_ms};

use super::tx::PgTx;
use super::{PostgresStore, Sql, cached, met, row_params, unavailable};

/// Why a statement of the claim stopped: its lock wait reached the bound,
/// or anything else.
enum Stop {
    Busy,
    Failed(StoreError),
}

impl From<StoreError> for Stop {
    fn from(e: StoreError) -> Self {
        Stop::Failed(e)
    }
}

fn stop(e: tokio_postgres::Error) -> Stop {
    match e.code() {
        Some(code) if code.code() == LOCK_NOT_AVAILABLE => Stop::Busy,
        _ => Stop::Failed(unavailable(e)),
    }
}

/// [`TwoPhase::claim_inside`](tower_idempotency::store::kit::two_phase::TwoPhase::claim_inside).
pub(crate) async fn claim(
    store: &PostgresStore,
    hold: Duration,
    req: &ClaimRequest,
    wait: Duration,
) -> Result<Inside<PostgresStore>, StoreError> {
    let client = store.client().await?;
    // 1. A completed record is answered by the read, with no transaction.
    if let Some(refused) = store.read_first(&client, req).await? {
        return Ok(Inside::Refused(refused));
    }
    // 2. The transaction and the insert, in one round trip.
    let insert = cached(&client, &store.sql.insert_inside).await?;
    let tx = PgTx::new(client);
    let found = match begin_and_insert(store, &tx, &insert, (hold, req, wait)).await? {
        Ok(true) => Ok(Found::Acquired { taken_over: false }),
        // 3. It met a committed record: judged under its row lock, as the
        //    claim that commits first judges it.
        Ok(false) => judge(store, &tx, req, wait).await,
        Err(stop) => Err(stop),
    };
    // 4. Claimed, or the transaction rolled back.
    match found {
        Ok(Found::Acquired { taken_over }) => {
            let cancel = tx.client().cancel_token();
            Ok(Inside::Claimed {
                tx,
                cancel,
                taken_over,
            })
        }
        Ok(refused) => {
            PostgresStore::roll_back_tx(tx).await;
            Ok(Inside::Refused(refused.decode()?.err().ok_or_else(
                || unavailable("a refused claim decoded as acquired"),
            )?))
        }
        Err(Stop::Busy) => {
            PostgresStore::roll_back_tx(tx).await;
            Ok(Inside::Busy)
        }
        // The connection is closed with the transaction (`PgTx`'s drop).
        Err(Stop::Failed(e)) => Err(e),
    }
}

/// `BEGIN` with its backstop and the wait's bound, the insert, and the
/// bound lifted, sent together: whether the insert claimed the key (the
/// inner `Result`), or the error that stopped it.
async fn begin_and_insert(
    store: &PostgresStore,
    tx: &PgTx,
    insert: &tokio_postgres::Statement,
    (hold, req, wait): (Duration, &ClaimRequest, Duration),
) -> Result<Result<bool, Stop>, StoreError> {
    let (bound, lifted) = lock_wait(wait);
    let begin = format!("{}; {bound}", begin_with_backstop(hold));
    let c = tx.client();
    let fingerprint = &req.fingerprint.0[..];
    let (offset, lease, ttl) = (
        store.offset_ms(),
        duration_ms(req.lease),
        duration_ms(req.ttl),
    );
    let params: [&(dyn ToSql + Sync); 7] = [
        &req.scope,
        &req.key,
        &fingerprint,
        &req.token.0,
        &offset,
        &lease,
        &ttl,
    ];
    let (began, inserted, lifted) = tokio::join!(
        c.batch_execute(&begin),
        c.execute(insert, &params),
        c.batch_execute(lifted)
    );
    if let Err(e) = began {
        // Never the case with a live connection; had the insert run outside
        // a transaction, its claim is given back. The connection is closed.
        if let Ok(1) = inserted {
            let what = "a claim outside its transaction";
            release_logged(store, req.record_id(), req.token, what).await;
        }
        return Err(unavailable(e));
    }
    Ok(match inserted.map_err(stop) {
        Ok(1) => lifted
            .map(|()| true)
            .map_err(|e| Stop::Failed(unavailable(e))),
        Ok(_) => Ok(false),
        Err(stop) => Err(stop),
    })
}

/// The record the insert met, judged by the kit's claim with every
/// statement's lock wait bounded.
async fn judge(
    store: &PostgresStore,
    tx: &PgTx,
    req: &ClaimRequest,
    wait: Duration,
) -> Result<Found, Stop> {
    let c = tx.client();
    let now = cached(c, &store.sql.now).await?;
    let now: i64 = c
        .query_one(&now, &[&store.offset_ms()])
        .await
        .and_then(|row| row.try_get(0))
        .map_err(stop)?;
    let mut steps = Bounded {
        tx,
        sql: &store.sql,
        wait,
    };
    claim_in(&mut steps, req, now).await
}

/// The claim's statements inside the open transaction, each with its lock
/// wait bounded.
struct Bounded<'a> {
    tx: &'a PgTx,
    sql: &'a Sql,
    wait: Duration,
}

impl Bounded<'_> {
    /// `statement` with `params`, its lock wait bounded: the rows it
    /// returned (a row count for an `INSERT` or `UPDATE` is none).
    async fn run(
        &self,
        statement: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<tokio_postgres::Row>, Stop> {
        let c = self.tx.client();
        let statement = cached(c, statement).await?;
        let (bound, lifted) = lock_wait(self.wait);
        let (bounded, rows, lifted) = tokio::join!(
            c.batch_execute(&bound),
            c.query(&statement, params),
            c.batch_execute(lifted)
        );
        bounded.map_err(stop)?;
        let rows = rows.map_err(stop)?;
        lifted.map_err(stop)?;
        Ok(rows)
    }

    /// A claim's row written by `statement` (`$1` to `$6`: scope, key,
    /// fingerprint, token, lease and TTL deadlines): the rows it returned.
    async fn write(
        &self,
        statement: &str,
        req: &ClaimRequest,
        (lease_until, expires_at): (i64, i64),
    ) -> Result<Vec<tokio_postgres::Row>, Stop> {
        let fingerprint = &req.fingerprint.0[..];
        let deadlines = (lease_until, expires_at);
        self.run(statement, &row_params(req, &fingerprint, &deadlines))
            .await
    }
}

impl ClaimSteps for Bounded<'_> {
    type Error = Stop;

    async fn insert(
        &mut self,
        req: &ClaimRequest,
        lease_until: i64,
        expires_at: i64,
    ) -> Result<bool, Stop> {
        // `RETURNING` tells an insert from a conflict in the rows.
        let insert = format!("{} RETURNING 1", self.sql.insert);
        let rows = self.write(&insert, req, (lease_until, expires_at)).await?;
        Ok(rows.len() == 1)
    }

    async fn select(&mut self, req: &ClaimRequest) -> Result<Option<Met>, Stop> {
        let rows = self.run(&self.sql.select, &[&req.scope, &req.key]).await?;
        rows.first().map(met).transpose().map_err(stop)
    }

    async fn take_over(
        &mut self,
        req: &ClaimRequest,
        lease_until: i64,
        expires_at: i64,
    ) -> Result<(), Stop> {
        self.write(&self.sql.take_over, req, (lease_until, expires_at))
            .await
            .map(drop)
    }

    fn vanished() -> Stop {
        Stop::Failed(unavailable("the conflicting record kept vanishing"))
    }
}
