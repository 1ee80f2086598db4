//! The layer's behaviour over real sockets (docs/contract.md §3–§7): an axum app on
//! loopback, a raw HTTP/1.1 client, and counts of the handler's executions.

use crate::common;

use common::charge::user;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use common::{Harness, Raw, eventually, send, serve, until_not_in_flight};
use tokio::sync::Barrier;
use tower_idempotency::problem::types;
use tower_idempotency::store::{
    Claim, ClaimRequest, Completion, FencingToken, MemoryStore, RecordId, SqliteStore, Store,
    StoreError,
};
use tower_idempotency::test_util::ManualClock;
use tower_idempotency::{IdempotencyLayer, StoredResponse};

const START_MS: i64 = 1_800_000_000_000;

/// Counts a run, waits at its gate if asked, answers 201 with fields that a
/// replay must reproduce exactly.
async fn charge(State(h): State<Harness>, headers: HeaderMap) -> Response {
    h.wait_at_gate(&headers).await;
    let n = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
    let mut response = (StatusCode::CREATED, format!("{{\"charge\":{n}}}")).into_response();
    let fields = response.headers_mut();
    fields.insert("content-type", HeaderValue::from_static("application/json"));
    fields.insert(
        "location",
        HeaderValue::from_str(&format!("/charges/{n}")).unwrap(),
    );
    fields.insert("etag", HeaderValue::from_static("\"v1\""));
    fields.append(
        "link",
        HeaderValue::from_static("</charges?page=2>; rel=\"next\""),
    );
    fields.append(
        "link",
        HeaderValue::from_static("</charges?page=9>; rel=\"last\""),
    );
    fields.insert(
        "content-disposition",
        HeaderValue::from_static("attachment; filename=\"a, b.json\""),
    );
    fields.insert("x-raw", HeaderValue::from_bytes(b"caf\xe9 \x80").unwrap());
    fields.insert(
        "set-cookie",
        HeaderValue::from_static("session=secret; HttpOnly"),
    );
    if headers.contains_key("x-forge-marker") {
        fields.insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    response
}

async fn binary(State(h): State<Harness>) -> Response {
    h.runs.fetch_add(1, Ordering::SeqCst);
    (StatusCode::OK, Body::from(&b"\xff\x00\xfe"[..])).into_response()
}

async fn status(State(h): State<Harness>, Path(code): Path<u16>) -> Response {
    let n = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
    (StatusCode::from_u16(code).unwrap(), format!("run {n}")).into_response()
}

async fn big(State(h): State<Harness>) -> Response {
    h.runs.fetch_add(1, Ordering::SeqCst);
    let body: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    body.into_response()
}

async fn panics(State(h): State<Harness>) -> Response {
    if h.runs.fetch_add(1, Ordering::SeqCst) == 0 {
        panic!("the first run of this handler panics");
    }
    (StatusCode::CREATED, "ok").into_response()
}

type Layer<St> = IdempotencyLayer<St, fn(&Parts) -> String>;

fn layer<St: Store>(store: St) -> Layer<St> {
    IdempotencyLayer::new(store, user as fn(&Parts) -> String)
}

fn routes() -> Router<Harness> {
    Router::new()
        .route(
            "/charges",
            post(charge).put(charge).patch(charge).get(charge),
        )
        .route("/other", post(charge))
        .route("/binary", post(binary))
        .route("/status/{code}", post(status))
        .route("/big", post(big))
        .route("/panics", post(panics))
}

async fn start<L>(layer: L) -> (std::net::SocketAddr, Harness)
where
    L: tower::Layer<axum::routing::Route> + Clone + Send + Sync + 'static,
    L::Service: tower::Service<axum::extract::Request> + Clone + Send + Sync + 'static,
    <L::Service as tower::Service<axum::extract::Request>>::Response: IntoResponse + 'static,
    <L::Service as tower::Service<axum::extract::Request>>::Error:
        Into<std::convert::Infallible> + 'static,
    <L::Service as tower::Service<axum::extract::Request>>::Future: Send + 'static,
{
    let harness = Harness::default();
    let app = routes().route_layer(layer).with_state(harness.clone());
    (serve(app).await, harness)
}

async fn post_key(addr: std::net::SocketAddr, path: &str, key: &str, body: &[u8]) -> Raw {
    send(
        addr,
        "POST",
        path,
        &[("idempotency-key", key.as_bytes())],
        body,
    )
    .await
}

/// POST /charges with key `k`, held at the gate `gate` until the test opens it.
fn spawn_gated(addr: std::net::SocketAddr, gate: &'static str) -> tokio::task::JoinHandle<Raw> {
    tokio::spawn(async move {
        send(
            addr,
            "POST",
            "/charges",
            &[("idempotency-key", b"k"), ("x-gate", gate.as_bytes())],
            b"",
        )
        .await
    })
}

fn memory() -> (MemoryStore, ManualClock) {
    let clock = ManualClock::new(START_MS);
    (MemoryStore::with_clock(clock.clone()), clock)
}

// ------------------------------------------------------------ replay

#[tokio::test]
async fn exact_repeat_replays_every_field_and_byte() {
    let (store, _) = memory();
    let (addr, h) = start(layer(store)).await;
    let first = post_key(addr, "/charges", "\"k1\"", b"amount=5").await;
    let again = post_key(addr, "/charges", "\"k1\"", b"amount=5").await;
    assert_eq!(h.runs(), 1);
    assert_eq!((first.status, again.status), (201, 201));
    assert!(!first.replayed());
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(first.body, b"{\"charge\":1}");

    // Every field but Set-Cookie comes back, in order, with its raw bytes.
    let without_cookie: Vec<_> = first
        .stable_headers()
        .into_iter()
        .filter(|(n, _)| n != "set-cookie")
        .collect();
    assert_eq!(again.stable_headers(), without_cookie);
    assert_eq!(
        first.header("set-cookie"),
        Some(&b"session=secret; HttpOnly"[..])
    );
    assert_eq!(again.header("set-cookie"), None);
    let links: Vec<_> = again
        .headers
        .iter()
        .filter(|(n, _)| n == "link")
        .map(|(_, v)| v.clone())
        .collect();
    assert_eq!(
        links,
        [
            b"</charges?page=2>; rel=\"next\"".to_vec(),
            b"</charges?page=9>; rel=\"last\"".to_vec()
        ]
    );
    assert_eq!(
        again.header("content-disposition"),
        Some(&b"attachment; filename=\"a, b.json\""[..])
    );
    assert_eq!(again.header("x-raw"), Some(&b"caf\xe9 \x80"[..]));
    assert_eq!(again.header("location"), Some(&b"/charges/1"[..]));
    assert_eq!(again.header("etag"), Some(&b"\"v1\""[..]));
    assert_eq!(again.header("content-length"), Some(&b"12"[..]));
}

#[tokio::test]
async fn binary_body_replays_exactly() {
    let (store, _) = memory();
    let (addr, h) = start(layer(store)).await;
    let first = post_key(addr, "/binary", "k", b"").await;
    let again = post_key(addr, "/binary", "k", b"").await;
    assert_eq!(first.body, b"\xff\x00\xfe");
    assert_eq!(again.body, b"\xff\x00\xfe");
    assert!(again.replayed());
    assert_eq!(again.header("content-length"), Some(&b"3"[..]));
    assert_eq!(h.runs(), 1);
}

#[tokio::test]
async fn quoted_and_bare_forms_are_one_key() {
    let (store, _) = memory();
    let (addr, h) = start(layer(store)).await;
    let first = post_key(addr, "/charges", "\"order-9\"", b"x").await;
    let again = post_key(addr, "/charges", "order-9", b"x").await;
    assert!(!first.replayed() && again.replayed());
    assert_eq!(h.runs(), 1);
}

#[tokio::test]
async fn a_client_cannot_forge_the_replay_marker() {
    let (store, _) = memory();
    let (addr, h) = start(layer(store)).await;
    let forged_request = send(
        addr,
        "POST",
        "/charges",
        &[("idempotency-key", b"k1"), ("idempotent-replayed", b"true")],
        b"",
    )
    .await;
    assert_eq!(forged_request.status, 201);
    assert!(!forged_request.replayed());
    // Even an inner service that sets the marker cannot mark a first response.
    let forged_response = send(
        addr,
        "POST",
        "/charges",
        &[("idempotency-key", b"k2"), ("x-forge-marker", b"1")],
        b"",
    )
    .await;
    assert_eq!(forged_response.header("idempotent-replayed"), None);
    assert_eq!(h.runs(), 2);
}

// ------------------------------------------------------------ mismatch

#[tokio::test]
async fn same_key_with_other_body_path_or_query_is_422() {
    let (store, _) = memory();
    let (addr, h) = start(layer(store)).await;
    assert_eq!(
        post_key(addr, "/charges?currency=eur", "k", b"amount=5")
            .await
            .status,
        201
    );
    let other_body = post_key(addr, "/charges?currency=eur", "k", b"amount=6").await;
    let other_path = post_key(addr, "/other?currency=eur", "k", b"amount=5").await;
    let other_query = post_key(addr, "/charges?currency=usd", "k", b"amount=5").await;
    for r in [&other_body, &other_path, &other_query] {
        assert_eq!(r.assert_problem(422), types::MISMATCH);
    }
    assert_eq!(h.runs(), 1);
}

#[tokio::test]
async fn keys_of_different_scopes_never_meet() {
    let (store, _) = memory();
    let (addr, h) = start(layer(store)).await;
    let alice = send(
        addr,
        "POST",
        "/charges",
        &[("idempotency-key", b"k"), ("x-user", b"alice")],
        b"",
    )
    .await;
    let bob = send(
        addr,
        "POST",
        "/charges",
        &[("idempotency-key", b"k"), ("x-user", b"bob")],
        b"",
    )
    .await;
    assert!(!alice.replayed() && !bob.replayed());
    assert_eq!(bob.body, b"{\"charge\":2}");
    assert_eq!(h.runs(), 2);
}

// ------------------------------------------------------------ in flight

#[tokio::test]
async fn repeat_while_in_flight_is_409_with_retry_after_and_other_body_is_422() {
    let (store, _) = memory();
    let (addr, h) = start(layer(store).lease(Duration::from_secs(30))).await;
    let mut entered = h.watch();
    let first = tokio::spawn(async move {
        send(
            addr,
            "POST",
            "/charges",
            &[("idempotency-key", b"k"), ("x-gate", b"g")],
            b"a",
        )
        .await
    });
    assert_eq!(entered.recv().await.unwrap(), "g");

    let busy = send(
        addr,
        "POST",
        "/charges",
        &[("idempotency-key", b"k"), ("x-gate", b"g")],
        b"a",
    )
    .await;
    assert_eq!(busy.assert_problem(409), types::IN_FLIGHT);
    let retry_after: u64 = busy.header_str("retry-after").unwrap().parse().unwrap();
    assert!((1..=30).contains(&retry_after), "Retry-After {retry_after}");
    // A different payload is a client error even while the first runs.
    let changed = send(
        addr,
        "POST",
        "/charges",
        &[("idempotency-key", b"k"), ("x-gate", b"g")],
        b"b",
    )
    .await;
    assert_eq!(changed.assert_problem(422), types::MISMATCH);

    h.open("g");
    let first = first.await.unwrap();
    assert_eq!(first.status, 201);
    let replay = send(
        addr,
        "POST",
        "/charges",
        &[("idempotency-key", b"k"), ("x-gate", b"g")],
        b"a",
    )
    .await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(h.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_four_parallel_deliveries_run_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("r.sqlite3"))
        .await
        .unwrap();
    let (addr, h) = start(layer(store)).await;
    let mut entered = h.watch();
    const N: usize = 24;
    let barrier = Arc::new(Barrier::new(N));
    let clients: Vec<_> = (0..N)
        .map(|_| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                barrier.wait().await;
                send(
                    addr,
                    "POST",
                    "/charges",
                    &[("idempotency-key", b"pay-1"), ("x-gate", b"g")],
                    b"5",
                )
                .await
            })
        })
        .collect();
    // One delivery got in; let it finish while the others are still arriving.
    assert_eq!(entered.recv().await.unwrap(), "g");
    h.open("g");
    let mut answers = Vec::new();
    for client in clients {
        answers.push(client.await.unwrap());
    }
    let applied: Vec<_> = answers
        .iter()
        .filter(|r| r.status == 201 && !r.replayed())
        .collect();
    assert_eq!(applied.len(), 1);
    for r in &answers {
        if r.replayed() {
            assert_eq!((r.status, &r.body), (201, &applied[0].body));
        } else if r.status != 201 {
            assert_eq!(r.assert_problem(409), types::IN_FLIGHT);
        }
    }
    assert_eq!(h.runs(), 1, "the handler ran once for {N} deliveries");
}

