//! Results: ratios to the bare handler, the targets of BENCHMARKS.md, the
//! JSON file and the Markdown table.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};

use crate::Args;
use crate::load::LoadResult;

/// One HTTP scenario.
pub struct Outcome {
    pub id: String,
    pub label: String,
    pub requests: u64,
    pub answered: u64,
    pub rps: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub errors: u64,
    pub first_error: Option<String>,
    /// Set when the handler's effects did not match the answers.
    pub effects_error: Option<String>,
    /// Requests/s of every round (the figure above is their median's).
    pub rounds: Vec<f64>,
}

impl Outcome {
    /// The round with the median requests/s (the lower middle one for an
    /// even count), with the errors of every round.
    pub fn median(mut all: Vec<Outcome>) -> Outcome {
        all.sort_by(|a, b| a.rps.total_cmp(&b.rps));
        let rounds = all.iter().map(|o| o.rps).collect();
        let errors = all.iter().map(|o| o.errors).sum();
        let first_error = all.iter().find_map(|o| o.first_error.clone());
        let effects_error = all.iter().find_map(|o| o.effects_error.clone());
        let mut median = all.swap_remove((all.len() - 1) / 2);
        median.rounds = rounds;
        median.errors = errors;
        median.first_error = first_error;
        median.effects_error = effects_error;
        median
    }
}

impl Outcome {
    pub fn from_load(id: &str, label: &str, r: &LoadResult, effects: Result<(), String>) -> Self {
        Outcome {
            id: id.to_owned(),
            label: label.to_owned(),
            requests: r.requests,
            answered: r.answered,
            rps: r.rps,
            p50_ms: r.p50_us as f64 / 1000.0,
            p99_ms: r.p99_us as f64 / 1000.0,
            max_ms: r.max_us as f64 / 1000.0,
            errors: r.errors,
            first_error: r.first_error.clone(),
            effects_error: effects.err(),
            rounds: vec![r.rps],
        }
    }
}

/// One run of `seed_credit.py`.
pub struct SeedResult {
    pub id: String,
    pub label: String,
    pub synchronous: String,
    pub threads: usize,
    pub credits: u64,
    pub credits_per_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// Credits/s of every round.
    pub rounds: Vec<f64>,
}

impl SeedResult {
    /// The round with the median credits/s.
    pub fn median(mut all: Vec<SeedResult>) -> SeedResult {
        all.sort_by(|a, b| a.credits_per_s.total_cmp(&b.credits_per_s));
        let rounds = all.iter().map(|s| s.credits_per_s).collect();
        let mut median = all.swap_remove((all.len() - 1) / 2);
        median.rounds = rounds;
        median
    }
}

pub struct MemorySample {
    pub requests: u64,
    pub rss_kb: u64,
    /// Records in the MemoryStore at that moment.
    pub records: u64,
    pub seconds: f64,
}

pub struct MemoryReport {
    total: u64,
    seconds: f64,
    baseline_kb: u64,
    samples: Vec<MemorySample>,
    errors: u64,
    first_error: Option<String>,
    runs: u64,
    expected_runs: u64,
    ttl: Duration,
}

/// The memory check calls RSS flat when, over the second half of the run
/// (from the fifth of its ten samples to the last), it grew by at most this
/// fraction. The first half lets the store reach its steady state (records
/// live for the TTL, then the purge task drops them).
pub const FLAT_TOLERANCE: f64 = 0.10;

