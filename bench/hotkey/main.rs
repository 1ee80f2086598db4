//! One hot key against another key: how long a credit with its own key
//! takes while a slow credit runs, with and without 100 repeats of the slow
//! credit's key (issue: repeats of one key must not slow the others).
//!
//! ```text
//! cargo build --release --example ledger --all-features
//! cargo run --release --example hotkey -- [--db URL] [--mode transactional] [--ledger-arg=--key-store=URL] [--slow-ms 2000] [--runs 10]
//! ```
//!
//! Each run: a credit whose handler takes `--slow-ms` is claimed, then 0
//! (baseline) or 100 (hot) parallel clients repeat it at once, and 200 ms
//! later a credit with another key, on another account, is timed. Prints
//! the unrelated credit's p50 and p99 (the largest, over 10 runs) for both.

#[path = "../../tests/common/ledger_driver.rs"]
mod driver;

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use driver::{Ledger, hot_key};

#[derive(Parser)]
struct Args {
    /// The ledger binary.
    #[arg(long, default_value = "target/release/examples/ledger")]
    ledger: PathBuf,
    /// `--db` of the ledger (default: a fresh SQLite file).
    #[arg(long)]
    db: Option<String>,
    /// `--mode` of the ledger.
    #[arg(long, default_value = "transactional")]
    mode: String,
    /// More arguments for the ledger (`--ledger-arg=--key-store=redis://...`,
    /// `--ledger-arg=--db-driver=sqlx`).
    #[arg(long = "ledger-arg", allow_hyphen_values = true)]
    ledger_args: Vec<String>,
    /// How long the slow credit's handler takes, in ms.
    #[arg(long, default_value_t = 2000)]
    slow_ms: u64,
    /// Runs per case.
    #[arg(long, default_value_t = 10)]
    runs: usize,
}

fn main() {
    let args = Args::parse();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let db = match &args.db {
        Some(url) => PathBuf::from(url),
        None => dir.path().join("hotkey.sqlite3"),
    };
    let extra: Vec<&str> = args.ledger_args.iter().map(String::as_str).collect();
    let ledger = Ledger::start_with(&args.ledger, &db, &args.mode, 60, &extra);
    for repeats in [0, 100] {
        let mut ms: Vec<f64> = Vec::new();
        let mut statuses = Vec::new();
        for _ in 0..args.runs {
            let seen = hot_key(&ledger, args.slow_ms, repeats);
            assert_eq!(seen.balances, (5, 5), "{seen:?}");
            ms.push(seen.unrelated.as_secs_f64() * 1000.0);
            statuses.push(seen.unrelated_status);
            std::thread::sleep(Duration::from_millis(100));
        }
        ms.sort_by(f64::total_cmp);
        let p99 = ms[((ms.len() * 99).div_ceil(100)).saturating_sub(1)];
        println!(
            "{} {} {}: {repeats:>3} repeats: unrelated credit p50 {:.1} ms, p99 {:.1} ms (slow credit {} ms; statuses {:?})",
            args.db
                .as_deref()
                .map_or("sqlite", |u| u.split(':').next().unwrap_or(u)),
            args.mode,
            args.ledger_args.join(" "),
            ms[ms.len() / 2],
            p99,
            args.slow_ms,
            statuses,
        );
    }
}
