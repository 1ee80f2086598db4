//! [`IdempotencyLayer`]: the configuration, and the [`tower_layer::Layer`]
//! that wraps a service in [`Idempotency`].

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

mod in_flight;
mod keys;
mod records;

use bytes::Bytes;
use http::{HeaderName, Method, Response};
use tower_layer::Layer;

use crate::config::{
    Config, DEFAULT_IN_FLIGHT_RETRY_AFTER, DEFAULT_MAX_REQUEST_BODY, DEFAULT_MAX_RESPONSE_BODY,
    Settings,
};
use crate::fingerprint::{DefaultFingerprinter, Fingerprinter};
use crate::hooks::Hooks;
use crate::mode::{Separate, Transactional};
use crate::policy::{DefaultStorePolicy, StorePolicy};
use crate::problem::Rejection;
use crate::scope::Scope;
use crate::seal::Keyring;
use crate::service::Idempotency;
use crate::store::{DEFAULT_LEASE, DEFAULT_MAX_HOLD, DEFAULT_TTL};
use crate::store::{Store, TransactionalStore};
use crate::wait::{DEFAULT_MAX_WAITERS, DEFAULT_MAX_WAITING_BYTES, DEFAULT_SIGNALLED_POLL};

/// Applies idempotency keys to the requests of a service: the first request
/// with a key runs, and its response is replayed to every repeat.
///
/// See the [crate docs](crate) for the full behaviour.
///
/// # Example: settings per route
///
/// axum's `route_layer` applies a layer to the routes added before it, so
/// each group of routes gets its own settings:
///
/// ```
/// use std::time::Duration;
/// use axum::{Router, routing::post, http::{Request, StatusCode}, body::Body};
/// use tower::ServiceExt;
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, scope::GlobalScope};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let store = MemoryStore::new();
/// // Payments: a key is required, and kept for 7 days.
/// let payments = Router::new()
///     .route("/payments", post(|| async { (StatusCode::CREATED, "paid") }))
///     .route_layer(
///         IdempotencyLayer::new(store.clone(), GlobalScope)
///             .require_key(true)
///             .ttl(Duration::from_secs(7 * 24 * 3600)),
///     );
/// // Comments: a key is optional (without one, every request runs), kept 1 hour.
/// let comments = Router::new()
///     .route("/comments", post(|| async { (StatusCode::CREATED, "posted") }))
///     .route_layer(IdempotencyLayer::new(store, GlobalScope).ttl(Duration::from_secs(3600)));
/// let app = payments.merge(comments);
///
/// let post = |path: &str| Request::post(path).body(Body::empty()).unwrap();
/// assert_eq!(app.clone().oneshot(post("/payments")).await.unwrap().status(), StatusCode::BAD_REQUEST);
/// assert_eq!(app.clone().oneshot(post("/comments")).await.unwrap().status(), StatusCode::CREATED);
/// # }
/// ```
///
/// Type parameters: `St` the [`Store`], `Sc` the [`Scope`], `F` the
/// [`Fingerprinter`], `P` the [`StorePolicy`], `M` the [`crate::mode`]
/// ([`Separate`] unless [`IdempotencyLayer::transactional`] was called).
#[must_use]
pub struct IdempotencyLayer<St, Sc, F = DefaultFingerprinter, P = DefaultStorePolicy, M = Separate>
{
    store: St,
    config: Config<Sc, F, P>,
    mode: PhantomData<fn() -> M>,
}

impl<St: Clone, Sc: Clone, F: Clone, P: Clone, M> Clone for IdempotencyLayer<St, Sc, F, P, M> {
    fn clone(&self) -> Self {
        IdempotencyLayer {
            store: self.store.clone(),
            config: self.config.clone(),
            mode: PhantomData,
        }
    }
}

impl<St, Sc, F, P, M> std::fmt::Debug for IdempotencyLayer<St, Sc, F, P, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = &self.config.settings;
        f.debug_struct("IdempotencyLayer")
            .field("header", &c.header)
            .field("key_from_body", &c.key_source.is_some())
            .field("methods", &c.methods)
            .field("require_key", &c.require_key)
            .field("lease", &c.lease)
            .field("ttl", &c.ttl)
            .field("max_request_body", &c.max_request_body)
            .field("max_response_body", &c.max_response_body)
            .field("marker", &c.marker)
            .field(
                "sealing_key_id",
                &c.keyring.as_ref().map(Keyring::sealing_id),
            )
            .finish_non_exhaustive()
    }
}

