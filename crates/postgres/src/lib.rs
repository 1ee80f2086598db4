#![doc = include_str!("../README.md")]
// Source map (for contributors; docs/architecture.md maps every file):
// `lib.rs` holds `PostgresStore`, its builder and its `Store` methods
// (on the core's store kit: `kit::claim`, `kit::pg_sql`);
// `transaction.rs` `PostgresTransaction` and transactional mode (the
// kit's `TwoPhase`); `inside.rs` the claim inside the handler's
// transaction (one phase, the default); `tx.rs` the connection inside one; `inspect.rs` `Inspect`
// in SQL; `connect.rs` the URL's libpq TLS parameters and start-up errors;
// `listen.rs` the LISTEN connection that wakes waiting repeats;
// `sslmode.rs` `sslmode` and `sslrootcert`; `tls.rs` the rustls connector
// (feature `tls`).
#![deny(unsafe_code, unreachable_pub)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{GenericClient, Object, Pool};
use tokio_postgres::Statement;

use tower_idempotency::response::StoredResponse;
use tower_idempotency::store::kit::builder::{Limits, Settings};
use tower_idempotency::store::kit::claim::{
    ClaimSteps, CompletedRow, Met, answer_cached, answer_completed, claim_in,
};
use tower_idempotency::store::kit::feed::{DEFAULT_MAX_WATCHED_KEYS, Feed, change_payload};
use tower_idempotency::store::kit::held::HeldKeys;
use tower_idempotency::store::kit::pg_sql::{
    LOCK_NOT_AVAILABLE, PgSql, advisory_key, busy_is_in_flight, lock_wait_ms, renew_arrays,
    renewed_in_order, schema, schema_current,
};
use tower_idempotency::store::kit::purge::{PurgeTask, in_batches};
use tower_idempotency::store::{
    Claim, ClaimRequest, Completion, FencingToken, RecordId, Refusal, Store, StoreError, Watch,
    duration_ms,
};

mod connect;
mod finish;
mod inside;
mod inspect;
mod listen;
mod sslmode;
#[cfg(feature = "tls")]
mod tls;
mod transaction;
mod tx;

/// The deadpool-postgres this crate is built with: [`PostgresStore::pool`]
/// is its `Pool`, and [`TransactionClient::statement_cache`] its
/// `StatementCache`.
pub use deadpool_postgres;
/// The tokio-postgres this crate is built with, for the statements a handler
/// runs through [`PostgresTransaction::client`].
pub use tokio_postgres;
pub use transaction::{PostgresTransaction, TransactionClient};

/// The long form: setup, TLS, failover and partitions, with examples that
/// compile.
#[doc = include_str!("../docs/guide.md")]
pub mod guide {}

