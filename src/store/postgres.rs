//! PostgreSQL, for fleets of app servers sharing one database (feature
//! `postgres`).

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{GenericClient, Manager, ManagerConfig, Object, Pool, RecyclingMethod};
use tokio_postgres::NoTls;

use super::{
    Claim, ClaimRequest, Clock, Completion, Decision, Existing, FencingToken, Inspect,
    RecordCounts, RecordSummary, Store, StoreError, TransactionClaim, TransactionalStore, decide,
    duration_ms,
};
use crate::fingerprint::{Fingerprint, Hasher};
use crate::response::StoredResponse;

/// Records in a PostgreSQL table; leases and TTLs judged by the database
/// server's clock.
///
/// * The claim runs in a transaction that first takes a transaction-level
///   advisory lock on the key, then `INSERT ... ON CONFLICT DO NOTHING`: the
///   primary key `(scope, key)` decides who is first, across every app server.
/// * Transactional mode ([`crate::mode::Transactional`]) runs in two phases,
///   as brandur's "atomic phases": the claim commits at once (so every server
///   sees the key in flight, with its fingerprint: a duplicate gets 409 or
///   422 without waiting on anything), then the handler's writes and the
///   record's completion share one transaction ([`PostgresTransaction`]) that
///   commits only while the record still carries this request's fencing
///   token. A crash before that commit rolls the writes back and leaves the
///   key in flight until its lease ends; the retry then runs once. A rollback
///   (a response not stored, an error, a panic, a dropped request) also gives
///   the key back at once.
/// * Connections come from a deadpool pool (default 16); a connection that
///   cannot be had in time, or a server that cannot be reached, is
///   [`StoreError::Unavailable`]: the layer answers 503.
/// * The table (default `idempotency_records`) is created on open under an
///   advisory lock, so app servers starting together do not race.
///
/// # Example
///
/// ```no_run
/// use tower_idempotency::{IdempotencyLayer, PostgresStore, scope::GlobalScope};
///
/// # async fn run() -> Result<(), tower_idempotency::StoreError> {
/// let store = PostgresStore::open("postgres://app@db.internal/app").await?;
/// let layer = IdempotencyLayer::new(store, GlobalScope).transactional();
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    pool: Pool,
    sql: Arc<Sql>,
    offset: Option<Arc<dyn Clock>>,
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
    table: String,
    pool_size: usize,
    wait_timeout: Duration,
    offset: Option<Arc<dyn Clock>>,
}

/// The statements, with the table name in them.
struct Sql {
    table: String,
    insert: String,
    select: String,
    take_over: String,
    complete: String,
    release: String,
    purge: String,
    stuck: String,
    counts: String,
}

/// The server's clock in unix milliseconds, shifted by parameter `$n` (ms).
fn now_ms(n: u8) -> String {
    format!("(floor(extract(epoch from clock_timestamp()) * 1000)::bigint + ${n}::bigint)")
}

impl Sql {
    fn new(table: &str) -> Sql {
        Sql {
            table: table.to_owned(),
            insert: format!(
                "INSERT INTO {table} (scope, key, fingerprint, token, state, lease_until, expires_at)
                 VALUES ($1, $2, $3, $4, 'in_flight', $5, $6)
                 ON CONFLICT (scope, key) DO NOTHING"
            ),
            select: format!(
                "SELECT fingerprint, state, lease_until, expires_at, response
                 FROM {table} WHERE scope = $1 AND key = $2 FOR UPDATE"
            ),
            take_over: format!(
                "UPDATE {table}
                 SET fingerprint = $3, token = $4, state = 'in_flight',
                     lease_until = $5, expires_at = $6, response = NULL
                 WHERE scope = $1 AND key = $2"
            ),
            complete: format!(
                "UPDATE {table} SET state = 'completed', response = $4
                 WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_flight'"
            ),
            release: format!(
                "DELETE FROM {table}
                 WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_flight'"
            ),
            purge: format!("DELETE FROM {table} WHERE expires_at <= {}", now_ms(1)),
            // The clock is read once per statement (a MATERIALIZED CTE is
            // evaluated once), so every row is judged at the same instant.
            stuck: format!(
                "WITH now AS MATERIALIZED (SELECT {} AS ms)
                 SELECT scope, key, fingerprint, lease_until, expires_at, now.ms
                 FROM {table}, now
                 WHERE state = 'in_flight' AND lease_until <= now.ms AND expires_at > now.ms
                 ORDER BY lease_until, scope, key
                 LIMIT $2",
                now_ms(1)
            ),
            counts: format!(
                "WITH now AS MATERIALIZED (SELECT {} AS ms)
                 SELECT
                    count(*) FILTER (WHERE expires_at > now.ms AND state = 'in_flight' AND lease_until > now.ms),
                    count(*) FILTER (WHERE expires_at > now.ms AND state = 'in_flight' AND lease_until <= now.ms),
                    count(*) FILTER (WHERE expires_at > now.ms AND state = 'completed'),
                    count(*) FILTER (WHERE expires_at <= now.ms)
                 FROM {table}, now",
                now_ms(1)
            ),
        }
    }

