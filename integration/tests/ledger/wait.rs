//! The ledger's `--wait-in-flight-ms`, over real HTTP and real processes:
//! parallel repeats (a barrier) of a credit that takes 1.5 s each wait for
//! it and get its replay, where without the flag they get 409
//! (`ledger_hot_key.rs` shows that side on SQLite); the credit applies once.
//! On SQLite in both modes, and on PostgreSQL in both modes, where a new
//! user saw 58 of 180 concurrent duplicates get 409.
//!
//! And a repeat sent past the lease (2 s) while a 5 s credit still runs
//! never costs that credit its work (issue 36, item 1): the first is
//! answered 201, the repeat 409 or the replay, one credit; on every store
//! the ledger runs on, in both modes.

use crate::driver;

use std::path::Path;

use driver::{Ledger, hot_key, repeat_past_the_lease};

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

/// The repeat past the lease, on the ledger's database `db` (`--db-driver
/// driver`) in `mode`.
fn a_repeat_past_the_lease_leaves_the_first_its_work(db: &Path, driver: &str, mode: &str) {
    let ledger = Ledger::start_with(
        &driver::ledger_beside_tests(),
        db,
        mode,
        2,
        &["--db-driver", driver],
    );
    let seen = repeat_past_the_lease(&ledger, 5000, std::time::Duration::from_secs(3));
    assert_eq!(seen.first.0, 201, "{seen:?}");
    assert!(
        matches!(seen.repeat, (409, false) | (201, true)),
        "{seen:?}"
    );
    assert_eq!(seen.balance, 5, "{seen:?}");
}

mod past_the_lease {
    use super::*;

    fn sqlite(driver: &str, mode: &str) {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("ledger.sqlite3");
        a_repeat_past_the_lease_leaves_the_first_its_work(&db, driver, mode);
    }

    #[test]
    fn sqlite_transactional() {
        sqlite("rusqlite", "transactional");
    }

    #[test]
    fn sqlite_separate() {
        sqlite("rusqlite", "separate");
    }

    #[test]
    fn postgres_transactional() {
        let url = postgres_url();
        a_repeat_past_the_lease_leaves_the_first_its_work(
            Path::new(&url),
            "rusqlite",
            "transactional",
        );
    }

    #[test]
    fn postgres_separate() {
        let url = postgres_url();
        a_repeat_past_the_lease_leaves_the_first_its_work(Path::new(&url), "rusqlite", "separate");
    }

    #[cfg(feature = "sqlx-sqlite")]
    #[test]
    fn sqlx_sqlite_transactional() {
        sqlite("sqlx", "transactional");
    }

    #[cfg(feature = "sqlx-sqlite")]
    #[test]
    fn sqlx_sqlite_separate() {
        sqlite("sqlx", "separate");
    }

    #[cfg(feature = "sqlx-postgres")]
    #[test]
    fn sqlx_postgres_transactional() {
        let url = postgres_url();
        a_repeat_past_the_lease_leaves_the_first_its_work(Path::new(&url), "sqlx", "transactional");
    }

    #[cfg(feature = "sqlx-postgres")]
    #[test]
    fn sqlx_postgres_separate() {
        let url = postgres_url();
        a_repeat_past_the_lease_leaves_the_first_its_work(Path::new(&url), "sqlx", "separate");
    }

    #[cfg(feature = "mysql")]
    #[test]
    fn mysql_transactional() {
        let url = crate::fresh_mysql_database("ledger_past_lease_mysql_tx");
        a_repeat_past_the_lease_leaves_the_first_its_work(Path::new(&url), "sqlx", "transactional");
    }

    #[cfg(feature = "mysql")]
    #[test]
    fn mysql_separate() {
        let url = crate::fresh_mysql_database("ledger_past_lease_mysql_sep");
        a_repeat_past_the_lease_leaves_the_first_its_work(Path::new(&url), "sqlx", "separate");
    }
}

