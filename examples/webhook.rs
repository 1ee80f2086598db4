//! A [Standard Webhooks](https://www.standardwebhooks.com) receiver: every
//! signed event creates one order, however often its sender redelivers it.
//!
//! ```text
//! cargo run --example webhook -- [--db PATH] [--listen ADDR] [--sender NAME=whsec_...]...
//! cargo run --example webhook -- sign --secret whsec_... --id ID [--timestamp SECS] PAYLOAD
//! ```
//!
//! `POST /webhooks/{sender}` takes the events of one sender, each sender with
//! its own secret. `POST /stripe/events` takes Stripe-shaped events, whose id
//! is in the JSON body rather than a header (see [`stripe`]). Without `--sender` the receiver knows one demo sender,
//! `acme`, whose secret is [`DEMO_SECRET`] (public: for trying it out only).
//! The `sign` command prints the three header fields a sender would send:
//!
//! ```text
//! $ payload='{"type":"order.created","data":{"sku":"tea","qty":2}}'
//! $ cargo run -q --example webhook -- sign --secret whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD --id msg_1 "$payload" > headers.txt
//! $ curl -si localhost:3000/webhooks/acme -H @headers.txt -H 'content-type: application/json' -d "$payload"
//! HTTP/1.1 201 Created
//! content-type: application/json
//! content-length: 68
//! date: Sun, 29 Nov 2026 14:47:13 GMT
//!
//! {"order":1,"qty":2,"sender":"acme","sku":"tea","webhook_id":"msg_1"}
//! ```
//!
//! Sending the same `curl` again within five minutes replays that answer
//! (`idempotent-replayed: true`); re-signing it (`sign` again) is what a
//! sender's retry does, and gets the replay too.
//!
//! # The scheme (Standard Webhooks 1.0, symmetric signatures)
//!
//! * `webhook-id`: the event's id, the same on every redelivery.
//! * `webhook-timestamp`: the attempt's time in unix seconds, new on every
//!   redelivery.
//! * `webhook-signature`: a space-separated list of `v1,<base64>` entries,
//!   each an HMAC-SHA256 over `{id}.{timestamp}.{payload}` (the exact body
//!   bytes) under the key that the secret `whsec_<base64>` encodes. Several
//!   entries allow a secret rotation: the message is authentic if ANY `v1`
//!   entry matches (compared in constant time); other versions (`v1a`,
//!   asymmetric) are ignored.
//!
//! # Verified before claimed
//!
//! Two layers wrap the route, in this order from the outside in:
//!
//! 1. [`verify_signature`] reads the body (at most [`MAX_BODY`] bytes), checks
//!    the timestamp and the signature, and only then inserts the
//!    [`VerifiedSender`] into the request's extensions and passes the request
//!    on with its exact body bytes.
//! 2. The [`IdempotencyLayer`], keyed by `webhook-id` (required), scoped by
//!    the [`VerifiedSender`] ([`verified_sender_scope`]): the same id from two
//!    senders is two events, and a sender can neither replay nor block
//!    another's. The scope reads nothing but the verified extension.
//!
//! So a forged, stale or malformed message never reaches the idempotency
//! store: it occupies no id, and the genuine message with that id is still
//! processed afterwards. A redelivery is signed anew (the signature covers
//! the new timestamp), but the layer's default fingerprint covers the
//! method, the path and query and the body, not the header fields, so it
//! still matches and the redelivery gets the stored answer.
//!
//! # Answers
//!
//! | status | when | `type` |
//! |---|---|---|
//! | 201 | an `order.created` event made an order; replays carry `idempotent-replayed: true` | |
//! | 200 | an event of another type, acknowledged and ignored | |
//! | 400 | `webhook-id` or `webhook-timestamp` missing, repeated or malformed | [`problem::MISSING_HEADER`], [`problem::MALFORMED_HEADER`] |
//! | 400 | `webhook-timestamp` more than 5 minutes from this server's clock, either way | [`problem::STALE_TIMESTAMP`] |
//! | 400 | a verified `order.created` whose data is not `{"sku": string, "qty": integer}` (stored and replayed) | [`problem::INVALID_PAYLOAD`] |
//! | 401 | `webhook-signature` missing, or no `v1` entry matches | [`problem::INVALID_SIGNATURE`] |
//! | 404 | no sender of that name | [`problem::UNKNOWN_SENDER`] |
//! | 413 | a body over [`MAX_BODY`] | [`problem::BODY_TOO_LARGE`] |
//! | 422 | a verified message whose id was used with another payload | the layer's `mismatch` |
//! | 409 | a redelivery while the first delivery is still being processed | the layer's `in-flight` |
//!
//! The orders are kept in memory ([`Orders`]); the idempotency records are
//! in the SQLite file (`--db`), so after a restart a redelivery is still
//! answered from its record, not made into a second order.
//!
//! A stale timestamp is a 400, not a 401: the message may well be authentic
//! but is too old (or too new) to be accepted, and [`TOLERANCE`] is what
//! keeps a captured message from being replayed after its record expired.
//!
//! # The TTL
//!
//! The record must outlive the sender's retries, or a late retry would find
//! the id free and create a second order. [`RECORD_TTL`] is 96 hours: the
//! longest documented automatic schedule is the Standard Webhooks
//! specification's example ([`STANDARD_WEBHOOKS_RETRY_SCHEDULE`]: immediately,
//! 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 14 h, 20 h, 24 h; the last attempt
//! 75 h 35 min 5 s after the first). Svix's (immediately, 5 s, 5 min,
//! 30 min, 2 h, 5 h, 10 h, 10 h) ends after 27 h 35 min 5 s. 96 hours leaves
//! about 20 hours over the longer one for jitter and a sender's queueing.
//! Manual redeliveries from a sender's dashboard can come at any later time;
//! past the TTL they are new events (and the timestamp check does not stop
//! them: a manual resend is freshly signed). The TTL counts from the claim,
//! made by the first verified delivery that reaches the layer; an answer the
//! layer does not store (a 5xx, say) releases the id, and the next attempt
//! claims it anew.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Extension, Path, Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header, request::Parts};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, KeyInit, Mac};
use serde::Deserialize;
use sha2::Sha256;
use tower_idempotency::{IdempotencyLayer, SqliteStore, Store};