#[tokio::test]
async fn lease_taken_over_fences_the_first_holder() {
    let (store, clock) = memory();
    let lease = Duration::from_secs(10);
    let (addr, h) = start(layer(store).lease(lease)).await;
    let mut entered = h.watch();
    let first = spawn_gated(addr, "one");
    assert_eq!(entered.recv().await.unwrap(), "one");
    clock.advance(lease + Duration::from_secs(1));
    // The fingerprint covers neither header, so this is the same request.
    let second = tokio::spawn(async move {
        send(
            addr,
            "POST",
            "/charges",
            &[("idempotency-key", b"k"), ("x-gate", b"two")],
            b"",
        )
        .await
    });
    assert_eq!(entered.recv().await.unwrap(), "two");
    h.open("two");
    let second = second.await.unwrap();
    assert_eq!(
        (second.status, &second.body[..]),
        (201, &b"{\"charge\":1}"[..])
    );
    h.open("one");
    let first = first.await.unwrap();
    // The first caller still gets its whole answer...
    assert_eq!(
        (first.status, &first.body[..]),
        (201, &b"{\"charge\":2}"[..])
    );
    // ...but the record keeps the second holder's response.
    let replay = post_key(addr, "/charges", "k", b"").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, second.body);
    assert_eq!(h.runs(), 2);
}

