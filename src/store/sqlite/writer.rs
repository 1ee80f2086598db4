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
use super::queue::{Deferred, Event, Queued, Work, WriterCounters, batch_failed};
use crate::store::kit::held::Holder;
use crate::store::{Clock, Completion, RecordId, StoreError, TransactionClaim};

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

/// The writer's side of a store: its queue, and what it reports.
pub(super) struct Writer {
    pub(super) events: std::sync::mpsc::Sender<Event>,
    /// At most the builder's `writer_queue` jobs wait for the writer: a job
    /// holds one permit from its sending until the writer starts it.
    pub(super) admission: Arc<tokio::sync::Semaphore>,
    pub(super) counters: Arc<WriterCounters>,
}

/// How the writer runs: its batch size, how many transactional requests may
/// be open in a batch at once, and how long one may hold it.
#[derive(Clone, Copy)]
pub(super) struct Limits {
    pub(super) batch: usize,
    pub(super) concurrent: usize,
    pub(super) queue: usize,
    /// How long a batch waits for SQLite's write lock (the busy timeout).
    pub(super) lock_wait: Duration,
    /// The store runs at `synchronous=FULL`, so a batch of writes that need
    /// not reach the disk (claims, releases, renewals) commits at `NORMAL`.
    pub(super) lazy_batches: bool,
}

impl Writer {
    /// The open transactional request that holds `id`, if one does.
    pub(super) fn holder(&self, id: &RecordId) -> Option<Holder> {
        self.counters.held.holder(id)
    }

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

/// Opens the batch's transaction, waiting at most `wait` for SQLite's write
/// lock, in steps of at most [`LOCK_STEP`].
///
/// Another connection to the file (the application's own, in separate mode)
/// holds the lock for one commit at a time, about one fsync. SQLite's own
/// busy handler sleeps 1, 2, 5, 10 ms and more between tries
/// (`sqliteDefaultBusyCallback`), so each collision would stall every
/// request queued behind the writer for a millisecond or more; here the
/// writer tries again after 20 µs, doubling up to `LOCK_STEP`.
fn begin_immediate(
    conn: &rusqlite::Connection,
    wait: Duration,
) -> rusqlite::Result<rusqlite::Transaction<'_>> {
    let deadline = Instant::now() + wait;
    let mut step = Duration::from_micros(20);
    conn.busy_timeout(Duration::ZERO)?;
    let begun = loop {
        match rusqlite::Transaction::new_unchecked(conn, TransactionBehavior::Immediate) {
            Err(rusqlite::Error::SqliteFailure(e, _))
                if e.code == rusqlite::ErrorCode::DatabaseBusy && Instant::now() < deadline =>
            {
                std::thread::sleep(step);
                step = (step * 2).min(LOCK_STEP);
            }
            begun => break begun,
        }
    };
    // Statements inside the transaction keep the store's busy timeout.
    conn.busy_timeout(wait)?;
    begun
}

/// Sets the connection's `synchronous` level (outside a transaction, where
/// SQLite allows it to change).
fn synchronous(conn: &rusqlite::Connection, level: &'static str) -> rusqlite::Result<()> {
    let sql = match level {
        "NORMAL" => "PRAGMA synchronous = NORMAL",
        _ => "PRAGMA synchronous = FULL",
    };
    conn.prepare_cached(sql)?.execute([]).map(drop)
}

/// The longest pause between two tries for the write lock.
const LOCK_STEP: Duration = Duration::from_micros(250);

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

