//! [`Idempotency`]: the service, and the request's path through the state
//! machine of [`crate::store`].
//!
//! The path of one intercepted request, in `intercept` and `claim_and_run`:
//!
//! 1. the key is parsed (400 before anything else; see [`crate::key`]), or,
//!    from a key source, found in the body once it is buffered
//!    ([`crate::key_source`]); then the scope (401) and the
//!    `Repeatability-First-Sent` field (400; see [`crate::first_sent`]);
//! 2. the body is buffered up to the limit (413) and fingerprinted;
//! 3. ONE atomic claim in the store decides: 422, replay, 409, 412 (a fresh
//!    claim first sent longer ago than the TTL), or run
//!    (in separate mode, from here on in a task of its own, so that a client
//!    that goes away cannot cut the handler from its record);
//! 4. the inner service runs while a [`crate::mode::Hold`] holds the claim;
//! 5. its response is stored (token-checked, in `record.rs`) or the claim
//!    is released; in separate mode a body that would wait is streamed to
//!    the caller and stored at its end (see [`crate::mode`]), and the caller
//!    that reads it bounds how long it is read.

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Limited};
use pin_project_lite::pin_project;
use tower_service::Service;
use tracing::Instrument;

use crate::body::{RequestBody, ResponseBody};
use crate::config::{Config, Settings};
use crate::fingerprint::Fingerprint;
use crate::fingerprint::Fingerprinter;
use crate::first_sent;
use crate::key::{ClaimedKey, parse_key};
use crate::mode::{Hold, Mode, Separate};
use crate::policy::{DoNotStore, StorePolicy};
use crate::problem::{Rejection, STORE_RETRY_AFTER_SECS};
use crate::record::{release, store_response, stream_deadline};
use crate::renew;
use crate::response::{StoredBody, StoredResponse};
use crate::scope::Scope;
use crate::seal::{self, Sealer};
use crate::store::{
    ClaimRequest, FencingToken, RecordId, Refusal, Store, StoreError, retry_after_secs,
};
use crate::telemetry::{self, Operation, Outcome, timed};
use crate::wait::WakeOnEnd;

mod body_key;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The service made by [`crate::IdempotencyLayer`].
///
/// The inner service receives `Request<`[`RequestBody<B>`]`>` and its errors
/// pass through unchanged (`Error = S::Error`); the layer's own rejections are
/// responses, so it can sit in axum, whose services must be infallible.
pub struct Idempotency<S, St, Sc, F, P, M = Separate> {
    inner: S,
    store: St,
    config: Arc<Config<Sc, F, P>>,
    mode: PhantomData<fn() -> M>,
}

impl<S: Clone, St: Clone, Sc, F, P, M> Clone for Idempotency<S, St, Sc, F, P, M> {
    fn clone(&self) -> Self {
        Idempotency {
            inner: self.inner.clone(),
            store: self.store.clone(),
            config: self.config.clone(),
            mode: PhantomData,
        }
    }
}

impl<S: std::fmt::Debug, St, Sc, F, P, M> std::fmt::Debug for Idempotency<S, St, Sc, F, P, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, St, Sc, F, P, M> Idempotency<S, St, Sc, F, P, M> {
    pub(crate) fn new(inner: S, store: St, config: Arc<Config<Sc, F, P>>) -> Self {
        Idempotency {
            inner,
            store,
            config,
            mode: PhantomData,
        }
    }
}

impl<S, St, Sc, F, P, M, ReqBody, ResBody> Service<Request<ReqBody>>
    for Idempotency<S, St, Sc, F, P, M>
