//! A gRPC payments service (tonic) behind `IdempotencyLayer`: a charge whose
//! answer was lost is retried with the same key, runs once, and every retry
//! gets the first answer.
//!
//! ```text
//! cargo run --example grpc --features client -- [--listen ADDR]   # serve, default 127.0.0.1:50051
//! cargo run --example grpc --features client -- charge [--to URL] [--key KEY] [--caller NAME] ACCOUNT AMOUNT_CENTS
//! ```
//!
//! `tests/core/grpc.rs` includes this file and drives it with a real tonic client
//! over HTTP/2. With the server running:
//!
//! ```text
//! $ cargo run -q --example grpc --features client -- charge --key k1 --caller alice acct-1 500
//! ChargeReply { charge_id: "ch_1", account: "acct-1", amount_cents: 500 }
//! $ cargo run -q --example grpc --features client -- charge --key k1 --caller alice acct-1 500
//! ChargeReply { charge_id: "ch_1", account: "acct-1", amount_cents: 500 } (replayed)
//! $ cargo run -q --example grpc --features client -- charge --key k1 --caller alice acct-1 700
//! FailedPrecondition: this idempotency key was first used with a different method, path, query or body; use a new key for a new operation
//! $ cargo run -q --example grpc --features client -- charge --key k2 --caller alice unavailable 100
//! Unavailable: the payment provider is unavailable; nothing was charged
//! $ cargo run -q --example grpc --features client -- charge --key k2 --caller alice unavailable 100
//! Unavailable: the payment provider is unavailable; nothing was charged
//! ```
//!
//! (The second `unavailable` call ran again: `UNAVAILABLE` released the key.)
//!
//! # The service, without protoc
//!
//! The messages are hand-written prost types and the server and client are
//! written against tonic's low-level API (`tonic::server::Grpc` with a
//! `UnaryService`, `tonic::client::Grpc`, `tonic_prost::ProstCodec`): what
//! `tonic-build` would generate from
//!
//! ```proto
//! syntax = "proto3";
//! package payments;
//! service Payments { rpc Charge(ChargeRequest) returns (ChargeReply); }
//! message ChargeRequest { string account = 1; int64 amount_cents = 2; }
//! message ChargeReply { string charge_id = 1; string account = 2; int64 amount_cents = 3; }
//! ```
//!
//! `Charge` counts its executions and answers a new `charge_id` each time it
//! runs; `amount_cents <= 0` answers `INVALID_ARGUMENT`, and the account
//! `unavailable` answers `UNAVAILABLE` (a provider outage: nothing was
//! charged, retry).
//!
//! # Keys and scope
//!
//! The key is the `idempotency-key` metadata entry (gRPC metadata are HTTP/2
//! header fields, and that is the layer's default field). `Charge` requires
//! one (`require_key(true)`). Keys belong to the caller named by the `x-caller`
//! metadata entry, `anonymous` without it: put your authenticated principal
//! there instead. The layer sits on the `payments.Payments` service only
//! ([`idempotent_payments`]), so other services on the same server (health,
//! reflection) see no key requirement.
//!
//! The default fingerprint covers the method, the path (`/payments.Payments/Charge`,
//! so another RPC with the same key is a mismatch) and the request body: the
//! gRPC frame, i.e. the compression flag and the protobuf bytes. A retry from
//! the same client sends the same bytes; a client that compresses one attempt
//! and not the next, or another protobuf library that orders fields
//! differently, gets a mismatch. Decode the message in a custom
//! `Fingerprinter` if your clients may do that.
//!
//! # Rejections as gRPC statuses: [`grpc_rejection`]
//!
//! The layer's own answers would be `application/problem+json` with a 4xx or
//! 5xx, from which a gRPC client can only guess a code from the HTTP status
//! (tonic: 400 becomes `INTERNAL`, 409, 410, 413 and 422 `UNKNOWN`), and the
//! problem's text is lost. [`grpc_rejection`] answers each with a
//! "Trailers-Only" response (HTTP 200, `content-type: application/grpc`,
//! `grpc-status` and `grpc-message` in the headers, no body), exactly what
//! tonic sends for a handler's `Err(Status)`:
//!
//! | rejection | HTTP default | gRPC | why |
//! |---|---|---|---|
//! | `MissingKey`, `InvalidKey` | 400 | `INVALID_ARGUMENT` | the request is malformed whatever the server's state |
//! | `UnreadableBody` | 400 | `INVALID_ARGUMENT` | the same: the body could not be read or fingerprinted |
//! | `BodyTooLarge` | 413 | `RESOURCE_EXHAUSTED` | what gRPC itself answers for a message over the receive limit |
//! | `Mismatch` | 422 | `FAILED_PRECONDITION` | see below |
//! | `InFlight` | 409 | `UNAVAILABLE` + `grpc-retry-pushback-ms` | see below |
//! | `StoreUnavailable` | 503 | `UNAVAILABLE` + `grpc-retry-pushback-ms` | nothing ran; retry the same call with the same key |
//! | `StoreFull` | 503 | `UNAVAILABLE` + `grpc-retry-pushback-ms` | the store has no room for a new key; nothing ran; retry later with the same key |
//! | `ResponseNotStored` | 410 | `ALREADY_EXISTS` | see below |
//!
//! **In flight: `UNAVAILABLE`, not `ABORTED`.** The client must retry this
//! very call, with the same key, after a delay; the retry then gets the
//! stored answer. gRPC's status-code guide says exactly that: "use
//! UNAVAILABLE if the client can retry just the failing call; use ABORTED if
//! the client should retry at a higher level (e.g. restart a
//! read-modify-write sequence)". Retrying at a higher level here would mean a
//! new key, i.e. a second charge. It is also the code that retry
//! configurations retry: the usual `retryableStatusCodes` of a gRPC service
//! config (gRFC A6) and the default retry settings of Google's client
//! libraries list `UNAVAILABLE`, while `ABORTED` appears only for some APIs.
//! tonic's client does not retry by itself; a `tower::retry` policy written
//! for it would test for `UNAVAILABLE` in any case. The delay travels as
//! `grpc-retry-pushback-ms` (gRFC
//! A6 server pushback, honoured by grpc-java, grpc-go and grpc-core when a
//! retry policy is set; in a Trailers-Only response the headers are the
//! trailers), in whole seconds as the HTTP answer's `Retry-After`: what is
//! left of the first request's lease, which is an upper bound (the first
//! request usually answers sooner; shorten it here if your handler is fast).
//! A server that is down also answers `UNAVAILABLE`; both mean "retry the
//! same call", so the client needs no special case.
//!
//! **Mismatch: `FAILED_PRECONDITION`, not `INVALID_ARGUMENT`.** The request is
//! valid on its own and would run with a fresh key; it is refused because of
//! the server's state (the key is bound to another request). That is
//! `FAILED_PRECONDITION` ("the system is not in a state required for the
//! operation's execution; do not retry until the state is fixed", here: use a
//! new key), while `INVALID_ARGUMENT` is for arguments that are wrong
//! "regardless of the state of the system". It also keeps a reused key apart
//! from a malformed key and from the handler's own `INVALID_ARGUMENT`.
//!
//! **Response not stored: `ALREADY_EXISTS`.** The call with this key already
//! ran to completion and will not run again, but its answer (larger than the
//! layer's `max_response_body`) was not kept. `ALREADY_EXISTS` says "done
//! before, do not retry" and is distinct from the mismatch and from every
//! retryable code; `DATA_LOSS` would suggest corruption, `NOT_FOUND` that the
//! key is unknown.
//!
//! **No principal: `UNAUTHENTICATED`.** The scope found no caller in the
//! request (see `tower_idempotency::scope`): the call did not run; the client
//! authenticates and calls again with the same key.
//!
//! # Which answers are stored: [`GrpcStorePolicy`]
//!
//! gRPC answers errors with HTTP 200: `DefaultStorePolicy`, which looks at the
//! HTTP status, would store an `UNAVAILABLE` and replay it to every retry, so
//! the retry would never run. [`GrpcStorePolicy`] also reads `grpc-status`,
//! from the response head and then from the trailers, and releases the key on
//! the codes that say "nothing
//! happened, try again" (`UNAVAILABLE`, `DEADLINE_EXCEEDED`,
//! `RESOURCE_EXHAUSTED`, `ABORTED`, `CANCELLED`, `UNKNOWN`, `INTERNAL`,
//! `UNIMPLEMENTED`, `DATA_LOSS`: the gRPC codes whose HTTP equivalents the
//! default policy releases, plus `ABORTED` and `CANCELLED`). Answer those only
//! when nothing was done. Considered answers (`OK`, `INVALID_ARGUMENT`,
//! `NOT_FOUND`, `ALREADY_EXISTS`, `PERMISSION_DENIED`, `UNAUTHENTICATED`,
//! `FAILED_PRECONDITION`, `OUT_OF_RANGE`) are stored and replayed, as the
//! HTTP default stores 4xx.
//!
//! ## Head and trailers
//!
//! A `StorePolicy` is asked first with the response's status and headers,
//! before the body is read, then with the trailers once the body has ended
//! (`should_store_trailers`). tonic answers a unary handler's `Err(Status)`
//! Trailers-Only, so the code is in the head; a status that comes only in the
//! trailers after a body (a streaming response that fails part way, or
//! tonic's own error when the reply cannot be encoded) is seen by the second
//! question. `tests/core/grpc.rs` covers both. One limit remains: a response
//! larger than the layer's response limit is completed before its trailers
//! arrive, so its trailer status is not seen.

