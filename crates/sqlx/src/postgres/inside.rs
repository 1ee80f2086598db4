//! Transactional mode in one phase on sqlx's PostgreSQL (the default; the
//! kit's `kit::one_phase`): the claim is written inside the handler's
//! transaction. `BEGIN` with its backstop sets the wait's bound, which
//! holds for the claim's statements and is lifted before the handler runs.

use std::time::Duration;

use sqlx::Row;

use tower_idempotency::store::kit::claim::{Found, claim_in};
use tower_idempotency::store::kit::pg_sql::{begin_with_backstop, lock_wait};
use tower_idempotency::store::kit::two_phase::{Inside, TwoPhase};
use tower_idempotency::store::{ClaimRequest, StoreError, duration_ms};

use super::sql::{checked, query};
use super::{SqlxPostgresStore, Steps, lock_timed_out, unavailable};

type Tx = sqlx::Transaction<'static, sqlx::Postgres>;

/// [`TwoPhase::claim_inside`].
pub(super) async fn claim(
    store: &SqlxPostgresStore,
    hold: Duration,
    req: &ClaimRequest,
    wait: Duration,
) -> Result<Inside<SqlxPostgresStore>, StoreError> {
    // 1. A completed record is answered by the read, with no transaction.
    {
        let mut conn = store.pool.acquire().await.map_err(unavailable)?;
        if let Some(refused) = store.read_first(&mut conn, req).await? {
            return Ok(Inside::Refused(refused));
        }
    }
    // 2. The transaction, its lock waits bounded, and the insert.
    let (bound, lifted) = lock_wait(wait);
    let begin = format!("{}; {bound}", begin_with_backstop(hold));
    let mut tx = store
        .pool
        .begin_with(checked(begin))
        .await
        .map_err(unavailable)?;
    let found = match insert(store, &mut tx, req).await {
        Ok(true) => Ok(Found::Acquired { taken_over: false }),
        // 3. It met a committed record: judged under its row lock, as the
        //    claim that commits first judges it.
        Ok(false) => judge(store, &mut tx, req).await,
        Err(e) => Err(e),
    };
    // 4. The bound lifted, with the backend's pid (to cancel a statement
    //    past the max hold); or the transaction rolled back.
    let found = match found {
        Ok(found) => lift(&mut tx, lifted).await.map(|pid| (found, pid)),
        Err(e) => Err(e),
    };
    match found {
        Ok((Found::Acquired { taken_over }, pid)) => Ok(Inside::Claimed {
            tx,
            cancel: pid,
            taken_over,
        }),
        Ok((refused, _)) => {
            SqlxPostgresStore::roll_back_tx(tx).await;
            Ok(Inside::Refused(refused.decode()?.err().ok_or_else(
                || unavailable("a refused claim decoded as acquired"),
            )?))
        }
        Err(e) if lock_timed_out(&e) => {
            SqlxPostgresStore::roll_back_tx(tx).await;
            Ok(Inside::Busy)
        }
        Err(e) => {
            SqlxPostgresStore::roll_back_tx(tx).await;
            Err(e)
        }
    }
}

/// The claim's insert inside `tx`: whether it claimed the key.
async fn insert(
    store: &SqlxPostgresStore,
    tx: &mut Tx,
    req: &ClaimRequest,
) -> Result<bool, StoreError> {
    let inserted = query(&store.sql.insert_inside)
        .bind(&req.scope)
        .bind(&req.key)
        .bind(&req.fingerprint.0[..])
        .bind(req.token.0)
        .bind(store.offset_ms())
        .bind(duration_ms(req.lease))
        .bind(duration_ms(req.ttl))
        .execute(&mut **tx)
        .await
        .map_err(unavailable)?;
    Ok(inserted.rows_affected() == 1)
}

/// The record the insert met, judged by the kit's claim on the server's
/// clock.
async fn judge(
    store: &SqlxPostgresStore,
    tx: &mut Tx,
    req: &ClaimRequest,
) -> Result<Found, StoreError> {
    let now: i64 = sqlx::query_scalar(store.sql.now.clone())
        .bind(store.offset_ms())
        .fetch_one(&mut **tx)
        .await
        .map_err(unavailable)?;
    let mut steps = Steps {
        conn: &mut *tx,
        sql: &store.sql,
    };
    claim_in(&mut steps, req, now).await
}

/// The session's own lock wait again, and the backend's pid, in one round
/// trip.
async fn lift(tx: &mut Tx, lifted: &'static str) -> Result<i32, StoreError> {
    let row = sqlx::raw_sql(checked(format!("{lifted}; SELECT pg_backend_pid()")))
        .fetch_one(&mut **tx)
        .await
        .map_err(unavailable)?;
    row.try_get(0).map_err(unavailable)
}