where
    M: Mode<St>,
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    S::Error: Send,
    St: Store,
    Sc: Scope,
    F: Fingerprinter,
    P: StorePolicy,
    ReqBody: Body + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Send,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, ResBody, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let settings = &self.config.settings;
        if !settings.methods.contains(req.method()) {
            return ResponseFuture::pass_through(self.inner.call(req.map(RequestBody::inner)));
        }
        // A key from the body is looked up in `intercept`, once it is read.
        let header_key = match settings.key_source {
            Some(_) => Ok(None),
            None => parse_key(req.headers(), &settings.header),
        };
        let key = match header_key {
            Ok(Some(key)) => Some(key),
            Ok(None) if settings.key_source.is_some() => None,
            Ok(None) if !settings.require_key => {
                return ResponseFuture::pass_through(self.inner.call(req.map(RequestBody::inner)));
            }
            Ok(None) => {
                telemetry::outcome(Outcome::Rejected);
                return ResponseFuture::rejected(settings, &Rejection::MissingKey);
            }
            Err(e) => {
                telemetry::outcome(Outcome::Rejected);
                return ResponseFuture::rejected(settings, &Rejection::InvalidKey(e));
            }
        };
        // The service that was driven to readiness goes with this request;
        // its clone stays for the next (tower's usual swap).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let run = intercept::<M, _, _, _, _, _, _, _>(
            inner,
            self.store.clone(),
            self.config.clone(),
            req,
            key,
        );
        ResponseFuture::intercepted(Box::pin(run))
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

pin_project! {
    /// The response future of [`Idempotency`].
    pub struct ResponseFuture<Fut, B: Body, E> {
        #[pin]
        kind: Kind<Fut, B, E>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<Fut, B: Body, E> {
        PassThrough { #[pin] future: Fut },
        Ready { response: Option<Response<ResponseBody<B>>> },
        Intercepted { future: BoxFuture<Result<Response<ResponseBody<B>>, E>> },
    }
}

impl<Fut, B: Body, E> ResponseFuture<Fut, B, E> {
    fn pass_through(future: Fut) -> Self {
        ResponseFuture {
            kind: Kind::PassThrough { future },
        }
    }

    fn rejected(settings: &Settings, rejection: &Rejection) -> Self {
        ResponseFuture {
            kind: Kind::Ready {
                response: Some(settings.rejection_response(rejection)),
            },
        }
    }

    fn intercepted(future: BoxFuture<Result<Response<ResponseBody<B>>, E>>) -> Self {
        ResponseFuture {
            kind: Kind::Intercepted { future },
        }
    }
}

impl<Fut, B, E> Future for ResponseFuture<Fut, B, E>
where
    Fut: Future<Output = Result<Response<B>, E>>,
    B: Body,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::PassThrough { future } => future
                .poll(cx)
                .map_ok(|response| response.map(ResponseBody::inner)),
            KindProj::Ready { response } => {
                // A `None` here means polled after completion; answer with an
                // error response rather than panic.
                Poll::Ready(Ok(response.take().unwrap_or_else(|| {
                    let mut r = Response::new(ResponseBody::full(Bytes::new(), None));
                    *r.status_mut() = http::StatusCode::INTERNAL_SERVER_ERROR;
                    r
                })))
            }
            KindProj::Intercepted { future } => future.as_mut().poll(cx),
        }
    }
}

