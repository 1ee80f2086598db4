//! The embedded default: SQLite through rusqlite (bundled), one file that
//! several processes may share.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::{OptionalExtension, TransactionBehavior, params};

use super::{
    Claim, ClaimRequest, Clock, Completion, Decision, Existing, FencingToken, Store, StoreError,
    SystemClock, TransactionClaim, TransactionalStore, decide, duration_ms,
};
use crate::response::StoredResponse;

/// The schema version this crate writes, kept in `PRAGMA user_version`.
const SCHEMA_VERSION: i64 = 1;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS idempotency_records (
    scope       TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    fingerprint BLOB    NOT NULL,
    token       INTEGER NOT NULL,
    state       TEXT    NOT NULL CHECK (state IN ('in_flight', 'completed')),
    lease_until INTEGER NOT NULL, -- unix ms; meaningful while in flight
    expires_at  INTEGER NOT NULL, -- unix ms; the record's TTL deadline
    response    BLOB,             -- StoredResponse::encode, once completed
    PRIMARY KEY (scope, key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at ON idempotency_records (expires_at);
";

/// SQLite's `synchronous` setting: how often a commit waits for the disk.
///
/// With WAL, `Normal` survives a process crash (kill -9) but may lose the
/// last commits on power loss; `Full` survives both and costs an fsync per
/// commit. See <https://www.sqlite.org/pragma.html#pragma_synchronous>.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Synchronous {
    /// `synchronous=NORMAL`.
    Normal,
    /// `synchronous=FULL` (the default: an acknowledged record survives power loss).
    #[default]
    Full,
}

/// Records in one SQLite file, in WAL mode.
///
/// * The claim is an `INSERT ... ON CONFLICT DO NOTHING` inside a
///   `BEGIN IMMEDIATE` transaction: the primary key `(scope, key)` decides
///   who is first, in one process or many sharing the file.
/// * Writes (claims, completions, releases, and transactional requests) go
///   through one writer thread per store, which commits the writes of
///   concurrent requests together (group commit, see [`SqliteTransaction`]);
///   each caller gets its answer once its batch is durable. A repeat of a
///   committed request is answered from a read on a pooled connection,
///   without the writer.
/// * Reads and purges run on Tokio's blocking pool
///   ([`tokio::task::spawn_blocking`]): no SQLite call ever blocks an async
///   worker thread.
/// * A request waits for the writer, or a lock held by another connection,
///   at most the busy timeout (default 5 s); past it the call fails with
///   [`StoreError::Unavailable`], which the layer answers with 503. A write
///   whose caller gave up never runs.
/// * The schema is created or migrated when the store opens.
/// * Connections enforce foreign keys (`PRAGMA foreign_keys = ON`), which
///   matters for the handler's own tables in transactional mode.
///
/// # Example
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, SqliteStore, Store};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let dir = tempfile::tempdir()?;
/// # let path = dir.path().join("app.sqlite3");
/// let store = SqliteStore::open(&path).await?;
/// assert_eq!(store.purge_expired().await?, 0);
/// let layer = IdempotencyLayer::new(store, |parts: &http::request::Parts| {
///     parts.headers.get("x-user").and_then(|v| v.to_str().ok()).unwrap_or("anonymous").to_owned()
/// });
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SqliteStore {
    pool: r2d2::Pool<SqliteConnectionManager>,
    clock: Arc<dyn Clock>,
    path: Arc<PathBuf>,
    busy_timeout: Duration,
    group_commit: usize,
    writer: Arc<std::sync::OnceLock<Writer>>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// Options for [`SqliteStore`]; made by [`SqliteStore::builder`].
#[must_use]
pub struct SqliteStoreBuilder {
    path: PathBuf,
    busy_timeout: Duration,
    synchronous: Synchronous,
    pool_size: u32,
    clock: Arc<dyn Clock>,
    group_commit: usize,
    on_connect: Option<ConnectHook>,
}

/// A function run on every connection a [`SqliteStore`] opens.
type ConnectHook = Arc<dyn Fn(&rusqlite::Connection) -> rusqlite::Result<()> + Send + Sync>;

impl SqliteStoreBuilder {
    /// How long a call waits for another connection's lock before it fails
    /// with [`StoreError::Unavailable`]. Default 5 s.
    pub fn busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Default [`Synchronous::Full`].
    pub fn synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// Connections kept open (default 8). SQLite has one writer at a time
    /// whatever this is; more connections let replays read concurrently.
    pub fn pool_size(mut self, size: u32) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// The clock that judges leases and TTLs (default the system clock).
    /// Every process sharing a file should use the same clock.
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// At most this many transactional requests share one commit (default
    /// 32; 1 commits each request on its own). See [`SqliteTransaction`],
    /// "Group commit". A batch never waits to fill: it commits as soon as no
    /// request is waiting for the writer.
    pub fn group_commit(mut self, requests: usize) -> Self {
        self.group_commit = requests.max(1);
        self
    }

    /// Runs `f` on every pooled connection the store opens, after the
    /// store's own settings (busy timeout, `synchronous`, `foreign_keys`) and
    /// before the connection is first used, including for the schema
    /// migration. For per-connection settings SQLite does not keep in the
    /// file, e.g. `PRAGMA max_page_count` (a cap on the file's size, in
    /// pages: writes past it fail with `SQLITE_FULL`, which the layer
    /// answers with 503) or `PRAGMA cache_size`. An error from `f` fails
    /// that connection: [`SqliteStoreBuilder::open`], or the call that
    /// needed it, fails with [`StoreError::Unavailable`].
    ///
    /// Do not change `journal_mode` or `busy_timeout` here: the store sets
    /// them itself.
    pub fn on_connect<F>(mut self, f: F) -> Self
    where
        F: Fn(&rusqlite::Connection) -> rusqlite::Result<()> + Send + Sync + 'static,
    {
        self.on_connect = Some(Arc::new(f));
        self
    }

    /// Opens (creating if missing) the file and creates or migrates the schema.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the file cannot be opened or
    /// written, or holds a schema newer than this crate knows.
    pub async fn open(self) -> Result<SqliteStore, StoreError> {
        let busy_ms = duration_ms(self.busy_timeout);
        let synchronous = match self.synchronous {
            Synchronous::Normal => "NORMAL",
            Synchronous::Full => "FULL",
        };
        let on_connect = self.on_connect.clone();
        let manager = SqliteConnectionManager::file(&self.path).with_init(move |c| {
            // SQLite opens a file it may not write read-only, and such a
            // connection stays read-only after the file is writable again:
            // kept in the pool, it would fail every write it is handed.
            // Refused here, the pool opens it again on a later call.
            if c.is_readonly(rusqlite::MAIN_DB)? {
                return Err(rusqlite::Error::SqliteFailure(
                    rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_READONLY),
                    Some("the database file cannot be opened for writing".into()),
                ));
            }
            c.busy_timeout(Duration::from_millis(busy_ms as u64))?;
            c.pragma_update(None, "synchronous", synchronous)?;
            // For the handler's own tables in transactional mode.
            c.pragma_update(None, "foreign_keys", "ON")?;
            if let Some(hook) = &on_connect {
                hook(c)?;
            }
            Ok(())
        });
        let path = self.path.clone();
        let pool_size = self.pool_size;
        let busy_timeout = self.busy_timeout;
        let wal_path = self.path.clone();
        let pool = blocking(move || {
            // WAL is a property of the file: set once here, not on every
            // pooled connection (each change takes a lock that contends with
            // other processes' writers).
            let conn = rusqlite::Connection::open(&wal_path).map_err(StoreError::unavailable)?;
            conn.busy_timeout(busy_timeout)
                .map_err(StoreError::unavailable)?;
            conn.pragma_update(None, "journal_mode", "WAL")
                .map_err(StoreError::unavailable)?;
            drop(conn);
            let pool = r2d2::Pool::builder()
                .max_size(pool_size)
                .min_idle(Some(1))
                .connection_timeout(busy_timeout + Duration::from_secs(1))
                .build(manager)
                .map_err(StoreError::unavailable)?;
            migrate(&mut *pool.get().map_err(StoreError::unavailable)?)?;
            Ok(pool)
        })
        .await?;
        Ok(SqliteStore {
            pool,
            clock: self.clock,
            path: Arc::new(path),
            busy_timeout,
            group_commit: self.group_commit,
            writer: Arc::new(std::sync::OnceLock::new()),
        })
    }
}

