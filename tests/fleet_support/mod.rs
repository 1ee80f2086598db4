//! The scenarios of several ledger processes on one database, shared by
//! `integration/tests/ledger/fleet.rs` (SQLite, PostgreSQL) and `integration/tests/mysql/fleet.rs`
//! (MySQL/MariaDB). The including test crate declares `mod driver` (the
//! storm example's `driver.rs`) beside this module.

// Each including crate uses only some of these (fleet.rs without
// `postgres` runs no take-over).
#![allow(dead_code, unreachable_pub)]

use std::path::PathBuf;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use crate::driver::{self, Ledger, request};

/// A fresh idempotency key.
pub fn key() -> String {
    format!(
        "fleet-{:016x}",
        tower_idempotency::store::FencingToken::random().0
    )
}

pub fn new_account(ledger: &Ledger) -> i64 {
    let created = request(
        ledger.addr,
        "POST",
        "/accounts",
        &[("idempotency-key", &key())],
        r#"{"name":"fleet"}"#,
    )
    .expect("create an account");
    assert_eq!(created.status, 201, "{}", created.body);
    serde_json::from_str::<serde_json::Value>(&created.body).unwrap()["id"]
        .as_i64()
        .unwrap()
}

pub fn balance(ledger: &Ledger, account: i64) -> i64 {
    let answer = request(ledger.addr, "GET", &format!("/accounts/{account}"), &[], "")
        .expect("read the balance");
    serde_json::from_str::<serde_json::Value>(&answer.body).unwrap()["balance"]
        .as_i64()
        .unwrap()
}

/// Two ledgers on `db`, twelve identical credits released together behind
/// a barrier, half to each: exactly one applies, the rest are replays or
/// 409, and both servers read a balance of 500.
pub fn racing_servers_apply_once(db: PathBuf, mode: &str) {
    let one = Ledger::start(&driver::ledger_beside_tests(), &db, mode, 2);
    let two = Ledger::start(&driver::ledger_beside_tests(), &db, mode, 2);
    let account = new_account(&one);
    let k = key();
    let barrier = Arc::new(Barrier::new(12));
    let clients: Vec<_> = (0..12)
        .map(|i| {
            let addr = if i % 2 == 0 { one.addr } else { two.addr };
            let (barrier, k) = (barrier.clone(), k.clone());
            std::thread::spawn(move || {
                barrier.wait();
                request(
                    addr,
                    "POST",
                    &format!("/accounts/{account}/credits"),
                    &[("idempotency-key", &k), ("x-ledger-delay-ms", "300")],
                    r#"{"amount":500}"#,
                )
                .expect("an answer")
            })
        })
        .collect();
    let answers: Vec<_> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let applied = answers
        .iter()
        .filter(|a| a.status == 201 && !a.replayed)
        .count();
    assert_eq!(
        applied,
        1,
        "{:?}",
        answers.iter().map(|a| a.status).collect::<Vec<_>>()
    );
    assert!(answers.iter().all(|a| a.status == 201 || a.status == 409));
    assert_eq!((balance(&one, account), balance(&two, account)), (500, 500));
}

/// Server one (of two on `db`) is killed holding the claim; server two
/// answers 409 until the lease (2 s) ends, then takes over and applies the
/// credit once. `record_state` reads the state of a key's record straight
/// from the database.
pub fn a_dead_servers_claim_is_taken_over(
    db: PathBuf,
    mode: &str,
    record_state: impl Fn(&str) -> Option<String>,
) {
    dead_server(db, mode, record_state, true);
}

/// Server one (of two on `db`) is killed holding a claim that lives in its
/// open transaction (one phase, `PostgresStore`'s transactional mode):
/// server two answers 409 while it runs (its insert meets the uncommitted
/// claim), and applies the credit once as soon as the database has rolled
/// the dead server's transaction back: before the lease (2 s) could end.
pub fn a_dead_servers_claim_dies_with_it(
    db: PathBuf,
    record_state: impl Fn(&str) -> Option<String>,
) {
    dead_server(db, "transactional", record_state, false);
}

fn dead_server(
    db: PathBuf,
    mode: &str,
    record_state: impl Fn(&str) -> Option<String>,
    committed_claim: bool,
) {
    let mut one = Ledger::start(&driver::ledger_beside_tests(), &db, mode, 2);
    let two = Ledger::start(&driver::ledger_beside_tests(), &db, mode, 2);
    let account = new_account(&two);
    let k = key();
    let (addr, path) = (one.addr, format!("/accounts/{account}/credits"));
    let slow = {
        let (k, path) = (k.clone(), path.clone());
        std::thread::spawn(move || {
            // Past a 409 from a probe of `until_in_flight` that came first.
            driver::request_past_409(
                addr,
                "POST",
                &path,
                &[("idempotency-key", &k), ("x-ledger-delay-ms", "10000")],
                r#"{"amount":700}"#,
            )
        })
    };
    if committed_claim {
        // Wait until server one's claim is in the database.
        let deadline = Instant::now() + Duration::from_secs(10);
        while record_state(&k).as_deref() != Some("in_flight") {
            assert!(
                Instant::now() < deadline,
                "server one never claimed the key"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    } else {
        // Uncommitted, the claim is seen by server one alone.
        driver::until_in_flight(addr, &path, &[("idempotency-key", &k)], r#"{"amount":700}"#);
        assert_eq!(record_state(&k), None);
    }
    let credit = |ledger: &Ledger| {
        request(
            ledger.addr,
            "POST",
            &path,
            &[("idempotency-key", &k)],
            r#"{"amount":700}"#,
        )
        .unwrap()
    };
    let busy = credit(&two);
    assert_eq!(busy.status, 409, "{}", busy.body);
    one.kill();
    assert!(
        slow.join().unwrap().is_none(),
        "the killed server must not answer"
    );
    let started = Instant::now();
    let done = loop {
        let answer = credit(&two);
        if answer.status != 409 {
            break answer;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "never taken over"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!((done.status, done.replayed), (201, false), "{}", done.body);
    if !committed_claim {
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
    }
    assert_eq!(balance(&two, account), 700);
    assert_eq!(record_state(&k).as_deref(), Some("completed"));
}
