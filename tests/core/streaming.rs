//! Streamed first responses (server-sent events, long bodies): in separate
//! mode each frame reaches the first caller as the inner service produces
//! it, the layer records the body as it passes and completes the record at
//! the end; a caller that leaves mid-stream stops the stream. Transactional
//! mode commits before it answers, so it buffers, unless the policy declines
//! the response. Over a real hyper server and client on loopback, and with
//! tower's `oneshot` where the body is driven by hand.

use crate::common;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::sync::{mpsc, oneshot};
use tower::{Layer, Service, ServiceExt};
use tower_idempotency::problem::types;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::{
    Claim, ClaimRequest, Completion, FencingToken, Inspect, RecordId, Store, StoreError,
};
use tower_idempotency::test_util::ManualClock;
use tower_idempotency::{IdempotencyLayer, MemoryStore, ResponseBody, SqliteStore, StoredResponse};

/// Bound on every wait in these tests (a failure, not a measurement).
const BOUND: Duration = Duration::from_secs(10);

async fn bounded<F: std::future::Future>(what: &str, future: F) -> F::Output {
    tokio::time::timeout(BOUND, future)
        .await
        .unwrap_or_else(|_| panic!("{what}: not within {BOUND:?}"))
}

// ------------------------------------------------------------ the handler

/// A response body fed frame by frame by the test through a channel. Ends
/// when the test drops its sender; tells the test when it is dropped.
struct ChannelBody {
    frames: mpsc::Receiver<Frame<Bytes>>,
    _dropped: Option<oneshot::Sender<()>>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.frames.poll_recv(cx).map(|frame| frame.map(Ok))
    }
}

/// The test's end of one [`ChannelBody`].
struct Feed {
    frames: mpsc::Sender<Frame<Bytes>>,
    /// Resolves (with `Err`) when the inner body has been dropped.
    dropped: oneshot::Receiver<()>,
}

impl Feed {
    async fn data(&self, bytes: &'static [u8]) {
        bounded(
            "frame accepted",
            self.frames.send(Frame::data(Bytes::from_static(bytes))),
        )
        .await
        .expect("the inner body is alive");
    }
}

/// The inner service: counts its runs and answers 200 `text/event-stream`
/// (or `content_type`) with the body the test prepared; a run without a
/// prepared body gets an empty one.
#[derive(Clone)]
struct Events {
    runs: Arc<AtomicUsize>,
    next: Arc<Mutex<Option<ChannelBody>>>,
    gate: Arc<Mutex<Option<Gate>>>,
    content_type: &'static str,
}

/// Holds the next run inside the handler, before its response head, until
/// the test opens it.
struct Gate {
    entered: oneshot::Sender<()>,
    open: oneshot::Receiver<()>,
}

impl Events {
    fn new(content_type: &'static str) -> Self {
        Events {
            runs: Arc::default(),
            next: Arc::default(),
            gate: Arc::default(),
            content_type,
        }
    }

    /// Prepares the body of the next run and returns its feed.
    fn prepare(&self) -> Feed {
        let (tx, rx) = mpsc::channel(16);
        let (dropped_tx, dropped_rx) = oneshot::channel();
        *self.next.lock().unwrap() = Some(ChannelBody {
            frames: rx,
            _dropped: Some(dropped_tx),
        });
        Feed {
            frames: tx,
            dropped: dropped_rx,
        }
    }