impl MemoryReport {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        total: u64,
        seconds: f64,
        baseline_kb: u64,
        samples: Vec<MemorySample>,
        errors: u64,
        first_error: Option<String>,
        runs: u64,
        expected_runs: u64,
        ttl: Duration,
    ) -> Self {
        MemoryReport {
            total,
            seconds,
            baseline_kb,
            samples,
            errors,
            first_error,
            runs,
            expected_runs,
            ttl,
        }
    }

    /// Growth from the middle sample to the last, as a fraction.
    fn growth(&self) -> Option<f64> {
        let middle = self.samples.get(self.samples.len().checked_sub(1)? / 2)?;
        let last = self.samples.last()?;
        Some((last.rss_kb as f64 - middle.rss_kb as f64) / middle.rss_kb as f64)
    }

    fn flat(&self) -> bool {
        self.growth().is_some_and(|g| g <= FLAT_TOLERANCE)
    }

    fn clean(&self) -> bool {
        self.errors == 0 && self.runs == self.expected_runs
    }

    fn json(&self) -> Value {
        json!({
            "requests": self.total,
            "seconds": self.seconds,
            "rps": self.total as f64 / self.seconds,
            "ttl_s": self.ttl.as_secs(),
            "purge_every_s": 1,
            "mix": "1/3 new keys (MemoryStore), 1/3 replays of the key just made, 1/3 no key",
            "baseline_rss_kb": self.baseline_kb,
            "samples": self.samples.iter().map(|s| json!({
                "requests": s.requests, "rss_kb": s.rss_kb, "records": s.records, "seconds": s.seconds,
            })).collect::<Vec<_>>(),
            "growth_second_half": self.growth(),
            "flat_tolerance": FLAT_TOLERANCE,
            "flat": self.flat(),
            "errors": self.errors,
            "first_error": self.first_error,
            "handler_runs": self.runs,
            "expected_handler_runs": self.expected_runs,
        })
    }
}

pub struct Results {
    value: Value,
    clean: bool,
}

/// A target of BENCHMARKS.md: `measured` must be at least `min` (or, with
/// `at_most`, at most).
struct Target {
    name: String,
    measured: Option<f64>,
    min: f64,
    unit: &'static str,
    at_most: bool,
}

impl Target {
    fn at_least(name: &str, measured: Option<f64>, min: f64, unit: &'static str) -> Self {
        Target {
            name: name.to_owned(),
            measured,
            min,
            unit,
            at_most: false,
        }
    }

    fn met(&self) -> Option<bool> {
        self.measured.map(|m| {
            if self.at_most {
                m <= self.min
            } else {
                m >= self.min
            }
        })
    }
}