/// One intercepted request, from its buffered body to its stored response.
async fn intercept<M, S, St, Sc, F, P, ReqBody, ResBody>(
    inner: S,
    store: St,
    config: Arc<Config<Sc, F, P>>,
    req: Request<ReqBody>,
    key: Option<String>,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    M: Mode<St>,
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send,
    S::Error: Send + 'static,
    St: Store,
    Sc: Scope,
    F: Fingerprinter,
    P: StorePolicy,
    ReqBody: Body + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body + Send + 'static,
    ResBody::Error: Send,
{
    let (parts, body) = req.into_parts();
    // A key from the body: the body is read first (see `crate::key_source`).
    let (key, mut parts, body) = match key {
        Some(key) => (key, parts, Pending::Unread(body)),
        None => match body_key::find(&config.settings, parts, body).await {
            body_key::Found::Key(key, parts, bytes, trailers) => {
                (key, parts, Pending::Read(bytes, trailers))
            }
            body_key::Found::None(parts, bytes, trailers) => {
                let request = Request::from_parts(parts, RequestBody::buffered(bytes, trailers));
                let mut inner = inner;
                return inner
                    .call(request)
                    .await
                    .map(|response| response.map(ResponseBody::inner));
            }
            body_key::Found::Rejected(rejection) => {
                return Ok(reject(&config.settings, Outcome::Rejected, rejection));
            }
        },
    };
    // No principal: 401 before the store is touched (and, for a header key,
    // before the body is read).
    let Some(scope) = config.scope.scope(&parts) else {
        return Ok(reject(
            &config.settings,
            Outcome::Rejected,
            Rejection::Unauthenticated,
        ));
    };
    if let Err(rejection) = first_sent::read(&config.settings, &mut parts) {
        return Ok(reject(&config.settings, Outcome::Rejected, rejection));
    }
    let span = telemetry::request_span(&scope, &key);
    async move {
        let settings = &config.settings;
        let (body, trailers) = match body {
            Pending::Read(bytes, trailers) => (bytes, trailers),
            Pending::Unread(body) => match buffer_request(body, settings.max_request_body).await {
                Ok(buffered) => buffered,
                Err(rejection) => return Ok(reject(settings, Outcome::Rejected, rejection)),
            },
        };
        let fingerprint = match config.fingerprinter.fingerprint(&parts, &body) {
            Ok(fingerprint) => fingerprint,
            Err(e) => {
                let rejection = Rejection::UnreadableBody(e.to_string());
                return Ok(reject(settings, Outcome::Rejected, rejection));
            }
        };
        parts
            .extensions
            .insert(ClaimedKey::new(key.clone(), scope.clone()));
        let claim = ClaimRequest {
            scope,
            key,
            fingerprint,
            token: FencingToken::random(),
            lease: settings.lease,
            ttl: settings.ttl,
            max_hold: settings.max_hold,
        };
        let waiting_bytes = body.len();
        let request = Request::from_parts(parts, RequestBody::buffered(body, trailers));
        // Set when the caller goes away: a repeat still waiting for its
        // first request then stops before it claims again.
        let abandoned = Arc::new(AtomicBool::new(false));
        let run = claim_and_run::<M, _, _, _, _, _, _, _>(
            inner,
            store,
            config.clone(),
            (claim, waiting_bytes, abandoned.clone()),
            request,
        );
        if !M::DETACHED {
            return run.await;
        }
        // From the claim on, the request cannot be cut short: if the client
        // goes away and this future is dropped, the rest of it (the claim,
        // the handler and the response head) runs on in a task of its own
        // (the handler's effect may outlive a cancelled future). Its retry
        // gets 409 until the record completes, then the replay. Until then
        // it runs in place, without a task of its own. The body is another
        // matter: one ready at once is stored before the head, but a stream
        // is read only by its caller, so with the caller gone its body is
        // dropped and the record completes without it (410 for repeats).
        DetachOnDrop::new(run.in_current_span(), abandoned).await
    }
    .instrument(span)
    .await
}

/// A request body before the claim: still to be read (a header key), or
/// already read to find a key in it.
enum Pending<B> {
    Unread(B),
    Read(Bytes, Option<HeaderMap>),
}

/// Runs a future in place; dropped before it has finished, it spawns the
/// rest on the current Tokio runtime, where it runs to completion.
struct DetachOnDrop<T: Send + 'static> {
    future: Option<BoxFuture<T>>,
    abandoned: Arc<AtomicBool>,
}

impl<T: Send + 'static> DetachOnDrop<T> {
    fn new(future: impl Future<Output = T> + Send + 'static, abandoned: Arc<AtomicBool>) -> Self {
        DetachOnDrop {
            future: Some(Box::pin(future)),
            abandoned,
        }
    }
}

impl<T: Send + 'static> Future for DetachOnDrop<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let Some(future) = self.future.as_mut() else {
            // Polled after it finished: a caller bug; never finishes again.
            return Poll::Pending;
        };
        let output = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(output)
    }
}

impl<T: Send + 'static> Drop for DetachOnDrop<T> {
    fn drop(&mut self) {
        let Some(future) = self.future.take() else {
            return;
        };
        self.abandoned.store(true, Ordering::Relaxed);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(future)),
            Err(_) => tracing::error!(
                "an intercepted request was dropped outside a Tokio runtime and cannot finish; its key stays in flight until its lease ends"
            ),
        }
    }
}

/// Records the outcome and answers with the rejection.
fn reject<B: Body>(
    settings: &Settings,
    outcome: Outcome,
    rejection: Rejection,
) -> Response<ResponseBody<B>> {
    telemetry::outcome(outcome);
    settings.rejection_response(&rejection)
}