    /// Holds the next run at a gate: returns the signal that it was entered
    /// and the sender that opens it.
    fn gate(&self) -> (oneshot::Receiver<()>, oneshot::Sender<()>) {
        let (entered_tx, entered_rx) = oneshot::channel();
        let (open_tx, open_rx) = oneshot::channel();
        *self.gate.lock().unwrap() = Some(Gate {
            entered: entered_tx,
            open: open_rx,
        });
        (entered_rx, open_tx)
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

impl<B> Service<Request<B>> for Events {
    type Response = Response<ChannelBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ChannelBody>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _req: Request<B>) -> Self::Future {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let body = self.next.lock().unwrap().take().unwrap_or_else(|| {
            let (_, frames) = mpsc::channel(1);
            ChannelBody {
                frames,
                _dropped: None,
            }
        });
        let mut response = Response::new(body);
        let headers = response.headers_mut();
        headers.insert("content-type", HeaderValue::from_static(self.content_type));
        headers.insert("cache-control", HeaderValue::from_static("no-cache"));
        headers.append("link", HeaderValue::from_static("</a>; rel=\"next\""));
        headers.append("link", HeaderValue::from_static("</b>; rel=\"last\""));
        let gate = self.gate.lock().unwrap().take();
        Box::pin(async move {
            if let Some(gate) = gate {
                let _ = gate.entered.send(());
                bounded("the gate opened", gate.open).await.unwrap();
            }
            Ok(response)
        })
    }
}

// ------------------------------------------------------------ server and client

/// Serves `service` over HTTP/1.1 on a free loopback port.
async fn serve<S>(service: S) -> SocketAddr
where
    S: Service<
            Request<Incoming>,
            Response = Response<ResponseBody<ChannelBody>>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let service = TowerToHyperService::new(service.clone());
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// One client connection with a request on it.
struct Call {
    response: Response<Incoming>,
    connection: tokio::task::JoinHandle<()>,
}

/// POSTs to `/events` with `key` on a fresh connection; returns once the
/// response head has arrived.
async fn post(addr: SocketAddr, key: &str) -> Call {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    let connection = tokio::spawn(async move {
        let _ = connection.await;
    });
    let request = Request::post("/events")
        .header("host", "test")
        .header("idempotency-key", key)
        .body(Full::new(Bytes::from_static(b"subscribe")))
        .unwrap();
    let response = bounded("response head", sender.send_request(request))
        .await
        .unwrap();
    Call {
        response,
        connection,
    }
}

impl Call {
    /// The next data frame's bytes (`None` at the end of the body).
    async fn next_data(&mut self) -> Option<Bytes> {
        loop {
            let frame = bounded("next frame", self.response.body_mut().frame()).await?;
            if let Ok(data) = frame.unwrap().into_data() {
                return Some(data);
            }
        }
    }

    /// The rest of the body.
    async fn rest(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        while let Some(data) = self.next_data().await {
            out.extend_from_slice(&data);
        }
        out
    }

    /// The head fields that do not depend on framing or replay.
    fn stable_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.response
            .headers()
            .iter()
            .filter(|(name, _)| {
                !matches!(
                    name.as_str(),
                    "date" | "transfer-encoding" | "content-length" | "idempotent-replayed"
                )
            })
            .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
            .collect()
    }

    fn replayed(&self) -> bool {
        self.response.headers().get("idempotent-replayed")
            == Some(&HeaderValue::from_static("true"))
    }
}