impl Results {
    pub fn new(
        args: &Args,
        outcomes: Vec<Outcome>,
        seeds: Vec<SeedResult>,
        memory: Option<MemoryReport>,
        elapsed: Duration,
    ) -> Self {
        // The denominator: the mean of the bare handler's measurements in
        // this run (at the start and, unless --only, at the end).
        let bare_runs: Vec<f64> = outcomes
            .iter()
            .filter(|o| o.id == "bare" || o.id == "bare_end")
            .map(|o| o.rps)
            .collect();
        assert!(!bare_runs.is_empty(), "bare always runs");
        let bare = bare_runs.iter().sum::<f64>() / bare_runs.len() as f64;
        let rps = |id: &str| outcomes.iter().find(|o| o.id == id).map(|o| o.rps);
        let ratio = |id: &str| rps(id).map(|r| r / bare);
        let seed_full = seeds
            .iter()
            .find(|s| s.id == "seed_full")
            .map(|s| s.credits_per_s);
        let vs = |a: &str, b: &str| Some(rps(a)? / rps(b)?);
        let mut targets = vec![
            Target::at_least("no key >= 0.97x bare", ratio("no_key"), 0.97, "x bare"),
            // GETs carry no body: compared with the bare handler's GETs.
            Target::at_least(
                "GET >= 0.97x bare GET",
                vs("get", "bare_get"),
                0.97,
                "x bare GET",
            ),
            Target::at_least("replay >= 0.8x bare", ratio("replay"), 0.8, "x bare"),
            Target::at_least(
                "new keys, SQLite WAL NORMAL (separate) >= 0.5x bare",
                ratio("new_sqlite_normal"),
                0.5,
                "x bare",
            ),
            Target::at_least(
                "durable new keys (transactional, FULL) >= 10x seed baseline (FULL)",
                rps("tx_sqlite_full").zip(seed_full).map(|(a, b)| a / b),
                10.0,
                "x seed FULL",
            ),
            Target::at_least(
                "replay ahead of axum-idempotent",
                vs("replay", "ai_replay"),
                1.0,
                "x axum-idempotent",
            ),
            Target::at_least(
                "new keys (MemoryStore) ahead of axum-idempotent",
                vs("new_memory", "ai_new"),
                1.0,
                "x axum-idempotent",
            ),
            Target::at_least(
                "no key ahead of axum-idempotent",
                vs("no_key", "ai_no_key"),
                1.0,
                "x axum-idempotent",
            ),
        ];
        if let Some(m) = &memory {
            targets.push(Target {
                name: format!(
                    "RSS flat over {} requests (growth over the second half <= {:.0}%)",
                    m.total,
                    FLAT_TOLERANCE * 100.0
                ),
                measured: m.growth(),
                min: FLAT_TOLERANCE,
                unit: "growth",
                at_most: true,
            });
        }
        let clean = outcomes
            .iter()
            .all(|o| o.errors == 0 && o.effects_error.is_none())
            && memory.as_ref().is_none_or(MemoryReport::clean);
        let value = json!({
            "machine": machine(),
            "config": {
                "connections": args.connections,
                "warmup_s": args.warmup,
                "window_s": args.window,
                "server_threads": args.server_threads,
                "client_threads": args.client_threads,
                "seed_threads": args.seed_threads,
                "rounds": args.rounds,
                "topology": "one process: server runtime and load-generator runtime with separate worker threads; HTTP/1.1 keep-alive over 127.0.0.1",
            },
            "elapsed_s": elapsed.as_secs_f64(),
            "bare_rps": bare,
            "bare_runs_rps": bare_runs,
            "scenarios": outcomes.iter().map(|o| json!({
                "id": o.id, "label": o.label,
                "rps": o.rps, "requests": o.requests, "answered": o.answered,
                "p50_ms": o.p50_ms, "p99_ms": o.p99_ms, "max_ms": o.max_ms,
                "ratio_to_bare": o.rps / bare,
                "ratio_to_seed_full": seed_full.filter(|_| o.id.starts_with("tx_sqlite")).map(|s| o.rps / s),
                "rounds_rps": o.rounds,
                "errors": o.errors, "first_error": o.first_error, "effects_error": o.effects_error,
            })).collect::<Vec<_>>(),
            "seed": seeds.iter().map(|s| json!({
                "id": s.id, "label": s.label, "synchronous": s.synchronous, "threads": s.threads,
                "credits": s.credits, "credits_per_s": s.credits_per_s,
                "p50_ms": s.p50_ms, "p99_ms": s.p99_ms,
                "ratio_to_bare": s.credits_per_s / bare,
                "rounds_credits_per_s": s.rounds,
            })).collect::<Vec<_>>(),
            "targets": targets.iter().map(|t| json!({
                "name": t.name, "measured": t.measured, "bound": t.min, "at_most": t.at_most,
                "unit": t.unit, "met": t.met(),
            })).collect::<Vec<_>>(),
            "memory": memory.as_ref().map(MemoryReport::json),
        });
        Results { value, clean }
    }

    pub fn clean(&self) -> bool {
        self.clean
    }