/// Takes a job to start now (returning its permit, counted in `waiting`);
/// `None` if none waits, or, in a lazy batch, if the next one must be
/// durable (it starts the next batch, so that the queue keeps its order).
/// Abandoned jobs are dropped on the way.
fn next_to_start(
    pending: &mut VecDeque<Queued>,
    lazy: bool,
    waiting: &std::sync::atomic::AtomicUsize,
) -> Option<Work> {
    // Checked before each pop: an abandoned job dropped below may have
    // stood in front of a durable one.
    while !(lazy
        && pending
            .front()
            .is_some_and(|Queued(work, _)| work.durable()))
    {
        let Queued(work, permit) = pending.pop_front()?;
        if permit.is_some() {
            waiting.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
        if !work.abandoned() {
            return Some(work);
        }
    }
    None
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
    let mut queue = Queue {
        inbox,
        pending: VecDeque::new(),
        closed: false,
        waiting: &counters.waiting,
    };
    let mut next_id = 0u64;
    // 1. Wait for the batch's first job (none: every sender is gone).
    while let Some(first) = queue.first_job() {
        // 2. Open the batch's transaction on a pooled connection; the first
        //    job fails alone when that cannot be done.
        let conn = match pool.get() {
            Ok(conn) => conn,
            Err(e) => {
                first.fail(StoreError::unavailable(e));
                continue;
            }
        };
        // A batch that starts with a lazy write holds only lazy writes.
        let lazy = limits.lazy_batches && !first.durable();
        let tx = match begin_batch(&conn, lazy, limits) {
            Ok(tx) => tx,
            Err(e) => {
                first.fail(StoreError::unavailable(e));
                continue;
            }
        };
        // 3. Run jobs and commands in it until the batch is over.
        let mut batch = Batch::new(&tx, clock, counters);
        batch.start(first, &mut next_id);
        queue.fill(&mut batch, &tx, lazy, limits, &mut next_id);
        let deferred = batch.into_deferred();
        // 4. Commit it (or roll back an empty one).
        let committed = end_batch(tx, &deferred);
        if lazy {
            // Other users of the pooled connection (purges) get the store's
            // level back; the next batch sets its own either way.
            let _ = synchronous(&conn, "FULL");
        }
        count_commit(counters, &committed, &deferred);
        // 5. Answer the waiters: what the batch stored, or why it failed.
        match committed {
            Ok(()) => answer_committed(deferred),
            Err(why) => answer_failed(deferred, &why),
        }
    }
}

/// The writer's side of its channel: the events it receives, and the jobs
/// received but not started yet, with their permits.
struct Queue<'a> {
    inbox: &'a std::sync::mpsc::Receiver<Event>,
    pending: VecDeque<Queued>,
    /// Every sender is gone: no event will come any more.
    closed: bool,
    /// The counter of jobs waiting for the writer (see [`next_to_start`]).
    waiting: &'a std::sync::atomic::AtomicUsize,
}

impl Queue<'_> {
    /// A job to start now, as [`next_to_start`] picks it.
    fn take(&mut self, lazy: bool) -> Option<Work> {
        next_to_start(&mut self.pending, lazy, self.waiting)
    }

    /// Step 1: the next batch's first job, waiting for one as long as it
    /// takes; `None` once every sender is gone and nothing is queued.
    /// Commands that come meanwhile are for requests that have ended.
    fn first_job(&mut self) -> Option<Work> {
        loop {
            if let Some(work) = self.take(false) {
                return Some(work);
            }
            if self.closed {
                return None;
            }
            match receive(self.inbox, Some(None)) {
                Next::Event(Event::Work(work, permit)) => {
                    self.pending.push_back(Queued(work, Some(permit)));
                }
                // A late command for a request that has ended.
                Next::Event(Event::Command(..)) | Next::Timeout | Next::Empty => {}
                Next::Closed => self.closed = true,
            }
        }
    }

    /// Step 3: starts queued jobs in `batch` while it has room (its size,
    /// its open requests, and in a lazy batch no durable job next), and
    /// runs the commands of its open requests, expiring those held past
    /// their max hold time. Returns when nothing is open and no more work
    /// may join, or nothing more is queued; or when SQLite or the last
    /// handle's going ended the batch (its open requests then rolled back).
    fn fill(
        &mut self,
        batch: &mut Batch<'_, '_>,
        tx: &rusqlite::Transaction<'_>,
        lazy: bool,
        limits: Limits,
        next_id: &mut u64,
    ) {
        loop {
            // SQLite itself rolls the whole transaction back on some errors
            // (a full disk, an I/O error): the batch is over.
            if tx.is_autocommit() {
                batch.abort(&mut self.pending);
                return;
            }
            let blocked = lazy
                && self
                    .pending
                    .front()
                    .is_some_and(|Queued(work, _)| work.durable());
            let room = !blocked && batch.open() < limits.concurrent && batch.started < limits.batch;
            if room && let Some(work) = self.take(lazy) {
                batch.start(work, next_id);
                continue;
            }
            let wait = match batch.open() {
                // Nothing open: commit unless more work is queued already.
                0 if !room || self.closed => return,
                0 => None,
                _ => Some(batch.deadline()),
            };
            match receive(self.inbox, wait) {
                Next::Event(Event::Work(work, permit)) => {
                    self.pending.push_back(Queued(work, Some(permit)));
                }
                Next::Event(Event::Command(id, command)) => {
                    batch.command(id, command, &mut self.pending);
                }
                Next::Timeout => batch.expire(&mut self.pending),
                Next::Empty => return,
                Next::Closed => {
                    // No sender left, so no handle either: nothing open can
                    // ever finish. Roll it back.
                    self.closed = true;
                    batch.abort(&mut self.pending);
                    return;
                }
            }
        }
    }
}

