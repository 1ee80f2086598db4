//! The store host's sessions, and one-phase claims (issue 37): a claim
//! made inside a session's open transaction is uncommitted. Other claims of
//! its key wait on it as on a row lock, each at most its own bound, then
//! find what the transaction left: the completed record (a replay, or 422),
//! or a free key. The transaction ends with its commit, its rollback, the
//! loss of its connection (its server crashed, or closed it), or the
//! store's backstop past its max hold; all but the commit roll the claim
//! back, and the key is free at once.
//!
//! The audit's rules for one-phase worlds, written apart from the locks:
//!
//! * a claim is never visible outside its transaction: the store never
//!   finds a key in flight on a committed claim, never takes one over, and
//!   never grants a key whose holder's transaction is still open;
//! * a claim never waits on another transaction past its bound;
//! * a holder whose server crashed is rolled back (at once, or by the
//!   backstop where its connection's end was lost too), and the next claim
//!   of its key finds it free: no lease is waited for. The time from the
//!   crash to that claim is noted in the trace.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tower_idempotency::store::{Claim, Clock, FencingToken, RecordId, Refusal, Store, StoreError};

use super::{Db, INJECTED, at_once};
use crate::wire::{self, Call, ClaimArgs, Id, Msg, Reply, WireClaim, WireInside};

/// How long past its max hold the store ends a transaction that is still
/// open (`idle_in_transaction_session_timeout`, MySQL's `wait_timeout`).
const BACKSTOP: Duration = Duration::from_secs(1);
/// How far past its bound a lock wait may be answered: the simulation's
/// timers fire on its ticks (2 ms).
const WAIT_SLACK: Duration = Duration::from_millis(10);

/// An open transaction's claim, as other claims see it: a row lock.
pub(super) struct RowLock {
    token: i64,
    /// Dropped when the transaction ends: every waiter wakes.
    ended: watch::Sender<()>,
}

/// The audit's record of a holder whose server crashed.
#[derive(Debug)]
pub(super) struct Crashed {
    token: i64,
    at_ms: u64,
    rolled_back_ms: Option<u64>,
}

/// A session's open transaction.
struct OpenTx {
    /// When the store ends it.
    backstop: tokio::time::Instant,
    /// The claim inside it, if any.
    claim: Option<(Id, i64)>,
}

/// Why a transaction ended without committing.
#[derive(Debug, Clone, Copy)]
enum Ended {
    RolledBack,
    ConnectionLost,
    Backstop,
    CommitRefused,
}

fn sim_ms() -> u64 {
    turmoil::sim_elapsed().unwrap_or_default().as_millis() as u64
}

/// One connection: its calls in turn. A transaction still open when the
/// connection is lost, or at its backstop, is rolled back.
pub(super) async fn session(db: Arc<Mutex<Db>>, mut stream: turmoil::net::TcpStream) {
    let mut tx: Option<OpenTx> = None;
    loop {
        let call = match tx.as_ref().map(|open| open.backstop) {
            // Biased: a run must not depend on Tokio's random choice.
            Some(backstop) => tokio::select! {
                biased;
                call = wire::read_frame::<Call>(&mut stream) => call.ok(),
                () = tokio::time::sleep_until(backstop) => {
                    end(&db, &mut tx, Ended::Backstop);
                    return;
                }
            },
            None => wire::read_frame::<Call>(&mut stream).await.ok(),
        };
        let Some(call) = call else {
            end(&db, &mut tx, Ended::ConnectionLost);
            return;
        };
        let reply = answer(&db, &mut tx, call).await;
        if wire::write_frame(&mut stream, &reply).await.is_err() {
            end(&db, &mut tx, Ended::ConnectionLost);
            return;
        }
    }
}

fn end(db: &Mutex<Db>, tx: &mut Option<OpenTx>, why: Ended) {
    if let Some(open) = tx.take() {
        db.lock().unwrap().end_tx(open, false, why);
    }
}