/// The wall clock steps back while a request holds its key (lease 60 s).
/// A small step leaves a lease shorter than one lease: 409 with exactly the
/// seconds left. A step of an hour leaves a deadline further ahead than one
/// lease: the retry takes the key over and runs, instead of meeting 409
/// (`Retry-After: 3659`) for an hour.
#[tokio::test]
async fn a_clock_stepped_back_never_holds_a_key_past_one_lease() {
    let (store, clock) = memory();
    let (addr, h) = start(
        layer(store)
            .lease(Duration::from_secs(60))
            .in_flight_retry_after(Duration::MAX),
    )
    .await;
    let mut entered = h.watch();
    clock.set(START_MS + 3_600_000);
    let first = spawn_gated(addr, "one");
    assert_eq!(entered.recv().await.unwrap(), "one");
    // 30 s on, then 20 s back: 50 s of the lease left.
    clock.set(START_MS + 3_630_000);
    clock.set(START_MS + 3_610_000);
    let busy = post_key(addr, "/charges", "k", b"").await;
    assert_eq!(busy.assert_problem(409), types::IN_FLIGHT);
    assert_eq!(busy.header_str("retry-after"), Some("50"));
    // An hour back: the deadline is 1 h 50 s ahead, past one lease.
    clock.set(START_MS + 10_000);
    let second = tokio::spawn(async move {
        send(
            addr,
            "POST",
            "/charges",
            &[("idempotency-key", b"k"), ("x-gate", b"two")],
            b"",
        )
        .await
    });
    assert_eq!(entered.recv().await.unwrap(), "two");
    h.open("two");
    let second = second.await.unwrap();
    assert_eq!(
        (second.status, &second.body[..]),
        (201, &b"{\"charge\":1}"[..])
    );
    h.open("one");
    assert_eq!(first.await.unwrap().status, 201);
    let replay = post_key(addr, "/charges", "k", b"").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, second.body);
    assert_eq!(h.runs(), 2);
}

