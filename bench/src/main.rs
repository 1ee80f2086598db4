//! tower-idempotency's end-to-end load benchmark (see BENCHMARKS.md).
//!
//! ```text
//! cargo run --release --manifest-path bench/Cargo.toml -- [--memory] [--help]
//! ```
//!
//! Every scenario serves an axum app on 127.0.0.1 (ephemeral port) from the
//! server runtime and drives it from the load generator's runtime; the two
//! runtimes have their own worker threads. Each figure is printed as a ratio
//! to the bare handler measured in the same run.

mod apps;
mod load;
mod report;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use http::{HeaderValue, Response, StatusCode};
use tokio::runtime::Runtime;
use tower_idempotency::store::Synchronous;

use apps::{Runs, Server};
use load::{Check, LoadConfig, LoadResult, MakeRequest};
use report::{MemoryReport, Outcome, SeedResult};

#[derive(Parser, Debug, Clone)]
#[command(about = "tower-idempotency end-to-end load benchmark (BENCHMARKS.md)")]
pub struct Args {
    /// Concurrent keep-alive connections (one request in flight on each).
    #[arg(long, default_value_t = 32)]
    connections: usize,
    /// Warm-up per scenario, seconds (requests sent, not measured).
    #[arg(long, default_value_t = 3.0)]
    warmup: f64,
    /// Measuring window per scenario, seconds.
    #[arg(long, default_value_t = 5.0)]
    window: f64,
    /// Worker threads of the server runtime.
    #[arg(long, default_value_t = 1)]
    server_threads: usize,
    /// Worker threads of the load generator's runtime.
    #[arg(long, default_value_t = 1)]
    client_threads: usize,
    /// Run only these scenarios (comma-separated ids; `bare` always runs).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Run every scenario this many times (in turn); each figure is the
    /// median round's.
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// Python threads of the seed-style baseline.
    #[arg(long, default_value_t = 32)]
    seed_threads: usize,
    /// The Python interpreter for the seed-style baseline.
    #[arg(long, default_value = "python3")]
    python: String,
    /// Also run the memory check (RSS over --memory-requests requests).
    #[arg(long)]
    memory: bool,
    /// Requests of the memory check.
    #[arg(long, default_value_t = 1_000_000)]
    memory_requests: u64,
    /// Where the SQLite files go (a fresh temporary directory inside it).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// The results file (JSON).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/results/latest.json"))]
    out: PathBuf,
}

/// Every scenario, in run order: (id, label).
const SCENARIOS: &[(&str, &str)] = &[
    ("bare", "(a) bare axum handler, no layer"),
    (
        "bare_get",
        "(a) bare axum handler, GET (the baseline for GET)",
    ),
    ("no_key", "(b) layer, POST without a key"),
    ("get", "(c) layer, GET"),
    (
        "replay",
        "(d) layer, replay of one completed key (MemoryStore)",
    ),
    ("new_memory", "(e) new keys, MemoryStore"),
    ("new_sqlite_normal", "(f) new keys, SQLite separate, NORMAL"),
    ("new_sqlite_full", "(f) new keys, SQLite separate, FULL"),
    (
        "tx_sqlite_normal",
        "(g) new keys, SQLite transactional credit, NORMAL",
    ),
    (
        "tx_sqlite_full",
        "(g) new keys, SQLite transactional credit, FULL",
    ),
    ("ai_no_key", "(h) axum-idempotent, POST without a key"),
    (
        "ai_replay",
        "(h) axum-idempotent, replay of one completed key",
    ),
    ("ai_new", "(h) axum-idempotent, new keys"),
    ("seed_full", "(i) seed-style Python credit, FULL"),
    ("seed_normal", "(i) seed-style Python credit, NORMAL"),
    (
        "bare_end",
        "(a) bare axum handler again, at the end (drift)",
    ),
];

struct Bench {
    args: Args,
    server: Runtime,
    client: Runtime,
    config: LoadConfig,
    dir: tempfile::TempDir,
    run_id: u64,
    /// Numbers the SQLite files: every scenario run gets a fresh one.
    files: AtomicU64,
}

fn runtime(name: &'static str, workers: usize) -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers.max(1))
        .thread_name(name)
        .enable_all()
        .build()
        .expect("a Tokio runtime")
}

