//! A fleet through a PostgreSQL failover: a private primary with a
//! synchronous streaming standby (`pg_basebackup -R`,
//! `synchronous_standby_names`), a ledger process whose `--db` names both
//! hosts with `target_session_attrs=read-write`, parallel clients crediting
//! distinct keys; mid-load the primary is stopped with `pg_ctl stop -m
//! immediate` and the standby promoted. Then every key has exactly one
//! credit, every acknowledged answer replays byte for byte, and requests in
//! flight at the crash ran once (after their lease, when their claim had
//! committed). Prints the recovery time (promotion to the first success).
//!
//! Needs PostgreSQL 15's server binaries, root, and the ledger example built
//! with the same features. Ports 15520 and 15521 (127.0.0.1).

#![cfg(feature = "postgres")]

use crate::driver;
use crate::pgcluster;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use driver::{Ledger, request};
use pgcluster::{PgCluster, wait_until};

const CLIENTS: usize = 6;
const ACCOUNTS: i64 = 4;
const LEASE_SECS: u64 = 2;

/// One key's outcome as its client saw it.
#[derive(Debug, Clone)]
struct Done {
    amount: i64,
    body: String,
    /// When the 201 came.
    at: Instant,
    /// Attempts that got no 201 first (503, 409, a broken connection).
    failed_attempts: usize,
    /// Whether one of them was 409: the key's claim had committed and the
    /// retry waited for its lease to end.
    waited_for_lease: bool,
}

