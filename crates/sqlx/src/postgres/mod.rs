//! PostgreSQL through the application's own `sqlx::PgPool` (feature
//! `sqlx-postgres`, sqlx 0.9).
//!
//! * `sql.rs`: the statements and the schema, the same as `PostgresStore`'s
//!   (`tower-idempotency-postgres`), so both stores can share one table.
//! * `transaction.rs`: [`SqlxPostgresTransaction`] (the crate's
//!   [`SqlxTransaction`](crate::SqlxTransaction) on PostgreSQL) and the steps on which the store kit runs
//!   [`TransactionalStore`](tower_idempotency::store::TransactionalStore) in two phases.
//! * `inspect.rs`: [`Inspect`](tower_idempotency::store::Inspect) in SQL.
//! * `listen.rs`: the `LISTEN` connection (sqlx's `PgListener`) that wakes
//!   waiting repeats with `notify_waiters`.
//!
//! # Example
//!
//! ```no_run
//! use sqlx::PgPool;
//! use tower_idempotency::{IdempotencyLayer, scope::GlobalScope};
//! use tower_idempotency_sqlx::SqlxPostgresStore;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = PgPool::connect("postgres://app@db.internal/app").await?;
//! // Creates the `idempotency_records` table if it is missing.
//! let store = SqlxPostgresStore::from_pool(pool).await?;
//! let layer = IdempotencyLayer::new(store, GlobalScope).transactional();
//! # Ok(()) }
//! ```

use std::sync::Arc;

use sqlx::{PgConnection, PgPool, Row};

use tower_idempotency::response::StoredResponse;
use tower_idempotency::store::kit::builder::{Limits, Settings};
use tower_idempotency::store::kit::feed::{
    DEFAULT_MAX_WATCHED_KEYS, Feed, change_key, change_payload,
};
use tower_idempotency::store::kit::held::HeldKeys;
use tower_idempotency::store::kit::purge::{PurgeTask, in_batches};
use tower_idempotency::store::{
    Claim, ClaimRequest, Completion, FencingToken, RecordId, Refusal, Store, StoreError, Watch,
};

mod inside;
mod inspect;
mod listen;
mod sql;
mod transaction;

use sql::{Sql, advisory_key, checked, query, schema, schema_current};
use tower_idempotency::store::kit::claim::{ClaimSteps, Met, answer_cached, claim_in};
use tower_idempotency::store::kit::pg_sql::{
    LOCK_NOT_AVAILABLE, busy_is_in_flight, lock_wait_ms, renew_arrays, renewed_in_order,
};
pub use transaction::{SqlxPostgresError, SqlxPostgresTransaction};