/// The atomic claim, then the inner service, then the record's completion
/// or release.
async fn claim_and_run<M, S, St, Sc, F, P, ReqBody, ResBody>(
    mut inner: S,
    store: St,
    config: Arc<Config<Sc, F, P>>,
    (claim, waiting_bytes, abandoned): (ClaimRequest, usize, Arc<AtomicBool>),
    mut request: Request<RequestBody<ReqBody>>,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    M: Mode<St>,
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    St: Store,
    Sc: Scope,
    F: Fingerprinter,
    P: StorePolicy,
    ResBody: Body + Send + 'static,
{
    let settings = &config.settings;
    // A streamed first response must end within the lease, or the max hold
    // when the lease is renewed (counted from here, before the store counts
    // it, less a margin), or it is recorded as not stored: see
    // `finish_stream`.
    let claimed_at = tokio::time::Instant::now();
    let mut lease_end = claimed_at + stream_deadline(settings.lease);
    let (id, token, fingerprint) = (claim.record_id(), claim.token, claim.fingerprint);
    let claimed = claim_or_wait::<M, _>(&store, settings, claim, waiting_bytes, &abandoned).await;
    let (hold, taken_over) = match claimed {
        Ok(Ok((hold, taken_over))) => {
            telemetry::claim(if taken_over { "taken_over" } else { "acquired" });
            (hold, taken_over)
        }
        Ok(Err(Refusal::Mismatch)) => {
            telemetry::claim("mismatch");
            return Ok(reject(settings, Outcome::Mismatch, Rejection::Mismatch));
        }
        Ok(Err(Refusal::InFlight { lease_remaining })) => {
            telemetry::claim("in_flight");
            let retry_after_secs = retry_after_secs(
                lease_remaining,
                settings.lease,
                settings.in_flight_retry_after,
            );
            let rejection = Rejection::InFlight { retry_after_secs };
            return Ok(reject(settings, Outcome::InFlight, rejection));
        }
        Ok(Err(Refusal::Completed(stored))) => {
            telemetry::claim("replayed");
            return Ok(replay_record(settings, &id, &fingerprint, stored));
        }
        Err(e) => {
            telemetry::claim("store_error");
            tracing::error!(error = %e, "idempotency store failed to claim; answering 503");
            let rejection = Rejection::store_failed(&e, STORE_RETRY_AFTER_SECS);
            return Ok(reject(settings, Outcome::StoreError, rejection));
        }
    };

    // No live record, and first sent longer ago than the TTL: it may have
    // run under a record that expired (`refuse_expired_retries`).
    if let Some(rejection) =
        first_sent::expired(settings, request.extensions()).filter(|_| !taken_over)
    {
        release(hold).await;
        return Ok(settings.rejection_response(&rejection));
    }
    let sealer = settings.keyring.clone().map(|keyring| Sealer {
        keyring,
        id: id.clone(),
        fingerprint,
    });
    request.headers_mut().remove(&settings.marker);
    hold.attach(request.extensions_mut());
    // The end of the hold, however it ends, wakes this key's waiters.
    let wake = settings.wait.clone().map(|waiting| WakeOnEnd {
        waiting,
        id: id.clone(),
    });
    // Renewed until the record is completed or released (`renew_lease`).
    let renewal = match (settings.max_hold, M::RENEWS) {
        (Some(max_hold), true) => request.extensions().get::<ClaimedKey>().map(|claimed| {
            renew::start(renew::Lease {
                store: store.clone(),
                id,
                token,
                lease: settings.lease,
                max_hold,
                signal: claimed.lease_signal(),
            })
        }),
        _ => None,
    };
    if let (Some(_), Some(max_hold)) = (&renewal, settings.max_hold) {
        // Renewed until the record is finished, but never past the max hold
        // (and never less than the first lease).
        lease_end = lease_end.max(claimed_at + stream_deadline(max_hold));
    }
    let mut hold = renew::Renewed {
        hold,
        renewal,
        wake,
    };
    let response = match inner.call(request).await {
        Ok(response) => response,
        Err(e) => {
            release(hold).await;
            return Err(e);
        }
    };
    // The handler's `DoNotStore` ("nothing happened") overrides the policy.
    if response.extensions().get::<DoNotStore>().is_some()
        || !config
            .policy
            .should_store(response.status(), response.headers())
    {
        release(hold).await;
        let (mut parts, body) = response.into_parts();
        parts.headers.remove(&settings.marker);
        return Ok(Response::from_parts(parts, ResponseBody::inner(body)));
    }
    hold.answered();
    let mut response = store_response(hold, &config, lease_end, response, sealer).await;
    first_sent::advertise(settings, response.headers_mut());
    Ok(response)
}

/// The atomic claim; a repeat that meets its key in flight, when the layer
/// lets repeats wait (`wait_in_flight`), claims again until the key is no
/// longer in flight or its wait is over (see [`crate::wait`]).
async fn claim_or_wait<M: Mode<St>, St: Store>(
    store: &St,
    settings: &Settings,
    claim: ClaimRequest,
    waiting_bytes: usize,
    abandoned: &AtomicBool,
) -> Result<Result<(M::Hold, bool), Refusal>, StoreError> {
    let once = || timed(Operation::Claim, M::claim(store, claim.clone()));
    let first = once().await;
    let (Some(waiting), Ok(Err(Refusal::InFlight { .. }))) = (&settings.wait, &first) else {
        return first;
    };
    let Some(waiter) = waiting.enter(&claim.record_id(), waiting_bytes) else {
        telemetry::wait("full");
        return first;
    };
    // Watched before the next claim, so that its change is not missed.
    let watch = store.watch(&claim.record_id());
    let deadline = tokio::time::Instant::now() + waiting.bound;
    let in_flight = |answer: &Result<Result<(M::Hold, bool), Refusal>, StoreError>| match answer {
        Ok(Err(Refusal::InFlight { lease_remaining })) => Some(*lease_remaining),
        _ => None,
    };
    match waiter
        .claim_until(
            deadline,
            abandoned,
            (watch.as_ref(), settings.signalled_poll),
            once,
            in_flight,
        )
        .await
    {
        Ok(answer) => {
            telemetry::wait("woken");
            answer
        }
        Err(last) => {
            telemetry::wait("timed_out");
            last.unwrap_or(first)
        }
    }
}

/// Buffers the request body up to `limit` bytes.
async fn buffer_request<B>(body: B, limit: usize) -> Result<(Bytes, Option<HeaderMap>), Rejection>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(Rejection::BodyTooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => {
            let trailers = collected.trailers().cloned();
            Ok((collected.to_bytes(), trailers))
        }
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(Rejection::BodyTooLarge { limit })
        }
        Err(e) => Err(Rejection::UnreadableBody(format!(
            "the request body could not be read: {e}"
        ))),
    }
}

