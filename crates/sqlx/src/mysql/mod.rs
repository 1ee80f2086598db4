//! MySQL and MariaDB, for fleets of app servers sharing one database
//! (feature `mysql`, over sqlx's MySQL driver).
//!
//! * `transaction.rs`: [`MySqlTransaction`] and the
//!   [`TransactionalStore`](tower_idempotency::store::TransactionalStore) impl
//!   (transactional mode, on the store kit's `one_phase` and `two_phase`);
//!   `inside.rs`: the claim inside the handler's transaction (one phase).
//! * `inspect.rs`: [`Inspect`](tower_idempotency::store::Inspect) in SQL; `sql.rs`: the
//!   statements and the schema.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::mysql::{
    MySql, MySqlArguments, MySqlConnectOptions, MySqlConnection, MySqlPool, MySqlPoolOptions,
};
use sqlx::{AssertSqlSafe, Executor, Row};

use tower_idempotency::fingerprint::Hasher;
use tower_idempotency::response::StoredResponse;
use tower_idempotency::store::kit::builder::{Limits, Settings};
use tower_idempotency::store::kit::held::HeldKeys;
use tower_idempotency::store::kit::purge::{PurgeTask, in_batches};
use tower_idempotency::store::{
    Claim, ClaimRequest, Completion, FencingToken, RecordId, Refusal, Store, StoreError,
};

mod inside;
mod inspect;
mod sql;
mod transaction;

use sql::{Backstop, Sql, q};
use tower_idempotency::store::kit::claim::{
    ClaimSteps, Found, Met, answer_cached, busy_is_in_flight, claim_in,
};

pub use transaction::MySqlTransaction;

/// Records in a MySQL or MariaDB (InnoDB) table; leases and TTLs judged by
/// the database server's clock (`NOW(6)`, read in UTC).
///
/// * A claim first reads the record with one consistent read (no lock): a
///   completed record within its TTL is answered from it (a replay, or 422),
///   so replays of one key run in parallel; with
///   [`MySqlStoreBuilder::replay_cache`], later replays of it are answered
///   from memory, until the TTL it had left. That read only answers; it
///   decides no race.
/// * Otherwise a new key is claimed by one `INSERT` of the in-flight
///   record, on its own (autocommit): the primary key (SHA-256 of scope and
///   key, so keys compare byte for byte whatever the collation) decides who
///   is first, across every app server. A record already there fails it
///   with a duplicate-key error, and the claim is then one transaction: its
///   `INSERT ... ON DUPLICATE KEY UPDATE` inserts the record (it vanished
///   meanwhile) or takes the exclusive row lock of the one there; under
///   that lock the record is read, judged at the server's clock read after
///   the lock, and taken over by a conditional `UPDATE` or left alone. No
///   earlier read decides anything. The claim's statements share one
///   pooled connection.
/// * Isolation is `READ COMMITTED`, set on every pooled connection. Every
///   decision is made under a row lock on the key's own record, so a
///   snapshot (`REPEATABLE READ`) adds nothing; what it would add is gap and
///   next-key locks (on the primary key and the `expires_at` index during
///   purges), which make unrelated keys wait on each other and deadlock.
///   Handlers in transactional mode run at this level too, as on
///   PostgreSQL's default.
/// * Transactional mode ([`tower_idempotency::mode::Transactional`]) writes
///   the claim inside the handler's transaction ([`MySqlTransaction`]), as
///   the PostgreSQL stores do: the claim, the handler's writes and the
///   completion commit together, or vanish together, so a crash frees the
///   key at once and no lease is renewed. Another server's repeat waits on
///   the uncommitted record at most its `wait_in_flight`, in whole seconds
///   (InnoDB's `innodb_lock_wait_timeout`), and at least 1 s. With
///   [`MySqlStoreBuilder::commit_claims_first`] it runs in two phases: the
///   claim commits at once, so every server sees the key in flight with its
///   fingerprint, and the transaction commits only while the record still
///   carries this request's fencing token.
/// * A transactional request holds its transaction (and a pooled
///   connection) at most the layer's max hold (default 60 s; see
///   [`MySqlTransaction`]).
/// * Lease renewals run in one statement per batch on a connection of
///   their own, outside the pool (also at `READ COMMITTED`), so they never
///   wait behind requests.
/// * Connections come from a sqlx pool (default 16); a connection that
///   cannot be had in time, a server that cannot be reached, a deadlock that
///   outlives three tries or any other database error is
///   [`StoreError::Unavailable`]: the layer answers 503.
/// * The table (default `idempotency_records`) is created on open with
///   `ENGINE=InnoDB`; an existing table on another engine (no transactions,
///   no row locks) is refused with [`StoreError::Config`].
///
/// # Example
///
/// ```no_run
/// use tower_idempotency::{IdempotencyLayer, scope::GlobalScope};
/// use tower_idempotency_sqlx::MySqlStore;
///
/// # async fn run() -> Result<(), tower_idempotency::StoreError> {
/// let store = MySqlStore::open("mysql://app@db.internal:3306/app").await?;
/// let layer = IdempotencyLayer::new(store, GlobalScope).transactional();
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct MySqlStore {
    pool: MySqlPool,
    /// One connection of its own for lease renewals
    /// ([`Store::renew_all`]), so they never wait behind requests.
    renewals: MySqlPool,
    sql: Arc<Sql>,
    /// Max hold, the transactions held past it, the test clock offset.
    limits: Limits,
    /// Transactional claims inside the handler's transaction (the
    /// default): the keys this process's open ones hold. `None` with
    /// [`MySqlStoreBuilder::commit_claims_first`].
    one_phase: Option<Arc<HeldKeys>>,
}