/// Records in a PostgreSQL table; leases and TTLs judged by the database
/// server's clock.
///
/// * A claim first reads the record with one plain `SELECT` (no lock): a
///   completed record within its TTL is answered from it (a replay, or 422
///   for another fingerprint), so replays of one key run in parallel. With
///   [`PostgresStoreBuilder::replay_cache`], the next replays of that record
///   need no statement at all, until the TTL it had left.
/// * Otherwise it inserts the in-flight record with `INSERT ... ON CONFLICT
///   DO NOTHING`, again without a transaction or a lock: the primary key
///   `(scope, key)` decides who is first, across every app server, and a
///   new key is claimed there. A record it meets (in flight, or past its
///   TTL) is judged in a transaction that first takes a transaction-level
///   advisory lock on the key, then reads the record under a row lock.
///   Both commit with `synchronous_commit = off` (visible at once, made
///   durable by the next durable commit); why that loses no effect is in
///   `docs/contract.md` §8.
/// * Transactional mode ([`Transactional`](tower_idempotency::mode::Transactional))
///   writes the claim inside the handler's transaction ([`PostgresTransaction`]),
///   after the same read: `BEGIN`, the insert and its bounded lock wait are
///   one round trip, and the claim commits with the handler's writes and the
///   completion, or vanishes with them. A crash, a dropped connection or a
///   rollback frees the key at once; no lease is renewed. Another server's
///   repeat waits on the uncommitted claim at most its
///   [`wait_in_flight`](tower_idempotency::IdempotencyLayer::wait_in_flight)
///   (100 ms without it), then replays, runs, or gets 409; this server's own
///   repeats are answered before they take a connection (422 at once for
///   another body). With [`PostgresStoreBuilder::commit_claims_first`] it
///   runs in two phases instead, as brandur's "atomic phases": the claim
///   commits at once (every server sees the key in flight, with its
///   fingerprint), then the handler's writes and the completion commit
///   together, only while the record still carries this request's fencing
///   token; a crash leaves the key in flight until its lease ends.
/// * A transactional request holds its transaction (and a pooled
///   connection) at most the layer's max hold (default 60 s); past it the
///   store rolls it back and the request gets 503 (see
///   [`PostgresTransaction`], "Max hold time").
/// * Lease renewals run in one statement per batch on a connection of
///   their own, outside the pool, so they never wait behind requests.
/// * Connections come from a deadpool pool (default 16); a connection that
///   cannot be had in time, or a server that cannot be reached, is
///   [`StoreError::Unavailable`]: the layer answers 503.
/// * The table (default `idempotency_records`) is created on open under an
///   advisory lock, so app servers starting together do not race.
///
/// # Example
///
/// ```no_run
/// use tower_idempotency::{IdempotencyLayer, scope::GlobalScope};
/// use tower_idempotency_postgres::PostgresStore;
///
/// # async fn run() -> Result<(), tower_idempotency::StoreError> {
/// let store = PostgresStore::open("postgres://app@db.internal/app").await?;
/// let layer = IdempotencyLayer::new(store, GlobalScope).transactional();
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    pool: Pool,
    /// One connection of its own for lease renewals
    /// ([`Store::renew_all`]), so they never wait behind requests.
    renewals: Pool,
    sql: Arc<Sql>,
    /// Max hold, the transactions held past it, the test clock offset.
    limits: Limits,
    /// Completions and releases announced to waiting repeats
    /// (`notify_waiters`): the feed their watches share, and where its
    /// listener connects.
    notify: Option<(Feed, Arc<connect::Target>)>,
    /// Transactional claims inside the handler's transaction (the
    /// default): the keys this process's open ones hold. `None` with
    /// [`PostgresStoreBuilder::commit_claims_first`].
    one_phase: Option<Arc<HeldKeys>>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("table", &self.sql.table)
            .finish_non_exhaustive()
    }
}

/// Options for [`PostgresStore`]; made by [`PostgresStore::builder`].
#[must_use]
pub struct PostgresStoreBuilder {
    url: String,
    pool_size: u32,
    wait_timeout: Duration,
    notify: bool,
    commit_claims_first: bool,
    settings: Settings,
}

/// The statements, with the table name in them.
type Sql = PgSql<String>;