/// Repeats `key` while it is answered 409 (its first is still finishing),
/// for at most 10 s; returns the status and body of the answer.
async fn repeat(addr: SocketAddr, key: &str) -> (Call, Vec<u8>) {
    let deadline = tokio::time::Instant::now() + BOUND;
    loop {
        let mut call = post(addr, key).await;
        let body = call.rest().await;
        if call.response.status() != StatusCode::CONFLICT || tokio::time::Instant::now() >= deadline
        {
            return (call, body);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn problem_type(status: StatusCode, call: &Call, body: &[u8]) -> String {
    assert_eq!(call.response.status(), status);
    assert_eq!(
        call.response.headers()["content-type"],
        "application/problem+json"
    );
    let doc: serde_json::Value = serde_json::from_slice(body).unwrap();
    assert_eq!(doc["status"], status.as_u16());
    doc["type"].as_str().unwrap().to_owned()
}

// ------------------------------------------------------------ separate mode

#[tokio::test]
async fn frames_reach_the_first_caller_while_the_stream_is_open() {
    let events = Events::new("text/event-stream");
    let addr =
        serve(IdempotencyLayer::new(MemoryStore::new(), GlobalScope).layer(events.clone())).await;
    let feed = events.prepare();
    feed.data(b"data: one\n\n").await;

    let started = Instant::now();
    let mut call = post(addr, "sse-1").await;
    let head_after = started.elapsed();
    let first = call.next_data().await;
    let first_after = started.elapsed();
    // The test still holds the body's sender: the stream cannot have ended.
    assert!(!feed.frames.is_closed());
    assert_eq!(first.as_deref(), Some(&b"data: one\n\n"[..]));
    println!("time to head: {head_after:?}; time to first frame: {first_after:?}");

    assert_eq!(call.response.status(), StatusCode::OK);
    assert_eq!(call.response.headers()["content-type"], "text/event-stream");
    feed.data(b"data: two\n\n").await;
    assert_eq!(
        call.next_data().await.as_deref(),
        Some(&b"data: two\n\n"[..])
    );
    drop(feed.frames);
    assert_eq!(call.next_data().await, None);
    assert_eq!(events.runs(), 1);
}

#[tokio::test]
async fn a_completed_stream_is_replayed_byte_for_byte() {
    let events = Events::new("text/event-stream");
    let addr =
        serve(IdempotencyLayer::new(MemoryStore::new(), GlobalScope).layer(events.clone())).await;
    let feed = events.prepare();
    let mut first = post(addr, "sse-2").await;
    let frames: [&'static [u8]; 3] = [
        b"id: 1\ndata: a\n\n",
        b"id: 2\ndata: \xff\x00\n\n",
        b": end\n\n",
    ];
    for frame in frames {
        feed.data(frame).await;
        assert_eq!(first.next_data().await.as_deref(), Some(frame));
    }
    drop(feed.frames);
    assert_eq!(first.next_data().await, None);
    assert!(!first.replayed());

    // At once: the stream ended for its caller only after the record was complete.
    let mut again = post(addr, "sse-2").await;
    let body = again.rest().await;
    assert_eq!(again.response.status(), StatusCode::OK);
    assert!(again.replayed());
    assert_eq!(body, frames.concat());
    assert_eq!(again.response.headers()["content-length"], "38");
    assert_eq!(again.stable_headers(), first.stable_headers());
    assert_eq!(
        again
            .stable_headers()
            .iter()
            .filter(|(n, _)| n == "link")
            .count(),
        2
    );
    assert_eq!(events.runs(), 1);
}

#[tokio::test]
async fn a_streamed_body_with_trailers_is_replayed_with_them() {
    let events = Events::new("application/grpc");
    let service = IdempotencyLayer::new(MemoryStore::new(), GlobalScope).layer(events.clone());
    let request = || {
        Request::post("/events")
            .header("idempotency-key", "grpc-1")
            .body(Full::new(Bytes::from_static(b"call")))
            .unwrap()
    };
    let feed = events.prepare();
    let first = bounded("head", service.clone().oneshot(request()))
        .await
        .unwrap();
    let mut body = first.into_body();
    feed.data(b"\x00\x00\x00\x00\x02hi").await;
    let frame = bounded("frame", body.frame()).await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), &b"\x00\x00\x00\x00\x02hi"[..]);
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    trailers.insert("grpc-message", HeaderValue::from_static("ok"));
    bounded(
        "trailers accepted",
        feed.frames.send(Frame::trailers(trailers.clone())),
    )
    .await
    .unwrap();
    let frame = bounded("trailers", body.frame()).await.unwrap().unwrap();
    assert_eq!(frame.into_trailers().unwrap(), trailers);

    let again = bounded("replay", service.clone().oneshot(request()))
        .await
        .unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let collected = bounded("replay body", again.into_body().collect())
        .await
        .unwrap();
    assert_eq!(collected.trailers(), Some(&trailers));
    assert_eq!(collected.to_bytes(), &b"\x00\x00\x00\x00\x02hi"[..]);
    assert_eq!(events.runs(), 1);
}

#[tokio::test]
async fn a_stream_over_the_limit_reaches_its_caller_whole_and_repeats_get_410() {
    let events = Events::new("text/event-stream");
    let layer = IdempotencyLayer::new(MemoryStore::new(), GlobalScope).max_response_body(16);
    let addr = serve(layer.layer(events.clone())).await;
    let feed = events.prepare();
    let mut first = post(addr, "sse-3").await;
    let frames: [&'static [u8]; 4] = [b"data: 0123\n\n", b"data: 4567\n\n", b"data: 89\n\n", b"x"];
    for frame in frames {
        feed.data(frame).await;
        assert_eq!(first.next_data().await.as_deref(), Some(frame));
    }
    drop(feed.frames);
    assert_eq!(first.next_data().await, None);

    let (again, body) = repeat(addr, "sse-3").await;
    assert_eq!(
        problem_type(StatusCode::GONE, &again, &body),
        types::RESPONSE_NOT_STORED
    );
    assert_eq!(events.runs(), 1);
}

#[tokio::test]
async fn a_client_leaving_mid_stream_stops_the_stream() {
    let events = Events::new("text/event-stream");
    let store = MemoryStore::new();
    let addr = serve(IdempotencyLayer::new(store.clone(), GlobalScope).layer(events.clone())).await;
    let mut feed = events.prepare();
    let mut first = post(addr, "sse-4").await;
    feed.data(b"data: one\n\n").await;
    assert_eq!(
        first.next_data().await.as_deref(),
        Some(&b"data: one\n\n"[..])
    );

    // The client goes away: its connection closes.
    first.connection.abort();
    drop(first);
    // hyper notices a closed connection when it writes to it: keep the
    // stream producing until the inner body is dropped.
    let dropped = bounded("the inner body dropped", async {
        loop {
            let sent = tokio::select! {
                dropped = &mut feed.dropped => return dropped,
                sent = feed.frames.send(Frame::data(Bytes::from_static(b": ping\n\n"))) => sent,
            };
            if sent.is_err() {
                // The receiver is gone: the body was dropped.
                return (&mut feed.dropped).await;
            }
        }
    })
    .await;
    dropped.expect_err("the inner body is dropped, never completed");
    // Nothing can read the stream any more: its receiver is gone.
    assert!(feed.frames.is_closed());

    let (again, body) = repeat(addr, "sse-4").await;
    assert_eq!(
        problem_type(StatusCode::GONE, &again, &body),
        types::RESPONSE_NOT_STORED
    );
    assert_eq!(events.runs(), 1);
}

#[tokio::test]
async fn a_dropped_body_drops_the_inner_body_at_once() {
    let events = Events::new("text/event-stream");
    let service = IdempotencyLayer::new(MemoryStore::new(), GlobalScope).layer(events.clone());
    let request = || {
        Request::post("/events")
            .header("idempotency-key", "sse-5")
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let mut feed = events.prepare();
    let first = bounded("head", service.clone().oneshot(request()))
        .await
        .unwrap();
    let mut body = first.into_body();
    feed.data(b"data: one\n\n").await;
    let frame = bounded("frame", body.frame()).await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), &b"data: one\n\n"[..]);
    drop(body);
    bounded("the drop signal", &mut feed.dropped)
        .await
        .expect_err("the inner body is dropped, never completed");
    assert!(feed.frames.is_closed());

    let again = common::until_not_in_flight(
        || async { service.clone().oneshot(request()).await.unwrap() },
        |r| r.status().as_u16(),
    )
    .await;
    assert_eq!(again.status(), StatusCode::GONE);
    let body = again.into_body().collect().await.unwrap().to_bytes();
    let doc: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(doc["type"], types::RESPONSE_NOT_STORED);
    assert_eq!(events.runs(), 1);
}

/// A [`MemoryStore`] whose completions fail, as a full disk would; counts them.
#[derive(Clone, Default)]
struct FailingCompletion {
    inner: MemoryStore,
    completions: Arc<AtomicUsize>,
}

impl Store for FailingCompletion {
    async fn claim(&self, request: ClaimRequest) -> Result<Claim, StoreError> {
        self.inner.claim(request).await
    }

    async fn complete(
        &self,
        _id: RecordId,
        _token: FencingToken,
        _response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        self.completions.fetch_add(1, Ordering::SeqCst);
        Err(StoreError::unavailable("disk full"))
    }

    async fn release(&self, id: RecordId, token: FencingToken) -> Result<bool, StoreError> {
        self.inner.release(id, token).await
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

#[tokio::test]
async fn a_store_error_after_the_stream_leaves_the_key_in_flight() {
    let events = Events::new("text/event-stream");
    let store = FailingCompletion::default();
    let layer = IdempotencyLayer::new(store.clone(), GlobalScope).lease(Duration::from_secs(60));
    let addr = serve(layer.layer(events.clone())).await;
    let feed = events.prepare();
    let mut first = post(addr, "sse-8").await;
    feed.data(b"data: one\n\n").await;
    assert_eq!(
        first.next_data().await.as_deref(),
        Some(&b"data: one\n\n"[..])
    );
    drop(feed.frames);
    // The caller has its bytes and a clean end, whatever the store said.
    assert_eq!(first.next_data().await, None);
    assert_eq!(store.completions.load(Ordering::SeqCst), 1);

    // The key stays in flight until its lease ends.
    let mut again = post(addr, "sse-8").await;
    let body = again.rest().await;
    assert_eq!(
        problem_type(StatusCode::CONFLICT, &again, &body),
        types::IN_FLIGHT
    );
    let counts = store.inner.counts().await.unwrap();
    assert_eq!((counts.in_flight, counts.completed), (1, 0));
    assert_eq!(events.runs(), 1);
}

#[tokio::test]
async fn a_client_leaving_before_the_head_still_runs_the_handler_but_not_the_stream() {
    let events = Events::new("text/event-stream");
    let service = IdempotencyLayer::new(MemoryStore::new(), GlobalScope).layer(events.clone());
    let request = || {
        Request::post("/events")
            .header("idempotency-key", "sse-9")
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let mut feed = events.prepare();
    feed.data(b"data: ready at once\n\n").await;
    let (entered, open) = events.gate();
    let first = tokio::spawn(service.clone().oneshot(request()));
    bounded("the handler entered", entered).await.unwrap();
    // The client goes away while the handler runs: its response future is dropped.
    first.abort();
    assert!(
        bounded("the abort", first)
            .await
            .unwrap_err()
            .is_cancelled()
    );
    open.send(()).unwrap();

    // The handler answers in a task of its own; nobody reads the stream, so
    // its body is dropped and never read to an end.
    bounded("the drop signal", &mut feed.dropped)
        .await
        .expect_err("the inner body is dropped, never completed");
    assert!(feed.frames.is_closed());
    assert_eq!(events.runs(), 1);
    let again = common::until_not_in_flight(
        || async { service.clone().oneshot(request()).await.unwrap() },
        |r| r.status().as_u16(),
    )
    .await;
    assert_eq!(again.status(), StatusCode::GONE);
    assert_eq!(events.runs(), 1);
}

#[tokio::test]
async fn a_stream_outliving_its_lease_is_recorded_as_not_stored() {
    let events = Events::new("text/event-stream");
    // The store's clock stands still, so no repeat can take the key over:
    // only the layer sees the lease (100 ms) end, renewed no further than
    // a max hold of one lease.
    let store = MemoryStore::with_clock(ManualClock::new(1_800_000_000_000));
    let hold = Duration::from_millis(100);
    let layer = IdempotencyLayer::new(store, GlobalScope)
        .lease(hold)
        .max_hold(hold);
    let service = layer.layer(events.clone());
    let request = || {
        Request::post("/events")
            .header("idempotency-key", "sse-10")
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let feed = events.prepare();
    let first = bounded("head", service.clone().oneshot(request()))
        .await
        .unwrap();
    let mut body = first.into_body();
    feed.data(b"data: one\n\n").await;
    let frame = bounded("frame", body.frame()).await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), &b"data: one\n\n"[..]);

    // Repeats get 409 until the lease ends for the layer, then 410.
    let again = common::until_not_in_flight(
        || async { service.clone().oneshot(request()).await.unwrap() },
        |r| r.status().as_u16(),
    )
    .await;
    assert_eq!(again.status(), StatusCode::GONE);

    // The first caller's stream goes on to its end.
    feed.data(b"data: two\n\n").await;
    let frame = bounded("frame", body.frame()).await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), &b"data: two\n\n"[..]);
    drop(feed.frames);
    assert!(bounded("end", body.frame()).await.is_none());
    assert_eq!(events.runs(), 1);
}

/// A stream still running near its lease's end is recorded as not stored a
/// margin before the store sees the lease end (a tenth of the lease, at most
/// 5 s), so a repeat arriving as the store's lease ends gets 410 and never
/// takes the key over to run the handler beside the live stream. Tokio's
/// clock is paused and moved by hand, with the store's clock, so the order
/// of the two is exact. The max hold is one lease, so renewal keeps the
/// lease's end where it is.
#[tokio::test(start_paused = true)]
async fn a_stream_is_recorded_not_stored_before_the_store_sees_its_lease_end() {
    let events = Events::new("text/event-stream");
    let clock = ManualClock::new(1_800_000_000_000);
    let store = MemoryStore::with_clock(clock.clone());
    let layer = IdempotencyLayer::new(store.clone(), GlobalScope)
        .lease(Duration::from_secs(10))
        .max_hold(Duration::from_secs(10));
    let service = layer.layer(events.clone());
    let request = || {
        Request::post("/events")
            .header("idempotency-key", "sse-margin")
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let feed = events.prepare();
    let first = service.clone().oneshot(request()).await.unwrap();
    let mut body = first.into_body();
    feed.data(b"data: one\n\n").await;
    let frame = body.frame().await.unwrap().unwrap();
    assert_eq!(frame.into_data().unwrap(), &b"data: one\n\n"[..]);

    // 8.999 s in: still in flight for both clocks. The store's clock moves
    // first, so the renewal the layer sends meanwhile is judged at 8.999 s,
    // as with clocks that move together (it extends to the max hold, 10 s).
    clock.advance(Duration::from_millis(8_999));
    tokio::time::advance(Duration::from_millis(8_999)).await;
    let early = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(early.status(), StatusCode::CONFLICT);

    // 9.001 s in: past the layer's deadline (10 s less 1 s); the record is
    // completed as not stored by the recording task.
    tokio::time::advance(Duration::from_millis(2)).await;
    let mut completed = false;
    for _ in 0..1_000 {
        if store.counts().await.unwrap().completed == 1 {
            completed = true;
            break;
        }
        tokio::task::yield_now().await;
    }
    assert!(
        completed,
        "the record was not completed before the lease's end"
    );

    // The store's clock reaches the lease end: a repeat gets 410, not a run.
    clock.advance(Duration::from_millis(1_000));
    let repeat = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(repeat.status(), StatusCode::GONE);
    assert_eq!(events.runs(), 1);
    drop(feed.frames);
    drop(body);
}

// ------------------------------------------------------------ store_when

/// A policy that lets event streams through: they are neither stored nor
/// buffered, and the key is given back.
fn not_event_streams(status: StatusCode, headers: &HeaderMap) -> bool {
    status.is_success()
        && headers
            .get("content-type")
            .is_none_or(|v| v != "text/event-stream")
}

async fn declined_streams_pass_through<S>(service: S, events: &Events)
where
    S: Service<
            Request<Incoming>,
            Response = Response<ResponseBody<ChannelBody>>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let addr = serve(service).await;
    for run in 1..=2 {
        let feed = events.prepare();
        feed.data(b"data: one\n\n").await;
        let mut call = post(addr, "sse-6").await;
        assert_eq!(
            call.next_data().await.as_deref(),
            Some(&b"data: one\n\n"[..])
        );
        assert!(!feed.frames.is_closed());
        drop(feed.frames);
        assert_eq!(call.next_data().await, None);
        assert!(!call.replayed());
        // The key was given back: the next request with it runs again.
        assert_eq!(events.runs(), run);
    }
}

#[tokio::test]
async fn a_declined_stream_passes_through_in_separate_mode() {
    let events = Events::new("text/event-stream");
    let layer =
        IdempotencyLayer::new(MemoryStore::new(), GlobalScope).store_when(not_event_streams);
    declined_streams_pass_through(layer.layer(events.clone()), &events).await;
}

// ------------------------------------------------------------ transactional mode

#[tokio::test]
async fn a_declined_stream_passes_through_in_transactional_mode() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("t.sqlite3"))
        .await
        .unwrap();
    let events = Events::new("text/event-stream");
    let layer = IdempotencyLayer::new(store, GlobalScope)
        .transactional()
        .store_when(not_event_streams);
    declined_streams_pass_through(layer.layer(events.clone()), &events).await;
}