impl<St: Store, Sc: Scope> IdempotencyLayer<St, Sc> {
    /// A layer over `store` whose keys belong to `scope`: one of
    /// [`crate::scope`]'s ready scopes (`scope::extension::<User>()`,
    /// `scope::header(..)`, `scope::from_fn(..)`), a closure over the
    /// request head, or [`crate::scope::GlobalScope`] after reading its
    /// warning. A request with a key whose scope finds no principal is
    /// answered 401. Put the layer inside the authentication middleware (see
    /// [`crate::scope#put-the-layer-inside-authentication`]).
    ///
    /// Defaults: header `Idempotency-Key`; methods POST and PATCH; a key is
    /// optional; lease [`DEFAULT_LEASE`] (10 s), renewed while the request
    /// runs up to [`DEFAULT_MAX_HOLD`] (60 s); TTL [`DEFAULT_TTL`]; request and
    /// response limits [`DEFAULT_MAX_REQUEST_BODY`] and
    /// [`DEFAULT_MAX_RESPONSE_BODY`]; marker `Idempotent-Replayed`;
    /// [`DefaultFingerprinter`]; [`DefaultStorePolicy`]; problem+json rejections.
    pub fn new(store: St, scope: Sc) -> Self {
        IdempotencyLayer {
            config: Config {
                settings: Settings {
                    renewer: Arc::new(crate::renew::Renewer::new(store.clone())),
                    header: HeaderName::from_static("idempotency-key"),
                    key_source: None,
                    methods: vec![Method::POST, Method::PATCH],
                    require_key: false,
                    lease: DEFAULT_LEASE,
                    max_hold: DEFAULT_MAX_HOLD,
                    in_flight_retry_after: DEFAULT_IN_FLIGHT_RETRY_AFTER,
                    ttl: DEFAULT_TTL,
                    max_request_body: DEFAULT_MAX_REQUEST_BODY,
                    max_response_body: DEFAULT_MAX_RESPONSE_BODY,
                    marker: HeaderName::from_static("idempotent-replayed"),
                    on_rejection: None,
                    wait: None,
                    waiter_limits: (DEFAULT_MAX_WAITERS, DEFAULT_MAX_WAITING_BYTES),
                    signalled_poll: DEFAULT_SIGNALLED_POLL,
                    refuse_expired: false,
                    retention_header: None,
                    clock: Arc::new(crate::store::SystemClock),
                    keyring: None,
                    hooks: Hooks::default(),
                },
                scope,
                fingerprinter: DefaultFingerprinter::new(),
                policy: DefaultStorePolicy,
            },
            store,
            mode: PhantomData,
        }
    }
}

impl<St, Sc, F, P, M> IdempotencyLayer<St, Sc, F, P, M> {
    /// The field that carries the key (default `Idempotency-Key`), e.g.
    /// `webhook-id` for Standard Webhooks receivers.
    pub fn header_name(mut self, name: HeaderName) -> Self {
        self.config.settings.header = name;
        self
    }

    /// The methods whose requests are intercepted (default POST and PATCH).
    /// Requests with other methods pass through untouched and unbuffered.
    pub fn methods<I: IntoIterator<Item = Method>>(mut self, methods: I) -> Self {
        self.config.settings.methods = methods.into_iter().collect();
        self
    }

    /// When `true`, an intercepted request without a key is answered with 400
    /// (IETF draft §2.7); when `false` (the default) it passes through
    /// untouched: it is never deduplicated.
    pub fn require_key(mut self, required: bool) -> Self {
        self.config.settings.require_key = required;
        self
    }