impl std::fmt::Debug for MySqlStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlStore")
            .field("table", &self.sql.table)
            .finish_non_exhaustive()
    }
}

/// Options for [`MySqlStore`]; made by [`MySqlStore::builder`].
#[must_use]
pub struct MySqlStoreBuilder {
    url: String,
    pool_size: u32,
    wait_timeout: Duration,
    commit_claims_first: bool,
    /// `false` only in tests: MySQL's SQL on a MariaDB server.
    mariadb_sql: bool,
    settings: Settings,
}

pub(super) fn unavailable(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> StoreError {
    StoreError::unavailable(e)
}

/// InnoDB chose this transaction as a deadlock victim (ER_LOCK_DEADLOCK):
/// it was rolled back whole and may be tried again.
fn is_deadlock(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db) if db.code().as_deref() == Some("40001")
        || db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>().is_some_and(|e| e.number() == 1213))
}

/// `(major, minor)` of a MariaDB server's `VERSION()`
/// (`10.11.19-MariaDB-0+deb12u1`); `None` for MySQL. MariaDB has
/// `idle_transaction_timeout` from 10.3 and `INSERT ... RETURNING` from
/// 10.5.
fn mariadb_version(version: &str) -> Option<(u32, u32)> {
    if !version.contains("MariaDB") {
        return None;
    }
    let mut parts = version.split(['.', '-']).map(str::parse::<u32>);
    match (parts.next(), parts.next()) {
        (Some(Ok(major)), Some(Ok(minor))) => Some((major, minor)),
        _ => None,
    }
}

/// Every connection's isolation level (see [`MySqlStore`], "Isolation").
fn read_committed(
    conn: &mut MySqlConnection,
) -> std::pin::Pin<Box<dyn Future<Output = Result<(), sqlx::Error>> + Send + '_>> {
    Box::pin(async move {
        conn.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .await
            .map(drop)
    })
}

/// A lock wait past `innodb_lock_wait_timeout` (1205,
/// `ER_LOCK_WAIT_TIMEOUT`).
fn is_lock_wait_timeout(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db)
        if db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>().is_some_and(|e| e.number() == 1205))
}

/// A duplicate-key error (1062, `ER_DUP_ENTRY`).
fn is_duplicate(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(db)
        if db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>().is_some_and(|e| e.number() == 1062))
}

/// The primary key of a record: SHA-256 over scope and key, framed so no
/// two records share an input.
fn record_key(scope: &str, key: &str) -> Vec<u8> {
    let mut hasher = Hasher::new("tower-idempotency/mysql-record/v1");
    hasher.part(scope.as_bytes()).part(key.as_bytes());
    hasher.finish().0.to_vec()
}

