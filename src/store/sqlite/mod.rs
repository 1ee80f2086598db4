//! The embedded default: SQLite through rusqlite (bundled), one file that
//! several processes may share.
//!
//! * `builder.rs`: [`SqliteStoreBuilder`], the schema and its migration.
//! * `claim.rs`: the claim's and the completion's SQL.
//! * `writer.rs`: the writer thread and its group commit.
//! * `batch.rs`: one batch of the writer, its stack of request savepoints.
//! * `transaction.rs`: [`SqliteTransaction`], the handler's handle.
//! * `inspect.rs`: [`Inspect`](crate::store::Inspect) in SQL.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::params;

use crate::response::StoredResponse;
use crate::store::kit::purge::{PurgeTask, in_batches};
use crate::store::kit::replay_cache::ReplayCache;
use crate::store::{
    Claim, ClaimRequest, Clock, Completion, Decision, FencingToken, RecordId, Refusal, Store,
    StoreError, TransactionClaim, TransactionalStore, decide, duration_ms,
};

mod batch;
mod builder;
mod claim;
mod inspect;
mod queue;
mod transaction;
mod writer;

pub use builder::{SqliteStoreBuilder, Synchronous};
use claim::{Refused, claim_in, complete_in, read_record};
use queue::{ABANDONED, Begin, Event, WAITING, Work, WriteJob};
use transaction::{Command, transaction_over};
pub use transaction::{SqliteTransaction, TransactionError};
pub use writer::GroupCommitStats;
use writer::{Limits, Writer};

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
/// * The writer's queue is bounded
///   ([`SqliteStoreBuilder::writer_queue`], default 1024 jobs): a claim that
///   finds it full fails at once with [`StoreError::Unavailable`] (503 with
///   `Retry-After`); a completion or release waits for room, at most the
///   busy timeout. A transactional request holds the writer at most
///   the layer's [`IdempotencyLayer::max_hold`](crate::IdempotencyLayer::max_hold) (default 60 s; see
///   [`SqliteTransaction`], "Max hold time").
/// * The schema is created or migrated when the store opens.
/// * Connections enforce foreign keys (`PRAGMA foreign_keys = ON`), which
///   matters for the handler's own tables in transactional mode.
/// * Connections keep temporary storage in memory (`PRAGMA temp_store =
///   MEMORY`): the sub-journal of the savepoints each transactional request
///   runs in, and a handler's `TEMP` tables and sorts. The sub-journal holds
///   a copy of each page a batch's requests change (4 KiB pages by default),
///   so it is bounded by [`SqliteStoreBuilder::group_commit`] requests' pages
///   and freed when the batch commits. On disk, SQLite would create, write
///   and delete a temporary file in most batches; in memory, transactional
///   credits ran 1.19x as fast (`BENCHMARKS.md`). A
///   [`SqliteStoreBuilder::on_connect`] hook can set it back to `FILE`.
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
/// // Keys belong to the caller your gateway names in `x-user` (a request
/// // without it gets 401: never a shared fallback scope).
/// let user = http::HeaderName::from_static("x-user");
/// let layer = IdempotencyLayer::new(store, tower_idempotency::scope::header(user));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SqliteStore {
    pool: r2d2::Pool<SqliteConnectionManager>,
    clock: Arc<dyn Clock>,
    path: Arc<PathBuf>,
    busy_timeout: Duration,
    limits: Limits,
    writer: Arc<std::sync::OnceLock<Writer>>,
    /// Completed records recently replayed, until their `expires_at` on the
    /// store's clock (bounded; see `store::kit::replay_cache`).
    completed: Arc<ReplayCache<i64>>,
    /// The rows one purge statement deletes at most, and the purge task.
    purge: (u32, PurgeTask),
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
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

impl Store for SqliteStore {
    async fn claim(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        // A repeat of a committed request is answered from a read.
        if let Some(refused) = self.committed_refusal(&req).await? {
            return Ok(Claim::Refused(refused));
        }
        // A transactional request open in the writer may hold the key (a
        // route in each mode sharing keys): never taken over (`claim_in`).
        let held = self.writer()?.counters.held.clone();
        self.write_with(Admission::Refuse, LAZY, move |tx, clock| {
            let holder = held.holder(&req.record_id());
            claim_in(tx, &req, clock.now_ms(), holder.map(|h| h.remaining()))
        })
        .await?
        .decode()
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        let (scope, key) = id.into_parts();
        let blob = response.encode();
        self.write(DURABLE, move |tx, _| {
            complete_in(tx, &scope, &key, token, &blob)
        })
        .await
    }

    async fn release(&self, id: RecordId, token: FencingToken) -> Result<bool, StoreError> {
        let (scope, key) = id.into_parts();
        self.write(LAZY, move |tx, _| {
            let deleted = tx.execute(
                "DELETE FROM idempotency_records
                 WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in_flight'",
                params![scope, key, token.0],
            )?;
            Ok(deleted == 1)
        })
        .await
    }