/// The answer to a repeat of the completed record `id`, met by a request
/// with `fingerprint`: the record opened (if it was sealed at rest, see
/// [`crate::seal`]) and replayed, or 410 if its body was not stored. A
/// sealed record that no configured key opens is never replayed: it is
/// logged at ERROR, counted, and answered 503, as a corrupt record is. Every
/// path that replays a stored record goes through here.
pub(crate) fn replay_record<B: Body>(
    settings: &Settings,
    id: &RecordId,
    fingerprint: &Fingerprint,
    stored: StoredResponse,
) -> Response<ResponseBody<B>> {
    match seal::open(settings.keyring.as_ref(), id, fingerprint, stored) {
        Ok(stored) => replay(settings, &stored),
        Err(e) => {
            telemetry::unopened();
            tracing::error!(error = %e, "a stored response did not open and is never replayed; answering 503");
            let retry_after_secs = STORE_RETRY_AFTER_SECS;
            reject(
                settings,
                Outcome::StoreError,
                Rejection::StoreUnavailable { retry_after_secs },
            )
        }
    }
}

/// The replay of an open record (or 410 if its body was not stored).
fn replay<B: Body>(settings: &Settings, stored: &StoredResponse) -> Response<ResponseBody<B>> {
    if stored.body == StoredBody::Omitted {
        return reject(settings, Outcome::NotStored, Rejection::ResponseNotStored);
    }
    telemetry::outcome(Outcome::Replayed);
    let trailers = stored.trailer_map();
    let mut response = stored
        .replay(&settings.marker)
        .map(|body| ResponseBody::full(body, trailers));
    first_sent::advertise(settings, response.headers_mut());
    response
}