fn unavailable(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> StoreError {
    StoreError::unavailable(e)
}

/// `sql` prepared once per pooled connection (deadpool's statement cache),
/// so that each later run is one round trip (bind and execute) instead of
/// two (parse, then bind and execute). The store runs a fixed set of
/// statements (those of [`Sql`]), so each connection's cache holds at most
/// that many.
async fn cached<C: GenericClient>(client: &C, sql: &str) -> Result<Statement, StoreError> {
    client.prepare_cached(sql).await.map_err(unavailable)
}

tower_idempotency::store::kit::builder::sql_builder_settings!(
    PostgresStoreBuilder,
    PostgresTransaction
);

impl PostgresStoreBuilder {
    /// Connections kept (default 16). In transactional mode each request
    /// holds one for its handler's whole run, at most the layer's
    /// [`IdempotencyLayer::max_hold`](tower_idempotency::IdempotencyLayer::max_hold).
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// How long a call waits for a pooled connection before it fails with
    /// [`StoreError::Unavailable`] (default 5 s). It bounds opening a new
    /// connection too (TCP, TLS and start-up), so a short one fails calls
    /// whenever the server is slow to accept, not only when the pool is
    /// exhausted.
    pub fn wait_timeout(mut self, timeout: Duration) -> Self {
        self.wait_timeout = timeout;
        self
    }

    /// Whether completions and releases wake repeats waiting on other
    /// servers ([`IdempotencyLayer::wait_in_flight`](tower_idempotency::IdempotencyLayer::wait_in_flight))
    /// through PostgreSQL's `NOTIFY` (default off). On, the completion's and
    /// the release's statement also run `pg_notify` on the channel
    /// `tower_idempotency` with a 16-hex-digit hash of the table, scope and
    /// key (no key is sent), delivered when they commit (in transactional
    /// mode, with the handler's transaction); the store keeps one more
    /// connection, outside the pool, that `LISTEN`s, opened when the first
    /// repeat waits. A waiter on another server then answers within about a
    /// millisecond of the completion instead of up to 100 ms (polling).
    ///
    /// Off by default because PostgreSQL serialises the commits of
    /// transactions that `NOTIFY` (one lock on the notification queue, held
    /// through the commit): with 8 clients completing records at once,
    /// 335 completions a second with `NOTIFY` against 1,760-2,010 without,
    /// on one local server (pgbench, 4,000 completions each). Turn it on
    /// where repeats wait often and completions are not the bottleneck.
    pub fn notify_waiters(mut self, on: bool) -> Self {
        self.notify = on;
        self
    }

    /// Whether a transactional request's claim commits on its own before
    /// the handler runs, in two phases (default `false`: the claim is
    /// written inside the handler's transaction).
    ///
    /// * `false`, one phase: a crash, a dropped connection or a rollback
    ///   frees the key at once, since the database rolls the claim back
    ///   with the handler's writes; no lease is renewed. Another server's
    ///   repeat waits on the uncommitted claim, at most its
    ///   [`wait_in_flight`](tower_idempotency::IdempotencyLayer::wait_in_flight)
    ///   (100 ms without it), then gets the replay, runs (the first rolled
    ///   back) or gets 409. It sees the fingerprint only once the first
    ///   commits: 422 for another body comes after that wait, or is a 409
    ///   until then (this server's own repeats get 422 at once). While it
    ///   runs, the claim is invisible to `Inspect` and the admin router.
    /// * `true`, two phases: every server sees the key in flight, with its
    ///   fingerprint, from the claim on (409 or 422 without waiting on
    ///   anything), and a crash leaves it in flight until its lease ends
    ///   (renewed while the handler runs; default lease 10 s).
    ///
    /// `docs/contract.md` §9 says what each promises.
    pub fn commit_claims_first(mut self, on: bool) -> Self {
        self.commit_claims_first = on;
        self
    }

    /// Connects and creates the table if it is missing.
    ///
    /// # Errors
    ///
    /// [`StoreError::Config`] for a URL that does not parse, a table name
    /// outside the rule of [`PostgresStoreBuilder::table`], or a URL that
    /// asks for TLS (`sslmode=require|verify-ca|verify-full`, `sslrootcert`)
    /// in a build without the `tls` feature;
    /// [`StoreError::Unavailable`] for a server that cannot be reached or a
    /// TLS handshake that fails, with the cause in words (unknown CA, host
    /// name mismatch, server without TLS).
    ///
    /// The URL takes libpq's parameters: `sslmode` and `sslrootcert` as
    /// libpq reads them (see the `tls` feature), several
    /// `host:port` pairs with `target_session_attrs=read-write` (the pool
    /// connects only to the primary, and after a failover to the new one),
    /// `connect_timeout`, `keepalives_idle`, `tcp_user_timeout`, ...
    pub async fn open(self) -> Result<PostgresStore, StoreError> {
        tower_idempotency::store::kit::table::check_table_name(&self.settings.table)?;
        let target = Arc::new(connect::parse(&self.url)?);
        let manager = connect::manager(&target)?;
        let pool = Pool::builder(manager)
            .max_size(self.pool_size as usize)
            .wait_timeout(Some(self.wait_timeout))
            .create_timeout(Some(self.wait_timeout))
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .map_err(unavailable)?;
        let renewals = Pool::builder(connect::manager(&target)?)
            .max_size(1)
            .wait_timeout(Some(self.wait_timeout))
            .create_timeout(Some(self.wait_timeout))
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .map_err(unavailable)?;
        let sql = Sql::new(&self.settings.table, |statement| statement);
        let mut client = pool
            .get()
            .await
            .map_err(|e| connect::startup_error(&target, e))?;
        let current: bool = client
            .query_one(&schema_current(&self.settings.table), &[])
            .await
            .map_err(unavailable)?
            .get(0);
        if !current {
            let tx = client.transaction().await.map_err(unavailable)?;
            // Two servers starting at once would race on CREATE TABLE.
            let lock = advisory_key(&self.settings.table, "migrate", "");
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&lock])
                .await
                .map_err(unavailable)?;
            tx.batch_execute(&schema(&self.settings.table))
                .await
                .map_err(unavailable)?;
            tx.commit().await.map_err(unavailable)?;
        }
        let mut store = PostgresStore {
            pool,
            renewals,
            sql: Arc::new(sql),
            limits: self.settings.limits(),
            notify: self
                .notify
                .then(|| (Feed::new(DEFAULT_MAX_WATCHED_KEYS), target)),
            one_phase: (!self.commit_claims_first).then(Arc::default),
        };
        store.limits.purge_task = PurgeTask::start(store.clone(), self.settings.purge);
        Ok(store)
    }
}