fn migrate(conn: &mut rusqlite::Connection) -> Result<(), StoreError> {
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(StoreError::unavailable)?;
    let version: i64 = tx
        .pragma_query_value(None, "user_version", |r| r.get(0))
        .map_err(StoreError::unavailable)?;
    if version > SCHEMA_VERSION {
        return Err(StoreError::unavailable(format!(
            "the database holds idempotency schema version {version}; this build knows {SCHEMA_VERSION}"
        )));
    }
    tx.execute_batch(SCHEMA).map_err(StoreError::unavailable)?;
    tx.pragma_update(None, "user_version", SCHEMA_VERSION)
        .map_err(StoreError::unavailable)?;
    tx.commit().map_err(StoreError::unavailable)
}

/// Runs `f` on Tokio's blocking pool.
async fn blocking<T, F>(f: F) -> Result<T, StoreError>
where
    F: FnOnce() -> Result<T, StoreError> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(StoreError::unavailable)?
}

impl SqliteStore {
    /// Opens `path` with the default options (see [`SqliteStoreBuilder`]).
    ///
    /// # Errors
    ///
    /// As [`SqliteStoreBuilder::open`].
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::builder(path).open().await
    }

    /// Options: busy timeout, `synchronous`, pool size, clock, group commit,
    /// a hook run on each new connection.
    pub fn builder(path: impl AsRef<Path>) -> SqliteStoreBuilder {
        SqliteStoreBuilder {
            path: path.as_ref().to_owned(),
            busy_timeout: Duration::from_secs(5),
            synchronous: Synchronous::default(),
            pool_size: 8,
            clock: Arc::new(SystemClock),
            group_commit: 32,
            on_connect: None,
        }
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` with a pooled connection on the blocking pool. `f` reads
    /// the clock itself, after it holds whatever lock it waits for: a claim
    /// that waited for the write lock must not start its lease in the past.
    async fn with_conn<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(&mut rusqlite::Connection, &dyn Clock) -> rusqlite::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let pool = self.pool.clone();
        let clock = self.clock.clone();
        blocking(move || {
            let mut conn = pool.get().map_err(StoreError::unavailable)?;
            f(&mut conn, &*clock).map_err(StoreError::unavailable)
        })
        .await
    }
}

/// What the claim found, before the response blob is decoded.
enum Found {
    Claim(Claim),
    Completed(Vec<u8>),
}

impl Found {
    fn decode(self) -> Result<Claim, StoreError> {
        match self {
            Found::Claim(claim) => Ok(claim),
            Found::Completed(blob) => StoredResponse::decode(&blob)
                .map(Claim::Completed)
                .map_err(|e| StoreError::Corrupt(e.to_string())),
        }
    }
}

/// A record's columns, as a claim reads them.
struct Record {
    fingerprint: Vec<u8>,
    state: String,
    lease_until: i64,
    expires_at: i64,
    response: Option<Vec<u8>>,
}

impl Record {
    fn existing(&self) -> Existing<'_> {
        Existing {
            fingerprint: &self.fingerprint,
            completed: self.state == "completed",
            lease_until: self.lease_until,
            expires_at: self.expires_at,
        }
    }
}

fn read_record(
    conn: &rusqlite::Connection,
    scope: &str,
    key: &str,
) -> rusqlite::Result<Option<Record>> {
    conn.query_row(
        "SELECT fingerprint, state, lease_until, expires_at, response
         FROM idempotency_records WHERE scope = ?1 AND key = ?2",
        params![scope, key],
        |r| {
            Ok(Record {
                fingerprint: r.get(0)?,
                state: r.get(1)?,
                lease_until: r.get(2)?,
                expires_at: r.get(3)?,
                response: r.get(4)?,
            })
        },
    )
    .optional()
}

/// The claim (the table in the module docs of [`super`]) inside `tx`, an IMMEDIATE transaction: it holds
/// SQLite's write lock, so what it reads is what it decides on. The primary
/// key `(scope, key)` decides who inserts first.
fn claim_in(
    tx: &rusqlite::Transaction<'_>,
    req: &ClaimRequest,
    now: i64,
) -> rusqlite::Result<Found> {
    let lease_until = now.saturating_add(duration_ms(req.lease));
    let expires_at = now.saturating_add(duration_ms(req.ttl));
    let fingerprint = &req.fingerprint.0[..];
    let inserted = tx.execute(
        "INSERT INTO idempotency_records
            (scope, key, fingerprint, token, state, lease_until, expires_at)
         VALUES (?1, ?2, ?3, ?4, 'in_flight', ?5, ?6)
         ON CONFLICT (scope, key) DO NOTHING",
        params![
            req.scope,
            req.key,
            fingerprint,
            req.token.0,
            lease_until,
            expires_at
        ],
    )?;
    if inserted == 1 {
        return Ok(Found::Claim(Claim::Acquired { taken_over: false }));
    }
    let Some(record) = read_record(tx, &req.scope, &req.key)? else {
        // The insert conflicted, so the row exists under the write lock.
        return Err(rusqlite::Error::QueryReturnedNoRows);
    };
    let existing = record.existing();
    let taken_over = match decide(&existing, &req.fingerprint, now) {
        Decision::Replace { taken_over } => taken_over,
        Decision::Mismatch => return Ok(Found::Claim(Claim::Mismatch)),
        Decision::Replay => return Ok(Found::Completed(record.response.unwrap_or_default())),
        Decision::InFlight(lease_remaining) => {
            return Ok(Found::Claim(Claim::InFlight { lease_remaining }));
        }
    };
    tx.execute(
        "UPDATE idempotency_records
         SET fingerprint = ?3, token = ?4, state = 'in_flight',
             lease_until = ?5, expires_at = ?6, response = NULL
         WHERE scope = ?1 AND key = ?2",
        params![
            req.scope,
            req.key,
            fingerprint,
            req.token.0,
            lease_until,
            expires_at
        ],
    )?;
    Ok(Found::Claim(Claim::Acquired { taken_over }))
}

/// Completes the record if it still carries `token`.
fn complete_in(
    conn: &rusqlite::Connection,
    scope: &str,
    key: &str,
    token: FencingToken,
    blob: &[u8],
) -> rusqlite::Result<Completion> {
    let updated = conn.execute(
        "UPDATE idempotency_records SET state = 'completed', response = ?4
         WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in_flight'",
        params![scope, key, token.0, blob],
    )?;
    Ok(if updated == 1 {
        Completion::Stored
    } else {
        Completion::Fenced
    })
}

impl Store for SqliteStore {
    async fn claim(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        // A repeat of a committed request is answered from a read.
        if let Some(refused) = self.committed_refusal(&req).await? {
            return Ok(refused);
        }
        self.write(move |tx, clock| claim_in(tx, &req, clock.now_ms()))
            .await?
            .decode()
    }

    async fn complete(
        &self,
        scope: String,
        key: String,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        let blob = response.encode();
        self.write(move |tx, _| complete_in(tx, &scope, &key, token, &blob))
            .await
    }

    async fn release(
        &self,
        scope: String,
        key: String,
        token: FencingToken,
    ) -> Result<bool, StoreError> {
        self.write(move |tx, _| {
            let deleted = tx.execute(
                "DELETE FROM idempotency_records
                 WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in_flight'",
                params![scope, key, token.0],
            )?;
            Ok(deleted == 1)
        })
        .await
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.with_conn(|conn, clock| {
            let n = conn.execute(
                "DELETE FROM idempotency_records WHERE expires_at <= ?1",
                params![clock.now_ms()],
            )?;
            Ok(n as u64)
        })
        .await
    }
}

// ------------------------------------------------------------ transactional

/// An open SQLite transaction in which the layer has claimed the request's
/// key. The handler runs its own SQL in it with [`SqliteTransaction::run`];
/// the layer commits (with the stored response) or rolls back after the
/// handler answers.
///
/// # Group commit
///
/// Transactional requests on one store go through one writer thread, which
/// owns a connection and SQLite's write lock. Each request runs in a
/// savepoint of the writer's open transaction: its claim, its handler's SQL
/// and its stored response, one request at a time (SQLite has one writer
/// anyway). When a request's handler answers, its savepoint is released into
/// the transaction; when no request waits for the writer, or
/// [`SqliteStoreBuilder::group_commit`] requests have joined, the writer
/// commits them all at once: one fsync for the batch instead of one per
/// request.
///
/// Nothing is answered before it is durable: a request's response, and a
/// replay or 422 that depends on a record written in the batch, are sent
/// only after the batch has committed. If the commit fails, every request in
/// the batch gets 503 and nothing of the batch happened, so each retry runs
/// again. A request whose own SQL fails the commit (a deferred foreign key)
/// therefore fails its batch mates too: they get 503 and their retries run.
/// A request that rolls back (a response that is not stored, an error, a
/// panic, a dropped request) rolls back only its savepoint.
///
/// Async worker threads never block on the transaction. A request waits for
/// the writer at most the store's busy timeout, then gets 503.
///
/// It reaches the handler as a request extension
/// (`req.extensions().get::<SqliteTransaction>()`) and, with the `axum`
/// feature, as an extractor.
///
/// # Example
///
/// ```
/// use tower_idempotency::store::SqliteTransaction;
///
/// // An axum handler behind `IdempotencyLayer::new(store, scope).transactional()`.
/// async fn credit(tx: SqliteTransaction) -> Result<String, String> {
///     let balance = tx
///         .run(|tx| {
///             tx.execute("UPDATE accounts SET balance = balance + 5 WHERE id = 1", [])?;
///             tx.query_row("SELECT balance FROM accounts WHERE id = 1", [], |r| r.get::<_, i64>(0))
///         })
///         .await
///         .map_err(|e| e.to_string())?
///         .map_err(|e: tower_idempotency::rusqlite::Error| e.to_string())?;
///     Ok(format!("balance {balance}"))
/// }
/// ```
#[derive(Clone)]
pub struct SqliteTransaction {
    commands: std::sync::mpsc::Sender<Command>,
}

impl std::fmt::Debug for SqliteTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteTransaction").finish_non_exhaustive()
    }
}