/// 300 repeats of a credit that takes 4 s, each allowed to wait 20 s: at
/// most 256 wait and get its replay (255 when the probe that saw the credit
/// in flight is still waiting too), the rest past the cap of waiting
/// repeats get 409 at once, on SQLite (where the store itself keeps them waiting) as on
/// PostgreSQL; one credit. The cap once held only for the layer's own
/// waiters: the repeats past it waited in the store (a helper saw 400 of
/// 400 wait).
fn waiting_repeats_are_capped(db: &Path, driver: &str, mode: &str) {
    let ledger = Ledger::start_with(
        &driver::ledger_beside_tests(),
        db,
        mode,
        60,
        &["--wait-in-flight-ms", "20000", "--db-driver", driver],
    );
    let seen = hot_key(&ledger, 4000, 300);
    let replays = seen.repeats.get(&(201, true)).copied().unwrap_or(0);
    assert!((255..=256).contains(&replays), "{seen:?}");
    assert_eq!(
        seen.repeats.get(&(409, false)),
        Some(&(300 - replays)),
        "{seen:?}"
    );
    assert_eq!(seen.balances, (5, 5), "{seen:?}");
}

/// Without `--wait-in-flight-ms`, a repeat of a credit in flight gets 409
/// at once, on SQLite in transactional mode too, where it used to wait for
/// the first to commit (LEDGER.md: "Default 0: 409 at once").
fn without_the_flag_repeats_get_409(db: &Path, driver: &str) {
    let ledger = Ledger::start_with(
        &driver::ledger_beside_tests(),
        db,
        "transactional",
        60,
        &["--db-driver", driver],
    );
    let seen = hot_key(&ledger, 2000, 20);
    assert_eq!(seen.repeats.get(&(409, false)), Some(&20), "{seen:?}");
    assert_eq!(seen.balances, (5, 5), "{seen:?}");
}

mod capped {
    use super::*;

    #[test]
    fn sqlite_transactional() {
        let dir = tempfile::tempdir().unwrap();
        waiting_repeats_are_capped(&dir.path().join("l.sqlite3"), "rusqlite", "transactional");
    }

    #[cfg(feature = "sqlx-sqlite")]
    #[test]
    fn sqlx_sqlite_transactional() {
        let dir = tempfile::tempdir().unwrap();
        waiting_repeats_are_capped(&dir.path().join("l.sqlite3"), "sqlx", "transactional");
    }

    #[test]
    fn postgres_separate() {
        waiting_repeats_are_capped(Path::new(&postgres_url()), "rusqlite", "separate");
    }

    #[test]
    fn sqlite_without_the_flag() {
        let dir = tempfile::tempdir().unwrap();
        without_the_flag_repeats_get_409(&dir.path().join("l.sqlite3"), "rusqlite");
    }

    #[cfg(feature = "sqlx-sqlite")]
    #[test]
    fn sqlx_sqlite_without_the_flag() {
        let dir = tempfile::tempdir().unwrap();
        without_the_flag_repeats_get_409(&dir.path().join("l.sqlite3"), "sqlx");
    }
}

/// Issue 37: two ledger processes on one PostgreSQL database, both in
/// transactional mode with the defaults (the claim inside the handler's
/// transaction). Each of 12 keys is sent to both at once (a barrier): one
/// credit per key; the other answer is 409 with `Retry-After` (it met the
/// uncommitted claim) or the replay (it came after the commit). A different
/// body is refused: 422 at once on the ledger holding the key, 409 on the
/// other while the first is in flight (it cannot see an uncommitted
/// fingerprint), 422 there once the first committed. A repeat allowed to
/// wait (`--wait-in-flight-ms`) waits on the uncommitted claim in the
/// database and gets the replay.
#[test]
fn postgres_transactional_two_ledgers_share_the_keys() {
    two_ledgers_share_the_keys(&postgres_url(), &[]);
}

/// The same through sqlx's PostgreSQL store.
#[cfg(feature = "sqlx-postgres")]
#[test]
fn sqlx_postgres_transactional_two_ledgers_share_the_keys() {
    two_ledgers_share_the_keys(&postgres_url(), &["--db-driver", "sqlx"]);
}

/// The same on MySQL/MariaDB, where a lock wait is bounded in whole
/// seconds: the ledger without the flag waits 1 s on the uncommitted claim
/// (then 409, or the replay of a first that committed meanwhile).
#[cfg(feature = "mysql")]
#[test]
fn mysql_transactional_two_ledgers_share_the_keys() {
    two_ledgers_share_the_keys(&crate::fresh_mysql_database("ledger_two_mysql"), &[]);
}