#[test]
fn a_primary_crash_and_promotion_lose_no_acknowledged_credit_and_apply_none_twice() {
    let hba = "host all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n";
    let primary = PgCluster::init(
        15520,
        "wal_level = replica\nmax_wal_senders = 5\nsynchronous_commit = on\n\
         synchronous_standby_names = 'standby1'\n",
        hba,
    );
    primary.start();
    let standby = primary.standby(15521, "standby1");
    // Once promoted, the standby has no standby of its own to wait for.
    std::fs::OpenOptions::new()
        .append(true)
        .open(standby.data().join("postgresql.conf"))
        .and_then(|mut f| {
            use std::io::Write;
            f.write_all(b"synchronous_standby_names = ''\n")
        })
        .unwrap();
    standby.start();
    wait_until(
        Duration::from_secs(30),
        "the standby streaming in sync",
        || {
            primary.psql("SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'")
                == "1"
        },
    );

    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write&connect_timeout=2",
        primary.port, standby.port
    );
    let ledger = Ledger::start(
        &driver::ledger_beside_tests(),
        std::path::Path::new(&url),
        "transactional",
        LEASE_SECS,
    );
    let addr = ledger.addr;
    for i in 0..ACCOUNTS {
        let created = request(
            addr,
            "POST",
            "/accounts",
            &[("idempotency-key", &format!("failover-account-{i}"))],
            r#"{"name":"failover"}"#,
        )
        .expect("create an account");
        assert_eq!(created.status, 201, "{}", created.body);
    }

    // Clients: each takes the next key and retries it until it gets a 201.
    let next_key = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let done: Arc<Mutex<HashMap<usize, Done>>> = Arc::default();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (next_key, stop, done) = (next_key.clone(), stop.clone(), done.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let i = next_key.fetch_add(1, Ordering::SeqCst);
                    let amount = i as i64 + 1;
                    let account = (i as i64 % ACCOUNTS) + 1;
                    let key = format!("failover-{i}");
                    let body = format!(r#"{{"amount":{amount}}}"#);
                    let deadline = Instant::now() + Duration::from_secs(90);
                    let mut failed_attempts = 0;
                    let mut waited_for_lease = false;
                    loop {
                        assert!(Instant::now() < deadline, "key {i} never completed");
                        let answer = request(
                            addr,
                            "POST",
                            &format!("/accounts/{account}/credits"),
                            // 30 ms between the claim and the credit: at
                            // the crash most clients are inside a request.
                            &[("idempotency-key", &key), ("x-ledger-delay-ms", "30")],
                            &body,
                        );
                        match &answer {
                            Some(a) if a.status == 201 => {
                                done.lock().unwrap().insert(
                                    i,
                                    Done {
                                        amount,
                                        body: a.body.clone(),
                                        at: Instant::now(),
                                        failed_attempts,
                                        waited_for_lease,
                                    },
                                );
                                break;
                            }
                            Some(a) => assert!(
                                a.status == 503 || a.status == 409,
                                "key {i}: unexpected {} {}",
                                a.status,
                                a.body
                            ),
                            None => {}
                        }
                        if answer.as_ref().is_some_and(|a| a.status == 409) {
                            waited_for_lease = true;
                        }
                        failed_attempts += 1;
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            })
        })
        .collect();

    let count = |done: &Arc<Mutex<HashMap<usize, Done>>>| done.lock().unwrap().len();
    wait_until(
        Duration::from_secs(60),
        "60 credits before the crash",
        || count(&done) >= 60,
    );
    let crashed_at = Instant::now();
    primary.stop_immediate();
    let acked_before_crash = count(&done);
    // Let the clients see the primary gone for a moment before promoting.
    std::thread::sleep(Duration::from_millis(500));
    standby.promote();
    let promoted_at = Instant::now();
    wait_until(
        Duration::from_secs(60),
        "60 credits after the promotion",
        || {
            done.lock()
                .unwrap()
                .values()
                .filter(|d| d.at > promoted_at)
                .count()
                >= 60
        },
    );
    stop.store(true, Ordering::SeqCst);
    for client in clients {
        client.join().expect("a client failed");
    }
    let done = Arc::try_unwrap(done).unwrap().into_inner().unwrap();
    let keys = next_key.load(Ordering::SeqCst).min(done.len());
    assert_eq!(done.len(), keys, "every key taken completed");
    let first_after = done
        .values()
        .filter(|d| d.at > promoted_at)
        .map(|d| d.at)
        .min()
        .unwrap();
    let retried = done.values().filter(|d| d.failed_attempts > 0).count();
    let waited = done.values().filter(|d| d.waited_for_lease).count();

    // Every answer replays byte for byte from the new primary.
    for (i, d) in &done {
        let account = (*i as i64 % ACCOUNTS) + 1;
        let again = request(
            addr,
            "POST",
            &format!("/accounts/{account}/credits"),
            &[("idempotency-key", &format!("failover-{i}"))],
            &format!(r#"{{"amount":{}}}"#, d.amount),
        )
        .expect("a replay");
        assert_eq!((again.status, again.replayed), (201, true), "key {i}");
        assert_eq!(again.body, d.body, "key {i}: the replay differs");
    }

    // Exactly one credit per key, on the promoted standby.
    let rows = standby.psql("SELECT amount, count(*) FROM credits GROUP BY amount ORDER BY amount");
    let credits: HashMap<i64, i64> = rows
        .lines()
        .map(|l| {
            let (a, n) = l.split_once('|').unwrap();
            (a.parse().unwrap(), n.parse().unwrap())
        })
        .collect();
    let expected: HashMap<i64, i64> = done.values().map(|d| (d.amount, 1)).collect();
    assert_eq!(credits, expected, "credits per key");
    let balance: i64 = standby
        .psql("SELECT sum(balance) FROM accounts")
        .parse()
        .unwrap();
    assert_eq!(balance, done.values().map(|d| d.amount).sum::<i64>());
    let credit_ids_in_answers: std::collections::HashSet<i64> = done
        .values()
        .map(|d| {
            serde_json::from_str::<serde_json::Value>(&d.body).unwrap()["credit_id"]
                .as_i64()
                .unwrap()
        })
        .collect();
    assert_eq!(
        credit_ids_in_answers.len(),
        done.len(),
        "one credit id per key"
    );

    eprintln!(
        "failover: {keys} keys, {acked_before_crash} acknowledged before the crash, \
         {retried} needed retries, {waited} of them waited for a lease (409) and then ran once; credits per key: all exactly 1 ({} credits); \
         first success {:.2} s after the promotion returned, {:.2} s after the crash",
        credits.len(),
        first_after.duration_since(promoted_at).as_secs_f64(),
        first_after.duration_since(crashed_at).as_secs_f64(),
    );
    drop(ledger);
}