impl PostgresStore {
    /// Connects to `url` (`postgres://user@host/db`) with the default options.
    ///
    /// # Errors
    ///
    /// As [`PostgresStoreBuilder::open`].
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        Self::builder(url).open().await
    }

    /// Options: table, pool size, wait timeout, purge, test time offset.
    pub fn builder(url: &str) -> PostgresStoreBuilder {
        PostgresStoreBuilder {
            url: url.to_owned(),
            pool_size: 16,
            wait_timeout: Duration::from_secs(5),
            notify: false,
            commit_claims_first: false,
            settings: Settings::default(),
        }
    }

    /// Transactional requests rolled back because they held their
    /// transaction past their max hold time (see [`PostgresTransaction`],
    /// "Max hold time"), since the store opened.
    pub fn transactions_held_too_long(&self) -> u64 {
        self.limits.held_too_long()
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    fn offset_ms(&self) -> i64 {
        self.limits.offset_ms()
    }

    /// The completion's statement and its parameters after the first
    /// four: with `notify_waiters`, the announcing one and its payload.
    /// `or_fail`: the statements that fail when they completed no record
    /// (`PgSql::complete_or_fail`).
    fn completion(&self, id: &RecordId, or_fail: bool) -> (&str, Option<String>) {
        let sql = &self.sql;
        match (&self.notify, or_fail) {
            (Some(_), _) => (
                if or_fail {
                    &sql.complete_notify_or_fail
                } else {
                    &sql.complete_notify
                },
                Some(change_payload(&sql.table, id.scope(), id.key())),
            ),
            (None, true) => (&sql.complete_or_fail, None),
            (None, false) => (&sql.complete, None),
        }
    }

    /// A completed record's answer, from the replay cache (off unless the
    /// builder sets `replay_cache`) or from one plain `SELECT`, without the
    /// lock (see `store::kit::pg_sql`): the replay, or 422.
    async fn read_first(
        &self,
        client: &Object,
        req: &ClaimRequest,
    ) -> Result<Option<Refusal>, StoreError> {
        let sent = self.limits.instant();
        let answer = match answer_cached(&self.limits.replays, req, sent) {
            Some(cached) => cached,
            None => {
                let row = client
                    .query_opt(
                        &cached(client, &self.sql.completed).await?,
                        &[&req.scope, &req.key, &self.offset_ms()],
                    )
                    .await
                    .map_err(unavailable)?;
                let Some(row) = row else { return Ok(None) };
                let row = CompletedRow {
                    fingerprint: row.try_get(0).map_err(unavailable)?,
                    response: row.try_get(1).map_err(unavailable)?,
                    ttl_left_ms: row.try_get(2).map_err(unavailable)?,
                };
                answer_completed(row, req, &self.limits.replays, sent)?
            }
        };
        Ok(match answer {
            Claim::Refused(refused) => Some(refused),
            Claim::Acquired { .. } => None,
        })
    }

    /// [`Store::claim`], its lock waits bounded by the claim's own wait.
    async fn claim_committed(&self, req: &ClaimRequest) -> Result<Claim, StoreError> {
        let mut client = self.client().await?;
        if let Some(refused) = self.read_first(&client, req).await? {
            return Ok(Claim::Refused(refused));
        }
        // Then a new key is claimed by its insert alone, without the lock.
        let fingerprint = &req.fingerprint.0[..];
        let wait = lock_wait_ms(req.wait_in_flight);
        let inserted = client
            .execute(
                &cached(&client, &self.sql.insert_first).await?,
                &[
                    &req.scope,
                    &req.key,
                    &fingerprint,
                    &req.token.0,
                    &self.offset_ms(),
                    &duration_ms(req.lease),
                    &duration_ms(req.ttl),
                    &wait,
                ],
            )
            .await
            .map_err(unavailable)?;
        if inserted == 1 {
            return Ok(Claim::Acquired { taken_over: false });
        }
        // Dropped unfinished (an error below), the transaction rolls back.
        let tx = client.transaction().await.map_err(unavailable)?;
        let lock = advisory_key(&self.sql.table, &req.scope, &req.key);
        let row = tx
            .query_one(
                &cached(&tx, &self.sql.lock_now).await?,
                &[&lock, &self.offset_ms(), &wait],
            )
            .await
            .map_err(unavailable)?;
        let now: i64 = row.try_get(0).map_err(unavailable)?;
        let mut steps = Steps {
            client: &tx,
            sql: &self.sql,
        };
        let found = claim_in(&mut steps, req, now).await?;
        tx.commit().await.map_err(unavailable)?;
        found.into_claim()
    }

    async fn client(&self) -> Result<Object, StoreError> {
        self.pool.get().await.map_err(unavailable)
    }
}