/// Records in a PostgreSQL table, reached through the application's own
/// [`sqlx::PgPool`]; leases and TTLs judged by the database server's clock.
///
/// The same records, statements and rules as `PostgresStore` (the crate
/// `tower-idempotency-postgres`, tokio-postgres), over sqlx instead:
///
/// * A claim first reads the record with one plain `SELECT` (no lock): a
///   completed record within its TTL is answered from it, so replays of one
///   key run in parallel (and, with
///   [`SqlxPostgresStoreBuilder::replay_cache`], from memory after that,
///   until the TTL it had left). Otherwise it inserts the in-flight record with
///   `INSERT ... ON CONFLICT DO NOTHING`, without a transaction or a lock
///   (the primary key `(scope, key)` decides who is first, across every app
///   server): a new key is claimed there. A record it meets is judged in a
///   transaction that first takes a transaction-level advisory lock on the
///   key. Both commit with
///   `synchronous_commit = off` (see `docs/contract.md` §8). The lock key, the table and its columns are `PostgresStore`'s:
///   the two stores may share a table, e.g. while a fleet moves from one to
///   the other.
/// * Transactional mode ([`tower_idempotency::mode::Transactional`]) writes
///   the claim inside the handler's transaction ([`SqlxPostgresTransaction`]),
///   after the same read, as `PostgresStore` does: it commits with the
///   handler's writes and the completion, or vanishes with them, so a crash,
///   a dropped connection or a rollback frees the key at once and no lease
///   is renewed. Another server's repeat waits on the uncommitted claim at
///   most its `wait_in_flight` (100 ms without it); this server's are answered
///   before they take a connection. With
///   [`SqlxPostgresStoreBuilder::commit_claims_first`] it runs in two phases
///   instead: the claim commits at once (every server sees the key in
///   flight), then the handler's writes and the completion commit together,
///   only while the record still carries this request's fencing token; a
///   crash leaves the key in flight until its lease ends.
/// * A transactional request holds its transaction (and a connection of the
///   pool) at most the layer's max hold (default 60 s); past it the store
///   rolls it back and the request gets 503 (see [`SqlxPostgresTransaction`],
///   "Max hold time").
/// * Lease renewals run in one statement per batch on a connection of
///   their own (made with the pool's connect options), so they never wait
///   behind requests for the pool.
/// * Connections come from the application's pool: its size and its
///   `acquire_timeout` (sqlx's default 30 s) apply. A connection that cannot
///   be had in time, or a server that cannot be reached, is
///   [`StoreError::Unavailable`]: the layer answers 503. A claim runs its
///   statements on one connection, taken from the pool once (a pool that
///   tests connections before it hands them out, sqlx's default, pays that
///   round trip once). In transactional mode each request in its handler
///   holds one connection of the pool.
/// * TLS is the pool's: enable one of sqlx's TLS features (e.g.
///   `tls-rustls`) in the application's own `sqlx` dependency; Cargo unifies
///   the features, and this crate enables none.
/// * The table (default `idempotency_records`) is created by
///   [`SqlxPostgresStore::from_pool`] / [`SqlxPostgresStoreBuilder::open`] under an
///   advisory lock, so app servers starting together do not race.
/// * Repeats waiting on another server
///   ([`IdempotencyLayer::wait_in_flight`](tower_idempotency::IdempotencyLayer::wait_in_flight))
///   poll, unless [`SqlxPostgresStoreBuilder::notify_waiters`] has the store
///   announce completions and releases (`NOTIFY`) and listen for them
///   (`LISTEN`, on one connection outside the pool).
///
/// # Example
///
/// ```no_run
/// use std::time::Duration;
/// use sqlx::postgres::PgPoolOptions;
/// use tower_idempotency_sqlx::SqlxPostgresStore;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let pool = PgPoolOptions::new()
///     .max_connections(16)
///     .acquire_timeout(Duration::from_secs(5))
///     .connect("postgres://app@db.internal/app")
///     .await?;
/// let store = SqlxPostgresStore::builder(pool)
///     .table("idempotency_records") // created if missing
///     .open()
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SqlxPostgresStore {
    pool: PgPool,
    /// One connection of its own for lease renewals
    /// ([`Store::renew_all`]), so they never wait behind requests.
    renewals: PgPool,
    sql: Arc<Sql>,
    /// Max hold, the transactions held past it, the test clock offset.
    limits: Limits,
    /// Completions and releases announced to waiting repeats
    /// (`notify_waiters`): the feed their watches share. Its listener
    /// connects as `pool` does.
    feed: Option<Feed>,
    /// Transactional claims inside the handler's transaction (the
    /// default): the keys this process's open ones hold. `None` with
    /// [`SqlxPostgresStoreBuilder::commit_claims_first`].
    one_phase: Option<Arc<HeldKeys>>,
}

impl std::fmt::Debug for SqlxPostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlxPostgresStore")
            .field("table", &self.sql.table)
            .finish_non_exhaustive()
    }
}

/// Options for [`SqlxPostgresStore`]; made by [`SqlxPostgresStore::builder`].
#[must_use]
pub struct SqlxPostgresStoreBuilder {
    pool: PgPool,
    notify: bool,
    commit_claims_first: bool,
    settings: Settings,
}

impl std::fmt::Debug for SqlxPostgresStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqlxPostgresStoreBuilder")
            .field("table", &self.settings.table)
            .field("notify_waiters", &self.notify)
            .finish_non_exhaustive()
    }
}