/// `POST /stripe/events`: Stripe-shaped events, keyed by their body's `id`.
#[path = "webhook_stripe.rs"]
pub mod stripe;

/// The field that names the event: the idempotency key.
pub const WEBHOOK_ID: HeaderName = HeaderName::from_static("webhook-id");
/// The attempt's time, integer unix seconds.
pub const WEBHOOK_TIMESTAMP: HeaderName = HeaderName::from_static("webhook-timestamp");
/// The space-separated `v1,<base64>` signatures.
pub const WEBHOOK_SIGNATURE: HeaderName = HeaderName::from_static("webhook-signature");

/// How far `webhook-timestamp` may be from this server's clock, either way
/// (the Standard Webhooks libraries' tolerance).
pub const TOLERANCE: Duration = Duration::from_secs(5 * 60);

/// The largest body read for verification (the same limit as the layer's).
pub const MAX_BODY: usize = tower_idempotency::DEFAULT_MAX_REQUEST_BODY;

/// The delays of the Standard Webhooks specification's example retry
/// schedule, each counted from the attempt before: the first attempt at
/// once, the last 75 h 35 min 5 s after it.
pub const STANDARD_WEBHOOKS_RETRY_SCHEDULE: [Duration; 10] = [
    Duration::ZERO,
    Duration::from_secs(5),
    Duration::from_secs(5 * 60),
    Duration::from_secs(30 * 60),
    Duration::from_secs(2 * 3600),
    Duration::from_secs(5 * 3600),
    Duration::from_secs(10 * 3600),
    Duration::from_secs(14 * 3600),
    Duration::from_secs(20 * 3600),
    Duration::from_secs(24 * 3600),
];

/// How long an event's record (and its stored answer) is kept: 96 hours,
/// longer than the whole retry schedule (see the module docs).
pub const RECORD_TTL: Duration = Duration::from_secs(96 * 3600);

/// When the last attempt of a schedule comes, counted from the first.
pub const fn schedule_span(schedule: &[Duration]) -> Duration {
    let mut total = Duration::ZERO;
    let mut i = 0;
    while i < schedule.len() {
        total = total.saturating_add(schedule[i]);
        i += 1;
    }
    total
}

