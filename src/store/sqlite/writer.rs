//! The writer thread: one connection holding SQLite's write lock, fed by a
//! bounded queue (its capacity, and a wait of at most the busy timeout). It
//! runs every write of a store, one savepoint per request, and commits them
//! in batches (group commit, see [`SqliteTransaction`]). A transactional
//! request holds it at most its max hold time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::TransactionBehavior;

use super::claim::{Found, Refused, claim_in, complete_in};
use super::transaction::{Command, Ended, SqliteTransaction};
use crate::store::{ClaimRequest, Clock, Completion, StoreError, TransactionClaim};

/// How many transactional requests the writer has committed, and in how many
/// commits: `requests / commits` is the mean batch size.
/// Made by [`SqliteStore::group_commit_stats`](super::SqliteStore::group_commit_stats).
/// `#[non_exhaustive]`: more figures may come; read the fields.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GroupCommitStats {
    /// Commits of the writer's transaction that succeeded.
    pub commits: u64,
    /// Requests whose writes and record those commits made durable.
    pub requests: u64,
}

pub(super) type ClaimReply =
    tokio::sync::oneshot::Sender<Result<TransactionClaim<SqliteTransaction>, StoreError>>;

/// A request asking the writer for its claim.
pub(super) struct Begin {
    pub(super) req: ClaimRequest,
    pub(super) reply: ClaimReply,
}