use std::convert::Infallible;
use std::error::Error;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, StatusCode};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tonic::server::{NamedService, UnaryService};
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Code, Status};
use tonic_prost::ProstCodec;
use tower::{Layer, Service};
use tower_idempotency::fingerprint::DefaultFingerprinter;
use tower_idempotency::policy::{DefaultStorePolicy, StorePolicy};
use tower_idempotency::problem::Rejection;
use tower_idempotency::{Idempotency, IdempotencyLayer, MemoryStore, Store};

/// The gRPC path of `Charge`.
pub const CHARGE_PATH: &str = "/payments.Payments/Charge";

/// The gRPC server-pushback trailer (gRFC A6): milliseconds to wait before a
/// retry.
pub const RETRY_PUSHBACK: &str = "grpc-retry-pushback-ms";

// ---- messages ---------------------------------------------------------------

/// `payments.ChargeRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ChargeRequest {
    /// The account to charge.
    #[prost(string, tag = "1")]
    pub account: String,
    /// The amount, in cents; must be positive.
    #[prost(int64, tag = "2")]
    pub amount_cents: i64,
}

/// `payments.ChargeReply`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ChargeReply {
    /// A new id for every execution of `Charge`.
    #[prost(string, tag = "1")]
    pub charge_id: String,
    /// The account charged.
    #[prost(string, tag = "2")]
    pub account: String,
    /// The amount charged, in cents.
    #[prost(int64, tag = "3")]
    pub amount_cents: i64,
}

