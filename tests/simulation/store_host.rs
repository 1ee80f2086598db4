//! The store host: the real `MemoryStore` (on a clock the simulation can
//! step back), the ledger's balances and the outbox table, behind the RPC
//! of `wire.rs`. A commit applies the completion, the credits and the
//! messages in one step, as a database transaction does.
//!
//! Beside it runs an audit of every answer against the contract's rules,
//! written independently of the store: who holds each record, until when.
//! A takeover of a live lease, a completion or release by anyone but the
//! holder, or a replay of a response the holder did not store is recorded
//! as a violation.
//!
//! In one-phase worlds the claim lives in a session's open transaction
//! (`store_one_phase.rs`): other claims of its key wait on it, and it is
//! rolled back with its connection. The audit's rules for them are there.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicI64, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tower_idempotency::StoredResponse;
use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::store::{
    Claim, ClaimRequest, Clock, Completion, FencingToken, MemoryStore, RecordId, Refusal, Store,
};

use crate::wire::{
    self, Call, ClaimArgs, Credit, Id, Msg, Reply, WireClaim, WireClaimed, WireFate,
};

#[path = "store_one_phase.rs"]
mod one_phase;

/// What an injected failure answers.
const INJECTED: &str = "injected: the database refused the call";

/// The simulation's wall clock as the store reads it: the simulated time,
/// plus an offset the fault schedule steps back.
#[derive(Clone, Default)]
pub struct SimClock {
    pub offset_ms: Arc<AtomicI64>,
}

/// 2026-01-01T00:00:00Z, where every run's clock starts.
const EPOCH_MS: i64 = 1_767_225_600_000;

impl Clock for SimClock {
    fn now_ms(&self) -> i64 {
        let elapsed = turmoil::sim_elapsed().unwrap_or_default();
        EPOCH_MS + elapsed.as_millis() as i64 + self.offset_ms.load(Ordering::SeqCst)
    }
}

/// Runs a memory-store future, which never waits, to its end at once: so
/// that a commit's steps are one atomic step of the host.
fn at_once<F: Future>(f: F) -> F::Output {
    match pin!(f).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(out) => out,
        Poll::Pending => panic!("the memory store never waits"),
    }
}

#[derive(Debug)]
enum RowState {
    Pending {
        due_ms: i64,
        lease_until_ms: Option<i64>,
    },
    Done,
    Dead,
}

#[derive(Debug)]
struct Row {
    message: Msg,
    attempts: u32,
    state: RowState,
}

/// Who the audit believes holds a record.
#[derive(Debug)]
struct Holder {
    token: i64,
    lease_until_ms: i64,
    lease_ms: i64,
    response: Option<Vec<u8>>,
    /// The server whose claim inside a transaction it is (one phase).
    server: Option<String>,
}

/// Everything the store host keeps; shared with the checks after the run.
pub struct Db {
    pub clock: SimClock,
    records: MemoryStore,
    pub balances: BTreeMap<String, i64>,
    /// Every committed credit, by record.
    pub applied: BTreeMap<Id, Vec<Credit>>,
    /// Every committed message's payload, by message key.
    pub committed: BTreeMap<String, Vec<Vec<u8>>>,
    outbox: Vec<Row>,
    holders: BTreeMap<Id, Holder>,
    pub violations: Vec<String>,
    /// When the clock was stepped back, in ms of simulated time.
    pub steps_at_ms: Vec<u64>,
    /// Injected failures per thousand calls.
    pub error_rate: Arc<AtomicU32>,
    rng: StdRng,
    /// Whether the fleet claims inside the handler's transaction.
    one_phase: bool,
    /// One phase: the claims inside open transactions, as row locks.
    locks: BTreeMap<Id, one_phase::RowLock>,
    /// One phase (audit): holders whose server crashed while they held.
    crashed: BTreeMap<Id, one_phase::Crashed>,
    /// The run's trace, for the store's own notes.
    trace: Arc<Mutex<Vec<String>>>,
}