    /// How long an in-flight claim holds, unless renewed, before a repeat
    /// may take it over (default [`DEFAULT_LEASE`], 10 s): how long a crashed
    /// holder's keys stay in flight. A live request's lease is renewed while
    /// it runs, up to [`max_hold`](Self::max_hold), so the lease need not
    /// exceed the handler's running time. Keep it well above the store's
    /// round trip (a second or more): a renewal comes every third of a lease.
    ///
    /// Every layer that shares a store's keys must use the same lease. A
    /// lease deadline further ahead than the claiming request's own lease
    /// counts as over (a wall clock that stepped back), so a layer with a
    /// shorter lease takes over a longer-lease claim that still has more than
    /// its own lease to run, and the handler runs twice. During a deploy that
    /// lowers the lease, expect this for claims made before it.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.settings.lease = lease;
        self
    }

    /// The `Retry-After` hint of the 409 answer to a repeat that arrives
    /// while the first request is in flight (default
    /// [`DEFAULT_IN_FLIGHT_RETRY_AFTER`], 1 s). The header carries whole
    /// seconds (RFC 9110 §10.2.3): the hint rounded up, but never more than
    /// the claim's remaining lease, nor less than 1. Set it near the
    /// handler's usual running time; `Duration::MAX` sends the remaining
    /// lease, the moment after which a repeat takes the claim over.
    pub fn in_flight_retry_after(mut self, hint: Duration) -> Self {
        self.config.settings.in_flight_retry_after = hint;
        self
    }

    /// How long a record is kept, from its claim (default [`DEFAULT_TTL`]).
    /// Past it the key counts as new.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.config.settings.ttl = ttl;
        self
    }

    /// The largest request body buffered for fingerprinting, in bytes
    /// (default [`DEFAULT_MAX_REQUEST_BODY`]). A larger body is answered
    /// with 413 and creates no record.
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.config.settings.max_request_body = bytes;
        self
    }

    /// The largest response body stored for replay, in bytes (default
    /// [`DEFAULT_MAX_RESPONSE_BODY`]). A larger first response still reaches
    /// its caller whole (streamed); the record completes without the body and
    /// every repeat gets the 410 problem [`Rejection::ResponseNotStored`]:
    /// the handler never runs twice.
    pub fn max_response_body(mut self, bytes: usize) -> Self {
        self.config.settings.max_response_body = bytes;
        self
    }

    /// The header set to `true` on replays (default `Idempotent-Replayed`,
    /// as Stripe sends). It is removed from requests before the inner service
    /// sees them and from first responses, so it marks replays only.
    pub fn replayed_header(mut self, name: HeaderName) -> Self {
        self.config.settings.marker = name;
        self
    }

    /// Answers rejections with `f` instead of problem+json.
    pub fn on_rejection<R>(mut self, f: R) -> Self
    where
        R: Fn(&Rejection) -> Response<Bytes> + Send + Sync + 'static,
    {
        self.config.settings.on_rejection = Some(Arc::new(f));
        self
    }

    /// Fingerprints requests with `fingerprinter` (see [`crate::fingerprint`]).
    pub fn fingerprint<F2: Fingerprinter>(
        self,
        fingerprinter: F2,
    ) -> IdempotencyLayer<St, Sc, F2, P, M> {
        let Config {
            settings,
            scope,
            policy,
            ..
        } = self.config;
        IdempotencyLayer {
            mode: PhantomData,
            store: self.store,
            config: Config {
                settings,
                scope,
                fingerprinter,
                policy,
            },
        }
    }

    /// Decides with `policy` which responses are stored (see [`crate::policy`]).
    ///
    /// The policy sees the head only, before the body is read: a response it
    /// declines passes through unbuffered, in either mode. In transactional
    /// mode a stored response is read whole before the commit, so declining
    /// `text/event-stream` here is the way to stream it (see
    /// [`crate::mode#streamed-responses-are-buffered`]).
    pub fn store_when<P2: StorePolicy>(self, policy: P2) -> IdempotencyLayer<St, Sc, F, P2, M> {
        let Config {
            settings,
            scope,
            fingerprinter,
            ..
        } = self.config;
        IdempotencyLayer {
            mode: PhantomData,
            store: self.store,
            config: Config {
                settings,
                scope,
                fingerprinter,
                policy,
            },
        }
    }
}

impl<St: TransactionalStore, Sc, F, P> IdempotencyLayer<St, Sc, F, P, Separate> {
    /// Commits the handler's writes, the record and the response in one
    /// transaction (see [`crate::mode`]). The handler gets the store's
    /// transaction type (for SQLite, `store::SqliteTransaction`)
    /// from its request's extensions, or as an axum extractor.
    ///
    /// A concurrent duplicate never runs the handler: it waits for the
    /// store's lock (up to SQLite's busy timeout), then sees the committed
    /// record and gets the replay (or 422). If the first request holds the
    /// lock past the busy timeout, the duplicate gets 409 with
    /// `Retry-After` (in flight) on SQLite; another body gets 422 at once.
    pub fn transactional(self) -> IdempotencyLayer<St, Sc, F, P, Transactional> {
        IdempotencyLayer {
            store: self.store,
            config: self.config,
            mode: PhantomData,
        }
    }
}

impl<S, St, Sc, F, P, M> Layer<S> for IdempotencyLayer<St, Sc, F, P, M>
where
    St: Clone,
    Sc: Clone,
    F: Clone,
    P: Clone,
{
    type Service = Idempotency<S, Self>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::from_config(inner, self.store.clone(), Arc::new(self.config.clone()))
    }
}

/// The service's own constructors, as tower-http's services have: kept
/// here, beside the layer they build on, so the service needs no layer.
impl<S, St: Store, Sc: Scope + Clone> Idempotency<S, IdempotencyLayer<St, Sc>> {
    /// `inner` behind [`IdempotencyLayer::new`]`(store, scope)` with every
    /// default: the same as `IdempotencyLayer::new(store, scope).layer(inner)`.
    pub fn new(inner: S, store: St, scope: Sc) -> Self {
        tower_layer::Layer::layer(&IdempotencyLayer::new(store, scope), inner)
    }

    /// The layer that makes this service, to configure before it wraps
    /// one: [`IdempotencyLayer::new`]`(store, scope)`.
    pub fn layer(store: St, scope: Sc) -> IdempotencyLayer<St, Sc> {
        IdempotencyLayer::new(store, scope)
    }
}
