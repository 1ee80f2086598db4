//! One run: a fresh database, two ledgers, the plan's clients and faults,
//! then the audit.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::runtime::Runtime;

use crate::audit::{self, Role, Sent, Window};
use crate::downstream::Downstream;
use crate::driver::{self, Ledger};
use crate::plan::{self, Fault, KeyPlan, LEASE};
use crate::stores::{Config, Db, Store};

/// A client that has no 201 by then has waited too long (liveness).
pub const CLIENT_DEADLINE: Duration = Duration::from_secs(60);
const CALLER: (&str, &str) = ("authorization", "Bearer harness");

/// What the runs of one configuration added up to.
#[derive(Debug, Default, Clone)]
pub struct Totals {
    pub keys: usize,
    pub kills: usize,
    pub pauses: usize,
    pub cuts: usize,
    pub holds: usize,
    pub sends: usize,
    pub in_flight: usize,
    pub unavailable: usize,
    pub dropped: usize,
    pub notifications: usize,
}

impl Totals {
    pub fn add(&mut self, other: &Totals) {
        self.keys += other.keys;
        self.kills += other.kills;
        self.pauses += other.pauses;
        self.cuts += other.cuts;
        self.holds += other.holds;
        self.sends += other.sends;
        self.in_flight += other.in_flight;
        self.unavailable += other.unavailable;
        self.dropped += other.dropped;
        self.notifications += other.notifications;
    }
}

impl std::fmt::Display for Totals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} keys; faults: {} kills, {} pauses, {} connection cuts, {} lock holds; \
             {} requests: {} answered 409, {} answered 503, {} dropped by a kill; {} notifications",
            self.keys,
            self.kills,
            self.pauses,
            self.cuts,
            self.holds,
            self.sends,
            self.in_flight,
            self.unavailable,
            self.dropped,
            self.notifications
        )
    }
}

pub struct Outcome {
    pub problems: Vec<String>,
    pub totals: Totals,
}

/// What the clients and the faults share.
struct World {
    ledgers: Vec<Mutex<Ledger>>,
    began: Instant,
    account: i64,
    sent: Mutex<Vec<Sent>>,
}

impl World {
    fn now(&self) -> Duration {
        self.began.elapsed()
    }

    fn sleep_until(&self, at: Duration) {
        if let Some(left) = at.checked_sub(self.now()) {
            std::thread::sleep(left);
        }
    }

    /// Sends the credit of `key` with `amount` to ledger `ledger`, and
    /// keeps the answer.
    fn send(
        &self,
        key: &str,
        amount: i64,
        role: Role,
        ledger: usize,
        extra: &[(&str, &str)],
    ) -> Sent {
        let addr = self.ledgers[ledger].lock().unwrap().addr;
        let path = format!("/accounts/{}/credits", self.account);
        let mut headers = vec![("idempotency-key", key), CALLER];
        headers.extend_from_slice(extra);
        let body = format!("{{\"amount\":{amount}}}");
        let sent = self.now();
        let answer = driver::request(addr, "POST", &path, &headers, &body);
        let slow = !extra.is_empty();
        let done = Sent {
            key: key.to_owned(),
            role,
            ledger,
            slow,
            sent,
            answered: self.now(),
            answer,
        };
        self.sent.lock().unwrap().push(done.clone());
        done
    }
}