/// A store that claims with a lease of 1 h 1 min whatever the layer asks
/// (a store shared with a layer of a longer lease, or one that trusts a
/// deadline the clock stepped back from): it answers 409 with 3659 s left.
#[derive(Clone)]
struct HourLongLease(MemoryStore);

impl Store for HourLongLease {
    async fn claim(&self, mut request: ClaimRequest) -> Result<Claim, StoreError> {
        request.lease = Duration::from_secs(3660);
        self.0.claim(request).await
    }
    async fn complete(
        &self,
        id: RecordId,
        t: FencingToken,
        r: StoredResponse,
    ) -> Result<Completion, StoreError> {
        self.0.complete(id, t, r).await
    }
    async fn release(&self, id: RecordId, t: FencingToken) -> Result<bool, StoreError> {
        self.0.release(id, t).await
    }
    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.0.purge_expired().await
    }

    async fn renew(
        &self,
        id: RecordId,
        token: FencingToken,
        lease: std::time::Duration,
    ) -> Result<bool, StoreError> {
        self.0.renew(id, token, lease).await
    }
}

/// The 409's `Retry-After` is the layer's hint (1 s by default), not the
/// remaining lease, and a configured hint is rounded up to whole seconds.
#[tokio::test]
async fn retry_after_on_409_is_the_configured_hint() {
    for (hint, expected) in [(None, "1"), (Some(Duration::from_millis(4_200)), "5")] {
        let (store, _clock) = memory();
        let layer = layer(store).lease(Duration::from_secs(60));
        let layer = match hint {
            Some(hint) => layer.in_flight_retry_after(hint),
            None => layer,
        };
        let (addr, h) = start(layer).await;
        let mut entered = h.watch();
        let first = spawn_gated(addr, "one");
        assert_eq!(entered.recv().await.unwrap(), "one");
        let busy = post_key(addr, "/charges", "k", b"").await;
        assert_eq!(busy.assert_problem(409), types::IN_FLIGHT);
        assert_eq!(busy.header_str("retry-after"), Some(expected), "{hint:?}");
        h.open("one");
        assert_eq!(first.await.unwrap().status, 201);
        assert_eq!(h.runs(), 1);
    }
}

/// `Retry-After` is never more than the layer's lease (RFC 9110 §10.2.3
/// delay-seconds), whatever lease the store reports left.
#[tokio::test]
async fn retry_after_is_at_most_the_layers_lease() {
    let (store, clock) = memory();
    let (addr, h) = start(
        layer(HourLongLease(store))
            .lease(Duration::from_secs(60))
            .in_flight_retry_after(Duration::MAX),
    )
    .await;
    let mut entered = h.watch();
    let first = spawn_gated(addr, "one");
    assert_eq!(entered.recv().await.unwrap(), "one");
    clock.advance(Duration::from_secs(1));
    let busy = post_key(addr, "/charges", "k", b"").await;
    assert_eq!(busy.assert_problem(409), types::IN_FLIGHT);
    assert_eq!(busy.header_str("retry-after"), Some("60"));
    h.open("one");
    assert_eq!(first.await.unwrap().status, 201);
    assert_eq!(h.runs(), 1);
}