// The record outlives the last retry of the schedule, by at least a few hours.
const _: () = assert!(
    RECORD_TTL.as_secs() >= schedule_span(&STANDARD_WEBHOOKS_RETRY_SCHEDULE).as_secs() + 4 * 3600
);

/// The demo sender's secret (24 bytes; the Standard Webhooks reference
/// libraries' test secret). Public: never use it for real traffic.
pub const DEMO_SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";

/// The `type` URIs of this receiver's problems (RFC 9457). They are URNs in
/// the `example` namespace (RFC 6963): name your own.
pub mod problem {
    /// 400: `webhook-id` or `webhook-timestamp` is absent.
    pub const MISSING_HEADER: &str = "urn:example:webhook:missing-header";
    /// 400: a field is repeated, not ASCII, or the timestamp is not digits.
    pub const MALFORMED_HEADER: &str = "urn:example:webhook:malformed-header";
    /// 400: the timestamp is more than the tolerance away from the server's clock.
    pub const STALE_TIMESTAMP: &str = "urn:example:webhook:stale-timestamp";
    /// 401: no signature, or none that matches.
    pub const INVALID_SIGNATURE: &str = "urn:example:webhook:invalid-signature";
    /// 404: the path names no known sender.
    pub const UNKNOWN_SENDER: &str = "urn:example:webhook:unknown-sender";
    /// 413: the body is over the limit.
    pub const BODY_TOO_LARGE: &str = "urn:example:webhook:body-too-large";
    /// 400: the body could not be read.
    pub const UNREADABLE_BODY: &str = "urn:example:webhook:unreadable-body";
    /// 400: a verified event whose payload this receiver does not understand.
    pub const INVALID_PAYLOAD: &str = "urn:example:webhook:invalid-payload";
}

// ------------------------------------------------------------ secrets and signatures

/// A sender's signing key, decoded from its `whsec_<base64>` form.
#[derive(Clone)]
pub struct Secret(Arc<[u8]>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

impl Secret {
    /// Parses `whsec_<base64>`; the key is the decoded bytes. The
    /// specification asks senders for at least 24 random bytes; any
    /// non-empty key is accepted here.
    pub fn parse(whsec: &str) -> Result<Secret, String> {
        let encoded = whsec
            .strip_prefix("whsec_")
            .ok_or("a Standard Webhooks secret starts with `whsec_`")?;
        let key = BASE64
            .decode(encoded)
            .map_err(|e| format!("the secret after `whsec_` is not base64: {e}"))?;
        if key.is_empty() {
            return Err("the secret is empty".into());
        }
        Ok(Secret(key.into()))
    }

    /// The HMAC over `{id}.{timestamp}.` followed by `payload`, not yet finalized.
    fn mac(&self, id: &str, timestamp: &str, payload: &[u8]) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes keys of any size");
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.as_bytes());
        mac.update(b".");
        mac.update(payload);
        mac
    }
}

/// Signs one delivery attempt as a sender does: the value of its
/// `webhook-signature` field (`v1,<base64 HMAC-SHA256>`), for the `id`, the
/// `timestamp` (unix seconds, also sent as `webhook-timestamp`) and the exact
/// body bytes. A sender rotating its secret sends one entry per secret,
/// joined by a space.
pub fn sign(secret: &Secret, id: &str, timestamp: i64, payload: &[u8]) -> String {
    let tag = secret
        .mac(id, &timestamp.to_string(), payload)
        .finalize()
        .into_bytes();
    format!("v1,{}", BASE64.encode(tag))
}

/// Whether any `v1` entry of a `webhook-signature` value is this message's
/// signature under `secret`. Each comparison is constant-time
/// ([`Mac::verify_slice`]); entries of other versions and undecodable ones
/// are skipped.
pub fn signature_matches(
    secret: &Secret,
    id: &str,
    timestamp: &str,
    payload: &[u8],
    signatures: &str,
) -> bool {
    let mac = secret.mac(id, timestamp, payload);
    signatures
        .split_ascii_whitespace()
        .filter_map(|entry| entry.strip_prefix("v1,"))
        .filter_map(|encoded| BASE64.decode(encoded).ok())
        .any(|tag| mac.clone().verify_slice(&tag).is_ok())
}

