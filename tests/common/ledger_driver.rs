//! Drives ledger processes from outside: bursts of distinct keys from
//! parallel clients, SIGKILLs at random moments, restarts, retries until every
//! key completes, then counts each key's credits in the database.
//!
//! Shared by `bench/storm` (`cargo run --release --example storm`, which
//! prints the figures) and the tests that start ledgers (`integration/tests/ledger/crash_sqlite.rs`
//! asserts the same figures). Standard library only, plus rusqlite to read the
//! credits afterwards.

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// The ledger example that `cargo test` builds beside a test binary
/// (`target/<profile>/deps/<test>` -> `target/<profile>/examples/ledger`).
/// Panics, naming the command to run, when it is not there.
pub fn ledger_beside_tests() -> PathBuf {
    let exe = std::env::current_exe().expect("own path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>");
    let binary = profile_dir
        .join("examples")
        .join(format!("ledger{}", std::env::consts::EXE_SUFFIX));
    assert!(
        binary.exists(),
        "no ledger at {}: run the whole `cargo test` (with the same features), which builds the examples",
        binary.display()
    );
    binary
}

/// One ledger process.
pub struct Ledger {
    binary: PathBuf,
    db: PathBuf,
    mode: String,
    lease_secs: u64,
    extra: Vec<String>,
    child: Option<Child>,
    pub addr: SocketAddr,
}

impl Ledger {
    pub fn start(binary: &Path, db: &Path, mode: &str, lease_secs: u64) -> Ledger {
        Ledger::start_with(binary, db, mode, lease_secs, &[])
    }

    /// As [`Ledger::start`], with more arguments (`--key-store URL`, say).
    pub fn start_with(
        binary: &Path,
        db: &Path,
        mode: &str,
        lease_secs: u64,
        extra: &[&str],
    ) -> Ledger {
        let mut ledger = Ledger {
            binary: binary.to_owned(),
            db: db.to_owned(),
            mode: mode.to_owned(),
            lease_secs,
            extra: extra.iter().map(|a| (*a).to_owned()).collect(),
            child: None,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        };
        ledger.restart();
        ledger
    }

    /// Starts the process (again) and waits for its `listening on` line.
    pub fn restart(&mut self) {
        let mut child = Command::new(&self.binary)
            .arg("--db")
            .arg(&self.db)
            .args([
                "--mode",
                &self.mode,
                "--listen",
                "127.0.0.1:0",
                "--fault-injection",
            ])
            // 0: no `--lease-secs`, the ledger's (the crate's) default.
            .args(
                Some(["--lease-secs".to_owned(), self.lease_secs.to_string()])
                    .filter(|_| self.lease_secs > 0)
                    .into_iter()
                    .flatten(),
            )
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.binary.display()));
        let stdout = child.stdout.take().expect("piped stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the ledger's first line");
        let addr = line
            .trim()
            .strip_prefix("listening on http://")
            .unwrap_or_else(|| panic!("unexpected first line from the ledger: {line:?}"));
        self.addr = addr.parse().expect("a socket address");
        self.child = Some(child);
    }

    /// SIGTERM, and wait for the process to end (at most `within`): its
    /// exit status, `None` if it was still running then (it is killed).
    pub fn terminate(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        let sent = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -TERM failed");
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(status) = child.try_wait().expect("wait for the ledger") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
        None
    }

    /// Sends signal `name` (`STOP`, `CONT`, ...) to the process.
    pub fn signal(&self, name: &str) {
        let child = self.child.as_ref().expect("a running ledger");
        let sent = Command::new("kill")
            .args([&format!("-{name}"), &child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -{name} failed");
    }

    /// SIGKILL, and wait for the process to be gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        self.kill();
    }
}

/// An answer: status and the `Retry-After` seconds, if any.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub retry_after: Option<u64>,
    pub replayed: bool,
    pub body: String,
}

/// One HTTP/1.1 request; `None` when the connection fails or dies (the
/// server was killed), or no answer came within 30 s.
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Option<Answer> {
    request_within(Duration::from_secs(30), addr, method, path, headers, body)
}