    fn schema(&self) -> String {
        let table = &self.table;
        format!(
            "CREATE TABLE IF NOT EXISTS {table} (
                scope       TEXT   NOT NULL,
                key         TEXT   NOT NULL,
                fingerprint BYTEA  NOT NULL,
                token       BIGINT NOT NULL,
                state       TEXT   NOT NULL CHECK (state IN ('in_flight', 'completed')),
                lease_until BIGINT NOT NULL, -- unix ms, server clock
                expires_at  BIGINT NOT NULL, -- unix ms, server clock
                response    BYTEA,
                PRIMARY KEY (scope, key)
            );
            CREATE INDEX IF NOT EXISTS {table}_expires_at ON {table} (expires_at);"
        )
    }
}

fn unavailable(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> StoreError {
    StoreError::unavailable(e)
}

impl PostgresStoreBuilder {
    /// The table (default `idempotency_records`): ASCII letters, digits and
    /// underscores, not starting with a digit, at most 48 characters.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// Connections kept (default 16). In transactional mode each request
    /// holds one for its handler's whole run.
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// How long a call waits for a pooled connection before it fails with
    /// [`StoreError::Unavailable`] (default 5 s).
    pub fn wait_timeout(mut self, timeout: Duration) -> Self {
        self.wait_timeout = timeout;
        self
    }

    /// For tests of leases and TTLs: a [`Clock`] whose reading, in
    /// milliseconds, is added to the server's clock. Leave it unset in
    /// production.
    pub fn time_offset(mut self, offset: impl Clock) -> Self {
        self.offset = Some(Arc::new(offset));
        self
    }

    /// Connects and creates the table if it is missing.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] for a bad URL or table name, or a server
    /// that cannot be reached.
    pub async fn open(self) -> Result<PostgresStore, StoreError> {
        let valid = !self.table.is_empty()
            && self.table.len() <= 48
            && !self.table.starts_with(|c: char| c.is_ascii_digit())
            && self
                .table
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            return Err(unavailable(format!("invalid table name {:?}", self.table)));
        }
        let config = tokio_postgres::Config::from_str(&self.url).map_err(unavailable)?;
        let manager = Manager::from_config(
            config,
            NoTls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(self.pool_size)
            .wait_timeout(Some(self.wait_timeout))
            .create_timeout(Some(self.wait_timeout))
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .build()
            .map_err(unavailable)?;
        let sql = Sql::new(&self.table);
        let mut client = pool.get().await.map_err(unavailable)?;
        let tx = client.transaction().await.map_err(unavailable)?;
        // Two servers starting at once would race on CREATE TABLE.
        let lock = advisory_key(&self.table, "migrate", "");
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&lock])
            .await
            .map_err(unavailable)?;
        tx.batch_execute(&sql.schema()).await.map_err(unavailable)?;
        tx.commit().await.map_err(unavailable)?;
        Ok(PostgresStore {
            pool,
            sql: Arc::new(sql),
            offset: self.offset,
        })
    }
}

