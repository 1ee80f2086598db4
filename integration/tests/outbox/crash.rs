//! Crash and restart across the outbox boundary: a real ledger process with
//! `--notify-url` (the example, built beside the tests) is SIGKILLed while
//! its relay delivers to a downstream that fails a share of attempts and
//! loses some answers. After restarts, every credit has been applied
//! downstream exactly once, under one key and one body.

#![cfg(all(feature = "sqlite", feature = "outbox"))]

use crate::driver;
use crate::outbox_support;

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use outbox_support::{Answer, Downstream, until};

/// One ledger process with `--notify-url`.
struct Ledger {
    child: Child,
    addr: SocketAddr,
}

impl Ledger {
    fn start(db: &OsStr, notify_url: &str) -> Ledger {
        Ledger::start_with(db, notify_url, &[])
    }

    /// As [`Ledger::start`], with more arguments.
    fn start_with(db: &OsStr, notify_url: &str, extra: &[&OsStr]) -> Ledger {
        let mut child = Command::new(driver::ledger_beside_tests())
            .arg("--db")
            .arg(db)
            .args([
                "--listen",
                "127.0.0.1:0",
                "--lease-secs",
                "2",
                "--notify-url",
                notify_url,
            ])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the ledger");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line
            .trim()
            .strip_prefix("listening on http://")
            .unwrap_or_else(|| {
                panic!("unexpected first line (is the ledger built with `outbox`?): {line:?}")
            })
            .parse()
            .unwrap();
        Ledger { child, addr }
    }

