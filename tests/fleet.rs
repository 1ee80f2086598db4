//! Several ledger processes on one database, as app servers behind a load
//! balancer: the database decides who is first, and a dead server's claim is
//! taken over once its lease ends. On a shared SQLite file always; on
//! PostgreSQL with `--features postgres` and a server
//! (`TOWER_IDEMPOTENCY_POSTGRES_URL`, or the local `test` database).

#[path = "../examples/storm/driver.rs"]
mod driver;

use std::path::PathBuf;
use std::sync::{Arc, Barrier};

use driver::{Ledger, request};

#[cfg(feature = "postgres")]
fn url() -> String {
    std::env::var("TOWER_IDEMPOTENCY_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

fn key() -> String {
    format!(
        "fleet-{:016x}",
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

/// The state of the record of idempotency key `key`, read straight from the
/// database (any scope).
#[cfg(feature = "postgres")]
fn record_state(key: &str) -> Option<String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let (client, connection) = tokio_postgres::connect(&url(), tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        client
            .query_opt(
                "SELECT state FROM idempotency_records WHERE key = $1",
                &[&key],
            )
            .await
            .unwrap()
            .map(|row| row.get(0))
    })
}

fn racing_servers_apply_once(db: PathBuf, mode: &str) {
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

#[cfg(feature = "postgres")]
#[test]
fn two_servers_on_postgres_racing_one_key_apply_it_once_transactional() {
    racing_servers_apply_once(PathBuf::from(url()), "transactional");
}

#[cfg(feature = "postgres")]
#[test]
fn two_servers_on_postgres_racing_one_key_apply_it_once_separate() {
    racing_servers_apply_once(PathBuf::from(url()), "separate");
}

#[test]
fn two_processes_on_one_sqlite_file_racing_one_key_apply_it_once() {
    let dir = tempfile::tempdir().unwrap();
    for mode in ["transactional", "separate"] {
        racing_servers_apply_once(dir.path().join(format!("{mode}.sqlite3")), mode);
    }
}

/// Server one dies holding the claim; server two answers 409 until the lease
/// (2 s) ends, then takes over and applies the credit once.
#[cfg(feature = "postgres")]
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
    // Wait until server one's claim is in the database.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while record_state(&k).as_deref() != Some("in_flight") {
        assert!(
            std::time::Instant::now() < deadline,
            "server one never claimed the key"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
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
    let started = std::time::Instant::now();
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
            started.elapsed() < std::time::Duration::from_secs(20),
            "never taken over"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert_eq!((done.status, done.replayed), (201, false), "{}", done.body);
    assert_eq!(balance(&two, account), 700);
}

#[cfg(feature = "postgres")]
#[test]
fn a_dead_servers_claim_is_taken_over_after_the_lease_transactional() {
    a_dead_servers_claim_is_taken_over("transactional");
}

#[cfg(feature = "postgres")]
#[test]
fn a_dead_servers_claim_is_taken_over_after_the_lease_separate() {
    a_dead_servers_claim_is_taken_over("separate");
}
