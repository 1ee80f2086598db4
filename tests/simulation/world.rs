//! One seed's world: its hosts, its clients, its fault schedule, and the
//! run until it settles.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::http::Request;
use bytes::Bytes;
use http_body_util::Full;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::app::{self, LockWait, Sending, ServerSetup};
use crate::checks::{self, Outcome};
use crate::http::{self, Downstream, Mood};
use crate::store_host::{self, Db};

const SERVERS: [&str; 2] = ["server-1", "server-2"];
const HOSTS: [&str; 7] = [
    "store",
    "server-1",
    "server-2",
    "downstream",
    "client-0",
    "client-1",
    "client-2",
];
const CLIENTS: usize = 3;
const CREDITS_PER_CLIENT: usize = 2;
/// Faults happen before this; then all are healed.
const FAULTS_END: Duration = Duration::from_secs(8);
/// A client that has no answer by then has waited too long (liveness).
pub const CLIENT_DEADLINE: Duration = Duration::from_secs(30);
/// A run whose outbox waits for a stepped-back clock ends here.
const STALLED: Duration = Duration::from_secs(20);
/// The whole run, settling included, ends by then.
const SIM_LIMIT: Duration = Duration::from_secs(45);

/// What a client asked and what it was answered, for one key.
#[derive(Debug, Default, Clone)]
pub struct Asked {
    pub account: String,
    pub amount: i64,
    /// Every 201 it got for the key (the first run's and replays).
    pub created: Vec<http::Answer>,
    /// The answer to the same key with another amount, sent after the 201.
    pub reused: Option<http::Answer>,
}

/// Shared by the clients, the hosts and the checks.
#[derive(Clone)]
pub struct Shared {
    pub db: Arc<Mutex<Db>>,
    pub downstream: Arc<Mutex<Downstream>>,
    pub sending: Arc<Mutex<Sending>>,
    pub asked: Arc<Mutex<BTreeMap<String, Asked>>>,
    pub trace: Arc<Mutex<Vec<String>>>,
}

impl Shared {
    fn note(&self, line: String) {
        let at = turmoil::sim_elapsed().unwrap_or_default().as_millis();
        self.trace
            .lock()
            .unwrap()
            .push(format!("{at:>6} ms  {line}"));
    }
}