// ------------------------------------------------------------ release

/// A client that goes away mid-handler does not cut the handler from its
/// record: the request finishes, and the retry gets its answer (409 while it
/// runs, the replay once it is stored), never a second run.
#[tokio::test]
async fn a_request_whose_client_left_still_completes_and_is_replayed() {
    let (store, _) = memory();
    let (addr, h) = start(layer(store.clone()).lease(Duration::from_secs(3600))).await;
    let mut entered = h.watch();
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = common::request_bytes(
        "POST",
        "/charges",
        &[("idempotency-key", b"k"), ("x-gate", b"g")],
        b"",
    );
    tokio::io::AsyncWriteExt::write_all(&mut conn, &req)
        .await
        .unwrap();
    assert_eq!(entered.recv().await.unwrap(), "g");
    drop(conn); // the client goes away mid-handler
    let busy = post_key(addr, "/charges", "k", b"").await;
    assert_eq!(busy.assert_problem(409), types::IN_FLIGHT);
    h.open("g");
    let retry = until_not_in_flight(|| post_key(addr, "/charges", "k", b""), |r| r.status).await;
    assert_eq!((retry.status, retry.replayed()), (201, true));
    assert_eq!(retry.body, b"{\"charge\":1}");
    assert_eq!(h.runs(), 1);
}

/// A store whose claim, once made, waits for the test before it answers: a
/// request cancelled in that moment has a record but no one to finish it,
/// unless the layer finishes the request regardless.
#[derive(Clone)]
struct SlowClaimAnswer {
    inner: MemoryStore,
    claimed: Arc<tokio::sync::Notify>,
    answer: Arc<tokio::sync::Semaphore>,
}

impl Store for SlowClaimAnswer {
    async fn claim(&self, request: ClaimRequest) -> Result<Claim, StoreError> {
        let claim = self.inner.claim(request).await;
        if matches!(claim, Ok(Claim::Acquired { .. })) {
            self.claimed.notify_one();
            self.answer.acquire().await.unwrap().forget();
        }
        claim
    }
    async fn complete(
        &self,
        id: RecordId,
        t: FencingToken,
        r: StoredResponse,
    ) -> Result<Completion, StoreError> {
        self.inner.complete(id, t, r).await
    }
    async fn release(&self, id: RecordId, t: FencingToken) -> Result<bool, StoreError> {
        self.inner.release(id, t).await
    }
    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.inner.purge_expired().await
    }

    async fn renew(
        &self,
        id: RecordId,
        token: FencingToken,
        lease: std::time::Duration,
    ) -> Result<bool, StoreError> {
        self.inner.renew(id, token, lease).await
    }
}

/// Cancellation at an exact point (a task aborted while the store has made
/// the claim but not answered), driven through the router without a socket.
#[tokio::test]
async fn a_request_cancelled_during_its_claim_still_runs_once() {
    use tower::ServiceExt;
    let (inner, _) = memory();
    let store = SlowClaimAnswer {
        inner,
        claimed: Arc::default(),
        answer: Arc::new(tokio::sync::Semaphore::new(0)),
    };
    let h = Harness::default();
    let app = routes()
        .route_layer(layer(store.clone()).lease(Duration::from_secs(3600)))
        .with_state(h.clone());
    let request = || {
        http::Request::post("/charges")
            .header("idempotency-key", "k")
            .body(Body::empty())
            .unwrap()
    };
    let first = tokio::spawn(app.clone().oneshot(request()));
    store.claimed.notified().await;
    first.abort(); // cancelled while the claim is made but not yet answered
    assert!(first.await.unwrap_err().is_cancelled());
    store.answer.add_permits(1);
    let retry = until_not_in_flight(
        || async { app.clone().oneshot(request()).await.unwrap() },
        |r| r.status().as_u16(),
    )
    .await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(h.runs(), 1);
}

#[tokio::test]
async fn panicking_handler_releases_the_key_at_once() {
    let (store, _) = memory();
    let (addr, h) = start(layer(store.clone()).lease(Duration::from_secs(3600))).await;
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = common::request_bytes("POST", "/panics", &[("idempotency-key", b"k")], b"");
    tokio::io::AsyncWriteExt::write_all(&mut conn, &req)
        .await
        .unwrap();
    let mut buf = Vec::new();
    let _ = tokio::io::AsyncReadExt::read_to_end(&mut conn, &mut buf).await;
    assert!(buf.is_empty(), "a panicking handler sends no response");
    eventually(Duration::from_secs(10), || store.is_empty()).await;
    let retry = post_key(addr, "/panics", "k", b"").await;
    assert_eq!((retry.status, retry.replayed()), (201, false));
    assert_eq!(h.runs(), 2);
}