/// Now, in unix seconds.
pub fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

// ------------------------------------------------------------ verification

/// The senders this receiver knows, by the name in their path.
#[derive(Debug, Clone, Default)]
pub struct Senders(HashMap<String, Secret>);

impl Senders {
    /// No senders yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds (or replaces) the sender `name` with its secret.
    #[must_use]
    pub fn with(mut self, name: &str, secret: Secret) -> Self {
        self.0.insert(name.to_owned(), secret);
        self
    }
}

/// The sender whose signature a request carried, put into the request's
/// extensions by [`verify_signature`] only after the signature matched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedSender(pub String);

/// The idempotency scope: the verified sender, and nothing the request
/// itself claims. A request without one cannot have come through
/// [`verify_signature`]; rather than trust its path, it is put in a scope of
/// its own, and the handler (which requires the extension) answers it 500,
/// which the layer does not store.
pub fn verified_sender_scope(parts: &Parts) -> String {
    match parts.extensions.get::<VerifiedSender>() {
        Some(VerifiedSender(name)) => format!("sender:{name}"),
        None => "unverified".to_owned(),
    }
}

/// An `application/problem+json` answer (RFC 9457).
fn problem_response(status: StatusCode, kind: &str, title: &str, detail: &str) -> Response {
    let body = serde_json::json!({
        "type": kind,
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut response = (status, body.to_string()).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

/// Why [`verify_signature`] refused a delivery. None of them reaches the
/// idempotency layer, so none occupies the `webhook-id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// 404: the path names no known sender.
    UnknownSender,
    /// 400: `webhook-id` or `webhook-timestamp` is absent.
    MissingHeader(HeaderName),
    /// 400: a field repeated, not visible ASCII, or a timestamp that is not digits.
    MalformedHeader(String),
    /// 400: the timestamp is more than [`TOLERANCE`] away from the server's
    /// clock; `newer` when it is ahead.
    StaleTimestamp {
        /// Ahead of the clock rather than behind it.
        newer: bool,
    },
    /// 413: the body is larger than [`MAX_BODY`].
    BodyTooLarge,
    /// 400: the body could not be read.
    UnreadableBody,
    /// 401: no `webhook-signature`, or no `v1` entry that matches.
    InvalidSignature(&'static str),
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match self {
            Refusal::UnknownSender => problem_response(
                StatusCode::NOT_FOUND,
                problem::UNKNOWN_SENDER,
                "Unknown sender",
                "this receiver has no sender of that name",
            ),
            Refusal::MissingHeader(name) => problem_response(
                StatusCode::BAD_REQUEST,
                problem::MISSING_HEADER,
                "Missing webhook header",
                &format!("the request has no `{name}` field"),
            ),
            Refusal::MalformedHeader(detail) => problem_response(
                StatusCode::BAD_REQUEST,
                problem::MALFORMED_HEADER,
                "Malformed webhook header",
                &detail,
            ),
            Refusal::StaleTimestamp { newer } => problem_response(
                StatusCode::BAD_REQUEST,
                problem::STALE_TIMESTAMP,
                "Webhook timestamp out of tolerance",
                &format!(
                    "`webhook-timestamp` is {} than this server's clock by more than {} s",
                    if newer { "newer" } else { "older" },
                    TOLERANCE.as_secs()
                ),
            ),
            Refusal::BodyTooLarge => problem_response(
                StatusCode::PAYLOAD_TOO_LARGE,
                problem::BODY_TOO_LARGE,
                "Webhook payload too large",
                &format!("the body is larger than {MAX_BODY} bytes"),
            ),
            Refusal::UnreadableBody => problem_response(
                StatusCode::BAD_REQUEST,
                problem::UNREADABLE_BODY,
                "Unreadable webhook payload",
                "the body could not be read",
            ),
            Refusal::InvalidSignature(detail) => {
                let mut response = problem_response(
                    StatusCode::UNAUTHORIZED,
                    problem::INVALID_SIGNATURE,
                    "Invalid webhook signature",
                    detail,
                );
                // RFC 9110 §11.6.1: a 401 carries a challenge. The scheme names
                // what is expected; it is not a registered HTTP authentication scheme.
                response.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Standard-Webhooks realm=\"webhooks\""),
                );
                response
            }
        }
    }
}