/// The advisory lock key of a record: 64 bits of SHA-256 over table, scope
/// and key, framed so no two records share an input.
fn advisory_key(table: &str, scope: &str, key: &str) -> i64 {
    let mut hasher = Hasher::new("tower-idempotency/pg-lock/v1");
    hasher
        .part(table.as_bytes())
        .part(scope.as_bytes())
        .part(key.as_bytes());
    let digest = hasher.finish().0;
    i64::from_be_bytes([
        digest[0], digest[1], digest[2], digest[3], digest[4], digest[5], digest[6], digest[7],
    ])
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

    /// Options: table, pool size, wait timeout, test time offset.
    pub fn builder(url: &str) -> PostgresStoreBuilder {
        PostgresStoreBuilder {
            url: url.to_owned(),
            table: "idempotency_records".into(),
            pool_size: 16,
            wait_timeout: Duration::from_secs(5),
            offset: None,
        }
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    fn offset_ms(&self) -> i64 {
        self.offset.as_ref().map_or(0, |c| c.now_ms())
    }

    async fn client(&self) -> Result<Object, StoreError> {
        self.pool.get().await.map_err(unavailable)
    }

    /// The claim inside an open transaction that holds the key's advisory
    /// lock; `now` is the server's clock read after the lock was taken.
    async fn claim_in<C: GenericClient>(
        &self,
        client: &C,
        req: &ClaimRequest,
        now: i64,
    ) -> Result<Claim, StoreError> {
        let lease_until = now.saturating_add(duration_ms(req.lease));
        let expires_at = now.saturating_add(duration_ms(req.ttl));
        let fingerprint = &req.fingerprint.0[..];
        let sql = &self.sql;
        // A release or a purge may delete the conflicting row between the
        // insert and the select (they do not take the key's lock): then the
        // insert is tried again, and wins.
        let mut found = None;
        for _ in 0..3 {
            let inserted = client
                .execute(
                    &sql.insert,
                    &[
                        &req.scope,
                        &req.key,
                        &fingerprint,
                        &req.token.0,
                        &lease_until,
                        &expires_at,
                    ],
                )
                .await
                .map_err(unavailable)?;
            if inserted == 1 {
                return Ok(Claim::Acquired { taken_over: false });
            }
            found = client
                .query_opt(&sql.select, &[&req.scope, &req.key])
                .await
                .map_err(unavailable)?;
            if found.is_some() {
                break;
            }
        }
        let row = found.ok_or_else(|| unavailable("the conflicting record kept vanishing"))?;
        let old_fingerprint: Vec<u8> = row.try_get(0).map_err(unavailable)?;
        let state: String = row.try_get(1).map_err(unavailable)?;
        let old_lease: i64 = row.try_get(2).map_err(unavailable)?;
        let old_expiry: i64 = row.try_get(3).map_err(unavailable)?;
        let existing = Existing {
            fingerprint: &old_fingerprint,
            completed: state == "completed",
            lease_until: old_lease,
            expires_at: old_expiry,
        };
        let taken_over = match decide(&existing, &req.fingerprint, now) {
            Decision::Replace { taken_over } => taken_over,
            Decision::Mismatch => return Ok(Claim::Mismatch),
            Decision::Replay => {
                let blob: Option<Vec<u8>> = row.try_get(4).map_err(unavailable)?;
                return StoredResponse::decode(&blob.unwrap_or_default())
                    .map(Claim::Completed)
                    .map_err(|e| StoreError::Corrupt(e.to_string()));
            }
            Decision::InFlight(lease_remaining) => return Ok(Claim::InFlight { lease_remaining }),
        };
        client
            .execute(
                &sql.take_over,
                &[
                    &req.scope,
                    &req.key,
                    &fingerprint,
                    &req.token.0,
                    &lease_until,
                    &expires_at,
                ],
            )
            .await
            .map_err(unavailable)?;
        Ok(Claim::Acquired { taken_over })
    }
}

impl Store for PostgresStore {
    async fn claim(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        let mut client = self.client().await?;
        // Dropped unfinished (an error below), the transaction rolls back.
        let tx = client.transaction().await.map_err(unavailable)?;
        let lock = advisory_key(&self.sql.table, &req.scope, &req.key);
        let row = tx
            .query_one(
                &format!("SELECT {} FROM pg_advisory_xact_lock($1)", now_ms(2)),
                &[&lock, &self.offset_ms()],
            )
            .await
            .map_err(unavailable)?;
        let now: i64 = row.try_get(0).map_err(unavailable)?;
        let claim = self.claim_in(&tx, &req, now).await?;
        tx.commit().await.map_err(unavailable)?;
        Ok(claim)
    }

    async fn complete(
        &self,
        scope: String,
        key: String,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        let blob = response.encode();
        let client = self.client().await?;
        let updated = client
            .execute(&self.sql.complete, &[&scope, &key, &token.0, &blob])
            .await
            .map_err(unavailable)?;
        Ok(if updated == 1 {
            Completion::Stored
        } else {
            Completion::Fenced
        })
    }

    async fn release(
        &self,
        scope: String,
        key: String,
        token: FencingToken,
    ) -> Result<bool, StoreError> {
        let client = self.client().await?;
        let deleted = client
            .execute(&self.sql.release, &[&scope, &key, &token.0])
            .await
            .map_err(unavailable)?;
        Ok(deleted == 1)
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let client = self.client().await?;
        client
            .execute(&self.sql.purge, &[&self.offset_ms()])
            .await
            .map_err(unavailable)
    }
}

/// One statement each: one snapshot of the table, judged at one reading of
/// the server's clock. No index serves the lease: both scan the table.
impl Inspect for PostgresStore {
    async fn stuck(&self, limit: usize) -> Result<Vec<RecordSummary>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let client = self.client().await?;
        let rows = client
            .query(&self.sql.stuck, &[&self.offset_ms(), &limit])
            .await
            .map_err(unavailable)?;
        rows.iter()
            .map(|row| {
                let fingerprint: Vec<u8> = row.try_get(2).map_err(unavailable)?;
                let fingerprint = <[u8; 32]>::try_from(fingerprint.as_slice())
                    .map_err(|_| StoreError::Corrupt("a fingerprint is not 32 bytes".into()))?;
                Ok(RecordSummary::new(
                    row.try_get(0).map_err(unavailable)?,
                    row.try_get(1).map_err(unavailable)?,
                    Fingerprint(fingerprint),
                    row.try_get(3).map_err(unavailable)?,
                    row.try_get(4).map_err(unavailable)?,
                    row.try_get(5).map_err(unavailable)?,
                ))
            })
            .collect()
    }

    async fn counts(&self) -> Result<RecordCounts, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_one(&self.sql.counts, &[&self.offset_ms()])
            .await
            .map_err(unavailable)?;
        let count = |i: usize| -> Result<u64, StoreError> {
            let n: i64 = row.try_get(i).map_err(unavailable)?;
            u64::try_from(n).map_err(unavailable)
        };
        Ok(RecordCounts {
            in_flight: count(0)?,
            stuck: count(1)?,
            completed: count(2)?,
            expired: count(3)?,
        })
    }
}

