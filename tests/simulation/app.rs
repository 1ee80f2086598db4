//! An app server host: the real `IdempotencyLayer`, in transactional mode
//! with lease renewal, around a credit handler written as the ledger's
//! (the credit and its notification in the request's transaction), and
//! the real outbox `Relay` with its `HttpSink`. The store it talks to is
//! the store host, over the simulated network: [`SimStore`] implements
//! `Store` and the kit's `TwoPhase` (so the shared two-phase lifecycle
//! that PostgreSQL and MySQL use runs here unchanged), [`SimQueue`] the
//! outbox's `Queue`.
//!
//! In one-phase worlds (issue 37; [`LockWait`]) `SimStore` claims as the
//! PostgreSQL and MySQL stores do by default: through the kit's
//! `one_phase`, inside the handler's transaction, on a session of its own
//! ([`claim_inside`]); the kit's `HeldKeys` answers this server's repeats.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::http::{Request, Response, StatusCode};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tower::Layer;
use tower_idempotency::key::ClaimedKey;
use tower_idempotency::store::kit::held::HeldKeys;
use tower_idempotency::store::kit::two_phase::{Held, Inside, TwoPhase, two_phase_store};
use tower_idempotency::store::{
    Claim, ClaimRequest, Completion, FencingToken, RecordId, Refusal, Store, StoreError,
};
use tower_idempotency::{IdempotencyLayer, RequestBody, StoredResponse, scope};
use tower_idempotency_outbox::test_util::{BoxFut, Claimed, Fate, Queue};
use tower_idempotency_outbox::{Counts, Entry, HttpSink, Message, Outbox, View};

use crate::http::SimClient;
use crate::wire::{
    self, Call, ClaimArgs, Credit, Id, Msg, Reply, Session, WireClaim, WireFate, WireInside,
};

/// The layer's lease, and how long renewal may hold a key.
pub const LEASE: Duration = Duration::from_secs(1);
pub const MAX_HOLD: Duration = Duration::from_secs(6);
/// The relay's lease: above its attempt (1 s) plus a store call (0.4 s).
pub const RELAY_LEASE: Duration = Duration::from_secs(2);
/// Where the handler's notification goes.
pub const DOWNSTREAM: &str = "http://downstream/credits";

fn id(record: &RecordId) -> Id {
    Id {
        scope: record.scope().to_owned(),
        key: record.key().to_owned(),
    }
}

fn bad_reply(reply: Reply) -> StoreError {
    StoreError::Corrupt(format!("unexpected reply {reply:?}"))
}

/// How the fleet's database bounds a claim's wait on another open
/// transaction's claim (one phase).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockWait {
    /// `lock_timeout`: whole milliseconds, at least 1.
    Postgres,
    /// `innodb_lock_wait_timeout`: whole seconds, rounded up, at least 1.
    MySql,
}

impl LockWait {
    fn bound(self, wait: Duration) -> Duration {
        match self {
            LockWait::Postgres => Duration::from_millis((wait.as_millis() as u64).max(1)),
            LockWait::MySql => {
                let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
                Duration::from_secs(secs.max(1))
            }
        }
    }
}

/// The store host's records, over the simulated network.
#[derive(Clone, Default)]
pub struct SimStore {
    held_too_long: Arc<AtomicU64>,
    /// One phase: the keys this server's open transactions hold (the kit's
    /// `one_phase` reads this field); `None`: the claim commits first.
    one_phase: Option<Arc<HeldKeys>>,
    /// One phase: how the database bounds a lock wait.
    lock_wait: Option<LockWait>,
    /// This server's name, as its claims tell the store host's audit.
    server: &'static str,
}

fn claim_args(request: &ClaimRequest) -> ClaimArgs {
    ClaimArgs {
        id: Id {
            scope: request.scope.clone(),
            key: request.key.clone(),
        },
        fingerprint: request.fingerprint.0.to_vec(),
        token: request.token.0,
        lease_ms: request.lease.as_millis() as u64,
        ttl_ms: request.ttl.as_millis() as u64,
        max_hold_ms: request.max_hold.map(|d| d.as_millis() as u64),
    }
}

fn claim_answer(claim: WireClaim) -> Result<Claim, StoreError> {
    match claim {
        WireClaim::Acquired { taken_over } => Ok(Claim::Acquired { taken_over }),
        WireClaim::Mismatch => Ok(Refusal::Mismatch.into()),
        WireClaim::Completed(bytes) => StoredResponse::decode(&bytes)
            .map(|r| Refusal::Completed(r).into())
            .map_err(|e| StoreError::Corrupt(e.to_string())),
        WireClaim::InFlight { remaining_ms } => Ok(Refusal::InFlight {
            lease_remaining: Duration::from_millis(remaining_ms),
        }
        .into()),
    }
}

