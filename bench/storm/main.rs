//! The crash storm: what each ledger mode does to money when the server is
//! SIGKILLed mid-request, and what each costs in throughput.
//!
//! ```text
//! cargo build --release --example ledger
//! cargo run --release --example storm -- [--bursts 4] [--keys 32] [--pause-ms 100] [--seed N]
//! ```
//!
//! For each mode (`transactional`, `separate`) it first measures new-key
//! credits per second (parallel clients, no faults), then runs the storm:
//! bursts of distinct keys from parallel clients, each asking the handler to
//! pause after writing its credit; a SIGKILL at a random moment; a restart;
//! every key retried until it completes. Then it counts each key's credits in
//! the database: applied more than once, or never.

#[path = "../../tests/common/ledger_driver.rs"]
mod driver;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use driver::{Ledger, StormConfig, request, storm};

fn arg(name: &str, default: u64) -> u64 {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name} takes a number"))
        })
        .unwrap_or(default)
}

/// Credits `total` new keys from `clients` threads; returns credits per second.
fn throughput(
    binary: &std::path::Path,
    dir: &std::path::Path,
    mode: &str,
    total: usize,
    clients: usize,
) -> f64 {
    let ledger = Ledger::start(
        binary,
        &dir.join(format!("throughput-{mode}.sqlite3")),
        mode,
        30,
    );
    let created = request(
        ledger.addr,
        "POST",
        "/accounts",
        &[("idempotency-key", "acct"), ("authorization", "Bearer t")],
        r#"{"name":"t"}"#,
    )
    .expect("create the account");
    assert_eq!(created.status, 201);
    let next = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let threads: Vec<_> = (0..clients)
        .map(|_| {
            let (next, addr) = (next.clone(), ledger.addr);
            std::thread::spawn(move || {
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= total {
                        return;
                    }
                    let key = format!("t-{n}");
                    let answer = request(
                        addr,
                        "POST",
                        "/accounts/1/credits",
                        &[("idempotency-key", &key), ("authorization", "Bearer t")],
                        r#"{"amount":1}"#,
                    )
                    .expect("an answer");
                    assert_eq!(answer.status, 201, "{}", answer.body);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("client thread");
    }
    total as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let binary = std::env::current_exe()
        .expect("own path")
        .with_file_name(format!("ledger{}", std::env::consts::EXE_SUFFIX));
    if !binary.exists() {
        eprintln!(
            "no ledger at {}: run `cargo build --release --example ledger` first",
            binary.display()
        );
        std::process::exit(2);
    }
    let bursts = arg("--bursts", 4) as usize;
    let keys = arg("--keys", 32) as usize;
    let pause_ms = arg("--pause-ms", 100);
    let seed = arg(
        "--seed",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_secs()),
    );
    let requests = arg("--requests", 2000) as usize;
    let clients = arg("--clients", 8) as usize;
    let dir = tempfile::tempdir().expect("a temporary directory");

    println!("ledger: {}", binary.display());
    println!("storm: {bursts} bursts x {keys} keys, pause {pause_ms} ms, lease 2 s, seed {seed}");
    println!("throughput: {requests} new-key credits from {clients} clients, synchronous=FULL\n");
    println!(
        "| mode | new keys/s | keys | kills | unanswered | applied twice | lost | balance | expected |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for mode in ["transactional", "separate"] {
        let rate = throughput(&binary, dir.path(), mode, requests, clients);
        let report = storm(&StormConfig {
            binary: binary.clone(),
            db: PathBuf::from(dir.path()).join(format!("storm-{mode}.sqlite3")),
            mode: mode.into(),
            bursts,
            keys_per_burst: keys,
            pause_ms,
            lease_secs: 2,
            seed,
        });
        println!(
            "| {mode} | {rate:.0} | {} | {} | {} | {} | {} | {} | {} |",
            report.keys,
            report.kills,
            report.unanswered,
            report.applied_twice,
            report.lost,
            report.balance,
            report.expected_balance
        );
    }
}