// ---- the handler --------------------------------------------------------------

/// The payments service's state.
#[derive(Debug, Default)]
pub struct Payments {
    executions: AtomicU64,
    gate: Option<Arc<Gate>>,
}

/// Holds every charge inside the handler until it is let through: a test
/// keeps a first request in flight with it, without sleeping.
#[derive(Debug)]
pub struct Gate {
    /// Gets one permit each time a charge enters the handler.
    pub entered: Semaphore,
    /// Each charge takes one permit before it goes on.
    pub proceed: Semaphore,
}

impl Default for Gate {
    /// A closed gate.
    fn default() -> Self {
        Gate {
            entered: Semaphore::new(0),
            proceed: Semaphore::new(0),
        }
    }
}

impl Payments {
    /// A service whose charges run at once.
    pub fn new() -> Self {
        Self::default()
    }

    /// A service whose charges wait at `gate`.
    pub fn gated(gate: Arc<Gate>) -> Self {
        Payments {
            executions: AtomicU64::new(0),
            gate: Some(gate),
        }
    }

    /// How many times `Charge` has run.
    pub fn executions(&self) -> u64 {
        self.executions.load(Ordering::SeqCst)
    }

    /// `Charge`: every call that reaches it is one execution.
    pub async fn charge(&self, request: ChargeRequest) -> Result<ChargeReply, Status> {
        let n = self.executions.fetch_add(1, Ordering::SeqCst) + 1;
        if let Some(gate) = &self.gate {
            gate.entered.add_permits(1);
            gate.proceed
                .acquire()
                .await
                .map_err(|_| Status::internal("the gate was closed"))?
                .forget();
        }
        if request.amount_cents <= 0 {
            return Err(Status::invalid_argument("amount_cents must be positive"));
        }
        if request.account == "unavailable" {
            return Err(Status::unavailable(
                "the payment provider is unavailable; nothing was charged",
            ));
        }
        Ok(ChargeReply {
            charge_id: format!("ch_{n}"),
            account: request.account,
            amount_cents: request.amount_cents,
        })
    }
}

