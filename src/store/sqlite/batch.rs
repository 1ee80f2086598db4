//! One batch of the writer: one SQLite transaction, and in it a stack of
//! savepoints, one per transactional request (its "frame"), in the order the
//! requests were claimed.
//!
//! A request's claim, SQL and completion run on the writer thread, one
//! statement batch at a time, on top of the stack. With one open request at
//! a time (the default, [`SqliteStoreBuilder::concurrent_transactions`]) the
//! stack holds at most one frame and this is the classic savepoint per
//! request. With more, requests' SQL interleaves: what a request runs lands
//! in the topmost frame, and the request then depends on that frame. When a
//! request rolls back, its frame and every frame above it are rolled back
//! (`ROLLBACK TO`): every request with work in them is rolled back too and
//! answered 503 (nothing of it happened, so its retry runs again). A frame is
//! released into the one below once its request has completed and nothing
//! open sits above it.
//!
//! [`SqliteStoreBuilder::concurrent_transactions`]: super::SqliteStoreBuilder::concurrent_transactions

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::claim::{Found, Refused, claim_in, complete_in};
use super::queue::{Begin, Deferred, Queued, Work, WriterCounters, exec};
use super::transaction::{Command, Ended, Handle, Job, KeyMark, Marked, SqliteTransaction};
use crate::store::kit::held::MAX_WAITERS;
use crate::store::{Clock, Completion, FencingToken, StoreError, TransactionClaim};

/// A transactional request of the batch.
struct Member {
    id: u64,
    scope: String,
    key: String,
    token: FencingToken,
    deadline: Option<Instant>,
    hold: Duration,
    /// `Some` while the request is open; dropping it resolves the handle's
    /// `closed`.
    ended: Option<tokio::sync::watch::Sender<Ended>>,
    /// Claims of the same key that found this request in flight: they run
    /// again once it has ended.
    waiters: Vec<Begin>,
    /// Its key, marked held until the member is dropped (or its handle
    /// posts its rollback, see [`KeyMark`]).
    _held: Marked,
}

/// A request's savepoint, and what landed in it.
struct Frame {
    owner: u64,
    name: String,
    /// Requests with work in this frame (its owner first).
    members: Vec<u64>,
    /// Answers that hold only if this frame's work commits.
    deferred: Vec<Deferred>,
}

/// Why a request is rolled back.
#[derive(Clone, Copy)]
pub(super) enum Why {
    /// The layer rolled it back, or every handle was dropped.
    Asked,
    /// Its closure panicked.
    Panicked,
    /// It held the writer past its max hold time.
    HeldTooLong,
    /// Its completion failed.
    Failed,
}

pub(super) struct Batch<'t, 'c> {
    tx: &'t rusqlite::Transaction<'c>,
    clock: &'t dyn Clock,
    counters: &'t WriterCounters,
    members: Vec<Member>,
    frames: Vec<Frame>,
    /// Answers whose work has been released into the transaction itself.
    base: Vec<Deferred>,
    /// Jobs started in this batch (its size, for the group commit limit).
    pub(super) started: usize,
}

/// The error of an answer whose work a batch mate's rollback undid.
fn undone() -> StoreError {
    StoreError::unavailable(
        "a request this one ran after in the same SQLite batch was rolled back, so nothing of this request happened",
    )
}

impl<'t, 'c> Batch<'t, 'c> {
    pub(super) fn new(
        tx: &'t rusqlite::Transaction<'c>,
        clock: &'t dyn Clock,
        counters: &'t WriterCounters,
    ) -> Self {
        Batch {
            tx,
            clock,
            counters,
            members: Vec::new(),
            frames: Vec::new(),
            base: Vec::new(),
            started: 0,
        }
    }

    /// Requests still open (claimed, neither completed nor rolled back).
    pub(super) fn open(&self) -> usize {
        self.members.len()
    }

    /// The answers of the batch, once every request has ended.
    pub(super) fn into_deferred(mut self) -> Vec<Deferred> {
        debug_assert!(self.members.is_empty() && self.frames.is_empty());
        for frame in self.frames.drain(..) {
            self.base.extend(frame.deferred);
        }
        self.base
    }