pub fn run(rt: &Runtime, binary: &Path, config: &Config, seed: u64) -> Outcome {
    let dir = tempfile::tempdir().expect("a temporary directory");
    // Names unique to this run: Redis keeps its records from earlier runs,
    // and two runs may share a database server.
    let nonce: u32 = rand::random();
    let store = config.store.name().replace('-', "_");
    let tag = format!("real_{store}_{}_{seed}_{nonce:08x}", config.mode);
    let db = Db::fresh(rt, config.store, &tag, dir.path());
    let plan = plan::plan(seed, &tag, config.store.cuts());
    let transactional = config.mode == "transactional";
    let downstream = Downstream::start();
    let mut flags: Vec<String> = db.flags.clone();
    flags.extend([
        "--wait-in-flight-ms".into(),
        plan.wait_in_flight_ms.to_string(),
    ]);
    if transactional {
        flags.extend(["--notify-url".into(), downstream.url()]);
    }
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let start = |_| Ledger::start_with(binary, &db.arg, config.mode, LEASE.as_secs(), &flags);
    let ledgers: Vec<Mutex<Ledger>> = (0..2).map(start).map(Mutex::new).collect();
    let account = new_account(&ledgers[0].lock().unwrap(), &plan.keys[0].key);
    let world = Arc::new(World {
        ledgers,
        began: Instant::now(),
        account,
        sent: Mutex::default(),
    });

    let windows = std::thread::scope(|s| {
        let faults = s.spawn(|| make_faults(rt, &world, &db, &plan.faults));
        let clients: Vec<_> = plan
            .keys
            .iter()
            .enumerate()
            .map(|(n, key)| {
                let world = &world;
                s.spawn(move || client(world, key, seed ^ (n as u64) << 32))
            })
            .collect();
        let answers: Vec<_> = clients
            .into_iter()
            .map(|c| c.join().expect("a client"))
            .collect();
        (faults.join().expect("the faults"), answers)
    });
    let (mut windows, answers) = windows;
    if transactional && config.store.sqlite_file() {
        windows.extend(slow_credits(&world, config.store == Store::SqlxSqlite));
    }
    let (credits, balance) = rt.block_on(db.credits(account));
    if transactional {
        wait_for_notifications(&downstream, credits.len());
    }
    let mut sent = world.sent.lock().unwrap().clone();
    sent.sort_by_key(|s| s.sent);
    if std::env::var_os("REAL_TRACE").is_some() {
        for s in &sent {
            let (key, role, ledger) = (&s.key, s.role, s.ledger);
            let answer = s.answer.as_ref().map(|a| (a.status, a.replayed));
            println!(
                "{:>8.3} s {:>8.3} s  {key} {role:?} to {ledger}: {answer:?}",
                s.sent.as_secs_f64(),
                s.answered.as_secs_f64()
            );
        }
    }
    let received = downstream.received.lock().unwrap().clone();
    let problems = audit::judge(&audit::Run {
        plan: &plan,
        account,
        answers: &answers,
        sent: &sent,
        windows: &windows,
        credits: &credits,
        balance,
        notifications: transactional.then_some(&received),
    });
    drop(world);
    rt.block_on(db.remove());
    let count = |f: &dyn Fn(&Sent) -> bool| sent.iter().filter(|s| f(s)).count();
    let faulted = |f: &dyn Fn(&Fault) -> bool| plan.faults.iter().filter(|(_, x)| f(x)).count();
    let totals = Totals {
        keys: plan.keys.len(),
        kills: faulted(&|f| matches!(f, Fault::Kill { .. })),
        pauses: faulted(&|f| matches!(f, Fault::Pause { .. })),
        cuts: faulted(&|f| matches!(f, Fault::Cut)),
        holds: faulted(&|f| matches!(f, Fault::Hold { .. })),
        sends: sent.len(),
        in_flight: count(&|s| s.status() == Some(409)),
        unavailable: count(&|s| s.status() == Some(503)),
        dropped: count(&|s| s.answer.is_none()),
        notifications: received.values().map(Vec::len).sum(),
    };
    Outcome { problems, totals }
}

/// Creates the run's account on `ledger`: its id.
fn new_account(ledger: &Ledger, key: &str) -> i64 {
    let key = format!("{key}-account");
    let headers = [("idempotency-key", key.as_str()), CALLER];
    let created = driver::request(
        ledger.addr,
        "POST",
        "/accounts",
        &headers,
        r#"{"name":"harness"}"#,
    )
    .expect("an answer");
    assert_eq!(created.status, 201, "{}", created.body);
    let json: serde_json::Value = serde_json::from_str(&created.body).unwrap();
    json["id"].as_i64().expect("an account id")
}