impl Db {
    pub fn new(seed: u64, one_phase: bool, trace: Arc<Mutex<Vec<String>>>) -> Arc<Mutex<Db>> {
        let clock = SimClock::default();
        Arc::new(Mutex::new(Db {
            one_phase,
            locks: BTreeMap::new(),
            crashed: BTreeMap::new(),
            trace,
            records: MemoryStore::with_clock(clock.clone()),
            clock,
            balances: BTreeMap::new(),
            applied: BTreeMap::new(),
            committed: BTreeMap::new(),
            outbox: Vec::new(),
            holders: BTreeMap::new(),
            violations: Vec::new(),
            steps_at_ms: Vec::new(),
            error_rate: Arc::new(AtomicU32::new(0)),
            rng: StdRng::seed_from_u64(seed ^ 0x5707e),
        }))
    }

    /// The outbox's rows: key -> payload.
    pub fn rows(&self) -> BTreeMap<String, Vec<u8>> {
        let rows = self.outbox.iter();
        rows.map(|r| (r.message.key.clone(), r.message.payload.clone()))
            .collect()
    }

    /// Whether message `key` waits only for its due time: pending, due
    /// later, and held by no live lease (`lease_ms`: the relays' lease).
    pub fn due_later(&self, key: &str, lease_ms: i64) -> bool {
        let now = self.clock.now_ms();
        let rows = self.outbox.iter();
        rows.filter(|r| r.message.key == key)
            .any(|r| match r.state {
                RowState::Pending {
                    due_ms,
                    lease_until_ms,
                } => {
                    due_ms > now
                        && !lease_until_ms.is_some_and(|l| l > now && l <= now + 2 * lease_ms)
                }
                _ => false,
            })
    }

    /// Message `key`'s row as the table holds it, times relative to now.
    pub fn row(&self, key: &str) -> String {
        let now = self.clock.now_ms();
        let rows = self.outbox.iter();
        let row = rows
            .filter(|r| r.message.key == key)
            .map(|r| match r.state {
                RowState::Pending {
                    due_ms,
                    lease_until_ms,
                } => format!(
                    "pending, {} attempts, due in {} ms, lease ends in {:?} ms",
                    r.attempts,
                    due_ms - now,
                    lease_until_ms.map(|l| l - now)
                ),
                RowState::Done => "done".into(),
                RowState::Dead => "dead".into(),
            });
        row.collect::<Vec<_>>().join("; ")
    }

    /// How far the clock was stepped back, in milliseconds.
    pub fn stepped_back_ms(&self) -> i64 {
        -self.clock.offset_ms.load(Ordering::SeqCst)
    }

    /// Messages neither delivered nor dead.
    pub fn undelivered(&self) -> usize {
        let rows = self.outbox.iter();
        rows.filter(|r| matches!(r.state, RowState::Pending { .. }))
            .count()
    }

    /// Messages that became dead letters.
    pub fn dead(&self) -> usize {
        let rows = self.outbox.iter();
        rows.filter(|r| matches!(r.state, RowState::Dead)).count()
    }

    fn violation(&mut self, what: String) {
        self.violations.push(what);
    }

    /// Whether this call meets an injected failure.
    fn refused(&mut self) -> bool {
        let rate = self.error_rate.load(Ordering::SeqCst);
        rate > 0 && self.rng.random_range(0..1000) < rate
    }

    fn handle(&mut self, call: Call) -> Reply {
        if self.refused() {
            return Reply::Error(INJECTED.into());
        }
        let now = self.clock.now_ms();
        match call {
            Call::Claim(args) => Reply::Claim(self.claim(&args, now, None)),
            Call::Complete {
                id,
                token,
                response,
            } => Reply::Bool(self.complete(id, token, response)),
            Call::Commit {
                id,
                token,
                response,
                credits,
                messages,
            } => Reply::Bool(self.commit(id, token, response, (credits, messages), now)),
            Call::Release { id, token } => Reply::Bool(self.release(id, token)),
            Call::Renew {
                id,
                token,
                lease_ms,
            } => Reply::Bool(self.renew(id, token, lease_ms, now)),
            Call::Purge => Reply::Count(at_once(self.records.purge_expired()).unwrap_or(0)),
            Call::Enqueue { message } => {
                self.enqueue(message, now);
                Reply::Bool(true)
            }
            Call::OutboxClaim { limit, lease_ms } => {
                Reply::Claimed(self.claim_messages(limit, lease_ms as i64, now))
            }
            Call::OutboxFinish {
                id,
                attempt,
                lease_until_ms,
                fate,
            } => Reply::Bool(self.finish(id, attempt, lease_until_ms, fate, now)),
            Call::Begin { .. } | Call::ClaimWaiting { .. } | Call::Rollback => {
                Reply::Error("a session's call, on a connection of its own".into())
            }
        }
    }