    /// Where new work's answers go: the topmost frame, or the transaction.
    fn top_deferred(&mut self) -> &mut Vec<Deferred> {
        match self.frames.last_mut() {
            Some(frame) => &mut frame.deferred,
            None => &mut self.base,
        }
    }

    /// `id` is about to run work: it now depends on the topmost frame.
    fn depend_on_top(&mut self, id: u64) {
        if let Some(top) = self.frames.last_mut()
            && !top.members.contains(&id)
        {
            top.members.push(id);
        }
    }

    /// Starts a job taken off the queue.
    pub(super) fn start(&mut self, work: Work, next_id: &mut u64) {
        self.started += 1;
        match work {
            Work::Request(begin) => self.claim(begin, next_id),
            Work::Write(write) => {
                if let Some(answer) = write.run(self.tx, self.clock) {
                    self.top_deferred().push(Deferred::Write(answer));
                }
            }
        }
    }

    fn claim(&mut self, Begin { req, reply, events }: Begin, next_id: &mut u64) {
        let id = *next_id;
        *next_id += 1;
        // Named by its depth on the stack: a handful of names, each parsed
        // once per connection (the statement cache).
        let name = format!("tower_idempotency_s{}", self.frames.len());
        if let Err(e) = exec(self.tx, &format!("SAVEPOINT {name}")) {
            let _ = reply.send(Err(StoreError::unavailable(e)));
            return;
        }
        let undo = |tx: &rusqlite::Transaction<'_>| undo_to(tx, &name);
        let record = req.record_id();
        let held = self.counters.held.holder(&record).map(|h| h.remaining());
        let taken_over = match claim_in(self.tx, &req, self.clock.now_ms(), held) {
            Err(e) => {
                undo(self.tx);
                let _ = reply.send(Err(StoreError::unavailable(e)));
                return;
            }
            Ok(Found::Acquired { taken_over }) => taken_over,
            Ok(Found::Refused(refused)) => {
                // Nothing was written.
                let _ = exec(self.tx, &format!("RELEASE {name}"));
                return self.refuse(Begin { req, reply, events }, refused);
            }
        };
        let (ended, watch) = tokio::sync::watch::channel(Ended::Open);
        let mark = std::sync::Arc::new(KeyMark::default());
        let transaction = SqliteTransaction {
            handle: std::sync::Arc::new(Handle {
                events: Box::new(events),
                id,
                key: mark.clone(),
            }),
            ended: watch,
        };
        let acquired = TransactionClaim::Acquired {
            transaction,
            taken_over,
        };
        if reply.send(Ok(acquired)).is_err() {
            // The caller gave up waiting: the claim never happened.
            undo(self.tx);
            return;
        }
        let hold = req.hold();
        self.frames.push(Frame {
            owner: id,
            name,
            members: vec![id],
            deferred: Vec::new(),
        });
        // Not if its handle has posted its rollback already: that comes next
        // in the queue.
        mark.hold(|| self.counters.held.hold(&record, req.fingerprint, hold));
        self.members.push(Member {
            id,
            scope: req.scope,
            key: req.key,
            token: req.token,
            deadline: Instant::now().checked_add(hold),
            hold,
            ended: Some(ended),
            waiters: Vec::new(),
            _held: Marked(mark),
        });
    }

