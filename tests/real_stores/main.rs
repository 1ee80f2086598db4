//! The simulation's checks over the real stores: a seeded fault harness.
//!
//! The deterministic simulation (`tests/simulation/`) runs the layer over
//! `MemoryStore`. This harness runs the same invariants
//! (`tests/common/invariants.rs`) over every real store, where a store's
//! own threads, sockets and locks cannot be driven step by step: each run
//! starts two ledger processes (the example, `--fault-injection`) on one
//! fresh database, sends credits from parallel clients, and makes faults
//! from a seed: `SIGKILL` and restart of a ledger, `SIGSTOP` past the lease
//! and `SIGCONT`, the database's connections cut, and an outside
//! transaction that holds the account's row (or SQLite's write lock).
//! Slow credits (past the 2 s lease) are repeated while they run, the
//! scenario of issue 36, item 1. After the faults, a quiet phase sends
//! more; then every credit is replayed and reused with another amount.
//!
//! `audit.rs` judges a run: the invariants; each 201's credit id is the
//! credit applied; every 503 and every dropped connection is explained by
//! a fault in its time (in the quiet phase nothing explains one); every
//! 409 and 503 says when to come back; in transactional mode every applied
//! credit's notification reached the downstream, the same bytes each time,
//! and nothing else did.
//!
//! ```text
//! cargo test --all-features -p integration --test real_stores          # 1 seed per store and mode
//! REAL_SEEDS=10 REAL_STORES=sqlite,postgres cargo test --all-features -p integration --test real_stores
//! REAL_SEED=7 REAL_STORES=mysql/separate cargo test ...                # one seed's plan again
//! ```
//!
//! A seed fixes the plan (keys, amounts, targets, faults and their times),
//! not the interleaving the processes then choose: a failing seed is run
//! again with its plan, which shows it with high probability, not surely.
//! The last line is `real stores: N runs, F failures`.

#[path = "../common/ledger_driver.rs"]
mod driver;
#[path = "../common/invariants.rs"]
mod invariants;

mod audit;
mod downstream;
mod plan;
mod run;
mod stores;

use stores::CONFIGS;

fn main() {
    let var = |name: &str| std::env::var(name).ok();
    let number = |name: &str| var(name).and_then(|v| v.parse::<u64>().ok());
    let chosen: Vec<&stores::Config> = match var("REAL_STORES") {
        None => CONFIGS.iter().collect(),
        Some(list) => {
            let names: Vec<&str> = list.split(',').map(str::trim).collect();
            let picked: Vec<_> = CONFIGS.iter().filter(|c| c.matches(&names)).collect();
            assert!(
                !picked.is_empty(),
                "REAL_STORES={list} names no configuration"
            );
            picked
        }
    };
    let seeds: Vec<u64> = match number("REAL_SEED") {
        Some(seed) => vec![seed],
        None => {
            let first = number("REAL_FIRST_SEED").unwrap_or(1);
            (first..first + number("REAL_SEEDS").unwrap_or(1)).collect()
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a Tokio runtime");
    let binary = driver::ledger_beside_tests();
    let (mut runs, mut failures) = (0, 0);
    for config in chosen {
        let mut totals = run::Totals::default();
        for &seed in &seeds {
            let outcome = run::run(&runtime, &binary, config, seed);
            runs += 1;
            totals.add(&outcome.totals);
            if !outcome.problems.is_empty() {
                failures += 1;
                println!(
                    "{} seed {seed}: FAILED\n  - {}",
                    config.name(),
                    outcome.problems.join("\n  - ")
                );
                println!(
                    "  plan again: REAL_SEED={seed} REAL_STORES={} cargo test --all-features -p integration --test real_stores",
                    config.name()
                );
            }
        }
        println!("{}: {} seeds, {totals}", config.name(), seeds.len());
    }
    println!("real stores: {runs} runs, {failures} failures");
    if failures > 0 {
        std::process::exit(1);
    }
}
