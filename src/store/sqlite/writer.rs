//! The writer thread: one connection holding SQLite's write lock, fed by one
//! queue (new work, admitted by a semaphore of the builder's queue size and
//! a wait of at most the busy timeout, and the commands of open requests).
//! It runs every write of a store, one savepoint per request (`batch.rs`),
//! and commits them in batches (group commit, see [`SqliteTransaction`]). A
//! transactional request holds its savepoint at most its max hold time.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use r2d2_sqlite::SqliteConnectionManager;
use rusqlite::TransactionBehavior;

use super::batch::{Batch, fail};
use super::claim::Refused;
use super::transaction::{Command, SqliteTransaction};
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
    /// For the handle's commands (the writer holds no sender of its own, so
    /// that it ends when the store and every handle are gone).
    pub(super) events: std::sync::mpsc::Sender<Event>,
}

/// What reaches the writer thread, in one queue.
pub(super) enum Event {
    /// New work, admitted by the store's semaphore (its permit is returned
    /// when the writer starts the work).
    Work(Work, tokio::sync::OwnedSemaphorePermit),
    /// A handler's command for the open request with this id.
    Command(u64, Command),
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
        let written = exec(tx, SAVEPOINT)
            .and_then(|()| write(tx, clock))
            .and_then(|value| exec(tx, RELEASE).map(|()| value));
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
    pub(super) events: std::sync::mpsc::Sender<Event>,
    /// At most the builder's `writer_queue` jobs wait for the writer: a job
    /// holds one permit from its sending until the writer starts it.
    pub(super) admission: Arc<tokio::sync::Semaphore>,
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

/// How the writer runs: its batch size, how many transactional requests may
/// be open in a batch at once, and how long one may hold it.
#[derive(Clone, Copy)]
pub(super) struct Limits {
    pub(super) batch: usize,
    pub(super) concurrent: usize,
    pub(super) max_hold: Duration,
    pub(super) queue: usize,
}

impl Writer {
    pub(super) fn start(
        pool: r2d2::Pool<SqliteConnectionManager>,
        clock: Arc<dyn Clock>,
        limits: Limits,
    ) -> Result<Writer, StoreError> {
        let (events, inbox) = std::sync::mpsc::channel();
        let counters = Arc::new(WriterCounters::default());
        let report = counters.clone();
        std::thread::Builder::new()
            .name("tower-idempotency-sqlite-writer".into())
            .spawn(move || write_batches(&pool, &*clock, &inbox, limits, &report))
            .map_err(StoreError::unavailable)?;
        Ok(Writer {
            events,
            admission: Arc::new(tokio::sync::Semaphore::new(limits.queue.max(1))),
            counters,
        })
    }
}

/// An answer held back until the batch it depends on has committed.
pub(super) enum Deferred {
    /// The request's writes and record; answered `Stored`.
    Commit(tokio::sync::oneshot::Sender<Result<Completion, StoreError>>),
    /// A refusal (replay, 422) read from a record written in this batch.
    Refusal(ClaimReply, Refused),
    /// A write of separate mode.
    Write(Answer),
}

/// A job the writer has received and not started: its permit (`None` for a
/// claim that waited for a request of its own key) returns when it starts.
pub(super) struct Queued(
    pub(super) Work,
    pub(super) Option<tokio::sync::OwnedSemaphorePermit>,
);

/// What the writer waits for next.
enum Next {
    Event(Event),
    /// An open request's max hold time has passed.
    Timeout,
    /// Nothing is queued right now (only when not waiting).
    Empty,
    /// Every sender is gone.
    Closed,
}

fn receive(inbox: &std::sync::mpsc::Receiver<Event>, wait: Option<Option<Instant>>) -> Next {
    use std::sync::mpsc::{RecvTimeoutError, TryRecvError};
    match wait {
        None => match inbox.try_recv() {
            Ok(event) => Next::Event(event),
            Err(TryRecvError::Empty) => Next::Empty,
            Err(TryRecvError::Disconnected) => Next::Closed,
        },
        Some(None) => inbox.recv().map_or(Next::Closed, Next::Event),
        Some(Some(deadline)) => {
            match inbox.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(event) => Next::Event(event),
                Err(RecvTimeoutError::Timeout) => Next::Timeout,
                Err(RecvTimeoutError::Disconnected) => Next::Closed,
            }
        }
    }
}

