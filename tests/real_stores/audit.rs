//! The judgement of one run: the invariants the simulation checks
//! (`invariants.rs`), and what only a run over real processes can show.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::driver::Answer;
use crate::invariants;
use crate::plan::{Fault, GRACE, Plan};
use crate::run::CLIENT_DEADLINE;

/// Why a request was sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The key's first send (slow, if the plan says so).
    First,
    /// The same request again while the first runs.
    Repeat,
    /// Sent again after a 409, a 503 or a dropped connection.
    Retry,
    /// Sent again after its 201: the replay.
    Replay,
    /// The key with another amount, after its 201.
    Reuse,
}

/// One request and its answer (`None`: the connection dropped).
pub struct Sent {
    pub key: String,
    pub role: Role,
    pub ledger: usize,
    /// Sent with `X-Ledger-Delay-Ms`.
    pub slow: bool,
    pub sent: Duration,
    pub answered: Duration,
    pub answer: Option<Answer>,
}

impl Clone for Sent {
    fn clone(&self) -> Self {
        let answer = self.answer.as_ref().map(|a| Answer {
            status: a.status,
            retry_after: a.retry_after,
            replayed: a.replayed,
            body: a.body.clone(),
        });
        Sent {
            key: self.key.clone(),
            answer,
            ..*self
        }
    }
}

impl Sent {
    pub fn status(&self) -> Option<u16> {
        self.answer.as_ref().map(|a| a.status)
    }

    pub fn body(&self) -> &str {
        self.answer.as_ref().map_or("", |a| &a.body)
    }
}

/// A fault as it happened: from its start to its healing.
pub struct Window {
    pub fault: Fault,
    pub start: Duration,
    pub end: Duration,
}

impl Window {
    /// Whether the fault can explain a request sent and answered then.
    fn explains(&self, sent: &Sent) -> bool {
        let overlaps = sent.sent <= self.end + GRACE && sent.answered >= self.start;
        match (self.fault, &sent.answer) {
            // A dropped connection: its own ledger was killed.
            (Fault::Kill { ledger, .. }, None) => overlaps && ledger == sent.ledger,
            (_, None) => false,
            (Fault::Slow { ledger, in_process }, Some(_)) => {
                overlaps && (in_process || ledger != sent.ledger)
            }
            (_, Some(_)) => overlaps,
        }
    }
}

/// What one key's client was answered 201 and 422.
#[derive(Debug, Default)]
pub struct Answers {
    pub created: Vec<String>,
    pub reused: Option<u16>,
}

pub struct Run<'a> {
    pub plan: &'a Plan,
    pub account: i64,
    /// In the plan's key order.
    pub answers: &'a [Answers],
    pub sent: &'a [Sent],
    pub windows: &'a [Window],
    /// `(credit id, amount)` of every credit of the account.
    pub credits: &'a [(i64, i64)],
    pub balance: i64,
    /// What the downstream received, by `Idempotency-Key` (transactional
    /// mode: the outbox).
    pub notifications: Option<&'a BTreeMap<String, Vec<Vec<u8>>>>,
}

pub fn judge(run: &Run<'_>) -> Vec<String> {
    let account = run.account.to_string();
    let key_of: BTreeMap<i64, &str> = run
        .plan
        .keys
        .iter()
        .map(|k| (k.amount, k.key.as_str()))
        .collect();
    let mut applied: BTreeMap<String, Vec<invariants::Applied>> = BTreeMap::new();
    let mut problems = Vec::new();
    for (_, amount) in run.credits {
        match key_of.get(amount) {
            Some(key) => applied
                .entry((*key).to_owned())
                .or_default()
                .push(invariants::Applied {
                    account: account.clone(),
                    amount: *amount,
                }),
            None => problems.push(format!("a credit of {amount} that no key asked for")),
        }
    }
    let asked: BTreeMap<String, invariants::Asked<'_>> = run
        .plan
        .keys
        .iter()
        .zip(run.answers)
        .map(|(plan, answers)| {
            let asked = invariants::Asked {
                account: account.clone(),
                amount: plan.amount,
                created: answers.created.iter().map(String::as_bytes).collect(),
                reused: answers.reused,
            };
            (plan.key.clone(), asked)
        })
        .collect();
    let balances = BTreeMap::from([(account.clone(), run.balance)]);
    problems.extend(invariants::judge(
        &applied,
        &balances,
        &asked,
        CLIENT_DEADLINE,
    ));
    problems.extend(answered_credits(run));
    problems.extend(explained(run));
    if let Some(received) = run.notifications {
        problems.extend(notified(run, received));
    }
    problems
}

