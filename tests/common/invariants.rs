//! The invariants of a run of credits, judged alike over the simulation's
//! memory store (`tests/simulation/`) and over the real stores
//! (`tests/real_stores/`):
//!
//! 1. at most one credit is applied per idempotency key, and each
//!    account's balance is the sum of the credits applied to it;
//! 2. liveness: every key was answered 201 (by its run or its retries),
//!    then 201 again by the replay, and both answers are the same bytes;
//! 3. the answered key has exactly one credit applied, of the amount and
//!    account it asked for;
//! 4. the key sent again with another amount is answered 422.
//!
//! Each harness adds what only it can see: the simulation audits every
//! store answer; the real-store harness explains every 503 and every
//! dropped connection by a fault it made.

use std::collections::BTreeMap;

/// A credit the database holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    pub account: String,
    pub amount: i64,
}

/// What a client asked under one idempotency key, and what it was answered.
#[derive(Debug, Default)]
pub struct Asked<'a> {
    pub account: String,
    pub amount: i64,
    /// The bodies of every 201 it got: its run's (or a retry's), then the
    /// replay's.
    pub created: Vec<&'a [u8]>,
    /// The status answered to the same key with another amount, sent after
    /// the 201.
    pub reused: Option<u16>,
}

/// The problems of a run: empty when every invariant holds.
/// `applied` holds the credits by idempotency key; `balances` what the
/// database says of each account; `deadline` is how long a client waited
/// for its 201, for the liveness message.
pub fn judge(
    applied: &BTreeMap<String, Vec<Applied>>,
    balances: &BTreeMap<String, i64>,
    asked: &BTreeMap<String, Asked<'_>>,
    deadline: std::time::Duration,
) -> Vec<String> {
    let mut problems = Vec::new();
    let mut sums: BTreeMap<&str, i64> = BTreeMap::new();
    for (key, credits) in applied {
        if credits.len() > 1 {
            problems.push(format!("{key}: {} credits applied", credits.len()));
        }
        for credit in credits {
            *sums.entry(&credit.account).or_default() += credit.amount;
        }
    }
    let nonzero: BTreeMap<&str, i64> = balances
        .iter()
        .filter(|(_, v)| **v != 0)
        .map(|(k, v)| (k.as_str(), *v))
        .collect();
    if nonzero != sums {
        problems.push(format!("balances {balances:?}, credits applied {sums:?}"));
    }
    for (key, asked) in asked {
        let Some(first) = asked.created.first() else {
            let by = deadline.as_secs();
            problems.push(format!("{key}: no 201 within {by} s (liveness)"));
            continue;
        };
        if asked.created.len() != 2 {
            problems.push(format!(
                "{key}: {} answers of 2 were 201",
                asked.created.len()
            ));
        }
        if let Some(other) = asked.created.iter().find(|b| *b != first) {
            problems.push(format!(
                "{key}: answered {:?}, then {:?}",
                String::from_utf8_lossy(first),
                String::from_utf8_lossy(other)
            ));
        }
        match applied.get(key).map(|credits| &credits[..]) {
            Some([credit]) if credit.amount == asked.amount && credit.account == asked.account => {}
            other => problems.push(format!("{key}: answered 201, credits applied {other:?}")),
        }
        if asked.reused != Some(422) {
            let reused = asked.reused;
            problems.push(format!("{key} reused with another amount: {reused:?}"));
        }
    }
    problems
}