/// The one value of the field `name`, as text.
fn single<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Result<&'a str, Refusal> {
    let mut values = headers.get_all(name).iter();
    let value = values
        .next()
        .ok_or_else(|| Refusal::MissingHeader(name.clone()))?;
    if values.next().is_some() {
        return Err(Refusal::MalformedHeader(format!(
            "the `{name}` field appears more than once"
        )));
    }
    value
        .to_str()
        .map_err(|_| Refusal::MalformedHeader(format!("the `{name}` field is not visible ASCII")))
}

/// The middleware that runs before the idempotency layer: it verifies the
/// message (see [`verify`]) and only then passes it on, with the
/// [`VerifiedSender`] in its extensions and its exact body bytes.
pub async fn verify_signature(
    State(senders): State<Arc<Senders>>,
    Path(sender): Path<String>,
    request: Request,
    next: Next,
) -> Response {
    let (mut parts, body) = request.into_parts();
    match verify(&senders, &sender, &parts.headers, body).await {
        Ok((sender, payload)) => {
            parts.extensions.insert(sender);
            next.run(Request::from_parts(parts, Body::from(payload)))
                .await
        }
        Err(refusal) => refusal.into_response(),
    }
}

/// Verifies one delivery to `sender`: returns the verified sender and the
/// body's exact bytes.
///
/// Order of the checks: the sender (404), `webhook-id` and
/// `webhook-timestamp` (400), the timestamp's tolerance (400), the body's size
/// (413), the signature (401).
pub async fn verify(
    senders: &Senders,
    sender: &str,
    headers: &HeaderMap,
    body: Body,
) -> Result<(VerifiedSender, Bytes), Refusal> {
    let (name, secret) = senders
        .0
        .get_key_value(sender)
        .ok_or(Refusal::UnknownSender)?;
    let id = single(headers, &WEBHOOK_ID)?;
    let timestamp = single(headers, &WEBHOOK_TIMESTAMP)?;
    // Digits only: the signed content holds the field as sent, so `+5` or
    // `-0` must not stand for a time.
    let seconds = match timestamp.parse::<i64>() {
        Ok(s) if timestamp.bytes().all(|b| b.is_ascii_digit()) => s,
        _ => {
            return Err(Refusal::MalformedHeader(
                "`webhook-timestamp` is not integer unix seconds".into(),
            ));
        }
    };
    let skew = seconds.saturating_sub(unix_now());
    if skew.unsigned_abs() > TOLERANCE.as_secs() {
        return Err(Refusal::StaleTimestamp { newer: skew > 0 });
    }

    let payload = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(payload) => payload,
        Err(e) if is_length_limit(&e) => return Err(Refusal::BodyTooLarge),
        Err(_) => return Err(Refusal::UnreadableBody),
    };

    // Several fields are one list (RFC 9110 §5.3).
    let mut signatures = String::new();
    for value in headers.get_all(&WEBHOOK_SIGNATURE) {
        let value = value.to_str().map_err(|_| {
            Refusal::InvalidSignature("the `webhook-signature` field is not visible ASCII")
        })?;
        signatures.push_str(value);
        signatures.push(' ');
    }
    if signatures.is_empty() {
        return Err(Refusal::InvalidSignature(
            "the request has no `webhook-signature` field",
        ));
    }
    if !signature_matches(secret, id, timestamp, &payload, &signatures) {
        return Err(Refusal::InvalidSignature(
            "no `v1` signature in `webhook-signature` matches this sender's secret",
        ));
    }
    Ok((VerifiedSender(name.clone()), payload))
}

/// Whether reading the body stopped at [`MAX_BODY`] (`to_bytes` wraps the
/// limit's error in an `axum::Error`).
fn is_length_limit(error: &axum::Error) -> bool {
    std::error::Error::source(error).is_some_and(|e| e.is::<http_body_util::LengthLimitError>())
}

// ------------------------------------------------------------ the orders