/// Ledgers on the database at `url`, with `driver` (`--db-driver`) flags.
fn two_ledgers_share_the_keys(url: &str, driver: &[&str]) {
    use std::sync::{Arc, Barrier};
    let binary = driver::ledger_beside_tests();
    let db = Path::new(url);
    let a = Ledger::start_with(&binary, db, "transactional", 0, driver);
    let waits = [driver, &["--wait-in-flight-ms", "10000"]].concat();
    let b = Ledger::start_with(&binary, db, "transactional", 0, &waits);
    let b_no_wait = Ledger::start_with(&binary, db, "transactional", 0, driver);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let post = |addr, key: &str, path: &str, body: &str, extra: &[(&str, &str)]| {
        let mut headers = vec![("idempotency-key", key)];
        headers.extend_from_slice(extra);
        driver::request(addr, "POST", path, &headers, body).expect("an answer")
    };
    let account = post(
        a.addr,
        &format!("acct-{nanos}"),
        "/accounts",
        r#"{"name":"two"}"#,
        &[],
    );
    assert_eq!(account.status, 201, "{}", account.body);
    let id: i64 = account
        .body
        .split("\"id\":")
        .nth(1)
        .unwrap()
        .split(',')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let path = format!("/accounts/{id}/credits");

    // 12 keys, each sent to A and to B-without-wait at once.
    const KEYS: usize = 12;
    let barrier = Arc::new(Barrier::new(2 * KEYS));
    let threads: Vec<_> = (0..KEYS)
        .flat_map(|k| [(k, a.addr), (k, b_no_wait.addr)])
        .map(|(k, addr)| {
            let (barrier, path) = (barrier.clone(), path.clone());
            std::thread::spawn(move || {
                let key = format!("dup-{nanos}-{k}");
                let headers = [
                    ("idempotency-key", key.as_str()),
                    ("x-ledger-delay-ms", "300"),
                ];
                barrier.wait();
                (
                    k,
                    driver::request(addr, "POST", &path, &headers, r#"{"amount":3}"#)
                        .expect("an answer"),
                )
            })
        })
        .collect();
    let mut per_key: Vec<Vec<driver::Answer>> = (0..KEYS).map(|_| Vec::new()).collect();
    for thread in threads {
        let (k, answer) = thread.join().unwrap();
        per_key[k].push(answer);
    }
    for (k, answers) in per_key.iter().enumerate() {
        let applied = answers
            .iter()
            .filter(|r| r.status == 201 && !r.replayed)
            .count();
        assert_eq!(applied, 1, "key {k}: {answers:?}");
        for r in answers.iter().filter(|r| r.status != 201 || r.replayed) {
            match (r.status, r.replayed) {
                (201, true) => {}
                (409, false) => assert!(r.retry_after.is_some_and(|s| s >= 1), "{r:?}"),
                _ => panic!("key {k}: {r:?}"),
            }
        }
    }

    // A different body, while a 3 s credit holds the key on A.
    let key = format!("other-{nanos}");
    let first = {
        let (addr, path, key) = (a.addr, path.clone(), key.clone());
        std::thread::spawn(move || {
            let headers = [
                ("idempotency-key", key.as_str()),
                ("x-ledger-delay-ms", "3000"),
            ];
            // Past a 409 from a probe of `until_in_flight` that came first.
            driver::request_past_409(addr, "POST", &path, &headers, r#"{"amount":4}"#)
                .expect("an answer")
        })
    };
    driver::until_in_flight(
        a.addr,
        &path,
        &[("idempotency-key", &key)],
        r#"{"amount":4}"#,
    );
    let same_ledger = post(a.addr, &key, &path, r#"{"amount":9}"#, &[]);
    assert_eq!(same_ledger.status, 422, "{}", same_ledger.body);
    let other_ledger = post(b_no_wait.addr, &key, &path, r#"{"amount":9}"#, &[]);
    assert_eq!(other_ledger.status, 409, "{}", other_ledger.body);
    // B waits on the uncommitted claim, then replays the committed credit.
    let waited = post(b.addr, &key, &path, r#"{"amount":4}"#, &[]);
    let first = first.join().unwrap();
    assert_eq!(
        (first.status, first.replayed),
        (201, false),
        "{}",
        first.body
    );
    assert_eq!(
        (waited.status, waited.replayed, &waited.body),
        (201, true, &first.body)
    );
    let after = post(b_no_wait.addr, &key, &path, r#"{"amount":9}"#, &[]);
    assert_eq!(after.status, 422, "{}", after.body);

    let account = driver::request(a.addr, "GET", &format!("/accounts/{id}"), &[], "").unwrap();
    let balance = 3 * KEYS as i64 + 4;
    assert!(
        account.body.contains(&format!("\"balance\":{balance}")),
        "{}",
        account.body
    );
}