/// The parameters `$1` to `$6` of a claim's row (`PgSql::insert`,
/// `PgSql::take_over`): scope, key, fingerprint, token, and the lease and
/// TTL deadlines (unix ms).
fn row_params<'a>(
    req: &'a ClaimRequest,
    fingerprint: &'a &'a [u8],
    (lease_until, expires_at): &'a (i64, i64),
) -> [&'a (dyn tokio_postgres::types::ToSql + Sync); 6] {
    [
        &req.scope,
        &req.key,
        fingerprint,
        &req.token.0,
        lease_until,
        expires_at,
    ]
}

/// The record [`Sql::select`](PgSql::select) read.
fn met(row: &tokio_postgres::Row) -> Result<Met, tokio_postgres::Error> {
    Ok(Met {
        fingerprint: row.try_get(0)?,
        completed: row.try_get::<_, String>(1)? == "completed",
        lease_until: row.try_get(2)?,
        expires_at: row.try_get(3)?,
        response: row.try_get(4)?,
        now: None,
    })
}

/// The claim's statements, in a transaction holding the key's advisory
/// lock.
struct Steps<'a, C> {
    client: &'a C,
    sql: &'a Sql,
}

impl<C: GenericClient + Sync> ClaimSteps for Steps<'_, C> {
    type Error = StoreError;

    async fn insert(
        &mut self,
        req: &ClaimRequest,
        lease_until: i64,
        expires_at: i64,
    ) -> Result<bool, StoreError> {
        let statement = cached(self.client, &self.sql.insert).await?;
        let fingerprint = &req.fingerprint.0[..];
        let deadlines = (lease_until, expires_at);
        let inserted = self
            .client
            .execute(&statement, &row_params(req, &fingerprint, &deadlines))
            .await
            .map_err(unavailable)?;
        Ok(inserted == 1)
    }

    async fn select(&mut self, req: &ClaimRequest) -> Result<Option<Met>, StoreError> {
        let statement = cached(self.client, &self.sql.select).await?;
        let row = self
            .client
            .query_opt(&statement, &[&req.scope, &req.key])
            .await
            .map_err(unavailable)?;
        row.as_ref().map(met).transpose().map_err(unavailable)
    }

    async fn take_over(
        &mut self,
        req: &ClaimRequest,
        lease_until: i64,
        expires_at: i64,
    ) -> Result<(), StoreError> {
        let statement = cached(self.client, &self.sql.take_over).await?;
        let fingerprint = &req.fingerprint.0[..];
        let deadlines = (lease_until, expires_at);
        self.client
            .execute(&statement, &row_params(req, &fingerprint, &deadlines))
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    fn vanished() -> StoreError {
        unavailable("the conflicting record kept vanishing")
    }
}