/// Each 201 names the credit applied for its key, and every 201 for a key
/// (its repeat's too) is the same bytes.
fn answered_credits(run: &Run<'_>) -> Vec<String> {
    let mut problems = Vec::new();
    for (plan, answers) in run.plan.keys.iter().zip(run.answers) {
        let Some(first) = answers.created.first() else {
            continue;
        };
        let id = credit_id(first);
        if !run
            .credits
            .iter()
            .any(|&(credit, amount)| Some(credit) == id && amount == plan.amount)
        {
            problems.push(format!(
                "{}: answered {first}, which is not its credit",
                plan.key
            ));
        }
        let others = run
            .sent
            .iter()
            .filter(|s| s.key == plan.key && s.role != Role::Reuse);
        for other in others.filter(|s| s.status() == Some(201)) {
            if other.body() != first {
                problems.push(format!(
                    "{}: answered {first}, and {} to a {:?}",
                    plan.key,
                    other.body(),
                    other.role
                ));
            }
        }
    }
    problems
}

/// Every answer is one the contract allows, and each 503 and dropped
/// connection has a fault in its time that explains it.
fn explained(run: &Run<'_>) -> Vec<String> {
    let mut problems = Vec::new();
    for sent in run.sent {
        let phase = if sent.sent >= run.plan.quiet_from {
            ", in the quiet phase"
        } else {
            ""
        };
        let what = || {
            let (key, role, ledger, at) = (&sent.key, sent.role, sent.ledger, sent.sent);
            format!("{key} ({role:?} to ledger {ledger} at {at:?}{phase})")
        };
        let fault = run.windows.iter().any(|w| w.explains(sent));
        match (&sent.answer, sent.role) {
            (None, _) if !fault => problems.push(format!(
                "{}: the connection dropped, and no kill explains it",
                what()
            )),
            (None, _) => {}
            (Some(a), _) if matches!(a.status, 409 | 503) && a.retry_after.is_none() => {
                problems.push(format!(
                    "{}: {} without Retry-After: {}",
                    what(),
                    a.status,
                    a.body
                ));
            }
            (Some(a), _) if a.status == 503 && !fault => {
                problems.push(format!(
                    "{}: 503 that no fault explains: {}",
                    what(),
                    a.body
                ));
            }
            (Some(a), Role::First | Role::Repeat | Role::Retry)
                if matches!(a.status, 201 | 409 | 503) => {}
            (Some(a), Role::Replay) if a.status == 201 && a.replayed => {}
            (Some(a), Role::Reuse) if a.status == 422 => {}
            (Some(a), _) if a.status == 503 => {}
            (Some(a), _) => problems.push(format!("{}: {} {}", what(), a.status, a.body)),
        }
    }
    problems
}

/// Transactional mode: each applied credit's notification reached the
/// downstream, with its credit's fields, the same bytes every time; the
/// downstream got nothing else.
fn notified(run: &Run<'_>, received: &BTreeMap<String, Vec<Vec<u8>>>) -> Vec<String> {
    let mut problems = Vec::new();
    let mut seen = Vec::new();
    for (key, bodies) in received {
        let first = &bodies[0];
        if bodies.iter().any(|b| b != first) {
            problems.push(format!("notification {key} was sent with different bodies"));
        }
        let text = String::from_utf8_lossy(first);
        match credit_id(&text) {
            Some(id) => seen.push(id),
            None => problems.push(format!("notification {key}: {text}")),
        }
        let id = credit_id(&text).unwrap_or(-1);
        match run.credits.iter().find(|(credit, _)| *credit == id) {
            Some((_, amount)) => {
                let want = format!(
                    "{{\"credit_id\":{id},\"account_id\":{},\"amount\":{amount}}}",
                    run.account
                );
                if text != want {
                    problems.push(format!("notification {key}: {text}, want {want}"));
                }
            }
            None => problems.push(format!(
                "notification {key} of a credit never applied: {text}"
            )),
        }
    }
    for (credit, _) in run.credits {
        if !seen.contains(credit) {
            problems.push(format!("credit {credit} was never notified"));
        }
    }
    let notified = received.len();
    if seen.len() != notified {
        problems.push(format!(
            "{notified} notification keys for {} credits",
            seen.len()
        ));
    }
    problems
}

/// The `credit_id` of a credit's JSON.
fn credit_id(json: &str) -> Option<i64> {
    let value: serde_json::Value = serde_json::from_str(json).ok()?;
    value["credit_id"].as_i64()
}