    /// The claim `args`, by `server`'s transaction if it is one (one phase).
    fn claim(&mut self, args: &ClaimArgs, now: i64, server: Option<&str>) -> WireClaim {
        let mut fp = [0; 32];
        fp.copy_from_slice(&args.fingerprint);
        let record = RecordId::new(args.id.scope.clone(), args.id.key.clone());
        let mut request = ClaimRequest::new(record, Fingerprint(fp), FencingToken(args.token))
            .with_lease(Duration::from_millis(args.lease_ms))
            .with_ttl(Duration::from_millis(args.ttl_ms));
        if let Some(hold) = args.max_hold_ms {
            request = request.with_max_hold(Duration::from_millis(hold));
        }
        let claim = at_once(self.records.claim(request));
        let (id, token, lease_ms) = (args.id.clone(), args.token, args.lease_ms as i64);
        self.audit_claim((id, token, lease_ms), now, claim, server)
    }

    /// The completion and the handler's writes, applied together only if
    /// the completion is stored.
    fn commit(
        &mut self,
        id: Id,
        token: i64,
        response: Vec<u8>,
        (credits, messages): (Vec<Credit>, Vec<Msg>),
        now: i64,
    ) -> bool {
        let stored = self.complete(id.clone(), token, response);
        if stored {
            for credit in &credits {
                *self.balances.entry(credit.account.clone()).or_default() += credit.amount;
            }
            self.applied.entry(id).or_default().extend(credits);
            for message in messages {
                let payloads = self.committed.entry(message.key.clone()).or_default();
                payloads.push(message.payload.clone());
                self.enqueue(message, now);
            }
        }
        stored
    }

    fn release(&mut self, id: Id, token: i64) -> bool {
        let record = RecordId::new(id.scope.clone(), id.key.clone());
        let released = at_once(self.records.release(record, FencingToken(token))).unwrap_or(false);
        if released {
            match self.holders.remove(&id) {
                Some(h) if h.token == token && h.response.is_none() => {}
                other => self.violation(format!(
                    "{id:?}: released by token {token}, held by {other:?}"
                )),
            }
        }
        released
    }

    fn renew(&mut self, id: Id, token: i64, lease_ms: u64, now: i64) -> bool {
        let record = RecordId::new(id.scope.clone(), id.key.clone());
        let lease = Duration::from_millis(lease_ms);
        let renewed =
            at_once(self.records.renew(record, FencingToken(token), lease)).unwrap_or(false);
        if renewed {
            match self.holders.get_mut(&id) {
                Some(h) if h.token == token && h.response.is_none() => {
                    h.lease_until_ms = now + lease_ms as i64;
                }
                other => {
                    let what = format!("{id:?}: renewed by token {token}, held by {other:?}");
                    self.violation(what);
                }
            }
        }
        renewed
    }

    fn complete(&mut self, id: Id, token: i64, response: Vec<u8>) -> bool {
        let Ok(decoded) = StoredResponse::decode(&response) else {
            self.violation(format!("{id:?}: a completion that does not decode"));
            return false;
        };
        let record = RecordId::new(id.scope.clone(), id.key.clone());
        let completion = at_once(self.records.complete(record, FencingToken(token), decoded));
        if !matches!(completion, Ok(Completion::Stored)) {
            return false;
        }
        match self.holders.get_mut(&id) {
            Some(h) if h.token == token && h.response.is_none() => h.response = Some(response),
            other => {
                let what = format!("{id:?}: completed by token {token}, held by {other:?}");
                self.violation(what);
            }
        }
        true
    }