// ------------------------------------------------------------ transactional

/// An open PostgreSQL transaction in which the layer has claimed the
/// request's key. The handler runs its own statements on it through
/// [`PostgresTransaction::client`]; the layer commits them with the record
/// and the stored response, or rolls everything back.
///
/// It reaches the handler as a request extension
/// (`req.extensions().get::<PostgresTransaction>()`) and, with the `axum`
/// feature, as an extractor.
///
/// # Example
///
/// ```no_run
/// use tower_idempotency::store::PostgresTransaction;
///
/// async fn credit(tx: PostgresTransaction) -> Result<String, String> {
///     let client = tx.client().await.map_err(|e| e.to_string())?;
///     let row = client
///         .query_one("UPDATE accounts SET balance = balance + 5 WHERE id = 1 RETURNING balance", &[])
///         .await
///         .map_err(|e| e.to_string())?;
///     Ok(format!("balance {}", row.get::<_, i64>(0)))
/// }
/// ```
#[derive(Clone)]
pub struct PostgresTransaction {
    connection: Arc<tokio::sync::Mutex<Option<TxConnection>>>,
}

/// A pooled connection inside an open transaction. Dropped before its
/// transaction ended cleanly (a cancelled commit, a failed `BEGIN`), it is
/// taken out of the pool and closed, so the server rolls the transaction back
/// and no later request can ever commit it.
struct TxConnection {
    client: Option<Object>,
    scope: String,
    key: String,
    token: FencingToken,
}