#[tokio::test]
async fn transactional_mode_commits_a_stream_before_it_answers() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("t.sqlite3"))
        .await
        .unwrap();
    let events = Events::new("text/event-stream");
    let layer = IdempotencyLayer::new(store.clone(), GlobalScope).transactional();
    let addr = serve(layer.layer(events.clone())).await;
    let feed = events.prepare();
    feed.data(b"data: one\n\n").await;
    feed.data(b"data: two\n\n").await;
    let first = tokio::spawn(async move {
        let mut call = post(addr, "sse-7").await;
        // When the head arrives, the record has committed.
        let counts = store.counts().await.unwrap();
        let body = call.rest().await;
        (call, counts, body)
    });
    drop(feed.frames);
    let (first, counts, body) = bounded("first response", first).await.unwrap();
    assert_eq!((counts.in_flight, counts.completed), (0, 1));
    assert_eq!(first.response.status(), StatusCode::OK);
    assert_eq!(body, b"data: one\n\ndata: two\n\n");
    // Buffered: the whole body in one response with its length.
    assert_eq!(first.response.headers()["content-length"], "22");

    let mut again = post(addr, "sse-7").await;
    assert_eq!(again.rest().await, b"data: one\n\ndata: two\n\n");
    assert!(again.replayed());
    assert_eq!(events.runs(), 1);
}