/// Expects exactly `status`, and the replay marker `marker` present or absent.
fn expect(status: StatusCode, marker: &'static str, replayed: bool) -> Check {
    Arc::new(move |head: &Response<()>, body: &Bytes| {
        if head.status() != status {
            return Err(format!(
                "expected {status}, got {}: {}",
                head.status(),
                String::from_utf8_lossy(body)
            ));
        }
        let marked = head.headers().get(marker).is_some_and(|v| v == "true");
        if marked != replayed {
            return Err(format!(
                "{marker}: expected replayed={replayed}, got {marked}"
            ));
        }
        if body.is_empty() {
            return Err("empty body".into());
        }
        Ok(())
    })
}

const MARKER: &str = "idempotent-replayed";
const AI_MARKER: &str = "idempotency-replayed";

impl Bench {
    fn load(&self, server: &Server, make: MakeRequest, check: Check) -> LoadResult {
        let addr = server.addr;
        let config = self.config;
        self.client.block_on(load::run(addr, config, make, check))
    }

    /// Sends one request from the load generator's runtime and checks it.
    fn once(
        &self,
        server: &Server,
        request: http::Request<http_body_util::Full<Bytes>>,
    ) -> (Response<()>, Bytes) {
        let addr = server.addr;
        self.client.block_on(async move {
            let mut sender = load::connect(addr).await;
            load::send(&mut sender, request)
                .await
                .expect("a setup request")
        })
    }

    fn new_key(&self, conn: usize, seq: u64) -> HeaderValue {
        apps::key(&format!("k-{}-{conn}-{seq}", self.run_id))
    }

    fn file(&self, name: &str) -> PathBuf {
        let n = self.files.fetch_add(1, Ordering::Relaxed);
        self.dir.path().join(format!("{name}-{n}.sqlite3"))
    }