/// The writer thread: one transaction per batch, one savepoint per request
/// (see `batch.rs`). Ends when every handle of the store is gone.
fn write_batches(
    pool: &r2d2::Pool<SqliteConnectionManager>,
    clock: &dyn Clock,
    inbox: &std::sync::mpsc::Receiver<Event>,
    limits: Limits,
    counters: &WriterCounters,
) {
    use std::sync::atomic::Ordering::Relaxed;
    // Jobs received but not started yet, with their permits.
    let mut pending: VecDeque<Queued> = VecDeque::new();
    let mut next_id = 0u64;
    // Takes a job to start now (returning its permit); `None` if none waits.
    let take = |pending: &mut VecDeque<Queued>| -> Option<Work> {
        while let Some(Queued(work, permit)) = pending.pop_front() {
            if permit.is_some() {
                counters.waiting.fetch_sub(1, Relaxed);
            }
            if !work.abandoned() {
                return Some(work);
            }
        }
        None
    };
    let mut closed = false;
    loop {
        // The batch's first job.
        let first = loop {
            if let Some(work) = take(&mut pending) {
                break Some(work);
            }
            if closed {
                break None;
            }
            match receive(inbox, Some(None)) {
                Next::Event(Event::Work(work, permit)) => {
                    pending.push_back(Queued(work, Some(permit)));
                }
                // A late command for a request that has ended.
                Next::Event(Event::Command(..)) | Next::Timeout | Next::Empty => {}
                Next::Closed => closed = true,
            }
        };
        let Some(first) = first else { return };
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
        let mut batch = Batch::new(&tx, clock, counters, limits.max_hold);
        batch.start(first, &mut next_id);
        loop {
            // SQLite itself rolls the whole transaction back on some errors
            // (a full disk, an I/O error): the batch is over.
            if tx.is_autocommit() {
                batch.abort(&mut pending);
                break;
            }
            let room = batch.open() < limits.concurrent && batch.started < limits.batch;
            if room && let Some(work) = take(&mut pending) {
                batch.start(work, &mut next_id);
                continue;
            }
            let wait = match batch.open() {
                // Nothing open: commit unless more work is queued already.
                0 if !room || closed => break,
                0 => None,
                _ => Some(batch.deadline()),
            };
            match receive(inbox, wait) {
                Next::Event(Event::Work(work, permit)) => {
                    pending.push_back(Queued(work, Some(permit)));
                }
                Next::Event(Event::Command(id, command)) => {
                    batch.command(id, command, &mut pending);
                }
                Next::Timeout => batch.expire(&mut pending),
                Next::Empty => break,
                Next::Closed => {
                    // No sender left, so no handle either: nothing open can
                    // ever finish. Roll it back.
                    closed = true;
                    batch.abort(&mut pending);
                    break;
                }
            }
        }
        let deferred = batch.into_deferred();
        let broken = tx.is_autocommit();
        let committed = if broken {
            Err("SQLite rolled the batch's transaction back".to_owned())
        } else if deferred.is_empty() {
            tx.rollback().map_err(|e| e.to_string())
        } else {
            tx.commit().map_err(|e| e.to_string())
        };
        let stored = deferred
            .iter()
            .filter(|d| matches!(d, Deferred::Commit(_)))
            .count() as u64;
        if committed.is_ok() && !deferred.is_empty() {
            counters.commits.fetch_add(1, Relaxed);
            counters.requests.fetch_add(stored, Relaxed);
        }
        match committed {
            Ok(()) => {
                for answer in deferred {
                    match answer {
                        Deferred::Commit(reply) => drop(reply.send(Ok(Completion::Stored))),
                        Deferred::Refusal(reply, found) => {
                            drop(reply.send(found.decode().map(TransactionClaim::Refused)));
                        }
                        Deferred::Write(answer) => answer(None),
                    }
                }
            }
            Err(why) => {
                let error = batch_failed(&why);
                for answer in deferred {
                    fail(answer, &error);
                }
            }
        }
    }
}

/// The savepoint a separate-mode write lives in.
const SAVEPOINT: &str = "SAVEPOINT tower_idempotency_write";
const RELEASE: &str = "RELEASE tower_idempotency_write";
const ROLLBACK: &str = "ROLLBACK TO tower_idempotency_write";

/// Runs one statement without parameters through the connection's cache of
/// prepared statements (parsing it would cost more than running it).
pub(super) fn exec(tx: &rusqlite::Transaction<'_>, sql: &str) -> rusqlite::Result<()> {
    tx.prepare_cached(sql)?.execute([]).map(drop)
}

/// Undoes a write's savepoint. Errors are ignored: they mean SQLite has
/// already rolled the whole transaction back, which the batch then sees.
fn roll_back_request(tx: &rusqlite::Transaction<'_>) {
    let _ = exec(tx, ROLLBACK).and_then(|()| exec(tx, RELEASE));
}