impl TxConnection {
    fn client(&self) -> Result<&Object, StoreError> {
        self.client.as_ref().ok_or_else(transaction_over)
    }

    /// The transaction ended (`COMMIT` or `ROLLBACK` answered): the
    /// connection may go back to the pool.
    fn ended(mut self) {
        drop(self.client.take());
    }
}

impl Drop for TxConnection {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            drop(Object::take(client));
        }
    }
}

impl std::fmt::Debug for PostgresTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresTransaction")
            .finish_non_exhaustive()
    }
}

/// The connection of an open [`PostgresTransaction`]; derefs to
/// [`tokio_postgres::Client`]. Statements run inside the transaction; do not
/// `COMMIT` or `ROLLBACK` (the layer does).
pub struct TransactionClient<'a> {
    guard: tokio::sync::MappedMutexGuard<'a, Object>,
}

impl std::ops::Deref for TransactionClient<'_> {
    type Target = tokio_postgres::Client;

    fn deref(&self) -> &tokio_postgres::Client {
        &self.guard
    }
}

fn transaction_over() -> StoreError {
    unavailable("the idempotency transaction has already been committed or rolled back")
}

impl PostgresTransaction {
    /// The transaction's connection, for the handler's statements. Calls
    /// from clones of this handle take turns.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the transaction has already ended.
    pub async fn client(&self) -> Result<TransactionClient<'_>, StoreError> {
        let guard = self.connection.lock().await;
        tokio::sync::MutexGuard::try_map(guard, |connection| {
            connection.as_mut().and_then(|c| c.client.as_mut())
        })
        .map(|guard| TransactionClient { guard })
        .map_err(|_| transaction_over())
    }

    async fn take(&self) -> Option<TxConnection> {
        self.connection.lock().await.take()
    }
}

/// Rolls back; if `ROLLBACK` fails, dropping the connection closes it.
async fn roll_back(connection: TxConnection) {
    let rolled_back = match connection.client() {
        Ok(client) => client.batch_execute("ROLLBACK").await.is_ok(),
        Err(_) => false,
    };
    if rolled_back {
        connection.ended();
    }
}

impl TransactionalStore for PostgresStore {
    type Transaction = PostgresTransaction;

    async fn claim_in_transaction(
        &self,
        req: ClaimRequest,
    ) -> Result<TransactionClaim<PostgresTransaction>, StoreError> {
        let (scope, key, token) = (req.scope.clone(), req.key.clone(), req.token);
        // Phase one: the claim commits on its own, so that every other
        // server sees the key in flight, with its fingerprint and lease.
        // It runs in a task of its own: if this request is cancelled while
        // the claim is under way, the task gives a committed claim back
        // instead of leaving the key in flight for the whole lease.
        let (answer, claimed) = tokio::sync::oneshot::channel();
        let store = self.clone();
        tokio::spawn(async move {
            let (scope, key, token) = (req.scope.clone(), req.key.clone(), req.token);
            let unanswered = answer.send(store.claim(req).await);
            if let Err(Ok(Claim::Acquired { .. })) = unanswered
                && let Err(e) = store.release(scope, key, token).await
            {
                tracing::error!(error = %e, "releasing an abandoned key failed; it stays in flight until its lease ends");
            }
        });
        let claimed = claimed
            .await
            .map_err(|_| unavailable("the claim task ended without an answer"))?;
        let taken_over = match claimed? {
            Claim::Acquired { taken_over } => taken_over,
            refused => return Ok(TransactionClaim::Refused(refused)),
        };
        // Until the transaction is handed over, a cancelled or failed open
        // gives the key back.
        let claim = ReleaseOnDrop::new(self.clone(), scope.clone(), key.clone(), token);
        // Phase two: the handler's writes and the completion, in one
        // transaction that commits only if the record still carries our token.
        let connection = TxConnection {
            client: Some(self.client().await?),
            scope,
            key,
            token,
        };
        connection
            .client()?
            .batch_execute("BEGIN")
            .await
            .map_err(unavailable)?;
        claim.disarm();
        Ok(TransactionClaim::Acquired {
            transaction: PostgresTransaction {
                connection: Arc::new(tokio::sync::Mutex::new(Some(connection))),
            },
            taken_over,
        })
    }