async fn answer(db: &Arc<Mutex<Db>>, tx: &mut Option<OpenTx>, call: Call) -> Reply {
    match call {
        Call::Begin { hold_ms } => {
            let mut db = db.lock().unwrap();
            if db.refused() {
                return Reply::Error(INJECTED.into());
            }
            if let Some(open) = tx.take() {
                db.end_tx(open, false, Ended::RolledBack);
            }
            let hold = Duration::from_millis(hold_ms) + BACKSTOP;
            *tx = Some(OpenTx {
                backstop: tokio::time::Instant::now() + hold,
                claim: None,
            });
            Reply::Bool(true)
        }
        Call::ClaimWaiting {
            claim,
            wait_ms,
            server,
        } => claim_waiting(db, tx, &claim, wait_ms, &server).await,
        Call::Rollback => {
            end(db, tx, Ended::RolledBack);
            Reply::Bool(true)
        }
        Call::Commit {
            id,
            token,
            response,
            credits,
            messages,
        } if tx.is_some() => {
            let open = tx.take().expect("an open transaction");
            let writes = (credits, messages);
            db.lock()
                .unwrap()
                .commit_in(open, (id, token, response), writes)
        }
        other => db.lock().unwrap().handle(other),
    }
}

/// The claim on a session, after a wait on another transaction's claim of
/// its key (at most `wait_ms`), audited for the wait's bound.
async fn claim_waiting(
    db: &Mutex<Db>,
    tx: &mut Option<OpenTx>,
    claim: &ClaimArgs,
    wait_ms: u64,
    server: &str,
) -> Reply {
    let began = tokio::time::Instant::now();
    let reply = wait_then_claim(db, tx, claim, wait_ms, server).await;
    let waited = began.elapsed();
    if waited > Duration::from_millis(wait_ms) + WAIT_SLACK {
        let what = format!(
            "{:?}: a claim waited {} ms on another transaction's claim, past its bound of {wait_ms} ms",
            claim.id,
            waited.as_millis()
        );
        db.lock().unwrap().violation(what);
    }
    reply
}

async fn wait_then_claim(
    db: &Mutex<Db>,
    tx: &mut Option<OpenTx>,
    claim: &ClaimArgs,
    wait_ms: u64,
    server: &str,
) -> Reply {
    if db.lock().unwrap().refused() {
        return Reply::Error(INJECTED.into());
    }
    let deadline = tokio::time::Instant::now() + Duration::from_millis(wait_ms);
    loop {
        let mut ended = {
            let mut db = db.lock().unwrap();
            let held = db.locks.get(&claim.id).map(|lock| lock.ended.subscribe());
            match held {
                None => return Reply::Inside(db.claim_inside(claim, server, tx.as_mut())),
                Some(ended) => ended,
            }
        };
        // Until the holder's transaction ends (its sender is dropped).
        if tokio::time::timeout_at(deadline, ended.changed())
            .await
            .is_err()
        {
            return Reply::Inside(WireInside::Busy);
        }
    }
}

impl Db {
    /// A claim of a key no open transaction holds: inside `tx` if the
    /// session has one open (the key is then locked until it ends), else
    /// committed at once.
    fn claim_inside(
        &mut self,
        args: &ClaimArgs,
        server: &str,
        tx: Option<&mut OpenTx>,
    ) -> WireInside {
        let now = self.clock.now_ms();
        match self.claim(args, now, Some(server)) {
            WireClaim::Acquired { taken_over } => {
                if let Some(open) = tx {
                    let (ended, _) = watch::channel(());
                    let lock = RowLock {
                        token: args.token,
                        ended,
                    };
                    self.locks.insert(args.id.clone(), lock);
                    open.claim = Some((args.id.clone(), args.token));
                }
                WireInside::Claimed { taken_over }
            }
            refused => WireInside::Refused(refused),
        }
    }

    /// The commit of a session's transaction: the completion and the
    /// handler's writes; the transaction ends either way.
    fn commit_in(
        &mut self,
        open: OpenTx,
        (id, token, response): (Id, i64, Vec<u8>),
        writes: (Vec<wire::Credit>, Vec<Msg>),
    ) -> Reply {
        if self.refused() {
            self.end_tx(open, false, Ended::CommitRefused);
            return Reply::Error(INJECTED.into());
        }
        let now = self.clock.now_ms();
        let stored = self.commit(id, token, response, writes, now);
        self.end_tx(open, stored, Ended::RolledBack);
        Reply::Bool(stored)
    }