/// One key's client: its first send (and the repeat while it runs), its
/// retries until 201, the replay, and the key reused with another amount.
fn client(world: &World, plan: &KeyPlan, seed: u64) -> audit::Answers {
    let mut rng = StdRng::seed_from_u64(seed);
    world.sleep_until(plan.at);
    let (key, amount) = (plan.key.as_str(), plan.amount);
    std::thread::scope(|s| {
        for &(after, to) in &plan.repeats {
            s.spawn(move || {
                world.sleep_until(plan.at + after);
                world.send(key, amount, Role::Repeat, to, &[]);
            });
        }
        let slow = plan.slow_ms.to_string();
        let delay = [("x-ledger-delay-ms", slow.as_str())];
        let extra: &[_] = if plan.slow_ms > 0 { &delay } else { &[] };
        let mut answer = world.send(key, amount, Role::First, plan.ledger, extra);
        let deadline = world.now() + CLIENT_DEADLINE;
        let mut answers = audit::Answers::default();
        while answer.status() != Some(201) {
            if world.now() > deadline {
                return answers;
            }
            let wait = answer
                .answer
                .as_ref()
                .and_then(|a| a.retry_after)
                .unwrap_or(0);
            std::thread::sleep(Duration::from_millis((wait * 1000).clamp(100, 300)));
            answer = world.send(key, amount, Role::Retry, rng.random_range(0..2), &[]);
        }
        answers.created.push(answer.body().to_owned());
        let replay = until_definite(world, || {
            world.send(key, amount, Role::Replay, rng.random_range(0..2), &[])
        });
        if replay.status() == Some(201) {
            answers.created.push(replay.body().to_owned());
        }
        let other = amount + 1_000_000;
        let reused = until_definite(world, || {
            world.send(key, other, Role::Reuse, rng.random_range(0..2), &[])
        });
        answers.reused = reused.status();
        answers
    })
}

/// Sends again while a fault stands between the request and its answer
/// (the connection dropped, or 503), for at most the client deadline.
fn until_definite(world: &World, mut send: impl FnMut() -> Sent) -> Sent {
    let deadline = world.now() + CLIENT_DEADLINE;
    loop {
        let sent = send();
        if !matches!(sent.status(), None | Some(503)) || world.now() > deadline {
            return sent;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Makes the plan's faults, one after the other: when each began and was
/// healed.
fn make_faults(rt: &Runtime, world: &World, db: &Db, faults: &[(Duration, Fault)]) -> Vec<Window> {
    let mut windows = Vec::new();
    for &(at, fault) in faults {
        world.sleep_until(at);
        let start = world.now();
        match fault {
            Fault::Kill { ledger, down } => {
                world.ledgers[ledger].lock().unwrap().kill();
                std::thread::sleep(down);
                world.ledgers[ledger].lock().unwrap().restart();
            }
            Fault::Pause { ledger, stopped } => {
                world.ledgers[ledger].lock().unwrap().signal("STOP");
                std::thread::sleep(stopped);
                world.ledgers[ledger].lock().unwrap().signal("CONT");
            }
            Fault::Cut => rt.block_on(db.cut()),
            Fault::Hold { hold } => rt.block_on(db.hold(world.account, hold)),
            Fault::Slow { .. } => unreachable!("the plan makes no slow credit a fault"),
        }
        windows.push(Window {
            fault,
            start,
            end: world.now(),
        });
    }
    windows
}

/// The slow first sends of a SQLite file in transactional mode, each of
/// which holds the write lock while it runs.
fn slow_credits(world: &World, in_process: bool) -> Vec<Window> {
    let sent = world.sent.lock().unwrap();
    let slow = sent.iter().filter(|s| s.role == Role::First && s.slow);
    let window = |s: &Sent| Window {
        fault: Fault::Slow {
            ledger: s.ledger,
            in_process,
        },
        start: s.sent,
        end: s.answered,
    };
    slow.map(window).collect()
}

/// Waits (at most 30 s) until the downstream has a notification for each
/// of `credits` credits.
fn wait_for_notifications(downstream: &Downstream, credits: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while downstream.received.lock().unwrap().len() < credits && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
}