tower_idempotency::store::kit::builder::sql_builder_settings!(MySqlStoreBuilder, MySqlTransaction);

impl MySqlStoreBuilder {
    /// Connections kept (default 16). In transactional mode each request
    /// holds one for its handler's whole run, at most the layer's
    /// [`IdempotencyLayer::max_hold`](tower_idempotency::IdempotencyLayer::max_hold).
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// Whether a transactional request's claim commits on its own before
    /// the handler runs, in two phases (default `false`: it is written
    /// inside the handler's transaction, so a crash frees the key at once
    /// and no lease is renewed; another server's repeat waits on it at most
    /// its `wait_in_flight` rounded up to whole seconds, at least 1 s).
    /// The PostgreSQL stores have the same switch; `docs/contract.md` §9
    /// says what each promises.
    ///
    /// On a MariaDB Galera cluster (`@@wsrep_on`) claims always commit
    /// first: certification finds a write conflict between nodes only at
    /// `COMMIT`, so a claim inside the handler's transaction would let a
    /// duplicate sent to another node run its handler too (its writes then
    /// rolled back, but not what the handler did outside the database).
    /// A claim that loses certification to a duplicate is judged as on one
    /// node: 409, or the replay.
    pub fn commit_claims_first(mut self, on: bool) -> Self {
        self.commit_claims_first = on;
        self
    }

    /// Tests only: the statements a MySQL server gets, on a MariaDB one
    /// (no `idle_transaction_timeout`, no `RETURNING`).
    #[doc(hidden)]
    pub fn without_mariadb_sql(mut self) -> Self {
        self.mariadb_sql = false;
        self
    }

    /// How long a call waits for a pooled connection (or a new one) before
    /// it fails with [`StoreError::Unavailable`] (default 5 s).
    pub fn wait_timeout(mut self, timeout: Duration) -> Self {
        self.wait_timeout = timeout;
        self
    }

    /// Connects and creates the table if it is missing.
    ///
    /// # Errors
    ///
    /// [`StoreError::Config`] for a URL that does not parse, a table name
    /// outside the rule of [`MySqlStoreBuilder::table`], or an existing
    /// table that is not InnoDB; [`StoreError::Unavailable`] for a server
    /// that cannot be reached.
    pub async fn open(self) -> Result<MySqlStore, StoreError> {
        tower_idempotency::store::kit::table::check_table_name(&self.settings.table)?;
        let options = MySqlConnectOptions::from_str(&self.url)
            .map_err(StoreError::config)?
            .timezone(Some("+00:00".to_owned()));
        let pool = MySqlPoolOptions::new()
            .max_connections(self.pool_size)
            .acquire_timeout(self.wait_timeout)
            .after_connect(|conn, _| read_committed(conn))
            .connect_with(options)
            .await
            .map_err(unavailable)?;
        let mut sql = Sql::new(&self.settings.table);
        // MariaDB (and MySQL versions that have it) tells whether a
        // transaction is open; see `MySqlTransaction`, "Errors inside".
        sql.in_transaction_check =
            sqlx::query_scalar::<_, i64>("SELECT CAST(@@in_transaction AS SIGNED)")
                .fetch_one(&pool)
                .await
                .is_ok();
        let version: String = sqlx::query_scalar("SELECT CAST(VERSION() AS CHAR)")
            .fetch_one(&pool)
            .await
            .map_err(unavailable)?;
        if let Some(v) = mariadb_version(&version).filter(|_| self.mariadb_sql) {
            if v >= (10, 3) {
                sql.backstop = Backstop::IdleTransaction;
            }
            sql.returning = v >= (10, 5);
        }
        pool.execute(AssertSqlSafe(sql.schema()))
            .await
            .map_err(unavailable)?;
        let engine: Option<String> = sqlx::query_scalar(
            "SELECT CAST(engine AS CHAR) FROM information_schema.tables
             WHERE table_schema = DATABASE() AND table_name = ?",
        )
        .bind(&self.settings.table)
        .fetch_optional(&pool)
        .await
        .map_err(unavailable)?;
        if !engine
            .as_deref()
            .is_some_and(|e| e.eq_ignore_ascii_case("InnoDB"))
        {
            return Err(StoreError::config(format!(
                "table {} uses the {} engine; the store needs InnoDB (transactions and row locks)",
                self.settings.table,
                engine.as_deref().unwrap_or("unknown")
            )));
        }
        // On a Galera cluster a claim inside the handler's transaction
        // would meet a duplicate on another node only at `COMMIT`
        // (certification), after both handlers ran: claims commit first.
        let galera = sqlx::query_scalar::<_, i64>("SELECT CAST(@@wsrep_on AS SIGNED)")
            .fetch_one(&pool)
            .await
            .is_ok_and(|on| on == 1);
        let mut store = MySqlStore {
            renewals: crate::renewals::options_beside(&pool)
                .after_connect(|conn, _| read_committed(conn))
                .connect_lazy_with((*pool.connect_options()).clone()),
            pool,
            sql: Arc::new(sql),
            limits: self.settings.limits(),
            one_phase: (!self.commit_claims_first && !galera).then(Arc::default),
        };
        store.limits.purge_task = PurgeTask::start(store.clone(), self.settings.purge);
        Ok(store)
    }
}