    /// Answers a claim refused by the record it read, or, when an open
    /// request of this batch holds its key, makes it that request's waiter.
    fn refuse(&mut self, begin: Begin, refused: Refused) {
        if let Refused::InFlight(remaining) = refused
            && let Some(owner) = self
                .members
                .iter_mut()
                .find(|m| m.scope == begin.req.scope && m.key == begin.req.key)
        {
            // In flight in this batch: wait for it, as a request waits for
            // the writer, then claim again. A waiter (and a repeat refused
            // past the cap) takes no place in the batch: repeats of one slow
            // key must not fill it and shut out other keys' requests. Its
            // caller stops waiting at its bound
            // (`ClaimRequest::wait_in_flight`; one that may not wait is
            // answered at once); at most `MAX_WAITERS` wait per key
            // (`store::kit::held`), and the next is answered in flight at
            // once.
            self.started -= 1;
            // Waiters whose callers stopped waiting hold no place.
            owner.waiters.retain(|waiter| !waiter.reply.is_closed());
            if owner.waiters.len() < MAX_WAITERS && !begin.req.wait_in_flight.is_zero() {
                owner.waiters.push(begin);
                return;
            }
            let refusal = Refused::InFlight(remaining).decode();
            let _ = begin.reply.send(refusal.map(TransactionClaim::Refused));
            return;
        }
        // The record it read may be one this batch wrote: answer only once
        // the batch is durable.
        let wrote = !self.frames.is_empty()
            || self
                .base
                .iter()
                .any(|d| matches!(d, Deferred::Commit(_) | Deferred::Write(_)));
        if wrote {
            self.top_deferred()
                .push(Deferred::Refusal(begin.reply, refused));
        } else {
            let _ = begin
                .reply
                .send(refused.decode().map(TransactionClaim::Refused));
        }
    }

    /// A handler's command for request `id`. One for a request that has
    /// ended is dropped: its caller then sees the transaction over.
    pub(super) fn command(&mut self, id: u64, command: Command, pending: &mut VecDeque<Queued>) {
        if !self.members.iter().any(|m| m.id == id) {
            return;
        }
        match command {
            Command::Run(job) => self.run(id, job, pending),
            Command::Commit { response, reply } => self.commit(id, &response, reply, pending),
            Command::Rollback => self.roll_back(id, Why::Asked, pending),
        }
    }

    fn run(&mut self, id: u64, job: Job, pending: &mut VecDeque<Queued>) {
        self.depend_on_top(id);
        if !job(self.tx) {
            tracing::error!(
                "a closure passed to SqliteTransaction::run panicked; its request was rolled back"
            );
            self.roll_back(id, Why::Panicked, pending);
        }
    }

    fn commit(
        &mut self,
        id: u64,
        response: &[u8],
        reply: tokio::sync::oneshot::Sender<Result<Completion, StoreError>>,
        pending: &mut VecDeque<Queued>,
    ) {
        self.depend_on_top(id);
        let Some(member) = self.members.iter().find(|m| m.id == id) else {
            return;
        };
        match complete_in(self.tx, &member.scope, &member.key, member.token, response) {
            Ok(Completion::Stored) => {
                self.top_deferred().push(Deferred::Commit(reply));
                self.end(id, None, pending);
                self.release_completed();
            }
            // Only the handler's own SQL could have removed the record
            // inside this transaction: keep nothing of it.
            Ok(Completion::Fenced) => {
                self.roll_back(id, Why::Failed, pending);
                let _ = reply.send(Err(StoreError::Corrupt(
                    "the claimed record vanished inside its transaction".into(),
                )));
            }
            Err(e) => {
                self.roll_back(id, Why::Failed, pending);
                let _ = reply.send(Err(StoreError::unavailable(e)));
            }
        }
    }

    /// Ends open request `id`: its handle's `closed` resolves (after
    /// `state` is published), and claims waiting for its key run next.
    fn end(&mut self, id: u64, state: Option<Ended>, pending: &mut VecDeque<Queued>) {
        let Some(at) = self.members.iter().position(|m| m.id == id) else {
            return;
        };
        let Member {
            ended,
            waiters,
            _held: held,
            ..
        } = self.members.swap_remove(at);
        // The key is free before anyone hears the request ended: a retry
        // sent on its answer is not met as in flight.
        drop(held);
        if let (Some(ended), Some(state)) = (&ended, state) {
            ended.send_replace(state);
        }
        for begin in waiters.into_iter().rev() {
            pending.push_front(Queued(Work::Request(begin), None));
        }
    }

