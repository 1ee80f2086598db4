//! From the request to the claim: the body buffered, the key, scope and
//! fingerprint found, and the rest run so that a caller going away cannot
//! cut a claimed request short.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, Request, Response};
use http_body::Body;
use tower_service::Service;
use tracing::Instrument;

use super::first_sent;
use crate::body::{RequestBody, ResponseBody, buffer_request};
use crate::config::Config;
use crate::fingerprint::Fingerprinter;
use crate::key::ClaimedKey;
use crate::mode::Mode;
use crate::policy::StorePolicy;
use crate::problem::Rejection;
use crate::scope::Scope;
use crate::store::{ClaimRequest, FencingToken, Store};
use crate::telemetry::{self, Outcome};

use super::run::{claim_and_run, reject};
use super::{BoxError, BoxFuture, body_key};

/// One intercepted request, from its buffered body to its stored response,
/// in four steps: its key, its scope, its claim, then the claim and the
/// handler run so that a caller going away cannot cut them short.
pub(super) async fn intercept<M, S, St, Sc, F, P, ReqBody, ResBody>(
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
    let refused = |rejection| Ok(reject(&config.settings, None, Outcome::Rejected, rejection));
    // 1. The key: from its header, or from the body (read first, see
    //    `crate::key_source`); without one the request passes through.
    let (parts, body) = req.into_parts();
    let (key, parts, body) = match key {
        Some(key) => (key, parts, Pending::Unread(body)),
        None => match body_key::find(&config.settings, parts, body).await {
            body_key::Found::Key(key, parts, bytes, trailers) => {
                (key, parts, Pending::Read(bytes, trailers))
            }
            body_key::Found::None(parts, bytes, trailers) => {
                let request = Request::from_parts(parts, RequestBody::buffered(bytes, trailers));
                return pass_through(inner, request).await;
            }
            body_key::Found::Rejected(rejection) => return refused(rejection),
        },
    };
    // 2. The scope: no principal is 401 before the store is touched (and,
    //    for a header key, before the body is read); then the first-sent
    //    guard's field.
    let (scope, parts) = match scope_of(&config, parts) {
        Ok(scoped) => scoped,
        Err(rejection) => return refused(rejection),
    };
    let span = telemetry::request_span(&scope, &key);
    async move {
        // 3. The claim: the body buffered and fingerprinted.
        let claimed = match claim_of(&config, (scope, key), parts, body).await {
            Ok(claim) => claim,
            Err(rejection) => {
                return Ok(reject(&config.settings, None, Outcome::Rejected, rejection));
            }
        };
        // 4. The claim made and the handler run, to the end.
        claim_and_run_to_the_end::<M, _, _, _, _, _, _, _>(inner, store, config.clone(), claimed)
            .await
    }
    .instrument(span)
    .await
}

/// A request with no key (the layer does not require one), passed through
/// with its buffered body.
async fn pass_through<S, ReqBody, ResBody>(
    mut inner: S,
    request: Request<RequestBody<ReqBody>>,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    ResBody: Body,
{
    inner
        .call(request)
        .await
        .map(|response| response.map(ResponseBody::inner))
}

/// The request's scope, and its head with the first-sent guard's field
/// read.
fn scope_of<Sc: Scope, F, P>(
    config: &Config<Sc, F, P>,
    mut parts: Parts,
) -> Result<(String, Parts), Rejection> {
    let scope = config
        .scope
        .scope(&parts)
        .ok_or(Rejection::Unauthenticated)?;
    first_sent::read(&config.settings, &mut parts)?;
    Ok((scope, parts))
}

/// The claim of a keyed request: its body buffered (up to the layer's
/// limit) and fingerprinted, its [`ClaimedKey`] attached, and the request
/// rebuilt around the buffered body.
async fn claim_of<Sc, F: Fingerprinter, P, ReqBody>(
    config: &Config<Sc, F, P>,
    (scope, key): (String, String),
    mut parts: Parts,
    body: Pending<ReqBody>,
) -> Result<Claimed<ReqBody>, Rejection>
where
    ReqBody: Body,
    ReqBody::Error: Into<BoxError>,
{
    let settings = &config.settings;
    let (body, trailers) = match body {
        Pending::Read(bytes, trailers) => (bytes, trailers),
        Pending::Unread(body) => buffer_request(body, settings.max_request_body).await?,
    };
    let fingerprint = config
        .fingerprinter
        .fingerprint(&parts, &body)
        .map_err(|e| Rejection::UnreadableBody(e.to_string()))?;
    parts.extensions.insert(
        ClaimedKey::new(key.clone(), scope.clone()).in_namespace(settings.hooks.namespace.clone()),
    );
    let claim = ClaimRequest {
        scope,
        key: settings.hooks.stored_key(key),
        fingerprint,
        token: FencingToken::random(),
        lease: settings.lease,
        ttl: settings.ttl,
        max_hold: Some(settings.max_hold),
        // Set per claim when the repeat has a place to wait
        // (`claim_or_wait`).
        wait_in_flight: std::time::Duration::ZERO,
    };
    let waiting_bytes = body.len();
    let request = Request::from_parts(parts, RequestBody::buffered(body, trailers));
    Ok((claim, waiting_bytes, request))
}

/// A claim, the bytes a repeat waiting with it holds, and its request.
type Claimed<B> = (ClaimRequest, usize, Request<RequestBody<B>>);

/// [`claim_and_run`], which from the claim on cannot be cut short: if the
/// client goes away and this future is dropped, the rest of it (the claim,
/// the handler and the response head) runs on in a task of its own (the
/// handler's effect may outlive a cancelled future). Its retry gets 409
/// until the record completes, then the replay. Until then it runs in
/// place, without a task of its own. The body is another matter: one ready
/// at once is stored before the head, but a stream is read only by its
/// caller, so with the caller gone its body is dropped and the record
/// completes without it (410 for repeats).
async fn claim_and_run_to_the_end<M, S, St, Sc, F, P, ReqBody, ResBody>(
    inner: S,
    store: St,
    config: Arc<Config<Sc, F, P>>,
    (claim, waiting_bytes, request): Claimed<ReqBody>,
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
    ResBody: Body + Send + 'static,
    ResBody::Error: Send,
{
    // Set when the caller goes away: a repeat still waiting for its first
    // request then stops before it claims again.
    let abandoned = Arc::new(AtomicBool::new(false));
    let run = claim_and_run::<M, _, _, _, _, _, _, _>(
        inner,
        store,
        config,
        (claim, waiting_bytes, abandoned.clone()),
        request,
    );
    if !M::DETACHED {
        return run.await;
    }
    DetachOnDrop::new(run.in_current_span(), abandoned).await
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
        // Unwinding from a panic inside it (a hook's, say): the future is
        // spent and cannot be resumed; dropping it drops its hold.
        if std::thread::panicking() {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(future)),
            Err(_) => tracing::error!(
                "an intercepted request was dropped outside a Tokio runtime and cannot finish; its key stays in flight until its lease ends"
            ),
        }
    }
}