/// Every sqlx error of the store is [`StoreError::Unavailable`]: a server
/// that cannot be reached, a pool timeout, a failed statement.
pub(super) fn unavailable(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> StoreError {
    StoreError::unavailable(e)
}

tower_idempotency::store::kit::builder::sql_builder_settings!(
    SqlxPostgresStoreBuilder,
    SqlxPostgresTransaction
);

impl SqlxPostgresStoreBuilder {
    /// Whether a transactional request's claim commits on its own before
    /// the handler runs, in two phases (default `false`: it is written
    /// inside the handler's transaction, so a crash frees the key at once
    /// and no lease is renewed; another server's repeat waits on it at most
    /// its `wait_in_flight`, 100 ms without it). `PostgresStoreBuilder::commit_claims_first`
    /// (tokio-postgres) is the same switch, and `docs/contract.md` §9 says
    /// what each promises.
    pub fn commit_claims_first(mut self, on: bool) -> Self {
        self.commit_claims_first = on;
        self
    }

    /// Whether completions and releases wake repeats waiting on other
    /// servers ([`IdempotencyLayer::wait_in_flight`](tower_idempotency::IdempotencyLayer::wait_in_flight))
    /// through PostgreSQL's `NOTIFY` (default off). On, the completion's and
    /// the release's statement also run `pg_notify` on the channel
    /// `tower_idempotency` with a 16-hex-digit hash of the table, scope and
    /// key (no key is sent), delivered when they commit (in transactional
    /// mode, with the handler's transaction); the store keeps one more
    /// connection, outside the pool (made with the pool's connect options
    /// and acquire timeout), on which sqlx's `PgListener` `LISTEN`s, opened
    /// when the first repeat waits and opened again, with backoff, if it
    /// drops. A waiter on another server then answers within about a
    /// millisecond of the completion instead of up to 100 ms (polling). The
    /// announcements are `PostgresStore`'s (`tower-idempotency-postgres`):
    /// on one table, either store's completions wake the other's waiters.
    ///
    /// Off by default because PostgreSQL serialises the commits of
    /// transactions that `NOTIFY` (one lock on the notification queue, held
    /// through the commit): completions that run at once then commit one at
    /// a time. `PostgresStoreBuilder::notify_waiters` gives pgbench figures
    /// (with 8 clients on one local server, under a fifth of the
    /// completions a second of the statement without `NOTIFY`). Turn it on
    /// where repeats wait often and completions are not the bottleneck.
    ///
    /// # Example
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use sqlx::PgPool;
    /// use tower_idempotency::{IdempotencyLayer, scope::GlobalScope};
    /// use tower_idempotency_sqlx::SqlxPostgresStore;
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let pool = PgPool::connect("postgres://app@db.internal/app").await?;
    /// let store = SqlxPostgresStore::builder(pool)
    ///     .notify_waiters(true)
    ///     .open()
    ///     .await?;
    /// // A repeat of a request in flight on another server waits for its
    /// // answer, woken by that server's NOTIFY.
    /// let layer = IdempotencyLayer::new(store, GlobalScope)
    ///     .wait_in_flight(Duration::from_secs(10));
    /// # Ok(()) }
    /// ```
    pub fn notify_waiters(mut self, on: bool) -> Self {
        self.notify = on;
        self
    }

    /// Checks the table name, then creates the table and its index if they
    /// are missing (`CREATE ... IF NOT EXISTS`, in one transaction holding an
    /// advisory lock, so servers starting together do not race).
    ///
    /// # Errors
    ///
    /// [`StoreError::Config`] for a table name outside the rule of
    /// [`SqlxPostgresStoreBuilder::table`], before any connection is tried;
    /// [`StoreError::Unavailable`] when the pool has no connection to give
    /// (a server that cannot be reached) or the statements fail (e.g. a role
    /// without `CREATE` on the schema).
    pub async fn open(self) -> Result<SqlxPostgresStore, StoreError> {
        tower_idempotency::store::kit::table::check_table_name(&self.settings.table)?;
        let sql = Sql::new(&self.settings.table, checked);
        let current: bool = sqlx::query_scalar(checked(schema_current(&self.settings.table)))
            .fetch_one(&self.pool)
            .await
            .map_err(unavailable)?;
        if !current {
            let mut tx = self.pool.begin().await.map_err(unavailable)?;
            // Two servers starting at once would race on CREATE TABLE.
            sqlx::query("SELECT pg_advisory_xact_lock($1)")
                .bind(advisory_key(&self.settings.table, "migrate", ""))
                .execute(&mut *tx)
                .await
                .map_err(unavailable)?;
            sqlx::raw_sql(checked(schema(&self.settings.table)))
                .execute(&mut *tx)
                .await
                .map_err(unavailable)?;
            tx.commit().await.map_err(unavailable)?;
        }
        let mut store = SqlxPostgresStore {
            renewals: crate::renewals::options_beside(&self.pool)
                .connect_lazy_with((*self.pool.connect_options()).clone()),
            pool: self.pool,
            sql: Arc::new(sql),
            limits: self.settings.limits(),
            feed: self.notify.then(|| Feed::new(DEFAULT_MAX_WATCHED_KEYS)),
            one_phase: (!self.commit_claims_first).then(Arc::default),
        };
        store.limits.purge_task = PurgeTask::start(store.clone(), self.settings.purge);
        Ok(store)
    }
}

impl SqlxPostgresStore {
    /// The store on `pool` with the default options (table
    /// `idempotency_records`); creates the table if it is
    /// missing.
    ///
    /// # Errors
    ///
    /// As [`SqlxPostgresStoreBuilder::open`].
    pub async fn from_pool(pool: PgPool) -> Result<Self, StoreError> {
        Self::builder(pool).open().await
    }

    /// Options: table, purge, `notify_waiters`, test time offset.
    /// The pool's own options (size, timeouts, TLS) are the application's.
    pub fn builder(pool: PgPool) -> SqlxPostgresStoreBuilder {
        SqlxPostgresStoreBuilder {
            pool,
            notify: false,
            commit_claims_first: false,
            settings: Settings::default(),
        }
    }

    /// Transactional requests rolled back because they held their
    /// transaction past their max hold time (see
    /// [`SqlxPostgresTransaction`], "Max hold time"), since the store opened.
    pub fn transactions_held_too_long(&self) -> u64 {
        self.limits.held_too_long()
    }

    /// The pool the store was made with.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The table the records live in.
    pub fn table(&self) -> &str {
        &self.sql.table
    }

    fn offset_ms(&self) -> i64 {
        self.limits.offset_ms()
    }

    /// The announcement of a change to `(scope, key)` with
    /// `notify_waiters`, else `None`.
    fn payload(&self, scope: &str, key: &str) -> Option<String> {
        self.feed
            .as_ref()
            .map(|_| change_payload(&self.sql.table, scope, key))
    }

    /// Completes the record on `conn` if it still carries `token`; with
    /// `notify_waiters`, announces it (at the commit, in a transaction).
    async fn complete_on(
        &self,
        conn: &mut PgConnection,
        scope: &str,
        key: &str,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<Completion, sqlx::Error> {
        let completion = query(match self.feed {
            Some(_) => &self.sql.complete_notify,
            None => &self.sql.complete,
        })
        .bind(scope)
        .bind(key)
        .bind(token.0)
        .bind(response.encode());
        // `complete_notify` selects one row per record completed.
        let updated = match self.payload(scope, key) {
            Some(payload) => completion.bind(payload),
            None => completion,
        }
        .execute(conn)
        .await?;
        Ok(if updated.rows_affected() == 1 {
            Completion::Stored
        } else {
            Completion::Fenced
        })
    }
}

/// Whether `e` is PostgreSQL's answer to a lock wait past `lock_timeout`.
fn is_lock_timeout(e: &(dyn std::error::Error + Send + Sync + 'static)) -> bool {
    e.downcast_ref::<sqlx::Error>()
        .and_then(sqlx::Error::as_database_error)
        .and_then(|e| e.code())
        .is_some_and(|code| code == LOCK_NOT_AVAILABLE)
}

/// [`is_lock_timeout`] of a store's error.
fn lock_timed_out(e: &StoreError) -> bool {
    matches!(e, StoreError::Unavailable(e) if is_lock_timeout(e.as_ref()))
}

/// The claim's statements, in a transaction holding the key's advisory
/// lock.
struct Steps<'a> {
    conn: &'a mut PgConnection,
    sql: &'a Sql,
}

impl ClaimSteps for Steps<'_> {
    type Error = StoreError;

    async fn insert(
        &mut self,
        req: &ClaimRequest,
        lease_until: i64,
        expires_at: i64,
    ) -> Result<bool, StoreError> {
        let inserted = query(&self.sql.insert)
            .bind(&req.scope)
            .bind(&req.key)
            .bind(&req.fingerprint.0[..])
            .bind(req.token.0)
            .bind(lease_until)
            .bind(expires_at)
            .execute(&mut *self.conn)
            .await
            .map_err(unavailable)?;
        Ok(inserted.rows_affected() == 1)
    }

    async fn select(&mut self, req: &ClaimRequest) -> Result<Option<Met>, StoreError> {
        let row = query(&self.sql.select)
            .bind(&req.scope)
            .bind(&req.key)
            .fetch_optional(&mut *self.conn)
            .await
            .map_err(unavailable)?;
        row.map(|row| {
            Ok(Met {
                fingerprint: row.try_get(0)?,
                completed: row.try_get::<String, _>(1)? == "completed",
                lease_until: row.try_get(2)?,
                expires_at: row.try_get(3)?,
                response: row.try_get(4)?,
                now: None,
            })
        })
        .transpose()
        .map_err(|e: sqlx::Error| unavailable(e))
    }

    async fn take_over(
        &mut self,
        req: &ClaimRequest,
        lease_until: i64,
        expires_at: i64,
    ) -> Result<(), StoreError> {
        query(&self.sql.take_over)
            .bind(&req.scope)
            .bind(&req.key)
            .bind(&req.fingerprint.0[..])
            .bind(req.token.0)
            .bind(lease_until)
            .bind(expires_at)
            .execute(&mut *self.conn)
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    fn vanished() -> StoreError {
        unavailable("the conflicting record kept vanishing")
    }
}

impl SqlxPostgresStore {
    /// A completed record's answer from the replay cache or the read-first
    /// `SELECT` (see [`SqlxPostgresStore::read_completed`]).
    async fn read_first(
        &self,
        conn: &mut PgConnection,
        req: &ClaimRequest,
    ) -> Result<Option<Refusal>, StoreError> {
        let sent = self.limits.instant();
        match answer_cached(&self.limits.replays, req, sent) {
            Some(Claim::Refused(refused)) => Ok(Some(refused)),
            _ => self.read_completed(conn, req, sent).await,
        }
    }

    /// Read first: a completed record is answered by one plain `SELECT`,
    /// without the lock (see `store::kit::pg_sql`): the replay, or 422.
    async fn read_completed(
        &self,
        conn: &mut PgConnection,
        req: &ClaimRequest,
        sent: std::time::Instant,
    ) -> Result<Option<Refusal>, StoreError> {
        let row = query(&self.sql.completed)
            .bind(&req.scope)
            .bind(&req.key)
            .bind(self.offset_ms())
            .fetch_optional(&mut *conn)
            .await
            .map_err(unavailable)?;
        crate::read_first::answer(row, req, &self.limits.replays, sent)
    }

    /// [`Store::claim`], its lock waits bounded by the claim's own wait.
    async fn claim_committed(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        // A replay cached by an earlier one needs no read (off unless the
        // builder sets `replay_cache`).
        let sent = self.limits.instant();
        if let Some(claim) = answer_cached(&self.limits.replays, &req, sent) {
            return Ok(claim);
        }
        // One connection for every statement of the claim: a pool that
        // tests a connection before it hands it out (sqlx's default) pays a
        // round trip for each.
        let mut conn = self.pool.acquire().await.map_err(unavailable)?;
        if let Some(refused) = self.read_completed(&mut conn, &req, sent).await? {
            return Ok(Claim::Refused(refused));
        }
        // Then a new key is claimed by its insert alone, without the lock.
        let inserted = query(&self.sql.insert_first)
            .bind(&req.scope)
            .bind(&req.key)
            .bind(&req.fingerprint.0[..])
            .bind(req.token.0)
            .bind(self.offset_ms())
            .bind(tower_idempotency::store::duration_ms(req.lease))
            .bind(tower_idempotency::store::duration_ms(req.ttl))
            .bind(lock_wait_ms(req.wait_in_flight))
            .execute(&mut *conn)
            .await
            .map_err(unavailable)?;
        if inserted.rows_affected() == 1 {
            return Ok(Claim::Acquired { taken_over: false });
        }
        // Dropped unfinished (an error below, a cancelled request), the
        // transaction rolls back (sqlx queues the ROLLBACK on the connection
        // before the pool hands it out again).
        let mut tx = sqlx::Connection::begin(&mut *conn)
            .await
            .map_err(unavailable)?;
        let now: i64 = sqlx::query_scalar(self.sql.lock_now.clone())
            .bind(advisory_key(&self.sql.table, &req.scope, &req.key))
            .bind(self.offset_ms())
            .bind(lock_wait_ms(req.wait_in_flight))
            .fetch_one(&mut *tx)
            .await
            .map_err(unavailable)?;
        let mut steps = Steps {
            conn: &mut tx,
            sql: &self.sql,
        };
        let found = claim_in(&mut steps, &req, now).await?;
        tx.commit().await.map_err(unavailable)?;
        found.into_claim()
    }
}

impl Store for SqlxPostgresStore {
    async fn claim(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        let hold = req.hold();
        busy_is_in_flight(self.claim_committed(req).await, hold, is_lock_timeout)
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        let (scope, key) = id.into_parts();
        let mut conn = self.pool.acquire().await.map_err(unavailable)?;
        self.complete_on(&mut conn, &scope, &key, token, &response)
            .await
            .map_err(unavailable)
    }

    async fn release(&self, id: RecordId, token: FencingToken) -> Result<bool, StoreError> {
        let payload = self.payload(id.scope(), id.key());
        let (scope, key) = id.into_parts();
        let release = query(match payload {
            Some(_) => &self.sql.release_notify,
            None => &self.sql.release,
        })
        .bind(scope)
        .bind(key)
        .bind(token.0);
        // `release_notify` selects one row per record released.
        let deleted = match payload {
            Some(payload) => release.bind(payload),
            None => release,
        }
        .execute(&self.pool)
        .await
        .map_err(unavailable)?;
        Ok(deleted.rows_affected() == 1)
    }

    async fn renew(
        &self,
        id: RecordId,
        token: FencingToken,
        lease: std::time::Duration,
    ) -> Result<bool, StoreError> {
        let (scope, key) = id.into_parts();
        let renewed = query(&self.sql.renew)
            .bind(scope)
            .bind(key)
            .bind(token.0)
            .bind(self.offset_ms())
            .bind(tower_idempotency::store::duration_ms(lease))
            .execute(&self.pool)
            .await
            .map_err(unavailable)?;
        Ok(renewed.rows_affected() == 1)
    }

    /// One statement for all `claims`, on the renewals' own connection.
    async fn renew_all(
        &self,
        claims: Vec<(RecordId, FencingToken)>,
        lease: std::time::Duration,
    ) -> Result<Vec<bool>, StoreError> {
        let (scopes, keys, tokens) = renew_arrays(&claims);
        let rows = query(&self.sql.renew_all)
            .bind(scopes)
            .bind(keys)
            .bind(tokens)
            .bind(self.offset_ms())
            .bind(tower_idempotency::store::duration_ms(lease))
            .fetch_all(&self.renewals)
            .await
            .map_err(unavailable)?;
        let rows = rows.iter().map(|row| (row.get(0), row.get(1)));
        Ok(renewed_in_order(&claims, rows))
    }

    /// With `notify_waiters`: woken by the `NOTIFY` of any server's
    /// completion or release of `id`; starts the `LISTEN` connection.
    fn watch(&self, id: &RecordId) -> Option<Watch> {
        let feed = self.feed.as_ref()?;
        listen::start(feed, &self.pool);
        feed.watch(change_key(&self.sql.table, id.scope(), id.key()))
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        in_batches(self.limits.purge_batch, |rows| {
            let purge = query(&self.sql.purge)
                .bind(self.offset_ms())
                .bind(i64::from(rows));
            async move {
                let purged = purge.execute(&self.pool).await.map_err(unavailable)?;
                Ok(purged.rows_affected())
            }
        })
        .await
    }
}
