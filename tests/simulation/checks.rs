//! The invariants, judged after each run against the store's tables, the
//! clients' answers, the downstream's log and the audit.
//!
//! 1. The audit found no takeover of a live lease, no completion or
//!    release by a stale holder, and no replay its holder did not store.
//! 2. Transactional mode applies at most one credit per key, and the
//!    balances are the sums of the credits applied.
//! 3. Liveness: every credit was answered 201 by the client deadline, after
//!    every fault had been healed; every 201 for a key (the run's and the
//!    replays) is byte for byte the same, and is the credit applied.
//! 4. A key reused with another amount is answered 422.
//! 5. The outbox: each applied credit's message is in the table with the
//!    payload committed with it, and the downstream acted on it at least
//!    once, never on anything else; no two relays sent one message at once.
//! 6. One phase (issue 37, the audit in `store_one_phase.rs`): a claim is
//!    never visible outside its transaction (no key found in flight on a
//!    committed claim, none taken over, none granted while its holder's
//!    transaction is open), no claim waits on another transaction past its
//!    bound, and a holder whose server crashed is rolled back and leaves
//!    its key free to the next claim, without a lease to wait for.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::app;
use crate::http::Downstream;
use crate::invariants;
use crate::store_host::Db;
use crate::world::{Asked, CLIENT_DEADLINE, Shared};

/// A step back of the store's clock longer than this may stall the outbox
/// past the end of the run.
const STALL_MS: i64 = 10_000;

/// A run's trace and what was wrong with it.
pub struct Outcome {
    pub trace: Vec<String>,
    pub problems: Vec<String>,
}

impl Outcome {
    pub fn failed(&self) -> bool {
        !self.problems.is_empty()
    }

    pub fn verdict(&self) -> String {
        if self.problems.is_empty() {
            "ok".into()
        } else {
            format!("FAILED\n  - {}", self.problems.join("\n  - "))
        }
    }
}

pub fn judge(shared: &Shared, elapsed: Duration, error: Option<String>) -> Outcome {
    let mut problems = Vec::new();
    if let Some(e) = error {
        problems.push(format!("the simulation stopped: {e}"));
    }
    let db = shared.db.lock().unwrap();
    let asked = shared.asked.lock().unwrap();
    let downstream = shared.downstream.lock().unwrap();
    problems.extend(db.violations.iter().cloned());
    problems.extend(ledger(&db, &asked));
    problems.extend(messages(&db, &asked, &downstream));
    let sending = shared.sending.lock().unwrap();
    // A step back of the clock ends every lease further ahead than one
    // lease (as the contract says): a relay may then claim a message whose
    // first holder is still sending, for up to one lease after the step.
    let relay_lease = app::RELAY_LEASE.as_millis() as u64;
    let after_step = |at: u64| {
        let mut steps = db.steps_at_ms.iter();
        steps.any(|&step| (step..=step + relay_lease).contains(&at))
    };
    for (key, at) in &sending.overlaps {
        if !after_step(*at) {
            problems.push(format!("two relays sent {key} at once, at {at} ms"));
        }
    }
    let mut trace = shared.trace.lock().unwrap().clone();
    trace.push(format!(
        "{:>6} ms  end: balances {:?}, {} messages, downstream acted {} times, refused {}",
        elapsed.as_millis(),
        db.balances,
        db.rows().len(),
        downstream.acted.values().map(Vec::len).sum::<usize>(),
        downstream.refused
    ));
    Outcome { trace, problems }
}

/// Invariants 2 to 4, as the real-store harness judges them too.
fn ledger(db: &Db, asked: &BTreeMap<String, Asked>) -> Vec<String> {
    let applied: BTreeMap<String, Vec<invariants::Applied>> = db
        .applied
        .iter()
        .map(|(id, credits)| {
            let credits = credits.iter().map(|c| invariants::Applied {
                account: c.account.clone(),
                amount: c.amount,
            });
            (id.key.clone(), credits.collect())
        })
        .collect();
    let judged: BTreeMap<String, invariants::Asked<'_>> = asked
        .iter()
        .map(|(key, a)| {
            let asked = invariants::Asked {
                account: a.account.clone(),
                amount: a.amount,
                created: a.created.iter().map(|c| &c.body[..]).collect(),
                reused: a.reused.as_ref().map(|r| r.status),
            };
            (key.clone(), asked)
        })
        .collect();
    invariants::judge(&applied, &db.balances, &judged, CLIENT_DEADLINE)
}

/// Invariant 5's messages: each answered credit's committed once and acted
/// on, no row but a committed one, nothing else acted on, no dead letter.
fn messages(db: &Db, asked: &BTreeMap<String, Asked>, downstream: &Downstream) -> Vec<String> {
    let mut problems = Vec::new();
    let rows = db.rows();
    for (key, asked) in asked.iter() {
        let Some(first) = asked.created.first() else {
            continue;
        };
        // The message of the credit the answer reports.
        let message = rows.iter().find(|(_, payload)| **payload == first.body[..]);
        match message {
            None => problems.push(format!(
                "{key}: no outbox message with the answered payload"
            )),
            Some((msg_key, payload)) => {
                if db.committed.get(msg_key).map(Vec::len) != Some(1) {
                    problems.push(format!(
                        "{key}: message {msg_key} committed {:?}",
                        db.committed.get(msg_key)
                    ));
                }
                match downstream.acted.get(msg_key) {
                    // A message is due at a time on the database's clock
                    // (its enqueue's, or its retry's): one due before the
                    // clock stepped back waits for the step too (the
                    // outbox's docs say so). Not lost: it must
                    // still be pending and held by no live lease (a lease
                    // from before the step is over).
                    None if db.stepped_back_ms() > STALL_MS
                        && db.due_later(msg_key, app::RELAY_LEASE.as_millis() as i64) => {}
                    None => problems.push(format!(
                        "{key}: its message never reached the downstream ({})",
                        db.row(msg_key)
                    )),
                    Some(seen) if seen.iter().any(|b| b[..] != payload[..]) => {
                        problems.push(format!("{key}: the downstream saw {seen:?}"));
                    }
                    Some(_) => {}
                }
            }
        }
    }
    for (msg_key, payload) in &rows {
        match db.committed.get(msg_key) {
            Some(committed) if committed.first() == Some(payload) => {}
            other => problems.push(format!(
                "outbox row {msg_key} holds {:?}; committed {other:?}",
                String::from_utf8_lossy(payload)
            )),
        }
    }
    for key in downstream.acted.keys() {
        if !rows.contains_key(key) {
            problems.push(format!(
                "the downstream acted on {key}, which no commit enqueued"
            ));
        }
    }
    if db.dead() > 0 {
        problems.push(format!("{} dead letters", db.dead()));
    }
    problems
}