/// [`request`], waiting at most `limit` for the answer.
pub fn request_within(
    limit: Duration,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Option<Answer> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
    stream.set_read_timeout(Some(limit)).ok()?;
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nhost: ledger\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        req.push_str(&format!("{name}: {value}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    stream.write_all(req.as_bytes()).ok()?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let mut lines = head.lines();
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let mut retry_after = None;
    let mut replayed = false;
    for line in lines {
        let (name, value) = line.split_once(':')?;
        match name.trim().to_ascii_lowercase().as_str() {
            "retry-after" => retry_after = value.trim().parse().ok(),
            "idempotent-replayed" => replayed = value.trim() == "true",
            _ => {}
        }
    }
    Some(Answer {
        status,
        retry_after,
        replayed,
        body: body.to_owned(),
    })
}

/// A small deterministic generator for kill moments (xorshift64*).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
    }
}

pub struct StormConfig {
    pub binary: PathBuf,
    pub db: PathBuf,
    pub mode: String,
    pub bursts: usize,
    pub keys_per_burst: usize,
    /// `X-Ledger-Pause-After-Effect-Ms` on every first delivery.
    pub pause_ms: u64,
    pub lease_secs: u64,
    pub seed: u64,
}

#[derive(Debug, Default)]
pub struct StormReport {
    pub keys: usize,
    pub kills: usize,
    /// First deliveries that got no answer because the server died.
    pub unanswered: usize,
    pub applied_twice: usize,
    pub lost: usize,
    pub balance: i64,
    pub expected_balance: i64,
}

/// Credits a new key until it completes; panics after `deadline`.
fn retry_until_complete(ledger: &Ledger, account: i64, key: &str, amount: i64, deadline: Instant) {
    loop {
        assert!(Instant::now() < deadline, "key {key} never completed");
        let answer = request(
            ledger.addr,
            "POST",
            &format!("/accounts/{account}/credits"),
            &[("idempotency-key", key), ("authorization", "Bearer storm")],
            &format!("{{\"amount\":{amount}}}"),
        );
        match answer {
            Some(a) if a.status == 201 => return,
            Some(a) if a.status == 409 || a.status == 503 => {
                let wait = a.retry_after.unwrap_or(1).min(2);
                std::thread::sleep(Duration::from_millis(250).min(Duration::from_secs(wait)));
            }
            Some(a) => panic!("key {key}: unexpected {} {}", a.status, a.body),
            None => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

pub fn storm(cfg: &StormConfig) -> StormReport {
    let mut ledger = Ledger::start(&cfg.binary, &cfg.db, &cfg.mode, cfg.lease_secs);
    let mut rng = Rng::new(cfg.seed);
    let account = request(
        ledger.addr,
        "POST",
        "/accounts",
        &[
            ("idempotency-key", "storm-account"),
            ("authorization", "Bearer storm"),
        ],
        r#"{"name":"storm"}"#,
    )
    .expect("create the account");
    assert_eq!(account.status, 201, "{}", account.body);
    let account: i64 = account
        .body
        .split("\"id\":")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|id| id.parse().ok())
        .expect("an account id");

    let mut report = StormReport::default();
    for burst in 0..cfg.bursts {
        // Key k of this burst credits amount k + 1 + burst * keys, so every
        // key's credits can be told apart afterwards.
        let keys: Vec<(String, i64)> = (0..cfg.keys_per_burst)
            .map(|k| {
                let n = burst * cfg.keys_per_burst + k;
                (format!("storm-{}-{n}", cfg.seed), n as i64 + 1)
            })
            .collect();
        let barrier = Arc::new(Barrier::new(keys.len() + 1));
        let addr = ledger.addr;
        let pause = cfg.pause_ms.to_string();
        let clients: Vec<_> = keys
            .iter()
            .cloned()
            .map(|(key, amount)| {
                let (barrier, pause) = (barrier.clone(), pause.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    request(
                        addr,
                        "POST",
                        &format!("/accounts/{account}/credits"),
                        &[
                            ("idempotency-key", &key),
                            ("authorization", "Bearer storm"),
                            ("x-ledger-pause-after-effect-ms", &pause),
                        ],
                        &format!("{{\"amount\":{amount}}}"),
                    )
                })
            })
            .collect();
        barrier.wait();
        // Kill at a random moment from a fifth of the pause to twice the
        // pause: some handlers have written their credit and not answered.
        // The first burst's kill comes half a pause in, before any answer
        // can have left (each waits a whole pause after its credit), so
        // every storm has a kill that lands mid-request.
        let kill_after = match burst {
            0 => cfg.pause_ms / 2,
            _ => cfg.pause_ms / 5 + rng.below(cfg.pause_ms * 2),
        };
        std::thread::sleep(Duration::from_millis(kill_after));
        ledger.kill();
        report.kills += 1;
        for client in clients {
            if client.join().expect("client thread").is_none() {
                report.unanswered += 1;
            }
        }
        ledger.restart();
        let deadline = Instant::now() + Duration::from_secs(120);
        for (key, amount) in &keys {
            retry_until_complete(&ledger, account, key, *amount, deadline);
        }
        report.keys += keys.len();
        report.expected_balance += keys.iter().map(|(_, a)| a).sum::<i64>();
    }

    let balance = request(
        ledger.addr,
        "GET",
        &format!("/accounts/{account}"),
        &[("authorization", "Bearer storm")],
        "",
    )
    .expect("read the balance");
    report.balance = balance
        .body
        .split("\"balance\":")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| c != '-' && !c.is_ascii_digit()).next())
        .and_then(|b| b.parse().ok())
        .expect("a balance");
    ledger.kill();

    // Count each key's credits (amounts are unique per key).
    let conn = rusqlite::Connection::open(&cfg.db).expect("open the ledger database");
    let mut counts = vec![0u32; report.keys];
    let mut stmt = conn
        .prepare("SELECT amount FROM credits WHERE account_id = ?1")
        .expect("query credits");
    let amounts = stmt
        .query_map([account], |r| r.get::<_, i64>(0))
        .expect("read credits");
    for amount in amounts {
        let index = amount.expect("an amount") as usize - 1;
        counts[index] += 1;
    }
    report.applied_twice = counts.iter().filter(|c| **c > 1).count();
    report.lost = counts.iter().filter(|c| **c == 0).count();
    report
}