impl Store for PostgresStore {
    async fn claim(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        let claimed = self.claim_committed(&req).await;
        busy_is_in_flight(claimed, req.hold(), |e| {
            e.downcast_ref::<tokio_postgres::Error>()
                .and_then(tokio_postgres::Error::code)
                .is_some_and(|code| code.code() == LOCK_NOT_AVAILABLE)
        })
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        let completion = finish::CompletionArgs::new(self, &id, token, &response, false);
        let client = self.client().await?;
        let statement = cached(&client, completion.statement).await?;
        let updated = client
            .execute(&statement, &completion.params())
            .await
            .map_err(unavailable)?;
        Ok(if updated == 1 {
            Completion::Stored
        } else {
            Completion::Fenced
        })
    }

    async fn release(&self, id: RecordId, token: FencingToken) -> Result<bool, StoreError> {
        let client = self.client().await?;
        let deleted = match &self.notify {
            Some(_) => {
                let payload = change_payload(&self.sql.table, id.scope(), id.key());
                let statement = cached(&client, &self.sql.release_notify).await?;
                client
                    .execute(&statement, &[&id.scope(), &id.key(), &token.0, &payload])
                    .await
            }
            None => {
                let statement = cached(&client, &self.sql.release).await?;
                client
                    .execute(&statement, &[&id.scope(), &id.key(), &token.0])
                    .await
            }
        }
        .map_err(unavailable)?;
        Ok(deleted == 1)
    }

    async fn renew(
        &self,
        id: RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let (scope, key) = id.into_parts();
        let client = self.client().await?;
        let lease = duration_ms(lease);
        let renewed = client
            .execute(
                &cached(&client, &self.sql.renew).await?,
                &[&scope, &key, &token.0, &self.offset_ms(), &lease],
            )
            .await
            .map_err(unavailable)?;
        Ok(renewed == 1)
    }

    /// One statement for all `claims`, on the renewals' own connection.
    async fn renew_all(
        &self,
        claims: Vec<(RecordId, FencingToken)>,
        lease: Duration,
    ) -> Result<Vec<bool>, StoreError> {
        let client = self.renewals.get().await.map_err(unavailable)?;
        let (scopes, keys, tokens) = renew_arrays(&claims);
        let rows = client
            .query(
                &cached(&client, &self.sql.renew_all).await?,
                &[
                    &scopes,
                    &keys,
                    &tokens,
                    &self.offset_ms(),
                    &duration_ms(lease),
                ],
            )
            .await
            .map_err(unavailable)?;
        let rows = rows.iter().map(|row| (row.get(0), row.get(1)));
        Ok(renewed_in_order(&claims, rows))
    }

    /// With `notify_waiters`: woken by the `NOTIFY` of any server's
    /// completion or release of `id`; starts the `LISTEN` connection.
    fn watch(&self, id: &RecordId) -> Option<Watch> {
        let (feed, target) = self.notify.as_ref()?;
        listen::start(feed, target);
        feed.watch(tower_idempotency::store::kit::feed::change_key(
            &self.sql.table,
            id.scope(),
            id.key(),
        ))
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let client = self.client().await?;
        let offset = self.offset_ms();
        in_batches(self.limits.purge_batch, |rows| {
            let (client, sql) = (&client, &self.sql.purge);
            async move {
                let rows = i64::from(rows);
                client
                    .execute(sql, &[&offset, &rows])
                    .await
                    .map_err(unavailable)
            }
        })
        .await
    }
}
