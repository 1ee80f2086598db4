//! The outbox tests' downstream: a real HTTP service behind our own
//! `IdempotencyLayer`, which counts the effects it applies per key and logs
//! every attempt, and whose answers a test scripts (fail before the handler,
//! or apply the effect and then lose the answer).

#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::{Next, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
#[cfg(feature = "sqlite")]
use std::path::Path;
use tower_idempotency::key::ClaimedKey;
use tower_idempotency::{IdempotencyLayer, MemoryStore};
use tower_idempotency_outbox::HttpSink;
#[cfg(feature = "sqlite")]
use tower_idempotency_outbox::{self as outbox, Message};

/// What the downstream does with one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// The layer and the handler run.
    Pass,
    /// Answered with this status before the layer: no effect.
    FailBefore(u16),
    /// The layer and the handler run (the effect is applied and recorded),
    /// then the answer is replaced by this status: a lost answer.
    FailAfter(u16),
}

/// `(key, body, n)` -> the answer, where `n` counts the earlier attempts
/// with that key.
pub type Script = Arc<dyn Fn(&str, &[u8], usize) -> Answer + Send + Sync>;

/// One attempt the downstream received.
#[derive(Debug, Clone)]
pub struct Attempt {
    pub key: String,
    pub body: Vec<u8>,
    pub relay: Option<String>,
    pub status: u16,
}

#[derive(Default)]
struct Log {
    attempts: Vec<Attempt>,
    effects: HashMap<String, usize>,
    in_flight: HashMap<String, usize>,
    /// The most attempts with one key under way at once.
    max_overlap: usize,
}

#[derive(Clone)]
pub struct Downstream {
    pub addr: SocketAddr,
    log: Arc<Mutex<Log>>,
    script: Arc<Mutex<Script>>,
    /// How long each attempt takes before it is answered.
    hold: Duration,
}

#[derive(Clone)]
struct Shared {
    log: Arc<Mutex<Log>>,
    script: Arc<Mutex<Script>>,
    hold: Duration,
}

impl Downstream {
    pub async fn start(script: Script, hold: Duration) -> Downstream {
        let log = Arc::new(Mutex::new(Log::default()));
        let script = Arc::new(Mutex::new(script));
        let shared = Shared {
            log: log.clone(),
            script: script.clone(),
            hold,
        };
        let layer = IdempotencyLayer::new(MemoryStore::new(), |_: &axum::http::request::Parts| {
            "relay".to_owned()
        })
        .require_key(true);
        let app = Router::new()
            .route("/notify", post(apply))
            .route_layer(layer)
            .layer(from_fn_with_state(shared.clone(), record))
            .with_state(shared);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Downstream {
            addr,
            log,
            script,
            hold,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}/notify", self.addr)
    }

    pub fn set_script(&self, script: Script) {
        *self.script.lock().unwrap() = script;
    }

    pub fn attempts(&self) -> Vec<Attempt> {
        self.log.lock().unwrap().attempts.clone()
    }

    /// Attempts per key.
    pub fn attempts_of(&self, key: &str) -> usize {
        self.log
            .lock()
            .unwrap()
            .attempts
            .iter()
            .filter(|a| a.key == key)
            .count()
    }

    /// Effects applied per key.
    pub fn effects(&self) -> HashMap<String, usize> {
        self.log.lock().unwrap().effects.clone()
    }

    pub fn max_overlap(&self) -> usize {
        self.log.lock().unwrap().max_overlap
    }
}

/// The effect: counted once per applied request (the layer replays repeats).
async fn apply(State(shared): State<Shared>, claimed: ClaimedKey) -> Response {
    *shared
        .log
        .lock()
        .unwrap()
        .effects
        .entry(claimed.key().to_owned())
        .or_default() += 1;
    StatusCode::CREATED.into_response()
}