#[tokio::test]
async fn server_errors_and_transient_4xx_release_other_4xx_replay() {
    let (store, _) = memory();
    let (addr, h) = start(layer(store)).await;
    for code in ["500", "503", "408", "429"] {
        let path = format!("/status/{code}");
        let key = format!("k{code}");
        let first = post_key(addr, &path, &key, b"").await;
        let retry = post_key(addr, &path, &key, b"").await;
        assert_eq!(first.status.to_string(), code);
        assert!(!retry.replayed(), "{code} must release the key");
    }
    assert_eq!(h.runs(), 8);
    let first = post_key(addr, "/status/404", "k404", b"").await;
    let again = post_key(addr, "/status/404", "k404", b"").await;
    assert_eq!(
        (first.status, again.status, again.replayed()),
        (404, 404, true)
    );
    assert_eq!(again.body, first.body);
    assert_eq!(h.runs(), 9);
}

#[tokio::test]
async fn a_custom_policy_decides_what_is_stored() {
    let (store, _) = memory();
    let only_2xx = |status: StatusCode, _: &HeaderMap| status.is_success();
    let (addr, h) = start(layer(store).store_when(only_2xx)).await;
    post_key(addr, "/status/404", "k", b"").await;
    let retry = post_key(addr, "/status/404", "k", b"").await;
    assert!(!retry.replayed());
    assert_eq!(h.runs(), 2);
}

// ------------------------------------------------------------ store faults

#[tokio::test]
async fn store_locked_past_busy_timeout_is_503_and_nothing_runs() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("r.sqlite3");
    let store = SqliteStore::builder(&path)
        .busy_timeout(Duration::from_millis(100))
        .open()
        .await
        .unwrap();
    let (addr, h) = start(layer(store)).await;
    let locker = rusqlite::Connection::open(&path).unwrap();
    locker.execute_batch("BEGIN EXCLUSIVE").unwrap();
    let r = post_key(addr, "/charges", "k", b"").await;
    assert_eq!(r.assert_problem(503), types::STORE_UNAVAILABLE);
    assert_eq!(r.header_str("retry-after"), Some("1"));
    assert_eq!(h.runs(), 0);
    locker.execute_batch("COMMIT").unwrap();
    let r = post_key(addr, "/charges", "k", b"").await;
    assert_eq!((r.status, r.replayed()), (201, false));
    assert_eq!(h.runs(), 1);
}

/// A store whose claim reports its configuration as invalid.
#[derive(Clone)]
struct Misconfigured;

impl Store for Misconfigured {
    async fn claim(&self, _: ClaimRequest) -> Result<Claim, StoreError> {
        Err(StoreError::config("invalid table name \"bad name;\""))
    }
    async fn complete(
        &self,
        _: RecordId,
        _: FencingToken,
        _: StoredResponse,
    ) -> Result<Completion, StoreError> {
        unreachable!("no claim was ever acquired")
    }
    async fn release(&self, _: RecordId, _: FencingToken) -> Result<bool, StoreError> {
        unreachable!("no claim was ever acquired")
    }
    async fn purge_expired(&self) -> Result<u64, StoreError> {
        Ok(0)
    }

    async fn renew(
        &self,
        id: RecordId,
        token: FencingToken,
        lease: std::time::Duration,
    ) -> Result<bool, StoreError> {
        let _ = (id, token, lease);
        Ok(false)
    }
}

#[tokio::test]
async fn a_misconfigured_store_is_500_without_retry_after_and_nothing_runs() {
    let (addr, h) = start(layer(Misconfigured)).await;
    let r = post_key(addr, "/charges", "k", b"").await;
    assert_eq!(r.assert_problem(500), types::STORE_MISCONFIGURED);
    assert_eq!(r.header_str("retry-after"), None);
    assert_eq!(h.runs(), 0);
}

/// A store whose `complete` always fails, as a full disk would.
#[derive(Clone)]
struct CompleteFails(MemoryStore);

impl Store for CompleteFails {
    async fn claim(&self, request: ClaimRequest) -> Result<Claim, StoreError> {
        self.0.claim(request).await
    }
    async fn complete(
        &self,
        _: RecordId,
        _: FencingToken,
        _: StoredResponse,
    ) -> Result<Completion, StoreError> {
        Err(StoreError::unavailable("disk full"))
    }
    async fn release(&self, id: RecordId, token: FencingToken) -> Result<bool, StoreError> {
        self.0.release(id, token).await
    }
    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.0.purge_expired().await
    }

    async fn renew(
        &self,
        id: RecordId,
        token: FencingToken,
        lease: std::time::Duration,
    ) -> Result<bool, StoreError> {
        self.0.renew(id, token, lease).await
    }
}

