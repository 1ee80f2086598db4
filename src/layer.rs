//! [`IdempotencyLayer`]: the configuration, and the [`tower_layer::Layer`]
//! that wraps a service in [`Idempotency`].

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Method, Response};
use tower_layer::Layer;

use crate::config::{
    Config, DEFAULT_IN_FLIGHT_RETRY_AFTER, DEFAULT_MAX_REQUEST_BODY, DEFAULT_MAX_RESPONSE_BODY,
    Settings,
};
use crate::fingerprint::{DefaultFingerprinter, Fingerprinter};
use crate::mode::{Separate, Transactional};
use crate::policy::{DefaultStorePolicy, StorePolicy};
use crate::problem::Rejection;
use crate::scope::Scope;
use crate::seal::Keyring;
use crate::service::Idempotency;
use crate::store::{DEFAULT_LEASE, DEFAULT_TTL};
use crate::store::{Store, TransactionalStore};
use crate::wait::{
    DEFAULT_MAX_WAITERS, DEFAULT_MAX_WAITING_BYTES, DEFAULT_SIGNALLED_POLL, Waiting,
};

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
    /// optional; lease [`DEFAULT_LEASE`]; TTL [`DEFAULT_TTL`]; request and
    /// response limits [`DEFAULT_MAX_REQUEST_BODY`] and
    /// [`DEFAULT_MAX_RESPONSE_BODY`]; marker `Idempotent-Replayed`;
    /// [`DefaultFingerprinter`]; [`DefaultStorePolicy`]; problem+json rejections.
    pub fn new(store: St, scope: Sc) -> Self {
        IdempotencyLayer {
            store,
            config: Config {
                settings: Settings {
                    header: HeaderName::from_static("idempotency-key"),
                    key_source: None,
                    methods: vec![Method::POST, Method::PATCH],
                    require_key: false,
                    lease: DEFAULT_LEASE,
                    max_hold: None,
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
                },
                scope,
                fingerprinter: DefaultFingerprinter::new(),
                policy: DefaultStorePolicy,
            },
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

    /// Reads the key from the JSON body at `pointer` (RFC 6901, e.g. `/id`)
    /// instead of a header: a string, or an integer in decimal. See
    /// [`crate::key_source`] for what changes (the body is read before the
    /// key is known) and an example; a body that is not JSON is answered
    /// with the 400 `invalid-key` problem.
    ///
    /// # Panics
    ///
    /// When `pointer` is neither empty nor starts with `/`.
    pub fn key_from_json(self, pointer: impl Into<String>) -> Self {
        self.key_from(crate::key_source::json_pointer(pointer))
    }

    /// Reads the key with `f`, a function of the request head and its
    /// buffered body, instead of a header. `Ok(None)` is no key (400
    /// `missing-key`, or a pass-through with `require_key(false)`); an error
    /// is the 400 `invalid-key` problem; a key is checked with
    /// [`check_key`](crate::key_source::check_key).
    ///
    /// ```
    /// use http::request::Parts;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, key::KeyError, scope::GlobalScope};
    ///
    /// // The key is the first line of a text body.
    /// let layer = IdempotencyLayer::new(MemoryStore::new(), GlobalScope).key_from_fn(
    ///     |_: &Parts, body: &[u8]| -> Result<Option<String>, KeyError> {
    ///         let text = std::str::from_utf8(body).map_err(|_| KeyError::NotPrintableAscii)?;
    ///         Ok(text.lines().next().map(str::to_owned))
    ///     },
    /// );
    /// # let _ = layer;
    /// ```
    pub fn key_from_fn<Fun>(self, f: Fun) -> Self
    where
        Fun: Fn(&http::request::Parts, &[u8]) -> Result<Option<String>, crate::key::KeyError>
            + Send
            + Sync
            + 'static,
    {
        self.key_from(crate::key_source::from_fn(f))
    }

    /// Reads the key with `source` instead of a header (see
    /// [`crate::key_source`]).
    pub fn key_from<K: crate::key_source::KeySource>(mut self, source: K) -> Self {
        self.config.settings.key_source = Some(Arc::new(source));
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

    /// How long an in-flight claim holds before a repeat may take it over
    /// (default [`DEFAULT_LEASE`]). Set it above the handler's longest
    /// running time: a holder still running when its lease ends may see its
    /// work repeated by the request that took over.
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

    /// Renews the lease of every claim while its request runs, for at most
    /// `max_hold` from the claim (off by default). A short
    /// [`lease`](Self::lease) then frees the keys of a crashed process
    /// within one lease, while a handler slower than the lease keeps its
    /// key: the layer extends the lease every third of a lease, fenced by
    /// the claim's token ([`Store::renew`](crate::store::Store::renew)).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, scope::GlobalScope};
    ///
    /// // Crashed holders free their keys within 5 s; a live handler may
    /// // hold its key for up to 10 minutes.
    /// let layer = IdempotencyLayer::new(MemoryStore::new(), GlobalScope)
    ///     .lease(Duration::from_secs(5))
    ///     .renew_lease(Duration::from_secs(600));
    /// # let _ = layer;
    /// ```
    ///
    /// - **Max hold.** Renewals stop at `max_hold`; the lease then runs out
    ///   and a repeat may take the key over. A transactional store rolls a
    ///   transaction back past its own max hold or this one, whichever is
    ///   shorter.
    /// - **A lost lease** (a renewal finds the record carrying another
    ///   token, or the store could not confirm one before the lease ended)
    ///   is logged at WARN, counted (`tower_idempotency_leases_lost_total` with the
    ///   `metrics` feature), and signalled to the handler through
    ///   [`ClaimedKey::lease_lost`](crate::key::ClaimedKey::lease_lost). In
    ///   transactional mode the commit is fenced by the token: a request
    ///   whose key was taken over never commits (503).
    /// - **Where it applies.** Separate mode on every store, and
    ///   transactional mode where the claim commits before the handler runs
    ///   (PostgreSQL, MySQL). SQLite's transactional claim lives inside the
    ///   open transaction, vanishes with a crash, and needs no renewal; but
    ///   there too `max_hold`, not the lease, caps how long a transaction
    ///   may be held (with the store's own max hold), so a handler slower
    ///   than a short lease is not rolled back at the lease.
    /// - **Streams.** Renewal goes on until the record is stored, so a
    ///   streamed first response is stored if it ends within `max_hold`
    ///   (or within the lease, if that is longer).
    /// - **Sizing.** A renewal is one short write on a connection of the
    ///   store's pool. A transactional request on PostgreSQL or MySQL holds
    ///   a connection of that pool while its handler runs, so size the pool
    ///   above the number of such requests at once: a renewal that cannot
    ///   get a connection before the lease ends is a lost lease. Keep the
    ///   lease well above the store's round trip (a second or more): a
    ///   renewal comes every third of a lease.
    pub fn renew_lease(mut self, max_hold: Duration) -> Self {
        self.config.settings.max_hold = Some(max_hold);
        self
    }

    /// A repeat that arrives while the first request with its key is in
    /// flight waits up to `max_wait` for it to finish, then gets the first
    /// request's answer: its replay (or 422 for another fingerprint, or,
    /// when the first gave its key back or lost its lease, a run of its
    /// own). Past `max_wait`, or when the waiters are full (see
    /// [`max_waiters`](Self::max_waiters)), it gets 409 as without this
    /// option. Off by default: `Duration::ZERO` answers 409 at once, the
    /// IETF draft's rule (§2.6).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, scope::GlobalScope};
    ///
    /// // Concurrent duplicates of a request that takes 200 ms get its
    /// // replay, not 409.
    /// let layer = IdempotencyLayer::new(MemoryStore::new(), GlobalScope)
    ///     .wait_in_flight(Duration::from_secs(2));
    /// # let _ = layer;
    /// ```
    ///
    /// - **Woken by the completion.** A first request in this process,
    ///   behind this layer (or a clone of it), wakes its waiters when its
    ///   record completes or its key is given back.
    /// - **Woken by the store for other servers.** A store with a signal
    ///   ([`Store::watch`](crate::store::Store::watch)) wakes a waiter when
    ///   a first request on another server completes or gives its key back:
    ///   `PostgresStore` with `notify_waiters(true)` (PostgreSQL
    ///   `LISTEN`/`NOTIFY`, off by default: it costs commit throughput) and
    ///   `RedisStore` on one server (pub/sub). Measured on loopback
    ///   (`bench/wake`, 200 runs): a waiter on another server answers
    ///   0.4 ms (PostgreSQL) or 0.6 ms (Redis) after the first request's
    ///   client has its response at the median, under 12 ms at worst;
    ///   polling alone: 29 ms at the median, 97 ms at worst.
    /// - **Polling as the backstop.** A waiter also claims again after
    ///   5 ms, then at doubling intervals up to 100 ms (without a live
    ///   signal: the memory and SQLite stores, MySQL, the sqlx PostgreSQL
    ///   store, a Redis Cluster, or while the store's listener reconnects),
    ///   or every [`signalled_poll_interval`](Self::signalled_poll_interval)
    ///   (default 1 s) while the signal is live; and at the end of the first
    ///   request's lease. Without a signal a first request on another server
    ///   is seen within 100 ms of its completion.
    /// - **Holds nothing.** A waiter holds no store connection and no writer
    ///   slot while it waits; each claim is one short store call, as a
    ///   client's retry would be.
    /// - **Cancelled with its caller.** A waiter whose client goes away
    ///   stops at its next claim and never runs the handler.
    pub fn wait_in_flight(mut self, max_wait: Duration) -> Self {
        let (count, bytes) = self.config.settings.waiter_limits;
        self.config.settings.wait =
            (!max_wait.is_zero()).then(|| Arc::new(Waiting::new(max_wait, count, bytes)));
        self
    }

    /// How often a waiting repeat claims again while its store's signal is
    /// live (see [`wait_in_flight`](Self::wait_in_flight)): the backstop
    /// for an announcement the store lost. Default 1 s; never later than
    /// the end of the first request's lease.
    pub fn signalled_poll_interval(mut self, interval: Duration) -> Self {
        self.config.settings.signalled_poll = interval;
        self
    }

    /// Caps the repeats that wait at once behind this layer (see
    /// [`wait_in_flight`](Self::wait_in_flight)): at most `count` of them
    /// (default [`DEFAULT_MAX_WAITERS`], 256), holding at most `bytes` of
    /// buffered request bodies between them (default
    /// [`DEFAULT_MAX_WAITING_BYTES`], 16 MiB). A repeat beyond either cap
    /// gets 409 at once.
    pub fn max_waiters(mut self, count: usize, bytes: usize) -> Self {
        if let Some(wait) = &self.config.settings.wait {
            self.config.settings.wait = Some(Arc::new(Waiting::new(wait.bound, count, bytes)));
        }
        self.config.settings.waiter_limits = (count, bytes);
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

    /// Refuses, with 412 [`Rejection::ExpiredRetry`] and without running the
    /// handler, a request whose `Repeatability-First-Sent` is older than the
    /// [`ttl`](Self::ttl) when its claim finds no live record: a retry whose
    /// record may have expired (off by default). Requests without the field
    /// are not guarded; a malformed field, or one more than a minute ahead of
    /// the layer's [`clock`](Self::clock), is a 400. See
    /// [`crate::first_sent`] for the rules and an example.
    pub fn refuse_expired_retries(mut self) -> Self {
        self.config.settings.refuse_expired = true;
        self
    }

    /// Sends the [`ttl`](Self::ttl) in whole seconds in the field `name` on
    /// first responses and replays (not on the layer's rejections, nor on
    /// answers that are not stored). No field name is standard;
    /// [`crate::first_sent::IDEMPOTENCY_TTL`] (`Idempotency-TTL`) is the
    /// one proposed for the IETF draft (see [`crate::first_sent`]).
    pub fn advertise_retention(mut self, name: HeaderName) -> Self {
        self.config.settings.retention_header = Some(name);
        self
    }

    /// The clock that judges `Repeatability-First-Sent` times (default: the
    /// system clock). Tests pass the `test_util::ManualClock` their store
    /// runs on.
    pub fn clock(mut self, clock: impl crate::store::Clock) -> Self {
        self.config.settings.clock = Arc::new(clock);
        self
    }

    /// Seals every stored response with `keyring`'s first key, and opens
    /// stored responses with any of its keys (off by default): header
    /// fields, body and trailers are kept encrypted (XChaCha20-Poly1305),
    /// bound to their scope, key and fingerprint; the status stays in the
    /// clear. Works with every store. A sealed record that no key opens is
    /// never replayed (503); a plain record, stored before this was turned
    /// on, is still replayed. See [`crate::seal`].
    pub fn encrypt_at_rest(mut self, keyring: Keyring) -> Self {
        self.config.settings.keyring = Some(keyring);
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
    type Service = Idempotency<S, St, Sc, F, P, M>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.store.clone(), Arc::new(self.config.clone()))
    }
}