impl MySqlStore {
    /// Connects to `url` (`mysql://user:password@host:3306/db`) with the
    /// default options.
    ///
    /// # Errors
    ///
    /// As [`MySqlStoreBuilder::open`].
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        Self::builder(url).open().await
    }

    /// Options: table, pool size, wait timeout, purge, test time offset.
    pub fn builder(url: &str) -> MySqlStoreBuilder {
        MySqlStoreBuilder {
            url: url.to_owned(),
            pool_size: 16,
            wait_timeout: Duration::from_secs(5),
            commit_claims_first: false,
            mariadb_sql: true,
            settings: Settings::default(),
        }
    }

    /// Transactional requests rolled back because they held their
    /// transaction past their max hold time, since the store opened.
    pub fn transactions_held_too_long(&self) -> u64 {
        self.limits.held_too_long()
    }

    /// The pool (its connections run at `READ COMMITTED`, in UTC), for the
    /// application's own queries.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    fn offset_ms(&self) -> i64 {
        self.limits.offset_ms()
    }

    /// The lease renewal of one claim, fenced by its token, on `pool`.
    async fn renew_on(
        &self,
        pool: &MySqlPool,
        id: RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let renewed = q(&self.sql.renew)
            .bind(
                self.offset_ms()
                    .saturating_add(tower_idempotency::store::duration_ms(lease)),
            )
            .bind(record_key(id.scope(), id.key()))
            .bind(token.0)
            .bind(self.offset_ms())
            .execute(pool)
            .await
            .map_err(unavailable)?;
        Ok(renewed.rows_affected() == 1)
    }

    /// Read first: a completed record is answered by one consistent read,
    /// without the claim's row lock, so replays of one key run in
    /// parallel: the replay, or 422. Safe for the reason the PostgreSQL
    /// stores' read is (see `store::kit::pg_sql`): a completed record does
    /// not change until its TTL ends, and the read decides no race.
    async fn read_completed(
        &self,
        conn: &mut MySqlConnection,
        req: &ClaimRequest,
        id: &[u8],
        sent: std::time::Instant,
    ) -> Result<Option<Refusal>, StoreError> {
        let row = q(&self.sql.completed)
            .bind(self.offset_ms())
            .bind(id)
            .bind(self.offset_ms())
            .fetch_optional(&mut *conn)
            .await
            .map_err(unavailable)?;
        crate::read_first::answer(row, req, &self.limits.replays, sent)
    }

    /// `insert` (`insert_first` or `insert_inside`) with a new record's
    /// parameters: `(id, scope, key, fingerprint, token, lease ms, TTL ms,
    /// offset)`.
    fn new_record<'q>(
        &self,
        insert: &Arc<str>,
        req: &'q ClaimRequest,
        id: &'q [u8],
    ) -> sqlx::query::Query<'q, MySql, MySqlArguments> {
        q(insert)
            .bind(id)
            .bind(&req.scope)
            .bind(&req.key)
            .bind(&req.fingerprint.0[..])
            .bind(req.token.0)
            .bind(tower_idempotency::store::duration_ms(req.lease))
            .bind(tower_idempotency::store::duration_ms(req.ttl))
            .bind(self.offset_ms())
    }

    /// The insert of a new key on its own (autocommit): `true` when it
    /// inserted, `false` when a record is there (a duplicate key, or on
    /// Galera a certification failure: the locking claim then reads and
    /// judges it).
    async fn insert_first(
        &self,
        conn: &mut MySqlConnection,
        req: &ClaimRequest,
        id: &[u8],
    ) -> Result<bool, StoreError> {
        let inserted = self
            .new_record(&self.sql.insert_first, req, id)
            .execute(conn)
            .await;
        match inserted {
            Ok(done) => Ok(done.rows_affected() == 1),
            Err(e) if is_duplicate(&e) => Ok(false),
            // On a Galera cluster a record inserted at once on another node
            // fails this one's certification at its commit (1213): judged
            // as the duplicate it is.
            Err(e) if is_deadlock(&e) => Ok(false),
            Err(e) => Err(unavailable(e)),
        }
    }

    /// One try of the claim, in one transaction. Its lock step is the
    /// insert itself: `INSERT ... ON DUPLICATE KEY UPDATE` inserts the
    /// record or takes the row lock of the one there.
    async fn try_claim(
        &self,
        conn: &mut MySqlConnection,
        req: &ClaimRequest,
        id: &[u8],
    ) -> Result<Found, sqlx::Error> {
        let offset = self.offset_ms();
        // Dropped unfinished (an error below), the transaction rolls back.
        let mut tx = sqlx::Connection::begin(conn).await?;
        let now: i64 = sqlx::query_scalar(AssertSqlSafe(self.sql.now.clone()))
            .bind(offset)
            .fetch_one(&mut *tx)
            .await?;
        let mut steps = Steps {
            conn: &mut tx,
            sql: &self.sql,
            id,
            offset,
        };
        let found = claim_in(&mut steps, req, now).await?;
        if found.is_acquired() {
            tx.commit().await?;
        } else {
            // Nothing to keep (the duplicate only bumped `claims`).
            tx.rollback().await?;
        }
        Ok(found)
    }

    /// [`Store::claim`], before a lock wait's timeout is answered.
    async fn claim_committed(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        // A replay cached by an earlier one needs no read (off unless the
        // builder sets `replay_cache`).
        let sent = self.limits.instant();
        if let Some(claim) = answer_cached(&self.limits.replays, &req, sent) {
            return Ok(claim);
        }
        let id = record_key(&req.scope, &req.key);
        // One connection for every statement of the claim: the pool tests
        // a connection (a ping, one round trip) each time it hands one out.
        let mut conn = self.pool.acquire().await.map_err(unavailable)?;
        if let Some(refused) = self.read_completed(&mut conn, &req, &id, sent).await? {
            return Ok(Claim::Refused(refused));
        }
        // Then a new key is claimed by its insert alone, outside a
        // transaction: the primary key decides who is first.
        if self.insert_first(&mut conn, &req, &id).await? {
            return Ok(Claim::Acquired { taken_over: false });
        }
        let mut tries = 0;
        loop {
            tries += 1;
            match self.try_claim(&mut conn, &req, &id).await {
                Ok(found) => return found.into_claim(),
                // InnoDB rolled the whole transaction back: nothing of it
                // stays, so it is tried again from the start.
                Err(e) if is_deadlock(&e) && tries < 3 => continue,
                Err(sqlx::Error::Decode(e)) => return Err(StoreError::Corrupt(e.to_string())),
                Err(e) => return Err(unavailable(e)),
            }
        }
    }
}