    fn audit_claim(
        &mut self,
        (id, token, lease_ms): (Id, i64, i64),
        now: i64,
        claim: Result<Claim, tower_idempotency::StoreError>,
        server: Option<&str>,
    ) -> WireClaim {
        if self.one_phase {
            self.audit_one_phase(&id, token, &claim);
        }
        let holder = self.holders.get(&id);
        match claim {
            Ok(Claim::Acquired { taken_over }) => {
                if let Some(h) = holder {
                    // Alive: ahead of now, and not further than one lease
                    // ahead (a step back of the clock ends a lease).
                    let alive = now < h.lease_until_ms && h.lease_until_ms <= now + h.lease_ms;
                    if h.response.is_some() {
                        self.violation(format!("{id:?}: a completed record was claimed again"));
                    } else if alive {
                        let what = format!(
                            "{id:?}: taken over (taken_over={taken_over}) {} ms before its lease ended",
                            h.lease_until_ms - now
                        );
                        self.violation(what);
                    }
                }
                let lease_until_ms = now + lease_ms;
                let fresh = Holder {
                    token,
                    lease_until_ms,
                    lease_ms,
                    response: None,
                    server: server.map(str::to_owned),
                };
                self.holders.insert(id, fresh);
                WireClaim::Acquired { taken_over }
            }
            Ok(Claim::Refused(Refusal::Completed(response))) => {
                let bytes = response.encode();
                if holder.and_then(|h| h.response.as_ref()) != Some(&bytes) {
                    let what = format!("{id:?}: replayed a response its holder did not store");
                    self.violation(what);
                }
                WireClaim::Completed(bytes)
            }
            Ok(Claim::Refused(Refusal::InFlight { lease_remaining })) => WireClaim::InFlight {
                remaining_ms: lease_remaining.as_millis() as u64,
            },
            Ok(Claim::Refused(_)) => WireClaim::Mismatch,
            Err(e) => {
                self.violation(format!("{id:?}: the memory store failed: {e}"));
                WireClaim::Mismatch
            }
        }
    }

    fn enqueue(&mut self, message: Msg, now: i64) {
        // `ON CONFLICT (msg_key) DO NOTHING`, as every database's table.
        if self.outbox.iter().any(|r| r.message.key == message.key) {
            return;
        }
        let state = RowState::Pending {
            due_ms: now,
            lease_until_ms: None,
        };
        let row = Row {
            message,
            attempts: 0,
            state,
        };
        self.outbox.push(row);
    }

    fn claim_messages(&mut self, limit: usize, lease_ms: i64, now: i64) -> Vec<WireClaimed> {
        let mut claimed = Vec::new();
        for (index, row) in self.outbox.iter_mut().enumerate() {
            if claimed.len() == limit {
                break;
            }
            let RowState::Pending {
                due_ms,
                lease_until_ms,
            } = &mut row.state
            else {
                continue;
            };
            // As the SQL: a lease further ahead than two leases is from
            // before a step back of the clock, and over.
            let leased =
                lease_until_ms.is_some_and(|until| until > now && until <= now + 2 * lease_ms);
            if *due_ms > now || leased {
                continue;
            }
            row.attempts += 1;
            *lease_until_ms = Some(now + lease_ms);
            claimed.push(WireClaimed {
                id: index as i64,
                attempt: row.attempts,
                lease_until_ms: now + lease_ms,
                message: row.message.clone(),
            });
        }
        claimed
    }

    fn finish(&mut self, id: i64, attempt: u32, lease: i64, fate: WireFate, now: i64) -> bool {
        let Some(row) = usize::try_from(id)
            .ok()
            .and_then(|i| self.outbox.get_mut(i))
        else {
            return false;
        };
        let RowState::Pending { lease_until_ms, .. } = row.state else {
            return false;
        };
        let fenced = row.attempts == attempt && lease_until_ms == Some(lease);
        row.state = match fate {
            // As the SQL: `done` needs only a pending row.
            WireFate::Done => RowState::Done,
            WireFate::Retry { after_ms } if fenced => RowState::Pending {
                due_ms: now + after_ms as i64,
                lease_until_ms: None,
            },
            WireFate::Dead if fenced => RowState::Dead,
            _ => return false,
        };
        true
    }
}

/// The store host's software: accepts calls until the simulation ends,
/// each connection's in turn (a session's, `store_one_phase.rs`).
pub async fn serve(db: Arc<Mutex<Db>>) -> turmoil::Result {
    let listener = turmoil::net::TcpListener::bind(("0.0.0.0", wire::STORE.1)).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        tokio::spawn(one_phase::session(db.clone(), stream));
    }
}
