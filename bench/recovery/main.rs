//! Kill to recovery: how long a key stays blocked after its holder is
//! SIGKILLed, from the kill until the first retry succeeds (the restart
//! included), for the ledger on one store.
//!
//! ```text
//! cargo build --release --example ledger --all-features
//! cargo run --release --example recovery -- [--lease-secs 5] [--db URL] [--mode separate] [--ledger-arg=--key-store=URL] [--runs 3]
//! ```
//!
//! Each run: a credit whose handler takes 20 s is claimed; the ledger is
//! killed while it runs and restarted; the same credit is retried every
//! 50 ms until it answers 201. The balance shows it was applied once. The
//! lease is renewed while a request runs, so a short lease is safe for slow
//! handlers, and the wait is about one lease: the crate's default (10 s)
//! unless `--lease-secs` is given; before renewal, a lease had to outlast
//! the slowest handler (the crate's old 60 s default).

#[path = "../../tests/common/ledger_driver.rs"]
mod driver;

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use driver::{Ledger, kill_to_recovery};

#[derive(Parser)]
struct Args {
    /// The ledger binary.
    #[arg(long, default_value = "target/release/examples/ledger")]
    ledger: PathBuf,
    /// `--db` of the ledger (default: a fresh SQLite file per run).
    #[arg(long)]
    db: Option<String>,
    /// `--mode` of the ledger.
    #[arg(long, default_value = "separate")]
    mode: String,
    /// More arguments for the ledger (`--ledger-arg=--key-store=redis://...`,
    /// `--ledger-arg=--db-driver=sqlx`).
    #[arg(long = "ledger-arg", allow_hyphen_values = true)]
    ledger_args: Vec<String>,
    /// `--lease-secs` of the ledger (0, the default: none, the crate's
    /// default lease).
    #[arg(long, default_value_t = 0)]
    lease_secs: u64,
    /// Kills to measure.
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

fn main() {
    let args = Args::parse();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut seconds = Vec::new();
    for run in 0..args.runs {
        let db = match &args.db {
            Some(url) => PathBuf::from(url),
            None => dir.path().join(format!("recovery-{run}.sqlite3")),
        };
        let extra: Vec<&str> = args.ledger_args.iter().map(String::as_str).collect();
        let mut ledger = Ledger::start_with(&args.ledger, &db, &args.mode, args.lease_secs, &extra);
        let seen = kill_to_recovery(&mut ledger, 20_000, Duration::from_secs(300));
        assert_eq!(seen.balance % seen.amount, 0, "{seen:?}");
        println!(
            "run {run}: kill to first success {:.2} s ({} answers 409 meanwhile), credited {} of {}",
            seen.elapsed.as_secs_f64(),
            seen.in_flight_answers,
            seen.balance,
            seen.amount
        );
        seconds.push(seen.elapsed.as_secs_f64());
    }
    seconds.sort_by(f64::total_cmp);
    let lease = match args.lease_secs {
        0 => "the default lease".to_owned(),
        secs => format!("lease {secs} s"),
    };
    println!(
        "mode {} {lease}: median kill to recovery {:.2} s over {} runs",
        args.mode,
        seconds[seconds.len() / 2],
        seconds.len()
    );
}