impl Store for SimStore {
    async fn claim(&self, request: ClaimRequest) -> Result<Claim, StoreError> {
        match wire::call(&Call::Claim(claim_args(&request))).await? {
            Reply::Claim(claim) => claim_answer(claim),
            other => Err(bad_reply(other)),
        }
    }

    async fn complete(
        &self,
        record: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        let call = Call::Complete {
            id: id(&record),
            token: token.0,
            response: response.encode(),
        };
        match wire::call(&call).await? {
            Reply::Bool(true) => Ok(Completion::Stored),
            Reply::Bool(false) => Ok(Completion::Fenced),
            other => Err(bad_reply(other)),
        }
    }

    async fn release(&self, record: RecordId, token: FencingToken) -> Result<bool, StoreError> {
        let call = Call::Release {
            id: id(&record),
            token: token.0,
        };
        match wire::call(&call).await? {
            Reply::Bool(released) => Ok(released),
            other => Err(bad_reply(other)),
        }
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        match wire::call(&Call::Purge).await? {
            Reply::Count(n) => Ok(n),
            other => Err(bad_reply(other)),
        }
    }

    async fn renew(
        &self,
        record: RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let call = Call::Renew {
            id: id(&record),
            token: token.0,
            lease_ms: lease.as_millis() as u64,
        };
        match wire::call(&call).await? {
            Reply::Bool(renewed) => Ok(renewed),
            other => Err(bad_reply(other)),
        }
    }
}

/// The handler's open transaction: its writes, sent with the completion
/// in one call that the store host applies atomically (the commit point).
#[derive(Default)]
pub struct SimTx {
    credits: Vec<Credit>,
    messages: Vec<Msg>,
    /// One phase: the session whose open transaction holds the claim.
    session: Option<Session>,
}

/// [`TwoPhase::claim_inside`]: on a session of its own, the transaction
/// opened, then the claim inside it, its wait bounded as the fleet's
/// database bounds it. Refused or busy, the session is closed: the store
/// rolls back its transaction, which holds nothing.
async fn claim_inside(
    store: &SimStore,
    hold: Duration,
    req: &ClaimRequest,
    wait: Duration,
) -> Result<Inside<SimStore>, StoreError> {
    let wait = store.lock_wait.unwrap_or(LockWait::Postgres).bound(wait);
    let begin = Call::Begin {
        hold_ms: hold.as_millis() as u64,
    };
    let claim = Call::ClaimWaiting {
        claim: claim_args(req),
        wait_ms: wait.as_millis() as u64,
        server: store.server.to_owned(),
    };
    let mut session = Session::open().await?;
    session.call(&begin, wire::CALL_TIMEOUT).await?;
    let claimed = session.call(&claim, wire::CALL_TIMEOUT + wait).await?;
    match claimed {
        Reply::Inside(WireInside::Claimed { taken_over }) => Ok(Inside::Claimed {
            tx: SimTx {
                session: Some(session),
                ..SimTx::default()
            },
            cancel: (),
            taken_over,
        }),
        Reply::Inside(WireInside::Busy) => Ok(Inside::Busy),
        Reply::Inside(WireInside::Refused(refused)) => match claim_answer(refused)? {
            Claim::Refused(refusal) => Ok(Inside::Refused(refusal)),
            Claim::Acquired { .. } => Err(StoreError::Corrupt("refused as acquired".into())),
        },
        other => Err(bad_reply(other)),
    }
}

impl TwoPhase for SimStore {
    type Tx = SimTx;
    type Cancel = ();
    const DROP_WITHOUT_RUNTIME: bool = true;

    fn held_too_long(&self) -> &AtomicU64 {
        &self.held_too_long
    }

    tower_idempotency::store::kit::one_phase::claims_inside!(claim_inside);

    async fn begin(&self, _hold: Duration) -> Result<(SimTx, ()), StoreError> {
        Ok((SimTx::default(), ()))
    }

    async fn cancel(&self, _: &()) -> Result<(), StoreError> {
        Ok(())
    }

    async fn complete_in(
        &self,
        tx: &mut SimTx,
        record: &RecordId,
        token: FencingToken,
        response: &StoredResponse,
    ) -> Result<bool, StoreError> {
        let call = Call::Commit {
            id: id(record),
            token: token.0,
            response: response.encode(),
            credits: std::mem::take(&mut tx.credits),
            messages: std::mem::take(&mut tx.messages),
        };
        let reply = match tx.session.as_mut() {
            None => wire::call(&call).await,
            Some(session) => session.call(&call, wire::CALL_TIMEOUT).await,
        };
        if reply.is_err() {
            // Its outcome unknown: the session is closed, and the store
            // rolls back a transaction still open on it.
            tx.session = None;
        }
        match reply? {
            Reply::Bool(committed) => Ok(committed),
            other => Err(bad_reply(other)),
        }
    }