    /// SIGKILL, and wait until the process is gone.
    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

/// POSTs until an answer other than 409 arrives; `None` if the connection
/// died (the process was killed).
async fn post(
    addr: SocketAddr,
    path: &'static str,
    key: String,
    body: String,
) -> Option<driver::Answer> {
    tokio::task::spawn_blocking(move || {
        for _ in 0..200 {
            let k = format!("\"{key}\"");
            let answer = driver::request(addr, "POST", path, &[("idempotency-key", &k)], &body)?;
            if answer.status != 409 {
                return Some(answer);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_credit_is_applied_downstream_once_across_kills() {
    let dir = tempfile::tempdir().unwrap();
    storm(dir.path().join("ledger.sqlite3").as_os_str()).await;
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_credit_is_applied_downstream_once_across_kills_on_postgres() {
    // A database of its own: its ledgers' relays take any row of the
    // outbox table, and other modules' messages are not theirs to deliver.
    let url = crate::postgres_database("outbox_crash").await;
    storm(OsStr::new(&url)).await;
}

/// With `--encryption-key-file` (issue 38, item 4): the notification is
/// delivered in the clear, byte for byte, while neither the outbox's row nor
/// the idempotency record holds the credited amount in clear.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sealed_notifications_keep_no_amount_in_clear() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("ledger.sqlite3");
    let key = dir.path().join("records.key");
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).unwrap();
    std::fs::write(&key, bytes).unwrap();
    let ds = Downstream::start(
        Arc::new(|_: &str, _: &[u8], _| Answer::Pass),
        Duration::ZERO,
    )
    .await;
    let args = [OsStr::new("--encryption-key-file"), key.as_os_str()];
    let ledger = Ledger::start_with(db.as_os_str(), &ds.url(), &args);
    let account = post(
        ledger.addr,
        "/accounts",
        "a".into(),
        r#"{"name":"a"}"#.into(),
    )
    .await;
    assert_eq!(account.unwrap().status, 201);
    let body = r#"{"amount":987654}"#;
    let credit = post(ledger.addr, "/accounts/1/credits", "c".into(), body.into()).await;
    assert_eq!(credit.unwrap().status, 201);
    until(
        Duration::from_secs(20),
        "the notification delivered",
        || !ds.effects().is_empty(),
    )
    .await;
    let delivered = ds.attempts().remove(0).body;
    assert_eq!(
        delivered,
        br#"{"credit_id":1,"account_id":1,"amount":987654}"#
    );
    let conn = outbox_support::rusqlite_conn(&db);
    let blobs = |sql: &str| -> Vec<Vec<u8>> {
        let mut statement = conn.prepare(sql).unwrap();
        let rows = statement.query_map([], |r| r.get::<_, Vec<u8>>(0)).unwrap();
        rows.map(Result::unwrap).collect()
    };
    let payloads = blobs("SELECT payload FROM tower_idempotency_outbox");
    let responses = blobs("SELECT response FROM idempotency_records WHERE response IS NOT NULL");
    assert_eq!((payloads.len(), responses.len()), (1, 2));
    for stored in payloads.iter().chain(&responses) {
        assert!(
            !stored.windows(6).any(|w| w == b"987654"),
            "a stored row holds the amount in clear"
        );
    }
    ledger.kill();
}

/// Kills per run: `TOWER_IDEMPOTENCY_OUTBOX_KILLS` (default 4), for longer
/// storms by hand.
fn kills() -> i64 {
    std::env::var("TOWER_IDEMPOTENCY_OUTBOX_KILLS").map_or(4, |v| v.parse().expect("an integer"))
}

/// Rounds of 8 credits on a fresh account, each followed by a SIGKILL while
/// the relay is at work and a restart; then convergence and the counts.
async fn storm(db: &OsStr) {
    let rounds = kills();
    let total = (rounds * 8) as usize;
    // Per key: the first attempt fails before the receiver, the second is
    // applied and its answer lost, the third is replayed by the receiver.
    let ds = Downstream::start(
        Arc::new(|_: &str, _: &[u8], n| match n {
            0 => Answer::FailBefore(503),
            1 => Answer::FailAfter(503),
            _ => Answer::Pass,
        }),
        Duration::from_millis(20),
    )
    .await;
    let mut ledger = Ledger::start(db, &ds.url());
    // Keys of their own: a PostgreSQL database outlives the run.
    let run = format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let account = post(
        ledger.addr,
        "/accounts",
        format!("acct-{run}"),
        r#"{"name":"a"}"#.into(),
    )
    .await
    .unwrap();
    assert_eq!(account.status, 201, "{}", account.body);
    let id = serde_json::from_str::<serde_json::Value>(&account.body).unwrap()["id"]
        .as_i64()
        .unwrap();
    let path: &'static str = Box::leak(format!("/accounts/{id}/credits").into_boxed_str());
    let mut credits: HashMap<i64, i64> = HashMap::new(); // credit id -> amount
    let mut kills = 0;
    for round in 0..rounds {
        let mut pending: Vec<(String, i64)> = (0..8)
            .map(|i| (format!("c-{run}-{round}-{i}"), round * 100 + i + 1))
            .collect();
        while !pending.is_empty() {
            let sends = pending.iter().map(|(k, amount)| {
                post(
                    ledger.addr,
                    path,
                    k.clone(),
                    format!("{{\"amount\":{amount}}}"),
                )
            });
            let answers = futures_join(sends).await;
            let mut retry = Vec::new();
            for ((key, amount), answer) in pending.into_iter().zip(answers) {
                match answer {
                    Some(a) if a.status == 201 => {
                        let doc: serde_json::Value = serde_json::from_str(&a.body).unwrap();
                        credits.insert(doc["credit_id"].as_i64().unwrap(), amount);
                    }
                    _ => retry.push((key, amount)),
                }
            }
            pending = retry;
        }
        // Kill while the relay is at work on this round's notifications.
        let first = round * 100 + 1;
        until(Duration::from_secs(20), "an attempt of this round", || {
            ds.attempts().iter().any(|a| {
                serde_json::from_slice::<serde_json::Value>(&a.body)
                    .ok()
                    .and_then(|d| d["amount"].as_i64())
                    == Some(first)
            })
        })
        .await;
        ledger.kill();
        kills += 1;
        ledger = Ledger::start(db, &ds.url());
    }
    assert_eq!((kills, credits.len()), (rounds, total));
    println!("{kills} kills, {total} credits");
    // Converge: every credit applied once (a killed relay's claims wait out
    // the 15 s lease).
    until(Duration::from_secs(60), "every credit applied", || {
        let effects = ds.effects();
        effects.len() == total && effects.values().all(|n| *n >= 1)
    })
    .await;
    ledger.kill();
    let attempts = ds.attempts();
    let mut key_of: HashMap<i64, HashSet<String>> = HashMap::new();
    let mut bodies: HashMap<String, HashSet<Vec<u8>>> = HashMap::new();
    for a in &attempts {
        let doc: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
        let credit = doc["credit_id"].as_i64().unwrap();
        assert_eq!(
            Some(&doc["amount"].as_i64().unwrap()),
            credits.get(&credit),
            "{doc}"
        );
        key_of.entry(credit).or_default().insert(a.key.clone());
        bodies
            .entry(a.key.clone())
            .or_default()
            .insert(a.body.clone());
    }
    assert_eq!(
        key_of.len(),
        total,
        "a notification for every credit, none other"
    );
    assert!(key_of.values().all(|k| k.len() == 1), "one key per credit");
    assert!(bodies.values().all(|b| b.len() == 1), "one body per key");
    let effects = ds.effects();
    assert_eq!(effects.len(), total);
    assert!(effects.values().all(|n| *n == 1), "0 doubles: {effects:?}");
}

/// Awaits all futures, in order (a dependency-free `join_all`).
async fn futures_join<F: std::future::Future + Send + 'static>(
    futs: impl Iterator<Item = F>,
) -> Vec<F::Output>
where
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futs.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}