    /// Ends a session's transaction: its claim committed (with its
    /// completion), or rolled back.
    fn end_tx(&mut self, open: OpenTx, committed: bool, why: Ended) {
        let Some((id, token)) = open.claim else {
            return;
        };
        if self.locks.get(&id).is_some_and(|lock| lock.token == token) {
            self.locks.remove(&id);
        }
        if committed {
            if self.crashed.get(&id).is_some_and(|c| c.token == token) {
                self.crashed.remove(&id);
            }
            return;
        }
        let record = RecordId::new(id.scope.clone(), id.key.clone());
        let released = at_once(self.records.release(record, FencingToken(token))).unwrap_or(false);
        match self.holders.remove(&id) {
            Some(h) if released && h.token == token && h.response.is_none() => {}
            other => self.violation(format!(
                "{id:?}: rolled back ({why:?}) by token {token}, released {released}, held by {other:?}"
            )),
        }
        if matches!(why, Ended::ConnectionLost | Ended::Backstop) {
            self.note(format!("store: {} rolled back ({why:?})", id.key));
        }
        if let Some(crashed) = self.crashed.get_mut(&id).filter(|c| c.token == token) {
            crashed.rolled_back_ms = Some(sim_ms());
        }
    }

    /// One phase's audit of a claim the store answered.
    pub(super) fn audit_one_phase(
        &mut self,
        id: &Id,
        token: i64,
        claim: &Result<Claim, StoreError>,
    ) {
        let open = self.holders.get(id).filter(|h| h.response.is_none());
        let open = open.map(|h| (h.token, h.server.clone()));
        let what = match claim {
            Ok(Claim::Acquired { taken_over: true }) => Some("taken over"),
            Ok(Claim::Acquired { .. }) if open.is_some() => Some("claimed while held"),
            Ok(Claim::Refused(Refusal::InFlight { .. })) => Some("found in flight"),
            _ => None,
        };
        let crashed = self.crashed.get(id).filter(|c| c.token != token);
        let since_crash = crashed.map(|c| (sim_ms().saturating_sub(c.at_ms), c.rolled_back_ms));
        if let Some(what) = what {
            let crash = since_crash.map_or(String::new(), |(ms, rolled_back)| {
                format!(
                    " {ms} ms after its holder's server crashed (rolled back at {rolled_back:?})"
                )
            });
            self.violation(format!(
                "{id:?}: {what}{crash}: a one-phase claim was visible outside its transaction (holder {open:?})"
            ));
        }
        match (claim, since_crash) {
            (Ok(Claim::Acquired { .. }), Some((ms, rolled_back))) => {
                let at = self.crashed.get(id).map_or(0, |c| c.at_ms);
                let rolled_back = rolled_back.map(|r| r.saturating_sub(at));
                self.note(format!(
                    "store: {} claimed again {ms} ms after its holder's server crashed (rolled back after {rolled_back:?} ms)",
                    id.key
                ));
                self.crashed.remove(id);
            }
            (Ok(Claim::Refused(Refusal::Completed(_))), Some(_)) => {
                self.crashed.remove(id);
            }
            _ => {}
        }
    }

    /// `server` crashed at `at_ms`: its open claims are noted for the audit.
    pub fn crashed(&mut self, server: &str, at_ms: u64) {
        let held = self
            .holders
            .iter()
            .filter(|(_, h)| h.response.is_none() && h.server.as_deref() == Some(server));
        let held: Vec<(Id, i64)> = held.map(|(id, h)| (id.clone(), h.token)).collect();
        for (id, token) in held {
            let crashed = Crashed {
                token,
                at_ms,
                rolled_back_ms: None,
            };
            self.crashed.insert(id, crashed);
        }
    }

    /// At the end of the run: every holder whose server crashed was rolled
    /// back (or committed first).
    pub fn audit_end(&mut self) {
        let stuck = self.crashed.iter().filter(|(id, c)| {
            c.rolled_back_ms.is_none()
                && self
                    .holders
                    .get(*id)
                    .is_some_and(|h| h.token == c.token && h.response.is_none())
        });
        let stuck: Vec<String> = stuck
            .map(|(id, c)| format!("{id:?}: its holder's server crashed at {} ms and its claim was never rolled back", c.at_ms))
            .collect();
        self.violations.extend(stuck);
    }

    fn note(&self, line: String) {
        let at = sim_ms();
        self.trace
            .lock()
            .unwrap()
            .push(format!("{at:>6} ms  {line}"));
    }
}