type Job = Box<dyn FnOnce(&rusqlite::Transaction<'_>) + Send>;

enum Command {
    Run(Job),
    Commit {
        response: Vec<u8>,
        reply: tokio::sync::oneshot::Sender<Result<Completion, StoreError>>,
    },
    Rollback,
}

fn transaction_over() -> StoreError {
    StoreError::unavailable("the idempotency transaction has already been committed or rolled back")
}

impl SqliteTransaction {
    /// Runs `f` on the writer's thread and returns its result. `f` must not
    /// commit, roll back or end the transaction itself (the layer does);
    /// savepoints of its own are fine.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the transaction has already ended
    /// (committed, rolled back, or its thread died).
    pub async fn run<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(&rusqlite::Transaction<'_>) -> T + Send + 'static,
        T: Send + 'static,
    {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move |tx| {
            let _ = reply.send(f(tx));
        });
        self.commands
            .send(Command::Run(job))
            .map_err(|_| transaction_over())?;
        answer.await.map_err(|_| transaction_over())
    }
}

super::transaction_extractor!(SqliteTransaction);

/// How many transactional requests the writer has committed, and in how many
/// commits: `requests / commits` is the mean batch size.
/// Made by [`SqliteStore::group_commit_stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupCommitStats {
    /// Commits of the writer's transaction that succeeded.
    pub commits: u64,
    /// Requests whose writes and record those commits made durable.
    pub requests: u64,
}

