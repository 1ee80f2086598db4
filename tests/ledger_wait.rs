//! The ledger's `--wait-in-flight-ms`, over real HTTP and real processes:
//! parallel repeats (a barrier) of a credit that takes 1.5 s each wait for
//! it and get its replay, where without the flag they get 409
//! (`ledger_hot_key.rs` shows that side on SQLite); the credit applies once.
//! On SQLite in both modes, and on PostgreSQL in both modes, where a new
//! user saw 58 of 180 concurrent duplicates get 409.

#[path = "common/ledger_driver.rs"]
mod driver;

use std::path::Path;

use driver::{Ledger, hot_key};

const REPEATS: usize = 40;

fn repeats_get_the_replay(db: &Path, mode: &str) {
    let ledger = Ledger::start_with(
        &driver::ledger_beside_tests(),
        db,
        mode,
        60,
        &["--wait-in-flight-ms", "20000"],
    );
    let seen = hot_key(&ledger, 1500, REPEATS);
    assert_eq!(seen.unrelated_status, 201, "{seen:?}");
    // Every repeat waited and was answered with the replay; none ran.
    assert_eq!(seen.repeats.get(&(201, true)), Some(&REPEATS), "{seen:?}");
    assert_eq!(seen.repeats.len(), 1, "{seen:?}");
    assert_eq!(seen.balances, (5, 5), "{seen:?}");
}

#[test]
fn sqlite_separate() {
    let dir = tempfile::tempdir().unwrap();
    repeats_get_the_replay(&dir.path().join("ledger.sqlite3"), "separate");
}

#[test]
fn sqlite_transactional() {
    let dir = tempfile::tempdir().unwrap();
    repeats_get_the_replay(&dir.path().join("ledger.sqlite3"), "transactional");
}

fn postgres_url() -> String {
    std::env::var("TOWER_IDEMPOTENCY_POSTGRES_URL")
        .expect("TOWER_IDEMPOTENCY_POSTGRES_URL names the test database (docs/testing.md)")
}

#[test]
fn postgres_separate() {
    repeats_get_the_replay(Path::new(&postgres_url()), "separate");
}

#[test]
fn postgres_transactional() {
    repeats_get_the_replay(Path::new(&postgres_url()), "transactional");
}