    async fn commit_tx(_: SimTx) -> Result<(), StoreError> {
        Ok(())
    }

    async fn roll_back_tx(tx: SimTx) {
        if let Some(mut session) = tx.session {
            // Unanswered, the session is closed: the store rolls back then.
            let _ = session.call(&Call::Rollback, wire::CALL_TIMEOUT).await;
        }
    }
}

/// The transaction handed to the handler.
#[derive(Clone)]
pub struct SimTransaction {
    held: Held<SimStore>,
}

two_phase_store!(SimStore, SimTransaction);

/// The outbox table on the store host.
pub struct SimQueue;

fn queue_call(call: Call) -> BoxFut<'static, Result<Reply, StoreError>> {
    Box::pin(async move { wire::call(&call).await })
}

impl Queue for SimQueue {
    fn claim(
        &self,
        _owner: &str,
        limit: usize,
        lease: Duration,
    ) -> BoxFut<'_, Result<Vec<Claimed>, StoreError>> {
        let lease_ms = lease.as_millis() as u64;
        Box::pin(async move {
            let Reply::Claimed(rows) = queue_call(Call::OutboxClaim { limit, lease_ms }).await?
            else {
                return Err(StoreError::Corrupt("unexpected reply".into()));
            };
            let claimed = rows.into_iter().map(|row| {
                let m = row.message;
                let message = Message::with_key(m.key, m.destination, m.content_type, m.payload)
                    .map_err(|e| StoreError::Corrupt(e.to_string()))?;
                Ok(Claimed {
                    id: row.id,
                    attempt: row.attempt,
                    lease_until_ms: row.lease_until_ms,
                    message,
                })
            });
            claimed.collect()
        })
    }

    fn finish(
        &self,
        id: i64,
        attempt: u32,
        lease_until_ms: i64,
        fate: Fate,
    ) -> BoxFut<'_, Result<bool, StoreError>> {
        let fate = match fate {
            Fate::Done => WireFate::Done,
            Fate::Retry { after, .. } => WireFate::Retry {
                after_ms: after.as_millis() as u64,
            },
            Fate::Dead { .. } => WireFate::Dead,
        };
        let call = Call::OutboxFinish {
            id,
            attempt,
            lease_until_ms,
            fate,
        };
        Box::pin(async move {
            match queue_call(call).await? {
                Reply::Bool(done) => Ok(done),
                other => Err(bad_reply(other)),
            }
        })
    }

    fn purge(&self, _: Duration, _: usize) -> BoxFut<'_, Result<u64, StoreError>> {
        Box::pin(async { Ok(0) })
    }

    fn list(&self, _: View, _: usize) -> BoxFut<'_, Result<Vec<Entry>, StoreError>> {
        Box::pin(async { Ok(Vec::new()) })
    }

    fn requeue(&self, _: i64) -> BoxFut<'_, Result<bool, StoreError>> {
        Box::pin(async { Ok(false) })
    }

    fn counts(&self) -> BoxFut<'_, Result<Counts, StoreError>> {
        Box::pin(async { Ok(Counts::default()) })
    }
}

/// Deliveries under way, by message key, across every relay: two at once
/// for one key would be two relays sending one message while both leases
/// hold.
#[derive(Default)]
pub struct Sending {
    pub now: BTreeMap<String, usize>,
    /// (key, when, in ms of simulated time)
    pub overlaps: Vec<(String, u64)>,
}

struct SendingGuard(Arc<Mutex<Sending>>, String);

impl Drop for SendingGuard {
    fn drop(&mut self) {
        let mut sending = self.0.lock().unwrap();
        if let Some(n) = sending.now.get_mut(&self.1) {
            *n -= 1;
        }
    }
}

/// What a server needs that outlives its crashes.
#[derive(Clone)]
pub struct ServerSetup {
    pub name: &'static str,
    pub wait_in_flight: bool,
    /// One phase (issue 37), with the database's lock-wait bound; `None`:
    /// the claim commits first.
    pub one_phase: Option<LockWait>,
    pub sending: Arc<Mutex<Sending>>,
    /// How many times this host's software has started.
    pub boots: Arc<AtomicUsize>,
}

