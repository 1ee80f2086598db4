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
    let wait_s = whole_seconds(wait).max(1);
    // 2. The transaction, with the max hold's backstop (and, unless the
    //    insert bounds its own wait, the wait's bound) on its session, in
    //    one round trip.
    let mut begin = format!(
        "SET SESSION {} = {}",
        store.sql.backstop.variable(),
        whole_seconds(hold) + 1
    );
    if !store.sql.returning {
        begin += &format!(", innodb_lock_wait_timeout = {wait_s}");
    }
    let mut tx = store
        .pool
        .begin_with(AssertSqlSafe(begin + "; BEGIN"))
        .await?;
    let inserted = match insert(store, &mut tx, req, id, wait_s).await {
        Ok(inserted) => inserted,
        Err(e) => return roll_back(tx, e).await,
    };
    let found = if inserted.new {
        Found::Acquired { taken_over: false }
    } else {
        // 3. It met a committed record and holds its row lock: judged as
        //    the claim that commits first judges it.
        match judge(store, &mut tx, req, id).await {
            Ok(found) => found,
            Err(e) => return roll_back(tx, e).await,
        }
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
    let cancel = match inserted.connection_id {
        Some(id) => Ok(id),
        None => lift(&mut tx).await,
    };
    match cancel {
        Ok(cancel) => Ok(Ok(Inside::Claimed {
            tx,
            cancel,
            taken_over,
        })),
        Err(e) => roll_back(tx, e).await,
    }
}

/// 4. (Without `Sql::returning`.) The session's lock-wait bound lifted, so
///    the handler runs with the server's own, and the session's id read (to
///    stop a statement past the max hold).
async fn lift(tx: &mut Tx) -> Result<u64, sqlx::Error> {
    sqlx::raw_sql(AssertSqlSafe(
        "SET SESSION innodb_lock_wait_timeout = DEFAULT; SELECT CONNECTION_ID()",
    ))
    .fetch_one(&mut **tx)
    .await
    .and_then(|row| row.try_get::<u64, _>(0))
}

/// `e`, after the transaction's rollback.
async fn roll_back<T>(tx: Tx, e: sqlx::Error) -> Result<T, sqlx::Error> {
    MySqlStore::roll_back_tx(tx).await;
    Err(e)
}

/// What the claim's insert did.
struct Inserted {
    /// It inserted a new record; else it met a committed one and now holds
    /// its row lock.
    new: bool,
    /// The session's id, when the insert returned it (`Sql::returning`).
    connection_id: Option<u64>,
}

/// The claim's insert. With `Sql::returning` (MariaDB 10.5 and later) it
/// bounds its own lock wait (`SET STATEMENT ... FOR`) and returns the
/// record's `claims` (1 only when it inserted) and the session's id, so no
/// round trip follows it.
async fn insert(
    store: &MySqlStore,
    tx: &mut Tx,
    req: &ClaimRequest,
    id: &[u8],
    wait_s: u64,
) -> Result<Inserted, sqlx::Error> {
    if store.sql.returning {
        let sql = store.sql.insert_inside_returning(wait_s);
        let row = store.new_record(&sql, req, id).fetch_one(&mut **tx).await?;
        return Ok(Inserted {
            new: row.try_get::<i64, _>(0)? == 1,
            connection_id: Some(row.try_get::<u64, _>(1)?),
        });
    }
    let inserted = store
        .new_record(&store.sql.insert_inside, req, id)
        .execute(&mut **tx)
        .await?;
    Ok(Inserted {
        new: inserted.rows_affected() == 1,
        connection_id: None,
    })
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