/// Logs each attempt, tracks overlapping attempts per key, applies the script.
async fn record(State(shared): State<Shared>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let raw_key = parts
        .headers
        .get("idempotency-key")
        .map(|v| v.to_str().unwrap_or("").to_owned());
    let relay = parts
        .headers
        .get("x-relay")
        .map(|v| v.to_str().unwrap_or("").to_owned());
    let key = raw_key
        .as_deref()
        .and_then(|k| k.strip_prefix('"')?.strip_suffix('"'))
        .unwrap_or("")
        .to_owned();
    let body: Bytes = axum::body::to_bytes(body, 1 << 20)
        .await
        .unwrap_or_default();
    let answer = {
        let mut log = shared.log.lock().unwrap();
        let n = log.attempts.iter().filter(|a| a.key == key).count()
            + log.in_flight.get(&key).copied().unwrap_or(0);
        let overlap = {
            let c = log.in_flight.entry(key.clone()).or_default();
            *c += 1;
            *c
        };
        log.max_overlap = log.max_overlap.max(overlap);
        let script = shared.script.lock().unwrap().clone();
        script(&key, &body, n)
    };
    // An attempt ends when its future ends, answered or dropped: a relay that
    // gives up on an attempt (its answer timeout) drops the connection, and
    // the server then drops this future. Counting only answered attempts as
    // ended would leave a dropped one "in flight" for ever.
    let mut in_flight = InFlight {
        log: Arc::clone(&shared.log),
        key: Some(key.clone()),
    };
    if !shared.hold.is_zero() {
        tokio::time::sleep(shared.hold).await;
    }
    let response = match answer {
        Answer::FailBefore(status) => StatusCode::from_u16(status).unwrap().into_response(),
        Answer::Pass | Answer::FailAfter(_) => {
            let inner = next
                .run(Request::from_parts(parts, Body::from(body.clone())))
                .await;
            match answer {
                Answer::FailAfter(status) => {
                    // Read the answer through, so the layer records it, then lose it.
                    let _ = axum::body::to_bytes(inner.into_body(), 1 << 20).await;
                    StatusCode::from_u16(status).unwrap().into_response()
                }
                _ => inner,
            }
        }
    };
    in_flight.end();
    let mut log = shared.log.lock().unwrap();
    log.attempts.push(Attempt {
        key,
        body: body.to_vec(),
        relay,
        status: response.status().as_u16(),
    });
    response
}

/// One attempt under way at the downstream, until [`InFlight::end`] or drop.
struct InFlight {
    log: Arc<Mutex<Log>>,
    key: Option<String>,
}

impl InFlight {
    fn end(&mut self) {
        if let Some(key) = self.key.take() {
            let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(c) = log.in_flight.get_mut(&key) {
                *c -= 1;
            }
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.end();
    }
}

/// Polls `condition` every 10 ms until it holds; panics after `limit`.
pub async fn until(limit: Duration, what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {limit:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Like [`until`], for a condition that needs an `await`.
pub async fn until_async<F, Fut>(limit: Duration, what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while !condition().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {limit:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub const WAIT: Duration = Duration::from_secs(20);

pub fn http_sink()
-> HttpSink<Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>> {
    HttpSink::new(Client::builder(TokioExecutor::new()).build_http())
}

pub fn script(f: impl Fn(&str, &[u8], usize) -> Answer + Send + Sync + 'static) -> Script {
    Arc::new(f)
}

/// Enqueues `messages` (key, body) in one transaction of a connection of its own.
#[cfg(feature = "sqlite")]
pub fn enqueue_direct(db: &Path, url: &str, messages: &[(&str, &str)]) {
    let mut conn = rusqlite_conn(db);
    let tx = conn.transaction().unwrap();
    for (key, body) in messages {
        let m = Message::with_key(*key, url, "application/json", body.as_bytes().to_vec()).unwrap();
        assert!(outbox::sqlite::enqueue(&tx, &m).unwrap());
    }
    tx.commit().unwrap();
}

#[cfg(feature = "sqlite")]
pub fn rusqlite_conn(db: &Path) -> tower_idempotency::rusqlite::Connection {
    let conn = tower_idempotency::rusqlite::Connection::open(db).unwrap();
    conn.busy_timeout(Duration::from_secs(5)).unwrap();
    conn
}