/// The claim's statements on one record (`id`, its primary key), in one
/// transaction.
struct Steps<'a> {
    conn: &'a mut MySqlConnection,
    sql: &'a Sql,
    id: &'a [u8],
    /// The clock's offset (ms), for the server's clock read under the lock.
    offset: i64,
}

impl ClaimSteps for Steps<'_> {
    type Error = sqlx::Error;

    async fn insert(
        &mut self,
        req: &ClaimRequest,
        lease_until: i64,
        expires_at: i64,
    ) -> Result<bool, sqlx::Error> {
        let inserted = q(&self.sql.insert)
            .bind(self.id)
            .bind(&req.scope)
            .bind(&req.key)
            .bind(&req.fingerprint.0[..])
            .bind(req.token.0)
            .bind(lease_until)
            .bind(expires_at)
            .execute(&mut *self.conn)
            .await?;
        Ok(inserted.rows_affected() == 1)
    }

    /// The record was there; this transaction holds its row lock now, and
    /// reads the server's clock again under it.
    async fn select(&mut self, _: &ClaimRequest) -> Result<Option<Met>, sqlx::Error> {
        let row = q(&self.sql.select)
            .bind(self.offset)
            .bind(self.id)
            .fetch_one(&mut *self.conn)
            .await?;
        Ok(Some(Met {
            fingerprint: row.try_get(0)?,
            completed: row.try_get::<String, _>(1)? == "completed",
            lease_until: row.try_get(2)?,
            expires_at: row.try_get(3)?,
            response: row.try_get(4)?,
            now: Some(row.try_get(5)?),
        }))
    }

    async fn take_over(
        &mut self,
        req: &ClaimRequest,
        lease_until: i64,
        expires_at: i64,
    ) -> Result<(), sqlx::Error> {
        q(&self.sql.take_over)
            .bind(&req.fingerprint.0[..])
            .bind(req.token.0)
            .bind(lease_until)
            .bind(expires_at)
            .bind(self.id)
            .execute(&mut *self.conn)
            .await?;
        Ok(())
    }

    fn vanished() -> sqlx::Error {
        sqlx::Error::RowNotFound
    }
}

