//! Several ledger processes on one MySQL/MariaDB database, as app servers
//! behind a load balancer: the database decides who is first, and a dead
//! server's claim is taken over once its lease ends, in both modes. Needs
//! the ledger example built with `--features mysql` beside the tests (a
//! whole `cargo test --features mysql` builds it) and the server at
//! `TOWER_IDEMPOTENCY_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`).

#![cfg(feature = "mysql")]

#[path = "../examples/storm/driver.rs"]
mod driver;

use std::path::PathBuf;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use driver::{Ledger, request};
use tower_idempotency::sqlx;

fn url() -> String {
    std::env::var("TOWER_IDEMPOTENCY_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

fn key() -> String {
    format!(
        "mysql-fleet-{:016x}",
        tower_idempotency::store::FencingToken::random().0
    )
}

fn new_account(ledger: &Ledger) -> i64 {
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

fn balance(ledger: &Ledger, account: i64) -> i64 {
    let answer = request(ledger.addr, "GET", &format!("/accounts/{account}"), &[], "")
        .expect("read the balance");
    serde_json::from_str::<serde_json::Value>(&answer.body).unwrap()["balance"]
        .as_i64()
        .unwrap()
}

/// The state of the ledger's record of idempotency key `key` (any scope),
/// read straight from the database.
fn record_state(key: &str) -> Option<String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let pool = sqlx::MySqlPool::connect(&url()).await.unwrap();
        sqlx::query_scalar("SELECT state FROM idempotency_records WHERE `key` = ?")
            .bind(key)
            .fetch_optional(&pool)
            .await
            .unwrap()
    })
}

/// Two ledgers, twelve identical credits released together: one applies.
fn racing_servers_apply_once(mode: &str) {
    let db = PathBuf::from(url());
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

#[test]
fn two_servers_on_mysql_racing_one_key_apply_it_once_transactional() {
    racing_servers_apply_once("transactional");
}

#[test]
fn two_servers_on_mysql_racing_one_key_apply_it_once_separate() {
    racing_servers_apply_once("separate");
}

/// Server one is killed holding the claim; server two answers 409 until the
/// lease (2 s) ends, then takes over and applies the credit once.
fn a_dead_servers_claim_is_taken_over(mode: &str) {
    let db = PathBuf::from(url());
    let mut one = Ledger::start(&driver::ledger_beside_tests(), &db, mode, 2);
    let two = Ledger::start(&driver::ledger_beside_tests(), &db, mode, 2);
    let account = new_account(&two);
    let k = key();
    let (addr, path) = (one.addr, format!("/accounts/{account}/credits"));
    let slow = {
        let (k, path) = (k.clone(), path.clone());
        std::thread::spawn(move || {
            request(
                addr,
                "POST",
                &path,
                &[("idempotency-key", &k), ("x-ledger-delay-ms", "10000")],
                r#"{"amount":700}"#,
            )
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while record_state(&k).as_deref() != Some("in_flight") {
        assert!(
            Instant::now() < deadline,
            "server one never claimed the key"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let busy = request(
        two.addr,
        "POST",
        &path,
        &[("idempotency-key", &k)],
        r#"{"amount":700}"#,
    )
    .unwrap();
    assert_eq!(busy.status, 409, "{}", busy.body);
    one.kill();
    assert!(
        slow.join().unwrap().is_none(),
        "the killed server must not answer"
    );
    let started = Instant::now();
    let done = loop {
        let answer = request(
            two.addr,
            "POST",
            &path,
            &[("idempotency-key", &k)],
            r#"{"amount":700}"#,
        )
        .unwrap();
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
    assert_eq!(balance(&two, account), 700);
    assert_eq!(record_state(&k).as_deref(), Some("completed"));
}

#[test]
fn a_dead_servers_claim_is_taken_over_after_the_lease_transactional() {
    a_dead_servers_claim_is_taken_over("transactional");
}

#[test]
fn a_dead_servers_claim_is_taken_over_after_the_lease_separate() {
    a_dead_servers_claim_is_taken_over("separate");
}
