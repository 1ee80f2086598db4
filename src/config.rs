//! What a layer is configured with: the defaults, and the [`Config`] its
//! services share. [`IdempotencyLayer`](crate::IdempotencyLayer) builds it;
//! [`Idempotency`](crate::Idempotency) reads it.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderName, Method, Response};

use crate::body::ResponseBody;
use crate::hooks::{EventKind, Hooks};
use crate::key_source::KeySource;
use crate::problem::Rejection;
use crate::seal::Keyring;
use crate::store::Clock;
use crate::store::RecordId;
use crate::wait::Waiting;

/// The default request body limit, 1 MiB.
pub const DEFAULT_MAX_REQUEST_BODY: usize = 1024 * 1024;
/// The default response body limit, 1 MiB.
pub const DEFAULT_MAX_RESPONSE_BODY: usize = 1024 * 1024;
/// The default `Retry-After` hint on a 409 in-flight answer: 1 second.
///
/// Most handlers finish in well under a second, so a client that obeys the
/// hint retries soon after the first request completes and gets its replay.
/// The remaining lease (up to [`DEFAULT_LEASE`](crate::DEFAULT_LEASE), 10 s,
/// renewed while the request runs) is the time after which the claim may be
/// *taken over*, not the time the first request needs; sent as the hint, it
/// would make obedient clients wait seconds for a result that was ready
/// after a few milliseconds.
pub const DEFAULT_IN_FLIGHT_RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

type RejectionFn = Arc<dyn Fn(&Rejection) -> Response<Bytes> + Send + Sync>;

/// What a layer is configured with; shared by its services behind an `Arc`.
#[derive(Clone)]
pub(crate) struct Config<Sc, F, P> {
    pub(crate) settings: Settings,
    pub(crate) scope: Sc,
    pub(crate) fingerprinter: F,
    pub(crate) policy: P,
}

/// The settings that do not change the layer's type.
#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) header: HeaderName,
    /// Where the key is read when not from `header`: looked up after the
    /// body is buffered (see `crate::key_source`).
    pub(crate) key_source: Option<Arc<dyn KeySource>>,
    pub(crate) methods: Vec<Method>,
    pub(crate) require_key: bool,
    pub(crate) lease: Duration,
    /// The longest a request may hold its key, counted from its claim: its
    /// lease is renewed while it runs, up to this (`max_hold`).
    pub(crate) max_hold: Duration,
    /// The layer's one renewal task, shared by its services.
    pub(crate) renewer: Arc<dyn crate::renew::Renew>,
    pub(crate) in_flight_retry_after: Duration,
    pub(crate) ttl: Duration,
    pub(crate) max_request_body: usize,
    pub(crate) max_response_body: usize,
    pub(crate) marker: HeaderName,
    pub(crate) on_rejection: Option<RejectionFn>,
    /// Repeats that wait for the first request (`wait_in_flight`).
    pub(crate) wait: Option<Arc<Waiting>>,
    /// The caps on waiters (`max_waiters`): how many, and how many bytes.
    pub(crate) waiter_limits: (usize, usize),
    /// How often a waiter claims while the store's signal is live
    /// (`signalled_poll_interval`).
    pub(crate) signalled_poll: Duration,
    /// Refuse a fresh claim first sent longer ago than the TTL (`first_sent`).
    pub(crate) refuse_expired: bool,
    /// The field that advertises the TTL on first responses and replays.
    pub(crate) retention_header: Option<HeaderName>,
    /// The clock that judges first-sent times.
    pub(crate) clock: Arc<dyn Clock>,
    /// Encryption at rest: the keys that seal and open stored responses.
    pub(crate) keyring: Option<Keyring>,
    /// The namespace, the event hook and the replay hook.
    pub(crate) hooks: Hooks,
}

impl Settings {
    pub(crate) fn rejection(&self, rejection: &Rejection) -> Response<Bytes> {
        match &self.on_rejection {
            Some(f) => f(rejection),
            None => rejection.to_problem(),
        }
    }

    /// [`Settings::rejection`] as the layer's response type, told to the
    /// application's event hook with the record `id` when it is known.
    pub(crate) fn rejection_response<B: http_body::Body>(
        &self,
        rejection: &Rejection,
        id: Option<&RecordId>,
    ) -> Response<ResponseBody<B>> {
        let kind = EventKind::Rejected {
            status: rejection.status(),
            problem_type: rejection.problem_type(),
        };
        self.hooks.emit(kind, id);
        self.rejection(rejection)
            .map(|body| ResponseBody::full(body, None))
    }
}
