//! [`Idempotency`]: the service, and the request's path through the state
//! machine of [`crate::store`].
//!
//! The path of one intercepted request, in `intercept.rs` (steps 1 and 2)
//! and `run.rs` (3 to 5):
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
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::IdempotencyLayer;
use crate::body::{RequestBody, ResponseBody};
use crate::config::{Config, Settings};
use crate::fingerprint::Fingerprinter;
use crate::key::parse_key;
use crate::mode::Mode;
use crate::policy::StorePolicy;
use crate::problem::Rejection;
use crate::scope::Scope;
use crate::store::Store;
use crate::telemetry::{self, Outcome};

mod body_key;
mod first_sent;
mod intercept;
mod run;

use intercept::intercept;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The service made by [`IdempotencyLayer`]: `inner` behind the layer `L`.
///
/// Named by the inner service and the layer that made it, as in
/// `Idempotency<Router, IdempotencyLayer<SqliteStore, GlobalScope>>`: the
/// layer's type carries the store, the scope, the fingerprinter, the store
/// policy and the [mode](crate::mode).
///
/// The inner service receives `Request<`[`RequestBody<B>`]`>` and its errors
/// pass through unchanged (`Error = S::Error`); the layer's own rejections are
/// responses, so it can sit in axum, whose services must be infallible.
pub struct Idempotency<S, L: LayerTypes> {
    inner: S,
    store: L::Store,
    config: Arc<Config<L::Scope, L::Fingerprinter, L::Policy>>,
}

/// The types an [`IdempotencyLayer`] fixes, which its service
/// [`Idempotency`] is made of. Implemented by `IdempotencyLayer` alone
/// (sealed).
pub trait LayerTypes: sealed::Sealed {
    /// The [`Store`].
    type Store;
    /// The [`Scope`].
    type Scope;
    /// The [`Fingerprinter`].
    type Fingerprinter;
    /// The [`StorePolicy`].
    type Policy;
    /// The [mode](crate::mode): [`crate::mode::Separate`] or [`crate::mode::Transactional`].
    type Mode;
}

mod sealed {
    pub trait Sealed {}
}

impl<St, Sc, F, P, M> sealed::Sealed for IdempotencyLayer<St, Sc, F, P, M> {}

impl<St, Sc, F, P, M> LayerTypes for IdempotencyLayer<St, Sc, F, P, M> {
    type Store = St;
    type Scope = Sc;
    type Fingerprinter = F;
    type Policy = P;
    type Mode = M;
}

impl<S: Clone, L: LayerTypes<Store: Clone>> Clone for Idempotency<S, L> {
    fn clone(&self) -> Self {
        Idempotency {
            inner: self.inner.clone(),
            store: self.store.clone(),
            config: self.config.clone(),
        }
    }
}

impl<S: std::fmt::Debug, L: LayerTypes> std::fmt::Debug for Idempotency<S, L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl<S, L: LayerTypes> Idempotency<S, L> {
    pub(crate) fn from_config(
        inner: S,
        store: L::Store,
        config: Arc<Config<L::Scope, L::Fingerprinter, L::Policy>>,
    ) -> Self {
        Idempotency {
            inner,
            store,
            config,
        }
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The inner service, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, St, Sc, F, P, M, ReqBody, ResBody> Service<Request<ReqBody>>
    for Idempotency<S, IdempotencyLayer<St, Sc, F, P, M>>
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

    #[inline]
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

pub(super) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

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
                response: Some(settings.rejection_response(rejection, None)),
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