// ---- the server (what tonic-build would generate) ---------------------------

/// The `payments.Payments` service as a tower service over HTTP requests.
#[derive(Debug, Clone)]
pub struct PaymentsServer {
    payments: Arc<Payments>,
}

impl PaymentsServer {
    /// Serves `payments`.
    pub fn new(payments: Arc<Payments>) -> Self {
        PaymentsServer { payments }
    }
}

impl NamedService for PaymentsServer {
    const NAME: &'static str = "payments.Payments";
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// `Charge` as tonic's unary service.
struct ChargeSvc(Arc<Payments>);

impl UnaryService<ChargeRequest> for ChargeSvc {
    type Response = ChargeReply;
    type Future = BoxFuture<Result<tonic::Response<ChargeReply>, Status>>;

    fn call(&mut self, request: tonic::Request<ChargeRequest>) -> Self::Future {
        let payments = self.0.clone();
        Box::pin(async move {
            let reply = payments.charge(request.into_inner()).await?;
            Ok(tonic::Response::new(reply))
        })
    }
}

impl<B> Service<http::Request<B>> for PaymentsServer
where
    B: http_body::Body + Send + 'static,
    B::Error: Into<Box<dyn Error + Send + Sync>> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if request.uri().path() != CHARGE_PATH {
            let status = Status::unimplemented(format!("no method {}", request.uri().path()));
            return Box::pin(async move { Ok(status.into_http()) });
        }
        let charge = ChargeSvc(self.payments.clone());
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::default());
            Ok(grpc.unary(charge, request).await)
        })
    }
}

// ---- the layer, configured for gRPC -------------------------------------------

/// Whose key is it: the `x-caller` metadata entry (use your authenticated
/// principal), `anonymous` without one.
pub fn caller(parts: &Parts) -> String {
    parts
        .headers
        .get("x-caller")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("anonymous")
        .to_owned()
}

/// Every rejection as a Trailers-Only gRPC status (see the module docs for
/// the mapping and its reasons).
pub fn grpc_rejection(rejection: &Rejection) -> http::Response<Bytes> {
    let (code, retry_after_secs) = match rejection {
        Rejection::MissingKey | Rejection::InvalidKey(_) | Rejection::UnreadableBody(_) => {
            (Code::InvalidArgument, None)
        }
        Rejection::BodyTooLarge { .. } => (Code::ResourceExhausted, None),
        Rejection::Mismatch => (Code::FailedPrecondition, None),
        Rejection::InFlight { retry_after_secs }
        | Rejection::StoreUnavailable { retry_after_secs }
        | Rejection::StoreFull { retry_after_secs } => (Code::Unavailable, Some(*retry_after_secs)),
        Rejection::ResponseNotStored => (Code::AlreadyExists, None),
        Rejection::Unauthenticated => (Code::Unauthenticated, None),
        // `Rejection` is non-exhaustive: a variant added later is a failure
        // of unknown kind until it is mapped here.
        _ => (Code::Unknown, None),
    };
    // `into_http` sets HTTP 200, `content-type: application/grpc`,
    // `grpc-status` and the percent-encoded `grpc-message`; the body is empty.
    let mut response: http::Response<Bytes> = Status::new(code, rejection.detail()).into_http();
    if let Some(secs) = retry_after_secs {
        response
            .headers_mut()
            .insert(RETRY_PUSHBACK, HeaderValue::from(secs.saturating_mul(1000)));
    }
    response
}

/// Whether a gRPC code says "nothing happened, try again": the key is
/// released so the retry runs.
pub fn is_transient(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable
            | Code::DeadlineExceeded
            | Code::ResourceExhausted
            | Code::Aborted
            | Code::Cancelled
            | Code::Unknown
            | Code::Internal
            | Code::Unimplemented
            | Code::DataLoss
    )
}