type ClaimReply =
    tokio::sync::oneshot::Sender<Result<TransactionClaim<SqliteTransaction>, StoreError>>;

/// A request asking the writer for its claim.
struct Begin {
    req: ClaimRequest,
    reply: ClaimReply,
}

/// What the writer is asked to do.
enum Work {
    /// A transactional request: its claim, then its handler's SQL, in a
    /// savepoint of the batch.
    Request(Begin),
    /// A short write of separate mode (claim, complete, release), answered
    /// once its batch has committed.
    Write(Box<dyn WriteOp>),
}

impl Work {
    /// The caller no longer waits for this.
    fn abandoned(&self) -> bool {
        match self {
            Work::Request(begin) => begin.reply.is_closed(),
            Work::Write(write) => write.abandoned(),
        }
    }

    fn fail(self, error: StoreError) {
        match self {
            Work::Request(begin) => drop(begin.reply.send(Err(error))),
            Work::Write(write) => write.fail(error),
        }
    }
}

/// Sends a write's result once its batch has ended: `None` if it committed,
/// else why it did not.
type Answer = Box<dyn FnOnce(Option<&str>) + Send>;

/// A write of separate mode, run in its own savepoint of the batch.
trait WriteOp: Send {
    fn abandoned(&self) -> bool;
    fn fail(self: Box<Self>, error: StoreError);
    /// Runs the write; `None` when it failed (and was answered already).
    fn run(self: Box<Self>, tx: &rusqlite::Transaction<'_>, clock: &dyn Clock) -> Option<Answer>;
}

struct WriteJob<T, F> {
    write: F,
    reply: tokio::sync::oneshot::Sender<Result<T, StoreError>>,
    /// Who decides first: the writer starting it, or its caller giving up
    /// (past the busy timeout). A write the caller gave up on never runs,
    /// and one that runs is always waited for: a claim is never committed
    /// for a caller who is gone.
    state: Arc<std::sync::atomic::AtomicU8>,
}

const WAITING: u8 = 0;
const RUNNING: u8 = 1;
const ABANDONED: u8 = 2;

impl<T, F> WriteOp for WriteJob<T, F>
where
    T: Send + 'static,
    F: FnOnce(&rusqlite::Transaction<'_>, &dyn Clock) -> rusqlite::Result<T> + Send + 'static,
{
    fn abandoned(&self) -> bool {
        self.state.load(std::sync::atomic::Ordering::SeqCst) == ABANDONED
    }

    fn fail(self: Box<Self>, error: StoreError) {
        let _ = self.reply.send(Err(error));
    }

    fn run(self: Box<Self>, tx: &rusqlite::Transaction<'_>, clock: &dyn Clock) -> Option<Answer> {
        let WriteJob {
            write,
            reply,
            state,
        } = *self;
        let start = state.compare_exchange(
            WAITING,
            RUNNING,
            std::sync::atomic::Ordering::SeqCst,
            std::sync::atomic::Ordering::SeqCst,
        );
        if start.is_err() {
            return None;
        }
        let written = tx
            .execute_batch(SAVEPOINT)
            .and_then(|()| write(tx, clock))
            .and_then(|value| tx.execute_batch(RELEASE).map(|()| value));
        match written {
            Ok(value) => Some(Box::new(move |failed: Option<&str>| {
                let _ = reply.send(match failed {
                    None => Ok(value),
                    Some(why) => Err(batch_failed(why)),
                });
            })),
            Err(e) => {
                roll_back_request(tx);
                let _ = reply.send(Err(StoreError::unavailable(e)));
                None
            }
        }
    }
}

fn batch_failed(why: &str) -> StoreError {
    StoreError::unavailable(format!(
        "the batch this write was committed in failed, so nothing of it happened: {why}"
    ))
}

/// The writer's side of a store: its queue, and what it reports.
pub(super) struct Writer {
    queue: std::sync::mpsc::Sender<Work>,
    counters: Arc<WriterCounters>,
}

#[derive(Default)]
struct WriterCounters {
    waiting: std::sync::atomic::AtomicUsize,
    commits: std::sync::atomic::AtomicU64,
    requests: std::sync::atomic::AtomicU64,
}

impl Writer {
    fn start(
        pool: r2d2::Pool<SqliteConnectionManager>,
        clock: Arc<dyn Clock>,
        batch: usize,
    ) -> Result<Writer, StoreError> {
        let (queue, inbox) = std::sync::mpsc::channel();
        let counters = Arc::new(WriterCounters::default());
        let report = counters.clone();
        std::thread::Builder::new()
            .name("tower-idempotency-sqlite-writer".into())
            .spawn(move || write_batches(&pool, &*clock, &inbox, batch, &report))
            .map_err(StoreError::unavailable)?;
        Ok(Writer { queue, counters })
    }
}

/// An answer held back until the batch it depends on has committed.
enum Deferred {
    /// The request's writes and record; answered `Stored`.
    Commit(tokio::sync::oneshot::Sender<Result<Completion, StoreError>>),
    /// A refusal (replay, 422) read from a record written in this batch.
    Refusal(ClaimReply, Found),
    /// A write of separate mode.
    Write(Answer),
}

/// The writer thread: one transaction per batch, one savepoint per request.
/// Ends when every handle of the store is gone.
fn write_batches(
    pool: &r2d2::Pool<SqliteConnectionManager>,
    clock: &dyn Clock,
    inbox: &std::sync::mpsc::Receiver<Work>,
    batch: usize,
    counters: &WriterCounters,
) {
    use std::sync::atomic::Ordering::Relaxed;
    // The next request whose caller still waits.
    let next = |wait: bool| loop {
        let work = if wait {
            inbox.recv().ok()?
        } else {
            inbox.try_recv().ok()?
        };
        counters.waiting.fetch_sub(1, Relaxed);
        if !work.abandoned() {
            return Some(work);
        }
    };
    while let Some(first) = next(true) {
        let mut conn = match pool.get() {
            Ok(conn) => conn,
            Err(e) => {
                first.fail(StoreError::unavailable(e));
                continue;
            }
        };
        let tx = match conn.transaction_with_behavior(TransactionBehavior::Immediate) {
            Ok(tx) => tx,
            Err(e) => {
                first.fail(StoreError::unavailable(e));
                continue;
            }
        };
        let mut deferred = Vec::new();
        let mut work = Some(first);
        let mut members = 0;
        while let Some(item) = work.take() {
            match item {
                Work::Request(begin) => serve_request(&tx, clock, begin, &mut deferred),
                Work::Write(write) => {
                    if let Some(answer) = write.run(&tx, clock) {
                        deferred.push(Deferred::Write(answer));
                    }
                }
            }
            members += 1;
            // SQLite itself rolls the whole transaction back on some errors
            // (a full disk, an I/O error): the batch is over.
            if tx.is_autocommit() || members >= batch {
                break;
            }
            work = next(false);
        }
        let committed = if deferred.is_empty() {
            tx.rollback()
        } else {
            tx.commit()
        };
        let stored = deferred
            .iter()
            .filter(|d| matches!(d, Deferred::Commit(_)))
            .count() as u64;
        if committed.is_ok() && !deferred.is_empty() {
            counters.commits.fetch_add(1, Relaxed);
            counters.requests.fetch_add(stored, Relaxed);
        }
        let failed = committed.err().map(|e| e.to_string());
        for answer in deferred {
            let error = || {
                StoreError::unavailable(format!(
                    "the batch this request was committed in failed, so nothing of it happened: {}",
                    failed.as_deref().unwrap_or_default()
                ))
            };
            match answer {
                Deferred::Commit(reply) => {
                    let _ = reply.send(match failed {
                        None => Ok(Completion::Stored),
                        Some(_) => Err(error()),
                    });
                }
                Deferred::Refusal(reply, found) => {
                    let _ = reply.send(match failed {
                        None => found.decode().map(TransactionClaim::Refused),
                        Some(_) => Err(error()),
                    });
                }
                Deferred::Write(answer) => answer(failed.as_deref()),
            }
        }
    }
}

/// The savepoint each request's claim, SQL and record live in.
const SAVEPOINT: &str = "SAVEPOINT tower_idempotency_request";
const RELEASE: &str = "RELEASE tower_idempotency_request";
const ROLLBACK: &str = "ROLLBACK TO tower_idempotency_request; RELEASE tower_idempotency_request";

/// Undoes the request's savepoint. Errors are ignored: they mean SQLite has
/// already rolled the whole transaction back, which the batch then sees.
fn roll_back_request(tx: &rusqlite::Transaction<'_>) {
    let _ = tx.execute_batch(ROLLBACK);
}

/// One request inside the writer's transaction: its claim, then its
/// handler's jobs until the layer commits or rolls back.
fn serve_request(
    tx: &rusqlite::Transaction<'_>,
    clock: &dyn Clock,
    Begin { req, reply }: Begin,
    deferred: &mut Vec<Deferred>,
) {
    if let Err(e) = tx.execute_batch(SAVEPOINT) {
        let _ = reply.send(Err(StoreError::unavailable(e)));
        return;
    }
    let found = match claim_in(tx, &req, clock.now_ms()) {
        Ok(found) => found,
        Err(e) => {
            roll_back_request(tx);
            let _ = reply.send(Err(StoreError::unavailable(e)));
            return;
        }
    };
    let taken_over = match found {
        Found::Claim(Claim::Acquired { taken_over }) => taken_over,
        refused => {
            // Nothing was written. The record it read may be one this batch
            // wrote: answer only once the batch is durable.
            let _ = tx.execute_batch(RELEASE);
            if deferred
                .iter()
                .any(|d| matches!(d, Deferred::Commit(_) | Deferred::Write(_)))
            {
                deferred.push(Deferred::Refusal(reply, refused));
            } else {
                let _ = reply.send(refused.decode().map(TransactionClaim::Refused));
            }
            return;
        }
    };
    let (commands, inbox) = std::sync::mpsc::channel();
    let transaction = SqliteTransaction { commands };
    let acquired = TransactionClaim::Acquired {
        transaction,
        taken_over,
    };
    if reply.send(Ok(acquired)).is_err() {
        // The caller gave up waiting: the claim never happened.
        roll_back_request(tx);
        return;
    }
    // Every handle gone without a commit: roll back.
    while let Ok(command) = inbox.recv() {
        match command {
            Command::Run(job) => job(tx),
            Command::Commit { response, reply } => {
                let completed = complete_in(tx, &req.scope, &req.key, req.token, &response)
                    .and_then(|completion| {
                        if completion == Completion::Stored {
                            tx.execute_batch(RELEASE)?;
                        }
                        Ok(completion)
                    });
                match completed {
                    Ok(Completion::Stored) => deferred.push(Deferred::Commit(reply)),
                    // Only the handler's own SQL could have removed the
                    // record inside this transaction: keep nothing of it.
                    Ok(Completion::Fenced) => {
                        roll_back_request(tx);
                        let _ = reply.send(Err(StoreError::Corrupt(
                            "the claimed record vanished inside its transaction".into(),
                        )));
                    }
                    Err(e) => {
                        roll_back_request(tx);
                        let _ = reply.send(Err(StoreError::unavailable(e)));
                    }
                }
                return;
            }
            Command::Rollback => break,
        }
    }
    roll_back_request(tx);
}

impl SqliteStore {
    /// The writer of transactional requests, started on first use.
    fn writer(&self) -> Result<&Writer, StoreError> {
        if let Some(writer) = self.writer.get() {
            return Ok(writer);
        }
        let writer = Writer::start(self.pool.clone(), self.clock.clone(), self.group_commit)?;
        // Another thread may have won the race; its writer is used and this
        // one's thread ends when its queue is dropped here.
        Ok(self.writer.get_or_init(|| writer))
    }

    /// Runs a short write in the writer's next batch and returns its result
    /// once the batch has committed: the claims, completions and releases
    /// of concurrent requests share one commit.
    async fn write<T, F>(&self, write: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&rusqlite::Transaction<'_>, &dyn Clock) -> rusqlite::Result<T> + Send + 'static,
    {
        use std::sync::atomic::Ordering::SeqCst;
        let (reply, mut answer) = tokio::sync::oneshot::channel();
        let state = Arc::new(std::sync::atomic::AtomicU8::new(WAITING));
        let job = WriteJob {
            write,
            reply,
            state: state.clone(),
        };
        self.send(Work::Write(Box::new(job)))?;
        match tokio::time::timeout(self.busy_timeout, &mut answer).await {
            Ok(answer) => answer.map_err(|_| transaction_over())?,
            Err(_) => match state.compare_exchange(WAITING, ABANDONED, SeqCst, SeqCst) {
                Ok(_) => Err(self.busy()),
                // The writer has started it: its batch decides.
                Err(_) => answer.await.map_err(|_| transaction_over())?,
            },
        }
    }

    fn busy(&self) -> StoreError {
        StoreError::unavailable(format!(
            "the SQLite writer was busy for longer than the busy timeout ({} ms)",
            self.busy_timeout.as_millis()
        ))
    }

    /// Queues work for the writer.
    fn send(&self, work: Work) -> Result<(), StoreError> {
        use std::sync::atomic::Ordering::Relaxed;
        let writer = self.writer()?;
        writer.counters.waiting.fetch_add(1, Relaxed);
        writer.queue.send(work).map_err(|_| {
            writer.counters.waiting.fetch_sub(1, Relaxed);
            StoreError::unavailable("the SQLite writer thread has stopped")
        })
    }

    /// Waits for the writer's answer, at most the busy timeout.
    async fn answer<T>(&self, answer: tokio::sync::oneshot::Receiver<T>) -> Result<T, StoreError> {
        match tokio::time::timeout(self.busy_timeout, answer).await {
            Ok(answer) => answer.map_err(|_| transaction_over()),
            Err(_) => Err(self.busy()),
        }
    }

    /// Requests waiting for the writer right now (transactional requests,
    /// and the claims, completions and releases of separate mode): a gauge
    /// of how far behind the single writer is.
    pub fn transactions_waiting(&self) -> usize {
        self.writer.get().map_or(0, |w| {
            w.counters
                .waiting
                .load(std::sync::atomic::Ordering::Relaxed)
        })
    }

    /// Commits made by the writer of transactional requests so far, and how
    /// many requests they carried (see [`SqliteTransaction`], "Group commit").
    pub fn group_commit_stats(&self) -> GroupCommitStats {
        use std::sync::atomic::Ordering::Relaxed;
        self.writer
            .get()
            .map_or_else(GroupCommitStats::default, |w| GroupCommitStats {
                commits: w.counters.commits.load(Relaxed),
                requests: w.counters.requests.load(Relaxed),
            })
    }

    /// What the committed record says, read without the write lock: a
    /// replay, a 422 or a 409 that needs no writer. `None`: the writer decides.
    async fn committed_refusal(&self, req: &ClaimRequest) -> Result<Option<Claim>, StoreError> {
        let (scope, key, fingerprint) = (req.scope.clone(), req.key.clone(), req.fingerprint);
        let found = self
            .with_conn(move |conn, clock| {
                let Some(record) = read_record(conn, &scope, &key)? else {
                    return Ok(None);
                };
                let existing = record.existing();
                Ok(match decide(&existing, &fingerprint, clock.now_ms()) {
                    Decision::Replace { .. } => None,
                    Decision::Mismatch => Some(Found::Claim(Claim::Mismatch)),
                    Decision::Replay => Some(Found::Completed(
                        record.response.clone().unwrap_or_default(),
                    )),
                    Decision::InFlight(lease_remaining) => {
                        Some(Found::Claim(Claim::InFlight { lease_remaining }))
                    }
                })
            })
            .await?;
        found.map(Found::decode).transpose()
    }
}

impl TransactionalStore for SqliteStore {
    type Transaction = SqliteTransaction;

    async fn claim_in_transaction(
        &self,
        req: ClaimRequest,
    ) -> Result<TransactionClaim<SqliteTransaction>, StoreError> {
        // A repeat of a committed request is answered from the committed
        // record, without waiting for the writer.
        if let Some(refused) = self.committed_refusal(&req).await? {
            return Ok(TransactionClaim::Refused(refused));
        }
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.send(Work::Request(Begin { req, reply }))?;
        self.answer(answer).await?
    }

    async fn commit(
        &self,
        transaction: &SqliteTransaction,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let response = response.encode();
        transaction
            .commands
            .send(Command::Commit { response, reply })
            .map_err(|_| transaction_over())?;
        answer.await.map_err(|_| transaction_over())?
    }

    fn rollback(&self, transaction: &SqliteTransaction) {
        let _ = transaction.commands.send(Command::Rollback);
    }
}

// ------------------------------------------------------------ inspection

/// One `SELECT` each, so every answer is one snapshot of the file (WAL
/// readers never wait for the writer). The time is read after the connection
/// is had, as the claim reads it. No index serves the lease: both scan the
/// table, which is fine for an operator's occasional look.
impl super::Inspect for SqliteStore {
    async fn stuck(&self, limit: usize) -> Result<Vec<super::RecordSummary>, StoreError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self
            .with_conn(move |conn, clock| {
                let now = clock.now_ms();
                let mut statement = conn.prepare_cached(
                    "SELECT scope, key, fingerprint, lease_until, expires_at
                     FROM idempotency_records
                     WHERE state = 'in_flight' AND lease_until <= ?1 AND expires_at > ?1
                     ORDER BY lease_until, scope, key
                     LIMIT ?2",
                )?;
                let rows = statement
                    .query_map(params![now, limit], |r| {
                        Ok((
                            r.get::<_, String>(0)?,
                            r.get::<_, String>(1)?,
                            r.get::<_, Vec<u8>>(2)?,
                            r.get::<_, i64>(3)?,
                            r.get::<_, i64>(4)?,
                        ))
                    })?
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                Ok((now, rows))
            })
            .await?;
        let (now, rows) = rows;
        rows.into_iter()
            .map(|(scope, key, fingerprint, lease_until, expires_at)| {
                let fingerprint = <[u8; 32]>::try_from(fingerprint.as_slice())
                    .map_err(|_| StoreError::Corrupt("a fingerprint is not 32 bytes".into()))?;
                Ok(super::RecordSummary::new(
                    scope,
                    key,
                    crate::fingerprint::Fingerprint(fingerprint),
                    lease_until,
                    expires_at,
                    now,
                ))
            })
            .collect()
    }

    async fn counts(&self) -> Result<super::RecordCounts, StoreError> {
        self.with_conn(|conn, clock| {
            conn.query_row(
                "SELECT
                    COALESCE(SUM(expires_at > ?1 AND state = 'in_flight' AND lease_until > ?1), 0),
                    COALESCE(SUM(expires_at > ?1 AND state = 'in_flight' AND lease_until <= ?1), 0),
                    COALESCE(SUM(expires_at > ?1 AND state = 'completed'), 0),
                    COALESCE(SUM(expires_at <= ?1), 0)
                 FROM idempotency_records",
                params![clock.now_ms()],
                |r| {
                    // COUNT-like sums: never negative.
                    let count = |i| r.get::<_, i64>(i).map(|n| n.max(0) as u64);
                    Ok(super::RecordCounts {
                        in_flight: count(0)?,
                        stuck: count(1)?,
                        completed: count(2)?,
                        expired: count(3)?,
                    })
                },
            )
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn newer_schema_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sqlite3");
        SqliteStore::open(&path).await.unwrap();
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.pragma_update(None, "user_version", 99).unwrap();
        drop(conn);
        let err = SqliteStore::open(&path).await.unwrap_err();
        assert!(err.to_string().contains("schema version 99"), "{err}");
    }

    #[tokio::test]
    async fn reopening_keeps_records_and_wal_is_on() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sqlite3");
        let store = SqliteStore::open(&path).await.unwrap();
        let mode: String = store
            .with_conn(|c, _| c.pragma_query_value(None, "journal_mode", |r| r.get(0)))
            .await
            .unwrap();
        assert_eq!(mode, "wal");
        drop(store);
        let again = SqliteStore::open(&path).await.unwrap();
        let version: i64 = again
            .with_conn(|c, _| c.pragma_query_value(None, "user_version", |r| r.get(0)))
            .await
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
    }
}
