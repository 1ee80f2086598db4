//! `--ttl-secs`: a credit's record is replayed until its TTL has passed,
//! in both modes on SQLite, PostgreSQL (both drivers) and MySQL, and past
//! it the same key is a new credit in transactional mode. In separate mode
//! it is refused (503) and nothing is credited twice: the ledger's own
//! unique `credits.request` keeps the key, as the fence against a cut-off
//! holder's late write, and holds no record life to tell a new use from a
//! late one. A TTL of 0 is refused before
//! the ledger opens anything.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::driver;

use driver::{Ledger, request};

fn ttl_in(db: &Path, mode: &str, extra: &[&str]) {
    let args = [&["--ttl-secs", "1"][..], extra].concat();
    let ledger = Ledger::start_with(&driver::ledger_beside_tests(), db, mode, 0, &args);
    let post = |path: &str, key: &str, body: &str| {
        request(ledger.addr, "POST", path, &[("idempotency-key", key)], body)
            .expect("the ledger answers")
    };
    assert_eq!(post("/accounts", r#""a""#, r#"{"name":"a"}"#).status, 201);
    let credit = || post("/accounts/1/credits", r#""c-1""#, r#"{"amount":5}"#);

    let first = credit();
    // The record was claimed before this instant: a second from here it
    // has expired by the server's clock too (one machine).
    let answered = Instant::now();
    assert_eq!(
        (first.status, first.replayed),
        (201, false),
        "{}",
        first.body
    );
    let repeat = credit();
    assert!(
        answered.elapsed() < Duration::from_millis(900),
        "too slow to judge"
    );
    assert_eq!(
        (repeat.status, repeat.replayed, &repeat.body),
        (201, true, &first.body)
    );

    std::thread::sleep(Duration::from_millis(1_100).saturating_sub(answered.elapsed()));
    let past_ttl = credit();
    // Transactional: a new credit. Separate: refused by the earlier
    // credit's `request`, and nothing credited twice.
    let (status, balance) = match mode {
        "separate" => (503, 5),
        _ => (201, 10),
    };
    assert_eq!(
        (past_ttl.status, past_ttl.replayed),
        (status, false),
        "{}",
        past_ttl.body
    );
    let account = request(ledger.addr, "GET", "/accounts/1", &[], "").unwrap();
    assert_eq!(
        account.body,
        format!(r#"{{"id":1,"name":"a","balance":{balance}}}"#)
    );
}

#[test]
fn sqlite() {
    for mode in ["transactional", "separate"] {
        let dir = tempfile::tempdir().unwrap();
        ttl_in(&dir.path().join("ledger.sqlite3"), mode, &[]);
    }
}

#[cfg(feature = "postgres")]
#[test]
fn postgres() {
    for (mode, driver) in [("transactional", "rusqlite"), ("separate", "rusqlite")]
        .into_iter()
        .chain(
            cfg!(feature = "sqlx-postgres")
                .then_some([("transactional", "sqlx"), ("separate", "sqlx")])
                .into_iter()
                .flatten(),
        )
    {
        let url = crate::fresh_postgres_database(&format!("ledger_ttl_{}_{driver}", &mode[..3]));
        ttl_in(Path::new(&url), mode, &["--db-driver", driver]);
    }
}

#[cfg(feature = "mysql")]
#[test]
fn mysql() {
    for mode in ["transactional", "separate"] {
        let url = crate::fresh_mysql_database(&format!("ledger_ttl_{}", &mode[..3]));
        ttl_in(Path::new(&url), mode, &[]);
    }
}

#[test]
fn a_ttl_of_zero_is_refused() {
    let out = std::process::Command::new(driver::ledger_beside_tests())
        .args(["--db", "ledger.sqlite3", "--ttl-secs", "0"])
        .output()
        .expect("the ledger runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        (out.status.code(), stderr.lines().next()),
        (
            Some(2),
            Some("error: invalid value '0' for '--ttl-secs <N>': must be at least 1")
        )
    );
}