    /// Runs one scenario; `None` for the Python ones (see [`Bench::seed`]).
    fn scenario(&self, id: &str) -> Outcome {
        let runs: Runs = Arc::new(AtomicU64::new(0));
        let no_key: MakeRequest = Arc::new(|_, _| apps::post_credit(&[]));
        let run_id = self.run_id;
        let new_keys: MakeRequest = Arc::new(move |conn, seq| {
            apps::post_credit(&[(
                "idempotency-key",
                apps::key(&format!("k-{run_id}-{conn}-{seq}")),
            )])
        });
        let created = expect(StatusCode::CREATED, MARKER, false);
        // (result, effects check)
        let (result, effects): (LoadResult, Result<(), String>) = match id {
            "bare" | "bare_end" => {
                let server = Server::start(&self.server, apps::bare(runs.clone()));
                let r = self.load(&server, no_key, created);
                server.stop(&self.server);
                let e = runs_equal(&runs, r.answered);
                (r, e)
            }
            "bare_get" => {
                let server = Server::start(&self.server, apps::bare(runs.clone()));
                let r = self.load(
                    &server,
                    Arc::new(|_, _| apps::get_credit()),
                    expect(StatusCode::OK, MARKER, false),
                );
                server.stop(&self.server);
                let e = runs_equal(&runs, r.answered);
                (r, e)
            }
            "no_key" => {
                let server = Server::start(
                    &self.server,
                    apps::layered(tower_idempotency::MemoryStore::new(), runs.clone()),
                );
                let r = self.load(&server, no_key, created);
                server.stop(&self.server);
                let e = runs_equal(&runs, r.answered);
                (r, e)
            }
            "get" => {
                let server = Server::start(
                    &self.server,
                    apps::layered(tower_idempotency::MemoryStore::new(), runs.clone()),
                );
                let r = self.load(
                    &server,
                    Arc::new(|_, _| apps::get_credit()),
                    expect(StatusCode::OK, MARKER, false),
                );
                server.stop(&self.server);
                let e = runs_equal(&runs, r.answered);
                (r, e)
            }
            "replay" => {
                let server = Server::start(
                    &self.server,
                    apps::layered(tower_idempotency::MemoryStore::new(), runs.clone()),
                );
                let key = self.new_key(usize::MAX, 0);
                let (head, _) = self.once(
                    &server,
                    apps::post_credit(&[("idempotency-key", key.clone())]),
                );
                assert_eq!(
                    head.status(),
                    StatusCode::CREATED,
                    "the replayed key's first run"
                );
                let make: MakeRequest =
                    Arc::new(move |_, _| apps::post_credit(&[("idempotency-key", key.clone())]));
                let r = self.load(&server, make, expect(StatusCode::CREATED, MARKER, true));
                server.stop(&self.server);
                let e = runs_equal(&runs, 1);
                (r, e)
            }
            "new_memory" => {
                let server = Server::start(
                    &self.server,
                    apps::layered(tower_idempotency::MemoryStore::new(), runs.clone()),
                );
                let r = self.load(&server, new_keys, created);
                server.stop(&self.server);
                let e = runs_equal(&runs, r.answered);
                (r, e)
            }
            "new_sqlite_normal" | "new_sqlite_full" => {
                let sync = if id.ends_with("full") {
                    Synchronous::Full
                } else {
                    Synchronous::Normal
                };
                let store = apps::sqlite_store(&self.server, &self.file(id), sync);
                let server = Server::start(&self.server, apps::layered(store, runs.clone()));
                let r = self.load(&server, new_keys, created);
                server.stop(&self.server);
                let e = runs_equal(&runs, r.answered);
                (r, e)
            }
            "tx_sqlite_normal" | "tx_sqlite_full" => {
                let sync = if id.ends_with("full") {
                    Synchronous::Full
                } else {
                    Synchronous::Normal
                };
                let path = self.file(id);
                let server =
                    Server::start(&self.server, apps::transactional(&self.server, &path, sync));
                let r = self.load(&server, new_keys, created);
                server.stop(&self.server);
                let (credits, balance) = apps::ledger_totals(&path);
                let e = if credits as u64 == r.answered && balance == credits * apps::CREDIT_AMOUNT
                {
                    Ok(())
                } else {
                    Err(format!(
                        "{} answered, but {credits} credits and balance {balance}",
                        r.answered
                    ))
                };
                (r, e)
            }
            "ai_no_key" | "ai_replay" | "ai_new" => {
                let server = Server::start(&self.server, apps::axum_idempotent(runs.clone()));
                // One session per connection, opened before the load.
                let cookies: Arc<Vec<HeaderValue>> = Arc::new(
                    (0..self.config.connections)
                        .map(|_| self.login(&server))
                        .collect(),
                );
                let replay_key = self.new_key(usize::MAX, 0);
                if id == "ai_replay" {
                    for cookie in cookies.iter() {
                        let (head, _) = self.once(
                            &server,
                            apps::post_credit(&[
                                ("cookie", cookie.clone()),
                                ("idempotency-key", replay_key.clone()),
                            ]),
                        );
                        assert_eq!(
                            head.status(),
                            StatusCode::CREATED,
                            "the replayed key's first run"
                        );
                    }
                }
                let setup_runs = runs.load(Ordering::SeqCst);
                let (make, check): (MakeRequest, Check) = match id {
                    "ai_no_key" => {
                        let c = cookies.clone();
                        (
                            Arc::new(move |conn, _| {
                                apps::post_credit(&[("cookie", c[conn].clone())])
                            }),
                            created,
                        )
                    }
                    "ai_replay" => {
                        let c = cookies.clone();
                        (
                            Arc::new(move |conn, _| {
                                apps::post_credit(&[
                                    ("cookie", c[conn].clone()),
                                    ("idempotency-key", replay_key.clone()),
                                ])
                            }),
                            expect(StatusCode::CREATED, AI_MARKER, true),
                        )
                    }
                    _ => {
                        let c = cookies.clone();
                        (
                            Arc::new(move |conn, seq| {
                                apps::post_credit(&[
                                    ("cookie", c[conn].clone()),
                                    (
                                        "idempotency-key",
                                        apps::key(&format!("k-{run_id}-{conn}-{seq}")),
                                    ),
                                ])
                            }),
                            expect(StatusCode::CREATED, AI_MARKER, false),
                        )
                    }
                };
                let r = self.load(&server, make, check);
                server.stop(&self.server);
                let expected = if id == "ai_replay" {
                    setup_runs
                } else {
                    setup_runs + r.answered
                };
                let e = runs_equal(&runs, expected);
                (r, e)
            }
            other => panic!("unknown scenario {other}"),
        };
        Outcome::from_load(id, label(id), &result, effects)
    }