#[tokio::test]
async fn failing_to_store_the_response_keeps_the_key_in_flight() {
    let (store, _) = memory();
    let (addr, h) = start(layer(CompleteFails(store.clone())).lease(Duration::from_secs(30))).await;
    let first = post_key(addr, "/charges", "k", b"").await;
    assert_eq!(first.status, 201, "the first caller still gets its answer");
    let repeat = post_key(addr, "/charges", "k", b"").await;
    assert_eq!(repeat.assert_problem(409), types::IN_FLIGHT);
    assert_eq!(h.runs(), 1, "the handler must not run again");
    assert_eq!(
        store.len(),
        1,
        "the record was neither completed nor deleted"
    );
}

// ------------------------------------------------------------ expiry

#[tokio::test]
async fn record_past_its_ttl_runs_as_new() {
    let (store, clock) = memory();
    let ttl = Duration::from_secs(3600);
    let (addr, h) = start(layer(store).ttl(ttl)).await;
    post_key(addr, "/charges", "k", b"").await;
    clock.advance(ttl - Duration::from_secs(1));
    assert!(post_key(addr, "/charges", "k", b"").await.replayed());
    clock.advance(Duration::from_secs(1));
    let fresh = post_key(addr, "/charges", "k", b"").await;
    assert_eq!((fresh.status, fresh.replayed()), (201, false));
    assert_eq!(h.runs(), 2);
}

// ------------------------------------------------------------ keys

#[tokio::test]
async fn requests_without_a_key_are_never_deduplicated() {
    let (store, _) = memory();
    let (addr, h) = start(layer(store.clone())).await;
    let one = send(addr, "POST", "/charges", &[], b"same").await;
    let two = send(addr, "POST", "/charges", &[], b"same").await;
    assert!(!one.replayed() && !two.replayed());
    assert_eq!(h.runs(), 2);
    assert!(store.is_empty());
}

#[tokio::test]
async fn invalid_keys_are_400_before_the_store_is_touched() {
    let (store, _) = memory();
    let (addr, h) = start(layer(store.clone()).require_key(true)).await;
    let long = vec![b'a'; 256];
    type Fields<'a> = Vec<(&'a str, &'a [u8])>;
    let cases: Vec<(&str, Fields)> = vec![
        ("missing", vec![]),
        ("empty sf-string", vec![("idempotency-key", b"\"\"")]),
        ("256 characters", vec![("idempotency-key", &long)]),
        ("non-ASCII", vec![("idempotency-key", b"k\xff\xfe")]),
        ("sf-list", vec![("idempotency-key", b"\"a\", \"b\"")]),
        ("unterminated", vec![("idempotency-key", b"\"abc")]),
        ("bad escape", vec![("idempotency-key", b"\"a\\x\"")]),
        ("parameters", vec![("idempotency-key", b"\"a\";p=1")]),
        (
            "two fields",
            vec![("idempotency-key", b"one"), ("idempotency-key", b"two")],
        ),
    ];
    for (label, headers) in cases {
        let r = send(addr, "POST", "/charges", &headers, b"").await;
        let expected = if label == "missing" {
            types::MISSING_KEY
        } else {
            types::INVALID_KEY
        };
        assert_eq!(r.assert_problem(400), expected, "{label}");
    }
    assert_eq!(h.runs(), 0);
    assert!(store.is_empty());
    let ok = send(
        addr,
        "POST",
        "/charges",
        &[("idempotency-key", &[b'a'; 255])],
        b"",
    )
    .await;
    assert_eq!(ok.status, 201);
}

#[tokio::test]
async fn only_post_and_patch_are_intercepted_by_default() {
    let (store, _) = memory();
    let (addr, h) = start(layer(store.clone()).require_key(true)).await;
    for method in ["GET", "PUT"] {
        let one = send(addr, method, "/charges", &[("idempotency-key", b"k")], b"").await;
        let two = send(addr, method, "/charges", &[("idempotency-key", b"k")], b"").await;
        assert!(!one.replayed() && !two.replayed(), "{method}");
        // Not intercepted, so a missing key is no error either.
        assert_eq!(send(addr, method, "/charges", &[], b"").await.status, 201);
    }
    assert!(store.is_empty());
    assert_eq!(h.runs(), 6);
    send(addr, "PATCH", "/charges", &[("idempotency-key", b"k")], b"").await;
    assert!(
        send(addr, "PATCH", "/charges", &[("idempotency-key", b"k")], b"")
            .await
            .replayed()
    );
    assert_eq!(h.runs(), 7);
}

