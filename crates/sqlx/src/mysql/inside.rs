//! Transactional mode in one phase on MySQL/MariaDB (the default; the kit's
//! `kit::one_phase`): the claim is written inside the handler's
//! transaction. The round trip that opens the transaction also bounds the
//! session's lock waits (`innodb_lock_wait_timeout`, whole seconds), and
//! the one after the insert lifts the bound before the handler runs.

use std::time::Duration;

use sqlx::mysql::MySql;
use sqlx::{AssertSqlSafe, Row};

use tower_idempotency::store::kit::claim::{Found, claim_in};
use tower_idempotency::store::kit::two_phase::{Inside, TwoPhase};
use tower_idempotency::store::{ClaimRequest, StoreError};

use super::{MySqlStore, Steps, is_deadlock, is_lock_wait_timeout, record_key, unavailable};

type Tx = sqlx::Transaction<'static, MySql>;

/// Tries of a claim InnoDB chose as a deadlock's victim (two claims waiting
/// on a record that a third rolled back): it was rolled back whole.
const TRIES: u32 = 3;

/// [`TwoPhase::claim_inside`].
pub(super) async fn claim(
    store: &MySqlStore,
    hold: Duration,
    req: &ClaimRequest,
    wait: Duration,
) -> Result<Inside<MySqlStore>, StoreError> {
    let id = record_key(&req.scope, &req.key);
    // 1. A completed record is answered by the read, with no transaction.
    {
        let sent = store.limits.instant();
        let mut conn = store.pool.acquire().await.map_err(unavailable)?;
        if let Some(refused) = store.read_completed(&mut conn, req, &id, sent).await? {
            return Ok(Inside::Refused(refused));
        }
    }
    let mut tries = 0;
    loop {
        tries += 1;
        match try_claim(store, hold, req, &id, wait).await {
            Err(e) if is_deadlock(&e) && tries < TRIES => continue,
            Err(e) if is_lock_wait_timeout(&e) => return Ok(Inside::Busy),
            Err(sqlx::Error::Decode(e)) => return Err(StoreError::Corrupt(e.to_string())),
            Err(e) => return Err(unavailable(e)),
            Ok(inside) => return inside,
        }
    }
}

/// One try: the transaction, the insert, a record met judged, the bound
/// lifted. On an error the transaction is rolled back, and the session's
/// timeouts set back to the server's.
async fn try_claim(
    store: &MySqlStore,
    hold: Duration,
    req: &ClaimRequest,
    id: &[u8],
    wait: Duration,
) -> Result<Result<Inside<MySqlStore>, StoreError>, sqlx::Error> {
    // 2. The transaction, with the max hold's backstop and the wait's
    //    bound on its session, in one round trip.
    let begin = format!(
        "SET SESSION wait_timeout = {}, innodb_lock_wait_timeout = {}; BEGIN",
        whole_seconds(hold) + 1,
        whole_seconds(wait).max(1)
    );
    let mut tx = store.pool.begin_with(AssertSqlSafe(begin)).await?;
    let found = match insert(store, &mut tx, req, id).await {
        Ok(true) => Found::Acquired { taken_over: false },
        // 3. It met a committed record and holds its row lock: judged as
        //    the claim that commits first judges it.
        Ok(false) => match judge(store, &mut tx, req, id).await {
            Ok(found) => found,
            Err(e) => return roll_back(tx, e).await,
        },
        Err(e) => return roll_back(tx, e).await,
    };
    let Found::Acquired { taken_over } = found else {
        MySqlStore::roll_back_tx(tx).await;
        return Ok(found.decode().and_then(|refused| {
            refused
                .err()
                .map(Inside::Refused)
                .ok_or_else(|| unavailable("a refused claim decoded as acquired"))
        }));
    };
    // 4. The bound lifted, with the session's id (to stop a statement past
    //    the max hold).
    let lifted = sqlx::raw_sql(AssertSqlSafe(
        "SET SESSION innodb_lock_wait_timeout = DEFAULT; SELECT CONNECTION_ID()",
    ))
    .fetch_one(&mut *tx)
    .await
    .and_then(|row| row.try_get::<u64, _>(0));
    match lifted {
        Ok(cancel) => Ok(Ok(Inside::Claimed {
            tx,
            cancel,
            taken_over,
        })),
        Err(e) => roll_back(tx, e).await,
    }
}

/// `e`, after the transaction's rollback.
async fn roll_back<T>(tx: Tx, e: sqlx::Error) -> Result<T, sqlx::Error> {
    MySqlStore::roll_back_tx(tx).await;
    Err(e)
}

/// The claim's insert: `true` when it inserted a new record, `false` when
/// it met a committed one (and now holds its row lock).
async fn insert(
    store: &MySqlStore,
    tx: &mut Tx,
    req: &ClaimRequest,
    id: &[u8],
) -> Result<bool, sqlx::Error> {
    let inserted = store
        .new_record(&store.sql.insert_inside, req, id)
        .execute(&mut **tx)
        .await?;
    Ok(inserted.rows_affected() == 1)
}

/// The record the insert met, judged by the kit's claim on the server's
/// clock, under the row lock the insert took.
async fn judge(
    store: &MySqlStore,
    tx: &mut Tx,
    req: &ClaimRequest,
    id: &[u8],
) -> Result<Found, sqlx::Error> {
    let offset = store.offset_ms();
    let now: i64 = sqlx::query_scalar(AssertSqlSafe(store.sql.now.clone()))
        .bind(offset)
        .fetch_one(&mut **tx)
        .await?;
    let mut steps = Steps {
        conn: tx,
        sql: &store.sql,
        id,
        offset,
    };
    claim_in(&mut steps, req, now).await
}

/// `d` in whole seconds, rounded up, as InnoDB's timeouts take it.
fn whole_seconds(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}