/// Transactional mode must commit before it answers, so it buffers; a
/// stream that outlives its transaction (rolled back past the store's max
/// hold time) is answered 503 as soon as the transaction ends, not when (or
/// if) the stream does, and nothing of it is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transactional_stream_past_the_max_hold_is_answered_503_when_it_ends() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::builder(dir.path().join("t.sqlite3"))
        .open()
        .await
        .unwrap();
    let events = Events::new("text/event-stream");
    let layer = IdempotencyLayer::new(store.clone(), GlobalScope)
        .max_hold(Duration::from_millis(200))
        .transactional();
    let service = layer.layer(events.clone());
    // A stream that sends one event and then never ends.
    let feed = events.prepare();
    feed.data(b"data: one\n\n").await;
    let request = Request::post("/events")
        .header("idempotency-key", "sse-held")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let answer = bounded("the answer after the max hold", service.oneshot(request))
        .await
        .unwrap();
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.headers()["retry-after"], "1");
    assert_eq!(answer.headers()["content-type"], "application/problem+json");
    assert_eq!(store.transactions_held_too_long(), 1);
    let counts = store.counts().await.unwrap();
    assert_eq!((counts.in_flight, counts.completed), (0, 0));
    assert_eq!(events.runs(), 1);
    drop(feed.frames);
}