impl Store for MySqlStore {
    /// Waits on a claim held in another open transaction (one phase) are
    /// bounded by the server's `innodb_lock_wait_timeout` (50 s by
    /// default), then refused as in flight.
    async fn claim(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        let hold = req.hold();
        busy_is_in_flight(self.claim_committed(req).await, hold, |e| {
            e.downcast_ref::<sqlx::Error>()
                .is_some_and(is_lock_wait_timeout)
        })
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        let done = q(&self.sql.complete)
            .bind(response.encode())
            .bind(record_key(id.scope(), id.key()))
            .bind(token.0)
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        Ok(if done.rows_affected() == 1 {
            Completion::Stored
        } else {
            Completion::Fenced
        })
    }

    async fn release(&self, id: RecordId, token: FencingToken) -> Result<bool, StoreError> {
        let deleted = q(&self.sql.release)
            .bind(record_key(id.scope(), id.key()))
            .bind(token.0)
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        Ok(deleted.rows_affected() == 1)
    }

    async fn renew(
        &self,
        id: RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        self.renew_on(&self.pool, id, token, lease).await
    }

    /// One statement for all `claims`, on the renewals' own connection.
    /// When it renewed fewer than all, each is asked again on its own to
    /// learn which (renewing a claim twice is harmless).
    async fn renew_all(
        &self,
        claims: Vec<(RecordId, FencingToken)>,
        lease: Duration,
    ) -> Result<Vec<bool>, StoreError> {
        if claims.is_empty() {
            return Ok(Vec::new());
        }
        let offset = self.offset_ms();
        let mut update = sqlx::query(AssertSqlSafe(self.sql.renew_all(claims.len())))
            .persistent(false)
            .bind(offset.saturating_add(tower_idempotency::store::duration_ms(lease)))
            .bind(offset);
        let ids: Vec<Vec<u8>> = claims
            .iter()
            .map(|(id, _)| record_key(id.scope(), id.key()))
            .collect();
        for id in &ids {
            update = update.bind(id.clone());
        }
        for (id, (_, token)) in ids.into_iter().zip(&claims) {
            update = update.bind(id).bind(token.0);
        }
        let renewed = update.execute(&self.renewals).await.map_err(unavailable)?;
        if renewed.rows_affected() == claims.len() as u64 {
            return Ok(vec![true; claims.len()]);
        }
        let mut each = Vec::with_capacity(claims.len());
        for (id, token) in claims {
            each.push(self.renew_on(&self.renewals, id, token, lease).await?);
        }
        Ok(each)
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        in_batches(self.limits.purge_batch, |rows| {
            let purge = q(&self.sql.purge).bind(self.offset_ms()).bind(rows);
            async move {
                let purged = purge.execute(&self.pool).await.map_err(unavailable)?;
                Ok(purged.rows_affected())
            }
        })
        .await
    }
}
