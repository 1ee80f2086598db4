//! What travels between the store, the requests' transactions and the
//! writer thread: the work queued for the writer ([`Event`]), the answers it
//! holds back until a batch commits ([`Deferred`]), and a separate-mode
//! write ([`WriteJob`]).

use std::sync::Arc;

use super::claim::Refused;
use super::transaction::{Command, Mailbox, SqliteTransaction};
use crate::store::kit::held::HeldKeys;
use crate::store::{ClaimRequest, Clock, Completion, StoreError, TransactionClaim};

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
    pub(super) fn abandoned(&self) -> bool {
        match self {
            Work::Request(begin) => begin.reply.is_closed(),
            Work::Write(write) => write.abandoned(),
        }
    }

    /// Whether its commit must reach the disk before it is answered (see
    /// [`WriteJob::durable`]). A transactional request's always must.
    pub(super) fn durable(&self) -> bool {
        match self {
            Work::Request(_) => true,
            Work::Write(write) => write.durable(),
        }
    }

    pub(super) fn fail(self, error: StoreError) {
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
    fn durable(&self) -> bool;
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
    /// Whether the commit must reach the disk before the answer: a
    /// completion must, so that a replay once answered survives a power
    /// loss. A claim, a release and a renewal need not (the writer commits
    /// a batch of only those with `synchronous=NORMAL`): in separate mode a
    /// claim lost with the machine changes no outcome. The effect it guarded
    /// either was lost too (the retry runs it, rightly) or is durable
    /// without its completion, and then the retry runs it again whether it
    /// finds the claim (taken over once its lease ends) or finds nothing:
    /// the double separate mode documents. A process crash loses nothing
    /// committed at any level.
    pub(super) durable: bool,
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

    fn durable(&self) -> bool {
        self.durable
    }

    fn fail(self: Box<Self>, error: StoreError) {
        let _ = self.reply.send(Err(error));
    }

    fn run(self: Box<Self>, tx: &rusqlite::Transaction<'_>, clock: &dyn Clock) -> Option<Answer> {
        let WriteJob {
            write,
            reply,
            state,
            durable: _,
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

pub(super) fn batch_failed(why: &str) -> StoreError {
    StoreError::unavailable(format!(
        "the batch this write was committed in failed, so nothing of it happened: {why}"
    ))
}

#[derive(Default)]
pub(super) struct WriterCounters {
    pub(super) waiting: std::sync::atomic::AtomicUsize,
    pub(super) commits: std::sync::atomic::AtomicU64,
    pub(super) requests: std::sync::atomic::AtomicU64,
    /// Transactional requests rolled back for holding the writer past their
    /// max hold time.
    pub(super) held_too_long: std::sync::atomic::AtomicU64,
    /// The key of every open transactional request, with its fingerprint
    /// and max hold (at most `concurrent_transactions` keys): a claim of a
    /// key held with another fingerprint is refused at once (422); one whose
    /// wait ends while its key is held answers "in flight" (409), not
    /// "busy" (503); and no claim takes a held key over (`claim_in`).
    /// Written by the writer thread only.
    pub(super) held: Arc<HeldKeys>,
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

/// The writer's queue is a request's mailbox: a handler's command reaches
/// the writer as an [`Event::Command`] for its request.
impl Mailbox for std::sync::mpsc::Sender<Event> {
    fn post(&self, id: u64, command: Command) -> bool {
        self.send(Event::Command(id, command)).is_ok()
    }
}