    pub fn write(&self, path: &Path) {
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).expect("create the results directory");
        }
        let text = serde_json::to_string_pretty(&self.value).expect("JSON");
        std::fs::write(path, text + "\n").expect("write the results");
    }

    pub fn markdown(&self) -> String {
        let v = &self.value;
        let m = &v["machine"];
        let mut out = format!(
            "Run {} on {} ({} CPUs, {}), {}; {} connections, {} s warm-up + {} s window per scenario, {} round(s) (median); bare = {:.0} req/s (mean of {}).\n\n",
            m["date"].as_str().unwrap_or("?"),
            m["cpu_model"].as_str().unwrap_or("?"),
            m["nproc"],
            m["rustc"].as_str().unwrap_or("?"),
            m["git"].as_str().unwrap_or("?"),
            v["config"]["connections"],
            v["config"]["warmup_s"],
            v["config"]["window_s"],
            v["config"]["rounds"],
            v["bare_rps"].as_f64().unwrap_or(f64::NAN),
            v["bare_runs_rps"].as_array().map_or(String::new(), |r| r
                .iter()
                .map(|x| format!("{:.0}", x.as_f64().unwrap_or(f64::NAN)))
                .collect::<Vec<_>>()
                .join(", ")),
        );
        out += "| scenario | req/s | p50 ms | p99 ms | x bare | errors |\n|---|---:|---:|---:|---:|---:|\n";
        for s in v["scenarios"].as_array().into_iter().flatten() {
            let mut ratio = format!("{:.3}", s["ratio_to_bare"].as_f64().unwrap_or(f64::NAN));
            if let Some(seed) = s["ratio_to_seed_full"].as_f64() {
                ratio += &format!(" ({seed:.1}x seed FULL)");
            }
            out += &format!(
                "| {} | {:.0} | {:.2} | {:.2} | {} | {} |\n",
                s["label"].as_str().unwrap_or("?"),
                s["rps"].as_f64().unwrap_or(f64::NAN),
                s["p50_ms"].as_f64().unwrap_or(f64::NAN),
                s["p99_ms"].as_f64().unwrap_or(f64::NAN),
                ratio,
                s["errors"],
            );
        }
        for s in v["seed"].as_array().into_iter().flatten() {
            out += &format!(
                "| {} ({} threads; credits/s) | {:.0} | {:.2} | {:.2} | {:.3} | 0 |\n",
                s["label"].as_str().unwrap_or("?"),
                s["threads"],
                s["credits_per_s"].as_f64().unwrap_or(f64::NAN),
                s["p50_ms"].as_f64().unwrap_or(f64::NAN),
                s["p99_ms"].as_f64().unwrap_or(f64::NAN),
                s["ratio_to_bare"].as_f64().unwrap_or(f64::NAN),
            );
        }
        out += "\n| target | measured | met |\n|---|---:|---|\n";
        for t in v["targets"].as_array().into_iter().flatten() {
            let measured = t["measured"].as_f64().map_or("not run".to_owned(), |x| {
                format!("{x:.3} {}", t["unit"].as_str().unwrap_or(""))
            });
            let met = match t["met"].as_bool() {
                Some(true) => "yes",
                Some(false) => "**no**",
                None => "-",
            };
            out += &format!(
                "| {} | {measured} | {met} |\n",
                t["name"].as_str().unwrap_or("?")
            );
        }
        if let Some(mem) = v["memory"].as_object() {
            out += &format!(
                "\nMemory check: {} requests in {:.1} s; VmRSS (MiB) after each tenth: ",
                mem["requests"],
                mem["seconds"].as_f64().unwrap_or(f64::NAN)
            );
            let points: Vec<String> = mem["samples"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|s| format!("{:.1}", s["rss_kb"].as_f64().unwrap_or(f64::NAN) / 1024.0))
                .collect();
            out += &points.join(", ");
            out += &format!(
                "; growth over the second half {:.1}% -> {}.\n",
                mem["growth_second_half"].as_f64().unwrap_or(f64::NAN) * 100.0,
                if mem["flat"].as_bool() == Some(true) {
                    "flat"
                } else {
                    "NOT flat"
                }
            );
        }
        out
    }
}

/// VmRSS of this process, in KiB (0 where /proc is missing).
pub fn rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or(0)
}

fn command(program: &str, args: &[&str]) -> Option<String> {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn proc_field(file: &str, field: &str) -> Option<String> {
    let text = std::fs::read_to_string(file).ok()?;
    text.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_owned())
}

fn machine() -> Value {
    json!({
        "nproc": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "cpu_model": proc_field("/proc/cpuinfo", "model name"),
        "mem_total": proc_field("/proc/meminfo", "MemTotal"),
        "kernel": command("uname", &["-r"]),
        "rustc": command("rustc", &["--version"]),
        "git": command("git", &["-C", env!("CARGO_MANIFEST_DIR"), "describe", "--always", "--dirty"]),
        "date": humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
    })
}