/// One fault, or its healing.
#[derive(Debug, Clone)]
enum Fault {
    Crash(&'static str),
    Restart(&'static str),
    Partition(&'static str, &'static str),
    Repair(&'static str, &'static str),
    StoreErrors(u32),
    ClockBack(i64),
    Downstream(Mood),
}

fn schedule(rng: &mut StdRng) -> Vec<(Duration, Fault)> {
    let hosts = &HOSTS[..6];
    let mut faults = Vec::new();
    let mut at = Duration::ZERO;
    loop {
        at += Duration::from_millis(rng.random_range(100..1200));
        if at >= FAULTS_END {
            break;
        }
        let lasting = Duration::from_millis(rng.random_range(200..2500));
        let server = SERVERS[rng.random_range(0..SERVERS.len())];
        match rng.random_range(0..6) {
            0 => {
                faults.push((at, Fault::Crash(server)));
                faults.push((at + lasting, Fault::Restart(server)));
            }
            1 | 2 => {
                let other = hosts[rng.random_range(0..hosts.len())];
                if other != server {
                    faults.push((at, Fault::Partition(server, other)));
                    faults.push((at + lasting, Fault::Repair(server, other)));
                }
            }
            3 => {
                faults.push((at, Fault::StoreErrors(rng.random_range(50..400))));
                faults.push((at + lasting, Fault::StoreErrors(0)));
            }
            4 => {
                let back = [2_000, 60_000, 3_600_000][rng.random_range(0..3)];
                faults.push((at, Fault::ClockBack(back)));
            }
            _ => {
                let mood = [Mood::Failing, Mood::Late][rng.random_range(0..2)];
                faults.push((at, Fault::Downstream(mood)));
                faults.push((at + lasting, Fault::Downstream(Mood::Fine)));
            }
        }
    }
    faults.sort_by_key(|(at, _)| *at);
    faults
}

fn apply(sim: &mut turmoil::Sim<'_>, shared: &Shared, fault: &Fault) {
    match fault {
        Fault::Crash(host) => {
            if sim.is_host_running(*host) {
                let at = sim.elapsed().as_millis() as u64;
                shared.db.lock().unwrap().crashed(host, at);
                sim.crash(*host);
            }
        }
        Fault::Restart(host) => {
            if !sim.is_host_running(*host) {
                sim.bounce(*host);
            }
        }
        Fault::Partition(a, b) => sim.partition(*a, *b),
        Fault::Repair(a, b) => sim.repair(*a, *b),
        Fault::StoreErrors(rate) => {
            let db = shared.db.lock().unwrap();
            db.error_rate.store(*rate, Ordering::SeqCst);
        }
        Fault::ClockBack(ms) => {
            let mut db = shared.db.lock().unwrap();
            db.clock.offset_ms.fetch_sub(*ms, Ordering::SeqCst);
            db.steps_at_ms.push(sim.elapsed().as_millis() as u64);
        }
        Fault::Downstream(mood) => shared.downstream.lock().unwrap().mood = Some(*mood),
    }
}

/// Sends one credit until it is answered 201 or 422, retrying on any other
/// answer or failure, on a server drawn from `rng`.
async fn until_answered(
    shared: &Shared,
    rng: &mut StdRng,
    user: &str,
    key: &str,
    body: String,
) -> Option<http::Answer> {
    while turmoil::sim_elapsed().unwrap_or_default() < CLIENT_DEADLINE {
        let server = SERVERS[rng.random_range(0..SERVERS.len())];
        let request = Request::post(format!("http://{server}/credits"))
            .header("x-user-id", user)
            .header("idempotency-key", format!("\"{key}\""))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.clone())))
            .expect("a request");
        let sent = tokio::time::timeout(Duration::from_secs(3), http::send(request)).await;
        let wait = match sent {
            Ok(Ok(answer)) => {
                let brief =
                    String::from_utf8_lossy(&answer.body[..answer.body.len().min(90)]).into_owned();
                let replayed = answer.replayed;
                shared.note(format!(
                    "{user} {key} via {server}: {} replayed={replayed} {brief}",
                    answer.status
                ));
                if matches!(answer.status, 201 | 422) {
                    return Some(answer);
                }
                Duration::from_secs(answer.retry_after.unwrap_or(0)).max(Duration::from_millis(150))
            }
            Ok(Err(e)) => {
                shared.note(format!("{user} {key} via {server}: failed: {e}"));
                Duration::from_millis(150)
            }
            Err(_) => {
                shared.note(format!("{user} {key} via {server}: no answer in 3 s"));
                Duration::from_millis(150)
            }
        };
        tokio::time::sleep(wait + Duration::from_millis(rng.random_range(0..100))).await;
    }
    None
}

async fn client(shared: Shared, index: usize, seed: u64) -> turmoil::Result {
    let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(31).wrapping_add(index as u64));
    let user = format!("user-{index}");
    let account = format!("acct-{index}");
    tokio::time::sleep(Duration::from_millis(rng.random_range(0..3000))).await;
    for n in 0..CREDITS_PER_CLIENT {
        let key = format!("{user}-credit-{n}");
        let amount = rng.random_range(1..1000);
        let body = |amount: i64| format!(r#"{{"account":"{account}","amount":{amount}}}"#);
        let asked = Asked {
            account: account.clone(),
            amount,
            ..Asked::default()
        };
        shared.asked.lock().unwrap().insert(key.clone(), asked);
        // Sent twice at once, as a double-clicked button does: one runs,
        // the other meets it in flight.
        let mut twin = StdRng::seed_from_u64(rng.random());
        let (a, b) = tokio::join!(
            until_answered(&shared, &mut rng, &user, &key, body(amount)),
            until_answered(&shared, &mut twin, &user, &key, body(amount)),
        );
        for answer in [a, b].into_iter().flatten() {
            let mut asked = shared.asked.lock().unwrap();
            asked.get_mut(&key).expect("asked").created.push(answer);
        }
        let reused = until_answered(&shared, &mut rng, &user, &key, body(amount + 1)).await;
        shared
            .asked
            .lock()
            .unwrap()
            .get_mut(&key)
            .expect("asked")
            .reused = reused;
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..1500))).await;
    }
    Ok(())
}