/// One request, sent again while it meets its key in flight (a probe of
/// [`until_in_flight`], say); `None` when the server died.
pub fn request_past_409(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Option<Answer> {
    loop {
        match request(addr, method, path, headers, body) {
            Some(a) if a.status == 409 => std::thread::sleep(Duration::from_millis(5)),
            other => return other,
        }
    }
}

/// Returns once another request holds the key of `headers` on `path`: the
/// same request, marked to fail after its effect (`X-Ledger-Fail`, not part
/// of the fingerprint), meets it in flight: 409, or no answer within 300 ms
/// where a repeat waits for the holder (`--wait-in-flight-ms`; that probe
/// is then left waiting). A probe that comes first runs, fails, rolls
/// its effect back and gives the key back: it changes nothing (and the
/// other request, sent with [`request_past_409`], tries again).
pub fn until_in_flight(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: &str) {
    let mut probe: Vec<(String, String)> = headers
        .iter()
        .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
        .collect();
    probe.push(("x-ledger-fail".into(), "after-effect".into()));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(Instant::now() < deadline, "the key was never in flight");
        let (answer, answered) = std::sync::mpsc::channel();
        let (path, body, probe) = (path.to_owned(), body.to_owned(), probe.clone());
        std::thread::spawn(move || {
            let headers: Vec<(&str, &str)> = probe
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_str()))
                .collect();
            let _ = answer.send(request(addr, "POST", &path, &headers, &body));
        });
        match answered.recv_timeout(Duration::from_millis(300)) {
            Err(_) => return,
            Ok(Some(a)) if a.status == 409 => return,
            Ok(Some(a)) if a.status == 500 => {}
            Ok(Some(a)) => panic!("a probe: {} {}", a.status, a.body),
            Ok(None) => {}
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// What [`kill_to_recovery`] saw.
#[derive(Debug)]
pub struct Recovery {
    /// From the SIGKILL until the retry's 201 (the restart included).
    pub elapsed: Duration,
    /// Retries answered 409 before that (the dead holder's lease).
    pub in_flight_answers: usize,
    /// The account's balance afterwards: the amount once.
    pub balance: i64,
    pub amount: i64,
}

/// A credit whose handler runs `handler_ms` is claimed; the ledger is
/// SIGKILLed while it runs, restarted, and the same credit retried every
/// 50 ms until it succeeds (for at most `give_up`).
pub fn kill_to_recovery(ledger: &mut Ledger, handler_ms: u64, give_up: Duration) -> Recovery {
    let caller = ("authorization", "Bearer recovery");
    // Keys of this call's own, so that runs can share a database.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let (account_key, key) = (format!("account-{nanos}"), format!("recovery-{nanos}"));
    let created = request(
        ledger.addr,
        "POST",
        "/accounts",
        &[("idempotency-key", &account_key), caller],
        r#"{"name":"recovery"}"#,
    )
    .expect("create the account");
    assert_eq!(created.status, 201, "{}", created.body);
    let account: i64 = created
        .body
        .split("\"id\":")
        .nth(1)
        .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
        .expect("an account id");
    let path = format!("/accounts/{account}/credits");
    let amount = 7;
    let body = format!("{{\"amount\":{amount}}}");
    let delay = handler_ms.to_string();
    let addr = ledger.addr;
    let first = {
        let (path, body, key) = (path.clone(), body.clone(), key.clone());
        std::thread::spawn(move || {
            request_past_409(
                addr,
                "POST",
                &path,
                &[
                    ("idempotency-key", &key),
                    caller,
                    ("x-ledger-delay-ms", &delay),
                ],
                &body,
            )
        })
    };
    let retry = |addr| {
        request(
            addr,
            "POST",
            &path,
            &[("idempotency-key", &key), caller],
            &body,
        )
    };
    until_in_flight(
        ledger.addr,
        &path,
        &[("idempotency-key", &key), caller],
        &body,
    );
    let killed = Instant::now();
    ledger.kill();
    assert!(
        first.join().unwrap().is_none(),
        "the first credit was answered"
    );
    ledger.restart();
    let mut in_flight_answers = 0;
    let elapsed = loop {
        assert!(
            killed.elapsed() < give_up,
            "no retry succeeded within {give_up:?}"
        );
        match retry(ledger.addr) {
            Some(a) if a.status == 201 => break killed.elapsed(),
            Some(a) if a.status == 409 => in_flight_answers += 1,
            Some(a) => panic!("after the restart: {} {}", a.status, a.body),
            None => {}
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let account = request(ledger.addr, "GET", &format!("/accounts/{account}"), &[], "")
        .expect("read the account");
    let balance = account
        .body
        .split("\"balance\":")
        .nth(1)
        .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
        .expect("a balance");
    Recovery {
        elapsed,
        in_flight_answers,
        balance,
        amount,
    }
}

/// What [`hot_key`] saw.
#[derive(Debug)]
pub struct HotKey {
    /// The unrelated credit's answer and how long it took.
    pub unrelated_status: u16,
    pub unrelated: Duration,
    /// The repeats' answers, counted: (status, replayed) -> count.
    pub repeats: std::collections::BTreeMap<(u16, bool), usize>,
    /// The two accounts' balances afterwards (the slow one's, the other's).
    pub balances: (i64, i64),
}

/// A credit whose handler takes `slow_ms` is claimed; `repeats` parallel
/// clients repeat it at once (a barrier); 200 ms later a credit with another
/// key, on another account, is timed. Status 0 counts a repeat that got no
/// answer.
pub fn hot_key(ledger: &Ledger, slow_ms: u64, repeats: usize) -> HotKey {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let caller = ("authorization", "Bearer hot-key");
    let account = |name: &str| create_account(ledger, caller, &format!("{name}-{nanos}"));
    let (hot, other) = (account("hot"), account("other"));
    let hot_path = format!("/accounts/{hot}/credits");
    let hot_key = format!("hot-credit-{nanos}");
    let body = r#"{"amount":5}"#;
    let addr = ledger.addr;
    let slow = slow_credit(addr, caller, &hot_path, &hot_key, slow_ms);
    let start = Arc::new(Barrier::new(repeats + 1));
    let repeaters: Vec<_> = (0..repeats)
        .map(|_| {
            let (path, key, start) = (hot_path.clone(), hot_key.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                let headers = [("idempotency-key", key.as_str()), caller];
                request(addr, "POST", &path, &headers, body).map(|a| (a.status, a.replayed))
            })
        })
        .collect();
    start.wait();
    // Let the repeats pile up, then time the unrelated credit.
    std::thread::sleep(Duration::from_millis(200));
    let sent = Instant::now();
    let unrelated = request(
        addr,
        "POST",
        &format!("/accounts/{other}/credits"),
        &[
            ("idempotency-key", &format!("other-credit-{nanos}")),
            caller,
        ],
        body,
    )
    .expect("an answer to the unrelated credit");
    let took = sent.elapsed();
    let first = slow.join().unwrap().expect("an answer to the slow credit");
    assert_eq!(first.status, 201, "{}", first.body);
    let mut counted = std::collections::BTreeMap::new();
    for repeater in repeaters {
        let seen = repeater.join().unwrap().unwrap_or((0, false));
        *counted.entry(seen).or_insert(0) += 1;
    }
    let balance = |id: i64| {
        let got = request(addr, "GET", &format!("/accounts/{id}"), &[], "").expect("an account");
        number_after(&got.body, "\"balance\":")
    };
    HotKey {
        unrelated_status: unrelated.status,
        unrelated: took,
        repeats: counted,
        balances: (balance(hot), balance(other)),
    }
}

/// Sends a credit of 5 to `path` under `key` whose handler takes
/// `slow_ms`, in a thread of its own (past any 409 of an earlier probe),
/// and returns once the ledger holds its key.
fn slow_credit(
    addr: SocketAddr,
    caller: (&'static str, &'static str),
    path: &str,
    key: &str,
    slow_ms: u64,
) -> std::thread::JoinHandle<Option<Answer>> {
    let body = r#"{"amount":5}"#;
    let slow = {
        let (path, key, delay) = (path.to_owned(), key.to_owned(), slow_ms.to_string());
        std::thread::spawn(move || {
            let headers = [
                ("idempotency-key", key.as_str()),
                caller,
                ("x-ledger-delay-ms", &delay),
            ];
            request_past_409(addr, "POST", &path, &headers, body)
        })
    };
    until_in_flight(addr, path, &[("idempotency-key", key), caller], body);
    slow
}

/// Creates an account named `name` (its key too) for `caller`; its id.
pub fn create_account(ledger: &Ledger, caller: (&str, &str), name: &str) -> i64 {
    let created = request(
        ledger.addr,
        "POST",
        "/accounts",
        &[("idempotency-key", name), caller],
        &format!("{{\"name\":\"{name}\"}}"),
    )
    .expect("create an account");
    assert_eq!(created.status, 201, "{}", created.body);
    number_after(&created.body, "\"id\":")
}

/// The integer after `label` in `json`.
fn number_after(json: &str, label: &str) -> i64 {
    json.split(label)
        .nth(1)
        .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {label} in {json}"))
}

/// What [`repeat_past_the_lease`] saw.
#[derive(Debug)]
pub struct PastTheLease {
    /// The slow first request's answer.
    pub first: (u16, String),
    /// The repeat's: status, replayed.
    pub repeat: (u16, bool),
    /// The account's balance afterwards.
    pub balance: i64,
}

/// A credit of 5 whose handler takes `slow_ms` is claimed; `after` later
/// (past the ledger's lease, while the credit still runs), one repeat of it
/// is sent. Issue 36, item 1: the repeat must never cost the first its
/// work, whatever the lease.
pub fn repeat_past_the_lease(ledger: &Ledger, slow_ms: u64, after: Duration) -> PastTheLease {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let caller = ("authorization", "Bearer past-the-lease");
    let account = create_account(ledger, caller, &format!("slow-{nanos}"));
    let path = format!("/accounts/{account}/credits");
    let key = format!("slow-credit-{nanos}");
    let body = r#"{"amount":5}"#;
    let addr = ledger.addr;
    let claimed = Instant::now();
    let slow = slow_credit(addr, caller, &path, &key, slow_ms);
    std::thread::sleep(after.saturating_sub(claimed.elapsed()));
    let repeat = request(
        addr,
        "POST",
        &path,
        &[("idempotency-key", &key), caller],
        body,
    )
    .expect("an answer to the repeat");
    let first = slow.join().unwrap().expect("an answer to the slow credit");
    let got = request(addr, "GET", &format!("/accounts/{account}"), &[], "").expect("an account");
    PastTheLease {
        first: (first.status, first.body),
        repeat: (repeat.status, repeat.replayed),
        balance: number_after(&got.body, "\"balance\":"),
    }
}