#[tokio::test]
async fn the_key_header_name_and_methods_are_configurable() {
    let (store, _) = memory();
    let layer = layer(store)
        .header_name(http::HeaderName::from_static("webhook-id"))
        .methods([http::Method::PUT]);
    let (addr, h) = start(layer).await;
    send(addr, "PUT", "/charges", &[("webhook-id", b"msg_1")], b"").await;
    assert!(
        send(addr, "PUT", "/charges", &[("webhook-id", b"msg_1")], b"")
            .await
            .replayed()
    );
    assert!(
        !send(addr, "POST", "/charges", &[("webhook-id", b"msg_1")], b"")
            .await
            .replayed()
    );
    assert_eq!(h.runs(), 2);
}

// ------------------------------------------------------------ limits

#[tokio::test]
async fn oversized_request_body_is_413_and_leaves_no_record() {
    let (store, _) = memory();
    let (addr, h) = start(layer(store.clone()).max_request_body(1024)).await;
    let r = post_key(addr, "/charges", "k", &[b'x'; 1025]).await;
    assert_eq!(r.assert_problem(413), types::BODY_TOO_LARGE);
    // A chunked body has no length up front: it is cut off at the limit.
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut req = b"POST /charges HTTP/1.1\r\nhost: t\r\nconnection: close\r\nidempotency-key: k\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
    for _ in 0..3 {
        req.extend_from_slice(b"200\r\n");
        req.extend_from_slice(&[b'y'; 512]);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"0\r\n\r\n");
    tokio::io::AsyncWriteExt::write_all(&mut conn, &req)
        .await
        .unwrap();
    let mut buf = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut conn, &mut buf)
        .await
        .unwrap();
    assert_eq!(
        common::parse_response(&buf).unwrap().assert_problem(413),
        types::BODY_TOO_LARGE
    );
    assert_eq!(h.runs(), 0);
    assert!(store.is_empty());
    let ok = post_key(addr, "/charges", "k", &[b'x'; 1024]).await;
    assert_eq!((ok.status, ok.replayed()), (201, false));
}

#[tokio::test]
async fn oversized_response_reaches_the_first_caller_whole_and_is_never_rerun() {
    let (store, _) = memory();
    let (addr, h) = start(layer(store).max_response_body(1024)).await;
    let first = post_key(addr, "/big", "k", b"").await;
    let expected: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(first.status, 200);
    assert_eq!(first.body, expected);
    let repeat = post_key(addr, "/big", "k", b"").await;
    assert_eq!(repeat.assert_problem(410), types::RESPONSE_NOT_STORED);
    assert_eq!(h.runs(), 1);
}

// ------------------------------------------------------------ options

#[tokio::test]
async fn rejections_can_be_answered_differently() {
    let (store, _) = memory();
    let layer = layer(store).require_key(true).on_rejection(|rejection| {
        let mut r =
            http::Response::new(bytes::Bytes::from(format!("nope: {}", rejection.status())));
        *r.status_mut() = rejection.status();
        r
    });
    let (addr, _) = start(layer).await;
    let r = send(addr, "POST", "/charges", &[], b"").await;
    assert_eq!(
        (r.status, &r.body[..]),
        (400, &b"nope: 400 Bad Request"[..])
    );
}

#[tokio::test]
async fn json_fingerprint_ignores_key_order() {
    let (store, _) = memory();
    let layer = layer(store).fingerprint(tower_idempotency::fingerprint::JsonFingerprinter::new());
    let (addr, h) = start(layer).await;
    post_key(addr, "/charges", "k", br#"{"amount":5,"to":"bob"}"#).await;
    assert!(
        post_key(addr, "/charges", "k", b"{ \"to\": \"bob\", \"amount\": 5 }")
            .await
            .replayed()
    );
    assert_eq!(
        post_key(addr, "/charges", "k", br#"{"amount":6,"to":"bob"}"#)
            .await
            .assert_problem(422),
        types::MISMATCH
    );
    let not_json = post_key(addr, "/charges", "k2", b"{oops").await;
    assert_eq!(not_json.assert_problem(400), types::UNREADABLE_BODY);
    assert_eq!(h.runs(), 1);
}

#[tokio::test]
async fn get_route_is_untouched() {
    let (store, _) = memory();
    let app = Router::new()
        .route("/ping", get(|| async { "pong" }))
        .route_layer(layer(store.clone()));
    let addr = serve(app).await;
    let r = send(addr, "GET", "/ping", &[("idempotency-key", b"k")], b"").await;
    assert_eq!((r.status, &r.body[..]), (200, &b"pong"[..]));
    assert!(store.is_empty());
}