/// The head half of [`GrpcStorePolicy`]: the HTTP default, and a transient
/// `grpc-status` in the head (a Trailers-Only answer) releases the key too.
pub fn grpc_store_policy(status: StatusCode, headers: &HeaderMap) -> bool {
    if !DefaultStorePolicy.should_store(status, headers) {
        return false;
    }
    match headers.get("grpc-status") {
        // An unparsable value reads as UNKNOWN: released.
        Some(code) => !is_transient(Code::from_bytes(code.as_bytes())),
        // OK, or a status still to come in the trailers.
        None => true,
    }
}

/// [`caller`] as a nameable type.
pub type CallerFn = fn(&Parts) -> String;
/// The store policy for gRPC: [`grpc_store_policy`] on the head, and a
/// transient `grpc-status` in the trailers releases the key too.
#[derive(Debug, Clone, Copy, Default)]
pub struct GrpcStorePolicy;

impl StorePolicy for GrpcStorePolicy {
    fn should_store(&self, status: StatusCode, headers: &HeaderMap) -> bool {
        grpc_store_policy(status, headers)
    }

    fn should_store_trailers(&self, trailers: &HeaderMap) -> bool {
        trailers
            .get("grpc-status")
            .is_none_or(|code| !is_transient(Code::from_bytes(code.as_bytes())))
    }
}

/// The policy's type in the layer.
pub type PolicyFn = GrpcStorePolicy;
/// The layer as configured for the payments service.
pub type PaymentsLayer<St> = IdempotencyLayer<St, CallerFn, DefaultFingerprinter, PolicyFn>;
/// The payments service behind the layer, under its gRPC name.
pub type IdempotentPayments<St> =
    Named<PaymentsServer, Idempotency<PaymentsServer, PaymentsLayer<St>>>;

/// The layer for gRPC: a required key, scoped by [`caller`], rejections as
/// gRPC statuses, and [`GrpcStorePolicy`].
pub fn payments_layer<St: Store>(store: St) -> PaymentsLayer<St> {
    IdempotencyLayer::new(store, caller as CallerFn)
        .require_key(true)
        .on_rejection(grpc_rejection)
        .store_when(GrpcStorePolicy)
}

/// `payments` behind `layer`, ready for `Server::add_service`.
pub fn idempotent_payments<St: Store>(
    payments: Arc<Payments>,
    layer: &PaymentsLayer<St>,
) -> IdempotentPayments<St> {
    Named::new(layer.layer(PaymentsServer::new(payments)))
}

/// Serves `payments` behind `layer` on `listener` until the server fails.
pub async fn serve<St: Store>(
    listener: TcpListener,
    payments: Arc<Payments>,
    layer: PaymentsLayer<St>,
) -> Result<(), tonic::transport::Error> {
    Server::builder()
        .add_service(idempotent_payments(payments, &layer))
        .serve_with_incoming(TcpIncoming::from(listener))
        .await
}

/// A service under `N`'s gRPC name: tonic's router routes
/// `/{NamedService::NAME}/*` to a service, and the layer's service cannot
/// know the name of the service it wraps.
#[derive(Debug)]
pub struct Named<N, S> {
    inner: S,
    name: PhantomData<fn() -> N>,
}

impl<N, S> Named<N, S> {
    /// `inner`, routed as `N`.
    pub fn new(inner: S) -> Self {
        Named {
            inner,
            name: PhantomData,
        }
    }
}

impl<N, S: Clone> Clone for Named<N, S> {
    fn clone(&self) -> Self {
        Named::new(self.inner.clone())
    }
}

impl<N: NamedService, S> NamedService for Named<N, S> {
    const NAME: &'static str = N::NAME;
}

impl<N, S: Service<R>, R> Service<R> for Named<N, S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> S::Future {
        self.inner.call(request)
    }
}

// ---- the client (what tonic-build would generate) ---------------------------

/// A `payments.Payments` client over one HTTP/2 connection.
#[derive(Debug, Clone)]
pub struct PaymentsClient {
    grpc: tonic::client::Grpc<Channel>,
}

impl PaymentsClient {
    /// Connects to `url` (`http://HOST:PORT`).
    pub async fn connect(url: String) -> Result<Self, Box<dyn Error + Send + Sync>> {
        let channel = Endpoint::from_shared(url)?.connect().await?;
        Ok(PaymentsClient {
            grpc: tonic::client::Grpc::new(channel),
        })
    }