    async fn renew(
        &self,
        id: RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let (scope, key) = id.into_parts();
        self.write(LAZY, move |tx, clock| {
            let now = clock.now_ms();
            let until = now.saturating_add(duration_ms(lease));
            let renewed = tx.execute(
                crate::store::kit::sqlite_sql::RENEW,
                params![scope, key, token.0, until, now],
            )?;
            Ok(renewed == 1)
        })
        .await
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        in_batches(self.purge.0, |rows| {
            self.with_conn(move |conn, clock| {
                let purge = crate::store::kit::sqlite_sql::PURGE;
                let n = conn.execute(purge, params![clock.now_ms(), rows])?;
                Ok(n as u64)
            })
        })
        .await
    }
}

impl SqliteStore {
    /// The writer of transactional requests, started on first use.
    fn writer(&self) -> Result<&Writer, StoreError> {
        if let Some(writer) = self.writer.get() {
            return Ok(writer);
        }
        let writer = Writer::start(self.pool.clone(), self.clock.clone(), self.limits)?;
        // Another thread may have won the race; its writer is used and this
        // one's thread ends when its queue is dropped here.
        Ok(self.writer.get_or_init(|| writer))
    }

    /// A write that finishes what a claim began (a completion, a release):
    /// it waits for room in a full queue.
    async fn write<T, F>(&self, durable: bool, write: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&rusqlite::Transaction<'_>, &dyn Clock) -> rusqlite::Result<T> + Send + 'static,
    {
        self.write_with(Admission::Wait, durable, write).await
    }

    /// Runs a short write in the writer's next batch and returns its result
    /// once the batch has committed: the claims, completions and releases
    /// of concurrent requests share one commit. Queueing and the answer
    /// together take at most the busy timeout. `durable`: its commit must
    /// reach the disk before it is answered (see [`WriteJob::durable`]).
    async fn write_with<T, F>(
        &self,
        admission: Admission,
        durable: bool,
        write: F,
    ) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&rusqlite::Transaction<'_>, &dyn Clock) -> rusqlite::Result<T> + Send + 'static,
    {
        use std::sync::atomic::Ordering::SeqCst;
        let deadline = tokio::time::Instant::now() + self.busy_timeout;
        let (reply, mut answer) = tokio::sync::oneshot::channel();
        let state = Arc::new(std::sync::atomic::AtomicU8::new(WAITING));
        let job = WriteJob {
            write,
            reply,
            state: state.clone(),
            durable,
        };
        let work = Work::Write(Box::new(job));
        match admission {
            Admission::Refuse => self.send(work)?,
            Admission::Wait => self.send_waiting(work, deadline).await?,
        }
        match tokio::time::timeout_at(deadline, &mut answer).await {
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

    /// Queues new work (a claim) for the writer, or fails at once when its
    /// queue is full.
    fn send(&self, work: Work) -> Result<(), StoreError> {
        let writer = self.writer()?;
        let permit = writer
            .admission
            .clone()
            .try_acquire_owned()
            .map_err(|_| self.queue_full())?;
        self.enqueue(writer, work, permit)
    }

    fn enqueue(
        &self,
        writer: &Writer,
        work: Work,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) -> Result<(), StoreError> {
        use std::sync::atomic::Ordering::Relaxed;
        writer.counters.waiting.fetch_add(1, Relaxed);
        writer.events.send(Event::Work(work, permit)).map_err(|_| {
            writer.counters.waiting.fetch_sub(1, Relaxed);
            writer_stopped()
        })
    }

    /// Sends `work`, waiting for room in the queue until `deadline`.
    async fn send_waiting(
        &self,
        work: Work,
        deadline: tokio::time::Instant,
    ) -> Result<(), StoreError> {
        let writer = self.writer()?;
        let admitted =
            tokio::time::timeout_at(deadline, writer.admission.clone().acquire_owned()).await;
        match admitted {
            Ok(Ok(permit)) => self.enqueue(writer, work, permit),
            Ok(Err(_)) => Err(writer_stopped()),
            Err(_) => Err(self.busy()),
        }
    }

    fn queue_full(&self) -> StoreError {
        StoreError::unavailable(format!(
            "the SQLite writer's queue is full ({} jobs wait); refused at once",
            self.limits.queue
        ))
    }

    /// Transactional requests the writer has rolled back because they held
    /// it past their max hold time (see [`SqliteTransaction`], "Max hold
    /// time"), since the store opened.
    pub fn transactions_held_too_long(&self) -> u64 {
        self.writer.get().map_or(0, |w| {
            w.counters
                .held_too_long
                .load(std::sync::atomic::Ordering::Relaxed)
        })
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
    async fn committed_refusal(&self, req: &ClaimRequest) -> Result<Option<Refusal>, StoreError> {
        let now = self.clock.now_ms();
        if let Some(refusal) = self
            .completed
            .refusal(&req.scope, &req.key, &req.fingerprint, now)
        {
            return Ok(Some(refusal));
        }
        let (scope, key, fingerprint, lease) = (
            req.scope.clone(),
            req.key.clone(),
            req.fingerprint,
            req.lease,
        );
        let found = self
            .with_conn(move |conn, clock| {
                let Some(record) = read_record(conn, &scope, &key)? else {
                    return Ok(None);
                };
                let decision = decide(&record.existing(), &fingerprint, clock.now_ms(), lease);
                Ok(match decision {
                    Decision::Replace { .. } => None,
                    Decision::Mismatch => Some((Refused::Mismatch, None)),
                    Decision::Replay => {
                        let (response, fingerprint, expires_at) = record.into_completed();
                        Some((
                            Refused::Completed(response),
                            Some((fingerprint, expires_at)),
                        ))
                    }
                    Decision::InFlight(lease_remaining) => {
                        Some((Refused::InFlight(lease_remaining), None))
                    }
                })
            })
            .await?;
        let Some((refused, completed)) = found else {
            return Ok(None);
        };
        let size = match &refused {
            Refused::Completed(blob) => blob.len(),
            _ => 0,
        };
        let refusal = refused.decode()?;
        if let (Refusal::Completed(response), Some((fingerprint, expires_at))) =
            (&refusal, completed)
        {
            // Immutable until it expires: later replays need no read.
            self.completed.insert(
                &req.scope,
                &req.key,
                &fingerprint,
                expires_at,
                response,
                size,
            );
        }
        Ok(Some(refusal))
    }
}

/// What a write does when the writer's queue is full.
#[derive(Clone, Copy)]
enum Admission {
    /// New work (a claim): fail at once, so the layer answers 503.
    Refuse,
    /// Work that finishes a claim: wait for room, at most the busy timeout.
    Wait,
}

/// A write whose commit must reach the disk before its answer (a
/// completion), and one whose need not (see [`WriteJob::durable`]).
const DURABLE: bool = true;
const LAZY: bool = false;

fn writer_stopped() -> StoreError {
    StoreError::unavailable("the SQLite writer thread has stopped")
}

impl TransactionalStore for SqliteStore {
    async fn ended(&self, transaction: &Self::Transaction) {
        transaction.closed().await;
    }

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
        let (reply, mut answer) = tokio::sync::oneshot::channel();
        let writer = self.writer()?;
        let events = writer.events.clone();
        let id = req.record_id();
        // Another fingerprint than the open request holding the key: 422
        // at once (checked first, as on every store), without waiting for
        // the writer that request holds.
        match writer.holder(&id) {
            Some(held) if held.fingerprint != req.fingerprint => {
                return Ok(TransactionClaim::Refused(Refusal::Mismatch));
            }
            // In flight, and not to wait: 409 at once, the writer untouched.
            Some(held) if req.wait_in_flight.is_zero() => {
                return Ok(TransactionClaim::Refused(Refusal::InFlight {
                    lease_remaining: held.remaining(),
                }));
            }
            _ => {}
        }
        let sent = tokio::time::Instant::now();
        let busy = sent + self.busy_timeout;
        // A claim that waits behind the open request holding its key waits
        // at most its own bound (the layer's `wait_in_flight`); one that
        // waits for the writer, at most the busy timeout.
        // A claim that may not wait has one deadline: no timer more on the
        // hot path (the writer answers it at once if it meets a holder).
        let bound = (!req.wait_in_flight.is_zero()).then(|| (sent + req.wait_in_flight).min(busy));
        self.send(Work::Request(Begin { req, reply, events }))?;
        for deadline in bound.into_iter().chain([busy]) {
            if let Ok(answer) = tokio::time::timeout_at(deadline, &mut answer).await {
                return answer.map_err(|_| transaction_over())?;
            }
            // The writer answers a claim before it marks its key held: a
            // holder seen here may be this very claim, and then its answer
            // is here too (read after the holder).
            let holder = writer.holder(&id);
            if let Ok(answer) = answer.try_recv() {
                return answer;
            }
            // Its wait ended while a request holding its key is open: that
            // one is in flight (409), the store is not too busy (503).
            // Dropping `answer` gives up the claim: the writer skips it, or
            // rolls back a claim it acquired meanwhile.
            if let Some(holder) = holder {
                return Ok(TransactionClaim::Refused(Refusal::InFlight {
                    lease_remaining: holder.remaining(),
                }));
            }
        }
        Err(self.busy())
    }

    async fn commit(
        &self,
        transaction: &SqliteTransaction,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let response = response.encode();
        transaction
            .handle
            .send(Command::Commit { response, reply })
            .map_err(|()| transaction.over())?;
        answer.await.map_err(|_| transaction.over())?
    }

    /// Posts the rollback and frees the key at once: a claim that finds
    /// it free is queued behind the rollback (see `KeyMark`).
    fn rollback(&self, transaction: &SqliteTransaction) {
        transaction.handle.roll_back();
    }

    /// Returns once the writer has rolled the request back and its key is
    /// free: a retry sent on the answer is not met as in flight (409).
    async fn roll_back_and_wait(&self, transaction: &SqliteTransaction) {
        self.rollback(transaction);
        transaction.closed().await;
    }
}