    /// Opens an axum-idempotent session; returns its `cookie` field.
    fn login(&self, server: &Server) -> HeaderValue {
        let request = http::Request::post("/login")
            .header(http::header::HOST, "127.0.0.1")
            .body(http_body_util::Full::new(Bytes::new()))
            .expect("a valid request");
        let (head, _) = self.once(server, request);
        assert_eq!(head.status(), StatusCode::NO_CONTENT, "login");
        let cookie = head
            .headers()
            .get_all(http::header::SET_COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .find(|v| v.starts_with("session="))
            .expect("a session cookie");
        let pair = cookie.split(';').next().expect("name=value");
        HeaderValue::from_str(pair).expect("a valid cookie")
    }

    /// (i) The seed-style baseline: `seed_credit.py` for the same window.
    fn seed(&self, id: &str) -> SeedResult {
        let synchronous = if id.ends_with("full") {
            "FULL"
        } else {
            "NORMAL"
        };
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("seed_credit.py");
        let db = self.file(id);
        let output = std::process::Command::new(&self.args.python)
            .arg(&script)
            .args(["--db".as_ref(), db.as_os_str()])
            .args(["--synchronous", synchronous])
            .args(["--threads", &self.args.seed_threads.to_string()])
            .args(["--warmup", &self.args.warmup.to_string()])
            .args(["--seconds", &self.args.window.to_string()])
            .output()
            .expect("run the seed-style baseline (python3)");
        if !output.status.success() {
            panic!(
                "seed_credit.py failed: {}\n{}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let v: serde_json::Value =
            serde_json::from_slice(&output.stdout).expect("seed_credit.py prints JSON");
        SeedResult {
            id: id.to_owned(),
            label: label(id).to_owned(),
            synchronous: synchronous.to_owned(),
            threads: self.args.seed_threads,
            credits: v["credits"].as_u64().expect("credits"),
            credits_per_s: v["credits_per_s"].as_f64().expect("credits_per_s"),
            p50_ms: v["p50_ms"].as_f64().expect("p50_ms"),
            p99_ms: v["p99_ms"].as_f64().expect("p99_ms"),
            rounds: Vec::new(),
        }
    }

    /// The memory check: a mix of new keys (MemoryStore, TTL 5 s, purged every
    /// second), replays of the key just made, and no key, `total` requests;
    /// VmRSS of this process (server and load generator) at 10 points.
    fn memory(&self) -> MemoryReport {
        let total = self.args.memory_requests;
        let runs: Runs = Arc::new(AtomicU64::new(0));
        let ttl = Duration::from_secs(5);
        let (app, store, purge) =
            apps::layered_memory_purged(&self.server, ttl, Duration::from_secs(1), runs.clone());
        let server = Server::start(&self.server, app);
        let addr = server.addr;
        let connections = self.config.connections;
        let run_id = self.run_id;
        let started = Instant::now();
        let step = (total / 10).max(1);
        let baseline_kb = report::rss_kb();
        let (samples, errors, first_error, expected_runs) = self.client.block_on(async move {
            let tickets = Arc::new(AtomicU64::new(0));
            let samples = Arc::new(std::sync::Mutex::new(Vec::new()));
            let tasks: Vec<_> = (0..connections)
                .map(|conn| {
                    let (tickets, samples, store) =
                        (tickets.clone(), samples.clone(), store.clone());
                    tokio::spawn(async move {
                        let mut sender = load::connect(addr).await;
                        let (mut errors, mut first_error) = (0u64, None::<String>);
                        let (mut seq, mut runs_expected) = (0u64, 0u64);
                        loop {
                            let ticket = tickets.fetch_add(1, Ordering::Relaxed) + 1;
                            if ticket > total {
                                break;
                            }
                            // new key, its replay, no key
                            let (request, replayed) = match seq % 3 {
                                0 => (
                                    apps::post_credit(&[(
                                        "idempotency-key",
                                        apps::key(&format!("m-{run_id}-{conn}-{seq}")),
                                    )]),
                                    false,
                                ),
                                1 => (
                                    apps::post_credit(&[(
                                        "idempotency-key",
                                        apps::key(&format!("m-{run_id}-{conn}-{}", seq - 1)),
                                    )]),
                                    true,
                                ),
                                _ => (apps::post_credit(&[]), false),
                            };
                            seq += 1;
                            if !replayed {
                                runs_expected += 1;
                            }
                            let check = match load::send(&mut sender, request).await {
                                Ok((head, _))
                                    if head.status() == StatusCode::CREATED
                                        && head.headers().get(MARKER).is_some() == replayed =>
                                {
                                    Ok(())
                                }
                                Ok((head, body)) => Err(format!(
                                    "{} replayed={replayed}: {}",
                                    head.status(),
                                    String::from_utf8_lossy(&body)
                                )),
                                Err(e) => Err(e),
                            };
                            if let Err(e) = check {
                                errors += 1;
                                first_error.get_or_insert(e);
                            }
                            if ticket % step == 0 {
                                samples.lock().expect("samples").push(report::MemorySample {
                                    requests: ticket,
                                    rss_kb: report::rss_kb(),
                                    records: store.len() as u64,
                                    seconds: started.elapsed().as_secs_f64(),
                                });
                            }
                        }
                        (errors, first_error, runs_expected)
                    })
                })
                .collect();
            let (mut errors, mut first_error, mut expected_runs) = (0, None, 0);
            for task in tasks {
                let (e, f, r) = task.await.expect("a memory task panicked");
                errors += e;
                expected_runs += r;
                if first_error.is_none() {
                    first_error = f;
                }
            }
            let mut samples = std::mem::take(&mut *samples.lock().expect("samples"));
            samples.sort_by_key(|s| s.requests);
            (samples, errors, first_error, expected_runs)
        });
        let seconds = started.elapsed().as_secs_f64();
        purge.abort();
        server.stop(&self.server);
        MemoryReport::new(
            total,
            seconds,
            baseline_kb,
            samples,
            errors,
            first_error,
            runs.load(Ordering::SeqCst),
            expected_runs,
            ttl,
        )
    }
}

fn runs_equal(runs: &Runs, expected: u64) -> Result<(), String> {
    let n = runs.load(Ordering::SeqCst);
    if n == expected {
        Ok(())
    } else {
        Err(format!("the handler ran {n} times; expected {expected}"))
    }
}

fn label(id: &str) -> &'static str {
    SCENARIOS
        .iter()
        .find(|(i, _)| *i == id)
        .map(|(_, l)| *l)
        .expect("a known scenario")
}

fn main() {
    let args = Args::parse();
    for id in &args.only {
        assert!(
            SCENARIOS.iter().any(|(i, _)| i == id),
            "unknown scenario {id}; known: {}",
            SCENARIOS
                .iter()
                .map(|(i, _)| *i)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let dir = match &args.dir {
        Some(d) => tempfile::tempdir_in(d),
        None => tempfile::tempdir(),
    }
    .expect("a temporary directory");
    let bench = Bench {
        server: runtime("server", args.server_threads),
        client: runtime("loadgen", args.client_threads),
        config: LoadConfig {
            connections: args.connections,
            warmup: Duration::from_secs_f64(args.warmup),
            window: Duration::from_secs_f64(args.window),
        },
        dir,
        run_id: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        args: args.clone(),
        files: AtomicU64::new(0),
    };
    let started = Instant::now();
    let wanted: Vec<(&str, &str)> = SCENARIOS
        .iter()
        .copied()
        .filter(|(id, _)| {
            args.only.is_empty() || args.only.iter().any(|o| o == id) || *id == "bare"
        })
        .collect();
    let mut outcomes: Vec<Vec<report::Outcome>> = wanted.iter().map(|_| Vec::new()).collect();
    let mut seeds: Vec<Vec<SeedResult>> = wanted.iter().map(|_| Vec::new()).collect();
    for round in 1..=args.rounds.max(1) {
        for (i, (id, label)) in wanted.iter().enumerate() {
            eprintln!(
                "[{:>6.1}s] round {round}: {id}: {label}",
                started.elapsed().as_secs_f64()
            );
            if id.starts_with("seed") {
                let s = bench.seed(id);
                eprintln!("          {:.0} credits/s", s.credits_per_s);
                seeds[i].push(s);
            } else {
                let o = bench.scenario(id);
                eprintln!(
                    "          {:.0} req/s, p50 {:.2} ms, p99 {:.2} ms, errors {}{}",
                    o.rps,
                    o.p50_ms,
                    o.p99_ms,
                    o.errors,
                    o.effects_error
                        .as_deref()
                        .map(|e| format!(", EFFECTS: {e}"))
                        .unwrap_or_default()
                );
                outcomes[i].push(o);
            }
        }
    }
    let outcomes: Vec<Outcome> = outcomes
        .into_iter()
        .filter(|o| !o.is_empty())
        .map(Outcome::median)
        .collect();
    let seeds: Vec<SeedResult> = seeds
        .into_iter()
        .filter(|s| !s.is_empty())
        .map(SeedResult::median)
        .collect();
    let memory = args.memory.then(|| {
        eprintln!(
            "[{:>6.1}s] memory check: {} requests",
            started.elapsed().as_secs_f64(),
            args.memory_requests
        );
        bench.memory()
    });
    let results = report::Results::new(&args, outcomes, seeds, memory, started.elapsed());
    results.write(&args.out);
    println!("{}", results.markdown());
    eprintln!("results written to {}", args.out.display());
    if !results.clean() {
        eprintln!("FAILED: a scenario had errors or wrong effect counts (see above)");
        std::process::exit(1);
    }
}