    /// Calls `Charge`. On `Err`, the status's metadata holds the response's
    /// header fields (a Trailers-Only answer's `idempotent-replayed`, say).
    pub async fn charge(
        &mut self,
        request: tonic::Request<ChargeRequest>,
    ) -> Result<tonic::Response<ChargeReply>, Status> {
        self.grpc
            .ready()
            .await
            .map_err(|e| Status::unavailable(format!("the channel is not ready: {e}")))?;
        let path = PathAndQuery::from_static(CHARGE_PATH);
        self.grpc.unary(request, path, ProstCodec::default()).await
    }
}

/// A `Charge` request with an optional key and caller in its metadata.
///
/// # Panics
///
/// If `key` or `caller` is not a valid metadata value (control characters,
/// non-ASCII).
pub fn charge_request(
    message: ChargeRequest,
    key: Option<&str>,
    caller: Option<&str>,
) -> tonic::Request<ChargeRequest> {
    let mut request = tonic::Request::new(message);
    for (name, value) in [("idempotency-key", key), ("x-caller", caller)] {
        if let Some(value) = value {
            let value = value.parse().expect("a valid metadata value");
            request.metadata_mut().insert(name, value);
        }
    }
    request
}

// ---- main ---------------------------------------------------------------------

const USAGE: &str = "usage: grpc [--listen ADDR]\n       \
grpc charge [--to URL] [--key KEY] [--caller NAME] ACCOUNT AMOUNT_CENTS";

/// The value after `--name` (or in `--name=value`), and the other arguments.
fn take_flag(args: &mut Vec<String>, name: &str) -> Result<Option<String>, String> {
    let Some(i) = args
        .iter()
        .position(|a| a == name || a.starts_with(&format!("{name}=")))
    else {
        return Ok(None);
    };
    let arg = args.remove(i);
    match arg.split_once('=') {
        Some((_, value)) => Ok(Some(value.to_owned())),
        None if i < args.len() => Ok(Some(args.remove(i))),
        None => Err(format!("{name} needs a value\n{USAGE}")),
    }
}

#[tokio::main]
async fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let run = if args.first().is_some_and(|a| a == "charge") {
        args.remove(0);
        charge_once(args).await
    } else {
        serve_cli(args).await
    };
    if let Err(e) = run {
        eprintln!("grpc: {e}");
        std::process::exit(2);
    }
}

/// `grpc [--listen ADDR]`: serves until the server fails.
async fn serve_cli(mut args: Vec<String>) -> Result<(), Box<dyn Error + Send + Sync>> {
    let listen = take_flag(&mut args, "--listen")?.unwrap_or("127.0.0.1:50051".into());
    if !args.is_empty() {
        return Err(USAGE.into());
    }
    let listener = TcpListener::bind(&listen).await?;
    println!("listening on http://{}", listener.local_addr()?);
    // Records live in memory; `SqliteStore::open(path)` keeps them across restarts.
    let layer = payments_layer(MemoryStore::new());
    serve(listener, Arc::new(Payments::new()), layer).await?;
    Ok(())
}

/// `grpc charge ...`: one call, its reply or status, and whether it was a replay.
async fn charge_once(mut args: Vec<String>) -> Result<(), Box<dyn Error + Send + Sync>> {
    let to = take_flag(&mut args, "--to")?.unwrap_or("http://127.0.0.1:50051".into());
    let key = take_flag(&mut args, "--key")?;
    let caller = take_flag(&mut args, "--caller")?;
    let [account, amount] = <[String; 2]>::try_from(args).map_err(|_| USAGE)?;
    let message = ChargeRequest {
        account,
        amount_cents: amount.parse().map_err(|_| USAGE)?,
    };
    let request = charge_request(message, key.as_deref(), caller.as_deref());
    let mut client = PaymentsClient::connect(to).await?;
    let (metadata, outcome) = match client.charge(request).await {
        Ok(response) => (
            response.metadata().clone(),
            format!("{:?}", response.get_ref()),
        ),
        Err(status) => {
            let outcome = format!("{:?}: {}", status.code(), status.message());
            (status.metadata().clone(), outcome)
        }
    };
    let replayed = metadata.get("idempotent-replayed").is_some();
    println!("{outcome}{}", if replayed { " (replayed)" } else { "" });
    Ok(())
}
