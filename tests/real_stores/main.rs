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
    // Configurations run side by side, `REAL_JOBS` at a time (default 2):
    // each has databases of its own, and only one uses Redis.
    let jobs = number("REAL_JOBS").unwrap_or(2).max(1) as usize;
    let next = std::sync::Mutex::new(chosen.iter().enumerate());
    let mut reports: Vec<(usize, String, usize)> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..jobs)
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    while let Some((n, config)) = next.lock().unwrap().next() {
                        let (report, failed) = seeds_of(&runtime, &binary, config, &seeds);
                        done.push((n, report, failed));
                    }
                    done
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("a worker"))
            .collect()
    });
    reports.sort_by_key(|(n, _, _)| *n);
    let runs = chosen.len() * seeds.len();
    let mut failures = 0;
    for (_, report, failed) in reports {
        print!("{report}");
        failures += failed;
    }
    println!("real stores: {runs} runs, {failures} failures");
    if failures > 0 {
        std::process::exit(1);
    }
}

/// Runs `seeds` on `config`: what to print, and how many runs failed.
fn seeds_of(
    runtime: &tokio::runtime::Runtime,
    binary: &std::path::Path,
    config: &stores::Config,
    seeds: &[u64],
) -> (String, usize) {
    let mut report = String::new();
    let mut totals = run::Totals::default();
    let mut failures = 0;
    for &seed in seeds {
        let outcome = run::run(runtime, binary, config, seed);
        totals.add(&outcome.totals);
        if !outcome.problems.is_empty() {
            failures += 1;
            let name = config.name();
            let problems = outcome.problems.join("\n  - ");
            report += &format!("{name} seed {seed}: FAILED\n  - {problems}\n");
            report += &format!(
                "  plan again: REAL_SEED={seed} REAL_STORES={name} cargo test --all-features -p integration --test real_stores\n"
            );
        }
    }
    report += &format!("{}: {} seeds, {totals}\n", config.name(), seeds.len());
    (report, failures)
}