/// One order, made by one `order.created` event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Order {
    /// Its number, from 1.
    pub id: u64,
    /// The verified sender of the event.
    pub sender: String,
    /// The event's `webhook-id`.
    pub webhook_id: String,
    /// What was ordered.
    pub sku: String,
    /// How many.
    pub qty: u32,
}

/// The orders made so far, shared by the handlers (and the tests).
#[derive(Debug, Clone, Default)]
pub struct Orders(Arc<Mutex<Vec<Order>>>);

impl Orders {
    /// No orders yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many orders were made.
    pub fn count(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    /// Every order, in the order they were made.
    pub fn all(&self) -> Vec<Order> {
        self.0.lock().unwrap().clone()
    }

    fn create(&self, sender: String, webhook_id: String, sku: String, qty: u32) -> Order {
        let mut orders = self.0.lock().unwrap();
        let order = Order {
            id: orders.len() as u64 + 1,
            sender,
            webhook_id,
            sku,
            qty,
        };
        orders.push(order.clone());
        order
    }
}

#[derive(Deserialize)]
struct Event {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    data: serde_json::Value,
}

#[derive(Deserialize)]
struct OrderCreated {
    sku: String,
    qty: u32,
}

/// Handles one verified event. It runs once per `(sender, webhook-id)`: the
/// layer answers every redelivery with this answer.
async fn receive(
    State(orders): State<Orders>,
    Extension(VerifiedSender(sender)): Extension<VerifiedSender>,
    headers: HeaderMap,
    payload: Bytes,
) -> Response {
    let invalid = |detail: String| {
        problem_response(
            StatusCode::BAD_REQUEST,
            problem::INVALID_PAYLOAD,
            "Invalid webhook payload",
            &detail,
        )
    };
    let event: Event = match serde_json::from_slice(&payload) {
        Ok(event) => event,
        Err(e) => return invalid(format!("the payload is not an event: {e}")),
    };
    if event.kind != "order.created" {
        // Acknowledge what this receiver does not handle, so the sender
        // does not retry it.
        let body = serde_json::json!({ "ignored": event.kind });
        return (StatusCode::OK, axum::Json(body)).into_response();
    }
    let data: OrderCreated = match serde_json::from_value(event.data) {
        Ok(data) => data,
        Err(e) => return invalid(format!("order.created data: {e}")),
    };
    // The layer passed `webhook-id` on; the verifier made sure there is one.
    let webhook_id = headers
        .get(&WEBHOOK_ID)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let order = orders.create(sender, webhook_id, data.sku, data.qty);
    let body = serde_json::json!({
        "order": order.id,
        "sender": order.sender,
        "webhook_id": order.webhook_id,
        "sku": order.sku,
        "qty": order.qty,
    });
    (StatusCode::CREATED, axum::Json(body)).into_response()
}

/// The receiver over any store: `POST /webhooks/{sender}`, verified, then
/// deduplicated by `webhook-id` per sender, then handled.
pub fn router<St: Store>(store: St, senders: Senders, orders: Orders) -> Router {
    let idempotency = IdempotencyLayer::new(store, verified_sender_scope)
        .header_name(WEBHOOK_ID)
        .require_key(true)
        .ttl(RECORD_TTL)
        .max_request_body(MAX_BODY);
    Router::new()
        .route("/webhooks/{sender}", post(receive))
        // The later `route_layer` is the outer one: verification runs first.
        .route_layer(idempotency)
        .route_layer(middleware::from_fn_with_state(
            Arc::new(senders),
            verify_signature,
        ))
        .with_state(orders)
}

// ------------------------------------------------------------ the command line

const USAGE: &str = "usage: webhook [--db PATH] [--listen ADDR] [--sender NAME=whsec_...]...
       webhook sign --secret whsec_... --id ID [--timestamp SECS] PAYLOAD";

struct Args {
    db: PathBuf,
    listen: SocketAddr,
    senders: Senders,
}

/// Reads `--flag value` or `--flag=value` pairs; `positional` gets the rest.
fn flags(
    args: Vec<String>,
    mut on_flag: impl FnMut(&str, String) -> Result<(), String>,
    mut positional: impl FnMut(String) -> Result<(), String>,
) -> Result<(), String> {
    let mut it = args.into_iter();
    while let Some(arg) = it.next() {
        if arg == "-h" || arg == "--help" {
            return Err(USAGE.into());
        }
        if !arg.starts_with("--") {
            positional(arg)?;
            continue;
        }
        let (flag, value) = match arg.split_once('=') {
            Some((f, v)) => (f.to_owned(), v.to_owned()),
            None => {
                let value = it
                    .next()
                    .ok_or_else(|| format!("{arg} needs a value\n{USAGE}"))?;
                (arg, value)
            }
        };
        on_flag(&flag, value)?;
    }
    Ok(())
}

fn serve_args(args: Vec<String>) -> Result<Args, String> {
    let mut db = PathBuf::from("webhooks.sqlite3");
    let mut listen = SocketAddr::from(([127, 0, 0, 1], 3000));
    let mut senders = Senders::new();
    let mut any_sender = false;
    flags(
        args,
        |flag, value| {
            match flag {
                "--db" => db = PathBuf::from(value),
                "--listen" => listen = value.parse().map_err(|e| format!("--listen: {e}"))?,
                "--sender" => {
                    let (name, secret) = value
                        .split_once('=')
                        .ok_or("--sender takes NAME=whsec_...")?;
                    let secret =
                        Secret::parse(secret).map_err(|e| format!("--sender {name}: {e}"))?;
                    senders = std::mem::take(&mut senders).with(name, secret);
                    any_sender = true;
                }
                other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
            }
            Ok(())
        },
        |arg| Err(format!("unexpected argument {arg:?}\n{USAGE}")),
    )?;
    if !any_sender {
        eprintln!("no --sender given: using the demo sender `acme` with the public DEMO_SECRET");
        senders = senders.with("acme", Secret::parse(DEMO_SECRET)?);
    }
    Ok(Args {
        db,
        listen,
        senders,
    })
}

/// `sign`: prints the three header fields of one delivery attempt.
fn sign_command(args: Vec<String>) -> Result<String, String> {
    let (mut secret, mut id, mut timestamp, mut payload) = (None, None, None, None);
    flags(
        args,
        |flag, value| {
            match flag {
                "--secret" => secret = Some(Secret::parse(&value)?),
                "--id" => id = Some(value),
                "--timestamp" => {
                    timestamp = Some(value.parse().map_err(|e| format!("--timestamp: {e}"))?)
                }
                other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
            }
            Ok(())
        },
        |arg| match payload.replace(arg) {
            None => Ok(()),
            Some(_) => Err(format!("one PAYLOAD only\n{USAGE}")),
        },
    )?;
    let secret = secret.ok_or(format!("sign needs --secret\n{USAGE}"))?;
    let id = id.ok_or(format!("sign needs --id\n{USAGE}"))?;
    let payload = payload.ok_or(format!("sign needs a PAYLOAD\n{USAGE}"))?;
    let timestamp = timestamp.unwrap_or_else(unix_now);
    let signature = sign(&secret, &id, timestamp, payload.as_bytes());
    Ok(format!(
        "webhook-id: {id}\nwebhook-timestamp: {timestamp}\nwebhook-signature: {signature}"
    ))
}

#[tokio::main]
async fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().is_some_and(|a| a == "sign") {
        args.remove(0);
        match sign_command(args) {
            Ok(headers) => println!("{headers}"),
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(2);
            }
        }
        return;
    }
    let args = serve_args(args).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2);
    });
    let store = SqliteStore::open(&args.db).await.unwrap_or_else(|e| {
        eprintln!("cannot open {}: {e}", args.db.display());
        std::process::exit(1);
    });
    // Expired records are ignored by lookups anyway; this reclaims their space.
    tower_idempotency::store::spawn_purge_task(store.clone(), Duration::from_secs(3600));
    let app = router(store.clone(), args.senders, Orders::new())
        .merge(stripe::router(store, stripe::Handled::default()));
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .unwrap_or_else(|e| {
            eprintln!("cannot listen on {}: {e}", args.listen);
            std::process::exit(1);
        });
    let addr = listener
        .local_addr()
        .expect("a bound listener has an address");
    println!("listening on http://{addr}");
    axum::serve(listener, app).await.expect("server");
}