    async fn commit(
        &self,
        transaction: &PostgresTransaction,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        let connection = transaction.take().await.ok_or_else(transaction_over)?;
        // Cancelled from here on, the connection closes (its `Drop`): the
        // server rolls back, and the key waits for its lease.
        let blob = response.encode();
        let (scope, key, token) = (
            connection.scope.clone(),
            connection.key.clone(),
            connection.token,
        );
        let completed = connection
            .client()?
            .execute(&self.sql.complete, &[&scope, &key, &token.0, &blob])
            .await;
        let failure = match completed {
            Ok(1) => None,
            // The lease ended and another request took the key over (or the
            // record expired): this request's writes must not count.
            Ok(_) => Some(unavailable(
                "the lease ended before the commit and another request took the key over; this request's writes were rolled back",
            )),
            // E.g. the handler's own statement failed and PostgreSQL aborted
            // the transaction.
            Err(e) => Some(unavailable(e)),
        };
        if let Some(e) = failure {
            roll_back(connection).await;
            // Nothing was committed: give the key back (token-checked, so a
            // request that took it over keeps it).
            if let Err(release) = self.release(scope, key, token).await {
                tracing::error!(error = %release, "releasing a rolled-back key failed; it stays in flight until its lease ends");
            }
            return Err(e);
        }
        match connection.client()?.batch_execute("COMMIT").await {
            Ok(()) => {
                connection.ended();
                Ok(Completion::Stored)
            }
            // The outcome of a failed COMMIT is unknown: the connection is
            // closed (dropped) and the key waits for its lease.
            Err(e) => Err(unavailable(e)),
        }
    }

    fn rollback(&self, transaction: &PostgresTransaction) {
        drop(self.spawn_rollback(transaction));
    }

    async fn roll_back_and_wait(&self, transaction: &PostgresTransaction) {
        if let Some(task) = self.spawn_rollback(transaction) {
            // The task goes on if this future is dropped: the key is still
            // given back.
            let _ = task.await;
        }
    }
}

impl PostgresStore {
    /// Rolls the transaction back and gives the key back, in a task of its
    /// own. Without a runtime, dropping the connection closes it, which
    /// rolls the transaction back; the claim then waits for its lease.
    fn spawn_rollback(
        &self,
        transaction: &PostgresTransaction,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let (store, transaction) = (self.clone(), transaction.clone());
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => Some(handle.spawn(async move {
                if let Some(connection) = transaction.take().await {
                    let (scope, key, token) =
                        (connection.scope.clone(), connection.key.clone(), connection.token);
                    roll_back(connection).await;
                    // Give the key back, so a retry runs at once.
                    if let Err(e) = store.release(scope, key, token).await {
                        tracing::error!(error = %e, "releasing a rolled-back key failed; it stays in flight until its lease ends");
                    }
                }
            })),
            Err(_) => {
                drop(
                    transaction
                        .connection
                        .try_lock()
                        .ok()
                        .and_then(|mut guard| guard.take()),
                );
                None
            }
        }
    }
}

/// Releases a phase-one claim when dropped armed (a cancelled or failed
/// transaction open), from a spawned task.
struct ReleaseOnDrop {
    store: PostgresStore,
    scope: String,
    key: String,
    token: FencingToken,
    armed: bool,
}

impl ReleaseOnDrop {
    fn new(store: PostgresStore, scope: String, key: String, token: FencingToken) -> Self {
        ReleaseOnDrop {
            store,
            scope,
            key,
            token,
            armed: true,
        }
    }

    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let store = self.store.clone();
        let (scope, key, token) = (
            std::mem::take(&mut self.scope),
            std::mem::take(&mut self.key),
            self.token,
        );
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(async move {
                if let Err(e) = store.release(scope, key, token).await {
                    tracing::error!(error = %e, "releasing an abandoned key failed; it stays in flight until its lease ends");
                }
            });
        }
    }
}

super::transaction_extractor!(PostgresTransaction);