    /// Releases every completed frame on top of the stack into the one
    /// below (or the transaction).
    fn release_completed(&mut self) {
        while let Some(top) = self.frames.last() {
            if self.members.iter().any(|m| m.id == top.owner) {
                return;
            }
            if exec(self.tx, &format!("RELEASE {}", top.name)).is_err() {
                // SQLite rolled the transaction back: the writer sees it.
                return;
            }
            let top = self.frames.pop().expect("checked above");
            match self.frames.last_mut() {
                Some(below) => {
                    below.deferred.extend(top.deferred);
                    for id in top.members {
                        if !below.members.contains(&id) {
                            below.members.push(id);
                        }
                    }
                }
                None => self.base.extend(top.deferred),
            }
        }
    }

    /// Rolls open request `id` back, with every frame from its own upwards.
    pub(super) fn roll_back(&mut self, id: u64, why: Why, pending: &mut VecDeque<Queued>) {
        let Some(mut k) = self.frames.iter().position(|f| f.owner == id) else {
            return;
        };
        // Every request with work at or above frame k is undone; a request
        // whose own frame is lower must be undone from there.
        loop {
            let lowest = self.frames[k..]
                .iter()
                .flat_map(|f| f.members.iter())
                .filter_map(|m| self.frames.iter().position(|f| f.owner == *m))
                .min()
                .unwrap_or(k);
            if lowest >= k {
                break;
            }
            k = lowest;
        }
        undo_to(self.tx, &self.frames[k].name);
        let undone_frames: Vec<Frame> = self.frames.drain(k..).collect();
        for frame in undone_frames {
            for answer in frame.deferred {
                fail(answer, &undone());
            }
            for member in frame.members {
                let state = if member == id {
                    match why {
                        Why::HeldTooLong => {
                            let hold = self.members.iter().find(|m| m.id == id).map(|m| m.hold);
                            hold.map(Ended::HeldTooLong)
                        }
                        _ => None,
                    }
                } else {
                    Some(Ended::BatchMateRolledBack)
                };
                self.end(member, state, pending);
            }
        }
        self.release_completed();
    }

    /// The earliest max-hold deadline of an open request.
    pub(super) fn deadline(&self) -> Option<Instant> {
        self.members.iter().filter_map(|m| m.deadline).min()
    }

    /// Rolls back every open request past its max hold time.
    pub(super) fn expire(&mut self, pending: &mut VecDeque<Queued>) {
        let now = Instant::now();
        let expired: Vec<(u64, Duration)> = self
            .members
            .iter()
            .filter(|m| m.deadline.is_some_and(|d| d <= now))
            .map(|m| (m.id, m.hold))
            .collect();
        for (id, hold) in expired {
            if !self.members.iter().any(|m| m.id == id) {
                continue;
            }
            self.counters
                .held_too_long
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::warn!(
                max_hold_ms = hold.as_millis() as u64,
                "an idempotency transaction held the SQLite writer past its max hold time; rolled back"
            );
            self.roll_back(id, Why::HeldTooLong, pending);
        }
    }

    /// SQLite ended the transaction on its own (a full disk, an I/O error):
    /// every open request is over, and nothing of the batch happened.
    pub(super) fn abort(&mut self, pending: &mut VecDeque<Queued>) {
        for frame in self.frames.drain(..).collect::<Vec<_>>() {
            self.base.extend(frame.deferred);
        }
        let open: Vec<u64> = self.members.iter().map(|m| m.id).collect();
        for id in open {
            self.end(id, Some(Ended::BatchMateRolledBack), pending);
        }
    }
}

/// Rolls back to savepoint `name` and removes it. An error means SQLite has
/// rolled the whole transaction back, which the writer sees.
fn undo_to(tx: &rusqlite::Transaction<'_>, name: &str) {
    let _ = exec(tx, &format!("ROLLBACK TO {name}"))
        .and_then(|()| exec(tx, &format!("RELEASE {name}")));
}

/// Answers a deferred answer with `error`.
pub(super) fn fail(answer: Deferred, error: &StoreError) {
    let error = || StoreError::unavailable(error.to_string());
    match answer {
        Deferred::Commit(reply) => drop(reply.send(Err(error()))),
        Deferred::Refusal(reply, _) => drop(reply.send(Err(error()))),
        Deferred::Write(answer) => answer(Some(&error().to_string())),
    }
}