/// What the writer is asked to do.
pub(super) enum Work {
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
pub(super) trait WriteOp: Send {
    fn abandoned(&self) -> bool;
    fn fail(self: Box<Self>, error: StoreError);
    /// Runs the write; `None` when it failed (and was answered already).
    fn run(self: Box<Self>, tx: &rusqlite::Transaction<'_>, clock: &dyn Clock) -> Option<Answer>;
}

pub(super) struct WriteJob<T, F> {
    pub(super) write: F,
    pub(super) reply: tokio::sync::oneshot::Sender<Result<T, StoreError>>,
    /// Who decides first: the writer starting it, or its caller giving up
    /// (past the busy timeout). A write the caller gave up on never runs,
    /// and one that runs is always waited for: a claim is never committed
    /// for a caller who is gone.
    pub(super) state: Arc<std::sync::atomic::AtomicU8>,
}

pub(super) const WAITING: u8 = 0;
const RUNNING: u8 = 1;
pub(super) const ABANDONED: u8 = 2;

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
    /// Bounded: at most the builder's `writer_queue` jobs wait in it.
    pub(super) queue: tokio::sync::mpsc::Sender<Work>,
    pub(super) counters: Arc<WriterCounters>,
}

#[derive(Default)]
pub(super) struct WriterCounters {
    pub(super) waiting: std::sync::atomic::AtomicUsize,
    pub(super) commits: std::sync::atomic::AtomicU64,
    pub(super) requests: std::sync::atomic::AtomicU64,
    /// Transactional requests rolled back for holding the writer past their
    /// max hold time.
    pub(super) held_too_long: std::sync::atomic::AtomicU64,
}

/// How the writer runs: its batch size, and how long one transactional
/// request may hold it.
#[derive(Clone, Copy)]
pub(super) struct Limits {
    pub(super) batch: usize,
    pub(super) max_hold: Duration,
    pub(super) queue: usize,
}

impl Writer {
    pub(super) fn start(
        pool: r2d2::Pool<SqliteConnectionManager>,
        clock: Arc<dyn Clock>,
        limits: Limits,
    ) -> Result<Writer, StoreError> {
        let (queue, mut inbox) = tokio::sync::mpsc::channel(limits.queue.max(1));
        let counters = Arc::new(WriterCounters::default());
        let report = counters.clone();
        std::thread::Builder::new()
            .name("tower-idempotency-sqlite-writer".into())
            .spawn(move || write_batches(&pool, &*clock, &mut inbox, limits, &report))
            .map_err(StoreError::unavailable)?;
        Ok(Writer { queue, counters })
    }
}

/// An answer held back until the batch it depends on has committed.
enum Deferred {
    /// The request's writes and record; answered `Stored`.
    Commit(tokio::sync::oneshot::Sender<Result<Completion, StoreError>>),
    /// A refusal (replay, 422) read from a record written in this batch.
    Refusal(ClaimReply, Refused),
    /// A write of separate mode.
    Write(Answer),
}

/// The writer thread: one transaction per batch, one savepoint per request.
/// Ends when every handle of the store is gone.
fn write_batches(
    pool: &r2d2::Pool<SqliteConnectionManager>,
    clock: &dyn Clock,
    inbox: &mut tokio::sync::mpsc::Receiver<Work>,
    limits: Limits,
    counters: &WriterCounters,
) {
    use std::sync::atomic::Ordering::Relaxed;
    // The next request whose caller still waits.
    let mut next = |wait: bool| loop {
        let work = if wait {
            inbox.blocking_recv()?
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
                Work::Request(begin) => {
                    serve_request(&tx, clock, begin, limits.max_hold, &mut deferred, counters);
                }
                Work::Write(write) => {
                    if let Some(answer) = write.run(&tx, clock) {
                        deferred.push(Deferred::Write(answer));
                    }
                }
            }
            members += 1;
            // SQLite itself rolls the whole transaction back on some errors
            // (a full disk, an I/O error): the batch is over.
            if tx.is_autocommit() || members >= limits.batch {
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
pub(super) const SAVEPOINT: &str = "SAVEPOINT tower_idempotency_request";
pub(super) const RELEASE: &str = "RELEASE tower_idempotency_request";
const ROLLBACK: &str = "ROLLBACK TO tower_idempotency_request; RELEASE tower_idempotency_request";

/// Undoes the request's savepoint. Errors are ignored: they mean SQLite has
/// already rolled the whole transaction back, which the batch then sees.
fn roll_back_request(tx: &rusqlite::Transaction<'_>) {
    let _ = tx.execute_batch(ROLLBACK);
}

/// One request inside the writer's transaction: its claim, then its
/// handler's jobs until the layer commits or rolls back, or until it has
/// held the writer for `max_hold` or its lease, whichever is shorter: then
/// its savepoint is rolled back, and its later SQL and its commit fail.
fn serve_request(
    tx: &rusqlite::Transaction<'_>,
    clock: &dyn Clock,
    Begin { req, reply }: Begin,
    max_hold: Duration,
    deferred: &mut Vec<Deferred>,
    counters: &WriterCounters,
) {
    let hold = max_hold.min(req.lease);
    let deadline = Instant::now().checked_add(hold);
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
        Found::Acquired { taken_over } => taken_over,
        Found::Refused(refused) => {
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
    // Dropped when this function returns: the handle's `closed` resolves.
    let (ended, watch) = tokio::sync::watch::channel(Ended::Open);
    let transaction = SqliteTransaction {
        commands,
        ended: watch,
    };
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
    loop {
        let command = match deadline {
            Some(deadline) => {
                inbox.recv_timeout(deadline.saturating_duration_since(Instant::now()))
            }
            None => inbox
                .recv()
                .map_err(|_| std::sync::mpsc::RecvTimeoutError::Disconnected),
        };
        let command = match command {
            Ok(command) => command,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                counters
                    .held_too_long
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tracing::warn!(
                    max_hold_ms = hold.as_millis() as u64,
                    "an idempotency transaction held the SQLite writer past its max hold time; rolled back"
                );
                ended.send_replace(Ended::HeldTooLong(hold));
                break;
            }
        };
        match command {
            Command::Run(job) => {
                if !job(tx) {
                    tracing::error!(
                        "a closure passed to SqliteTransaction::run panicked; its request was rolled back"
                    );
                    break;
                }
            }
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