/// How a seed's fleet claims in transactional mode: odd seeds in one
/// phase (issue 37), the claim inside the handler's transaction (lock
/// waits bounded as on PostgreSQL, or as on MySQL), even seeds with the
/// claim committed first, as before.
pub fn one_phase(seed: u64) -> Option<LockWait> {
    match seed % 4 {
        1 => Some(LockWait::Postgres),
        3 => Some(LockWait::MySql),
        _ => None,
    }
}

/// Seed `seed`'s hosts and links.
fn build(seed: u64, rng: &mut StdRng, shared: &Shared) -> turmoil::Sim<'static> {
    let mut sim = turmoil::Builder::new()
        .rng_seed(seed)
        .tick_duration(Duration::from_millis(2))
        .simulation_duration(SIM_LIMIT + Duration::from_secs(5))
        .build();
    let db = shared.db.clone();
    sim.host("store", move || store_host::serve(db.clone()));
    let downstream = shared.downstream.clone();
    sim.host("downstream", move || http::downstream(downstream.clone()));
    for name in SERVERS {
        let setup = ServerSetup {
            name,
            wait_in_flight: rng.random_bool(0.5),
            one_phase: one_phase(seed),
            sending: shared.sending.clone(),
            boots: Arc::new(AtomicUsize::new(0)),
        };
        sim.host(name, move || app::serve(setup.clone()));
    }
    for index in 0..CLIENTS {
        sim.client(
            format!("client-{index}"),
            client(shared.clone(), index, seed),
        );
    }
    // Each link's latency is fixed for the run (drawn from the seed): a
    // latency drawn per message would depend on the order in which a
    // crashed host's sockets close, which Tokio does not fix.
    for (i, a) in HOSTS.iter().enumerate() {
        for b in &HOSTS[i + 1..] {
            sim.set_link_latency(*a, *b, Duration::from_millis(rng.random_range(1..40)));
        }
    }
    sim
}

/// Runs seed `seed` to the end and judges it.
pub fn run(seed: u64) -> Outcome {
    let mut rng = StdRng::seed_from_u64(seed);
    let trace: Arc<Mutex<Vec<String>>> = Arc::default();
    let shared = Shared {
        db: Db::new(seed, one_phase(seed).is_some(), trace.clone()),
        downstream: Arc::default(),
        sending: Arc::default(),
        asked: Arc::default(),
        trace,
    };
    let mode = match one_phase(seed) {
        Some(lock) => format!("one phase, lock waits as on {lock:?}"),
        None => "two phases".into(),
    };
    shared.note(format!("transactional mode in {mode}"));
    let mut sim = build(seed, &mut rng, &shared);
    let faults = schedule(&mut rng);
    for (at, fault) in &faults {
        shared
            .trace
            .lock()
            .unwrap()
            .push(format!("{:>6} ms  fault {fault:?}", at.as_millis()));
    }
    let mut pending = faults.into_iter().peekable();
    let mut error = None;
    let mut healed = false;
    loop {
        while let Some((_, fault)) = pending.next_if(|(at, _)| *at <= sim.elapsed()) {
            apply(&mut sim, &shared, &fault);
        }
        if !healed && sim.elapsed() >= FAULTS_END {
            healed = true;
            heal(&mut sim, &shared);
        }
        let settled = healed && {
            let db = shared.db.lock().unwrap();
            db.undelivered() == 0 || (db.stepped_back_ms() > 10_000 && sim.elapsed() > STALLED)
        };
        match sim.step() {
            Ok(true) if settled => break,
            Ok(_) if sim.elapsed() >= SIM_LIMIT => break,
            Ok(_) => {}
            Err(e) => {
                error = Some(e.to_string());
                break;
            }
        }
    }
    shared.db.lock().unwrap().audit_end();
    checks::judge(&shared, sim.elapsed(), error)
}

/// Ends every fault: the network whole, every server up, the store
/// answering, the downstream well.
fn heal(sim: &mut turmoil::Sim<'_>, shared: &Shared) {
    for (i, a) in HOSTS.iter().enumerate() {
        for b in &HOSTS[i + 1..] {
            sim.repair(*a, *b);
        }
    }
    for server in SERVERS {
        if !sim.is_host_running(server) {
            sim.bounce(server);
        }
    }
    apply(sim, shared, &Fault::StoreErrors(0));
    apply(sim, shared, &Fault::Downstream(Mood::Fine));
    shared
        .trace
        .lock()
        .unwrap()
        .push(format!("{:>6} ms  healed", sim.elapsed().as_millis()));
}