/// The ledger's credit: `{"account": "...", "amount": N}` credits the
/// account and enqueues its notification, both in the request's
/// transaction; answers 201 with the credit and where it ran.
async fn credit(
    server: String,
    credits: Arc<AtomicU64>,
    req: Request<RequestBody<hyper::body::Incoming>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let answer = |status: StatusCode, body: String| {
        let mut response = Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() = status;
        Ok(response)
    };
    let (parts, body) = req.into_parts();
    let (Some(tx), Some(claimed)) = (
        parts.extensions.get::<SimTransaction>().cloned(),
        parts.extensions.get::<ClaimedKey>().cloned(),
    ) else {
        return answer(StatusCode::BAD_REQUEST, "a key is required".into());
    };
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
        return answer(StatusCode::BAD_REQUEST, "unreadable body".into());
    };
    let Ok(parsed) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return answer(StatusCode::BAD_REQUEST, "not JSON".into());
    };
    let (Some(account), Some(amount)) = (parsed["account"].as_str(), parsed["amount"].as_i64())
    else {
        return answer(StatusCode::BAD_REQUEST, "account and amount".into());
    };
    // The work takes a while; some credits outlive a lease (renewed).
    let work_ms = u64::from(body.iter().map(|&b| u32::from(b)).sum::<u32>() % 7) * 250;
    tokio::time::sleep(Duration::from_millis(work_ms)).await;
    // The credit's id, as a ledger row's would be: a run elsewhere, or
    // again, makes another.
    let n = credits.fetch_add(1, Ordering::SeqCst) + 1;
    let payload = format!(r#"{{"account":"{account}","amount":{amount},"credit":"{server}/{n}"}}"#);
    let Ok(message) = Message::new(&claimed, 0, DOWNSTREAM, "application/json", payload.clone())
    else {
        return answer(StatusCode::INTERNAL_SERVER_ERROR, "message".into());
    };
    let msg = Msg {
        key: message.key().to_owned(),
        destination: message.destination().to_owned(),
        content_type: message.content_type().to_owned(),
        payload: message.payload().to_vec(),
    };
    let write = async {
        let mut tx = tx.held.lock(|tx| tx).await?;
        tx.credits.push(Credit {
            account: account.to_owned(),
            amount,
        });
        tx.messages.push(msg);
        Ok::<_, StoreError>(())
    };
    if write.await.is_err() {
        return answer(StatusCode::SERVICE_UNAVAILABLE, "transaction over".into());
    }
    answer(StatusCode::CREATED, payload)
}

/// The server host's software (started again after each crash).
pub async fn serve(setup: ServerSetup) -> turmoil::Result {
    let boot = setup.boots.fetch_add(1, Ordering::SeqCst) + 1;
    let who = format!("{}/{boot}", setup.name);
    let credits = Arc::new(AtomicU64::new(0));
    let sending = setup.sending.clone();
    let sink = tower_idempotency_outbox::from_fn(move |delivery| {
        let sending = sending.clone();
        async move {
            let key = delivery.key.clone();
            {
                let mut s = sending.lock().unwrap();
                let n = s.now.entry(key.clone()).or_default();
                *n += 1;
                if *n > 1 {
                    let at = turmoil::sim_elapsed().unwrap_or_default().as_millis() as u64;
                    s.overlaps.push((key.clone(), at));
                }
            }
            let _guard = SendingGuard(sending, key);
            tower_idempotency_outbox::Sink::deliver(&HttpSink::new(SimClient), delivery).await
        }
    });
    let outbox = Outbox::from_queue(SimQueue);
    let _relay = outbox
        .relay(sink)
        .lease(RELAY_LEASE)
        .answer_timeout(Duration::from_secs(1))
        .poll_interval(Duration::from_millis(100))
        // One fixed delay: the relay's jitter would make a run differ
        // between two runs of one seed.
        .backoff(Duration::from_millis(200), Duration::from_millis(200))
        .max_attempts(None)
        .spawn();
    let store = SimStore {
        one_phase: setup.one_phase.map(|_| Arc::default()),
        lock_wait: setup.one_phase,
        server: setup.name,
        ..SimStore::default()
    };
    let mut layer = IdempotencyLayer::new(store, scope::header("x-user-id"))
        .require_key(true)
        .lease(LEASE)
        .max_hold(MAX_HOLD);
    if setup.wait_in_flight {
        layer = layer.wait_in_flight(Duration::from_millis(1500));
    }
    let handler = tower::service_fn(move |req| credit(who.clone(), credits.clone(), req));
    let service = layer.transactional().layer(handler);
    let listener = turmoil::net::TcpListener::bind(("0.0.0.0", 80)).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        let service = TowerToHyperService::new(service.clone());
        tokio::spawn(async move {
            let connection = hyper::server::conn::http1::Builder::new();
            let _ = connection
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