/// Step 2: sets the connection's `synchronous` level for a lazy or a
/// durable batch (when the store runs lazy batches at all), then opens the
/// batch's transaction, waiting at most the busy timeout for the lock.
fn begin_batch(
    conn: &rusqlite::Connection,
    lazy: bool,
    limits: Limits,
) -> rusqlite::Result<rusqlite::Transaction<'_>> {
    if limits.lazy_batches {
        synchronous(conn, if lazy { "NORMAL" } else { "FULL" })?;
    }
    begin_immediate(conn, limits.lock_wait)
}

/// Step 4: ends the batch's transaction: commits it when the batch has
/// answers to give, rolls back one with none. `Err` says why nothing of the
/// batch was stored: SQLite rolled it back already, or the end failed.
fn end_batch(tx: rusqlite::Transaction<'_>, deferred: &[Deferred]) -> Result<(), String> {
    if tx.is_autocommit() {
        Err("SQLite rolled the batch's transaction back".to_owned())
    } else if deferred.is_empty() {
        tx.rollback().map_err(|e| e.to_string())
    } else {
        tx.commit().map_err(|e| e.to_string())
    }
}

/// Step 4, once the transaction has ended: counts a commit that stored
/// something, and the requests it made durable, for [`GroupCommitStats`].
fn count_commit(counters: &WriterCounters, committed: &Result<(), String>, deferred: &[Deferred]) {
    use std::sync::atomic::Ordering::Relaxed;
    let stored = deferred
        .iter()
        .filter(|d| matches!(d, Deferred::Commit(_)))
        .count() as u64;
    if committed.is_ok() && !deferred.is_empty() {
        counters.commits.fetch_add(1, Relaxed);
        counters.requests.fetch_add(stored, Relaxed);
    }
}

/// Step 5, after a commit: each waiter gets its result (`Stored`, a
/// refusal read in the batch, or a write's success).
fn answer_committed(deferred: Vec<Deferred>) {
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

/// Step 5, after a failed batch: each waiter gets the batch's failure, as
/// nothing of its request happened.
fn answer_failed(deferred: Vec<Deferred>, why: &str) {
    let error = batch_failed(why);
    for answer in deferred {
        fail(answer, &error);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU8, AtomicUsize};

    use super::super::queue::{ABANDONED, Queued, WAITING, Work, WriteJob};
    use super::next_to_start;

    /// A separate-mode write that does nothing, in `state`.
    fn job(state: u8, durable: bool) -> Queued {
        let (reply, _) = tokio::sync::oneshot::channel::<Result<(), crate::store::StoreError>>();
        let write = |_: &rusqlite::Transaction<'_>, _: &dyn crate::store::Clock| Ok(());
        let job = WriteJob {
            write,
            reply,
            state: Arc::new(AtomicU8::new(state)),
            durable,
        };
        Queued(Work::Write(Box::new(job)), None)
    }

    #[test]
    fn a_lazy_batch_stops_at_a_durable_job_behind_an_abandoned_one() {
        let waiting = AtomicUsize::new(0);
        // A claim whose caller gave up, then a completion, then a claim.
        let mut pending = VecDeque::from([
            job(ABANDONED, false),
            job(WAITING, true),
            job(WAITING, false),
        ]);
        assert!(next_to_start(&mut pending, true, &waiting).is_none());
        assert_eq!(pending.len(), 2, "only the abandoned claim was dropped");
        // The completion starts the next batch, a durable one, in order.
        let first = next_to_start(&mut pending, false, &waiting).unwrap();
        assert!(first.durable());
        let second = next_to_start(&mut pending, false, &waiting).unwrap();
        assert!(!second.durable());
        assert!(next_to_start(&mut pending, false, &waiting).is_none());
    }

    #[test]
    fn abandoned_jobs_are_dropped_and_never_started() {
        let waiting = AtomicUsize::new(0);
        let mut pending = VecDeque::from([
            job(WAITING, false),
            job(ABANDONED, true),
            job(ABANDONED, false),
            job(WAITING, false),
        ]);
        assert!(
            !next_to_start(&mut pending, true, &waiting)
                .unwrap()
                .durable()
        );
        // An abandoned completion still ends a lazy batch (whether it was
        // abandoned is read only once it is popped).
        assert!(next_to_start(&mut pending, true, &waiting).is_none());
        assert_eq!(pending.len(), 3);
        // The next batch drops both abandoned jobs and starts the claim.
        assert!(
            !next_to_start(&mut pending, false, &waiting)
                .unwrap()
                .durable()
        );
        assert!(pending.is_empty());
    }
}
