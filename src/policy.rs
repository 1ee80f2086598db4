//! Which responses complete a record and which release it.
//!
//! # Example
//!
//! ```
//! use http::{HeaderMap, StatusCode};
//! use tower_idempotency::policy::{DefaultStorePolicy, StorePolicy};
//!
//! let policy = DefaultStorePolicy;
//! assert!(policy.should_store(StatusCode::CREATED, &HeaderMap::new()));
//! assert!(policy.should_store(StatusCode::NOT_FOUND, &HeaderMap::new()));
//! assert!(!policy.should_store(StatusCode::TOO_MANY_REQUESTS, &HeaderMap::new()));
//! assert!(!policy.should_store(StatusCode::BAD_GATEWAY, &HeaderMap::new()));
//!
//! // Store successes only.
//! let only_success = |status: StatusCode, _: &HeaderMap| status.is_success();
//! assert!(!only_success.should_store(StatusCode::NOT_FOUND, &HeaderMap::new()));
//! ```
//!
//! A stored response is replayed to every repeat until the record's TTL ends.
//! A released record is deleted, so a retry with the same key runs the inner
//! service again at once. Release is meant for answers that say "nothing
//! happened, try again": server errors and the transient client errors.
//!
//! # Validation failures: [`DoNotStore`]
//!
//! Every 4xx but the three transient ones is stored, so a client whose
//! request was refused for its input must send its corrected request with a
//! NEW key: the same key with the corrected body has another fingerprint
//! and gets 422. Stripe saves no result when a request fails validation
//! before the endpoint begins to execute, so the client may retry with the
//! same key. A layer cannot see where validation ends, so here the handler
//! says it: a response carrying the [`DoNotStore`] extension releases the key
//! (in transactional mode, the transaction rolls back), whatever its status
//! and whatever the policy says. The corrected request, with the same key,
//! then runs.
//!
//! ```
//! use axum::{Extension, http::StatusCode, response::IntoResponse};
//! use tower_idempotency::policy::DoNotStore;
//!
//! async fn charge(body: String) -> axum::response::Response {
//!     let Ok(amount) = body.parse::<u64>() else {
//!         // Nothing happened: let the client fix the amount and retry with the same key.
//!         return (StatusCode::UNPROCESSABLE_ENTITY, Extension(DoNotStore), "amount must be a number").into_response();
//!     };
//!     (StatusCode::CREATED, format!("charged {amount}")).into_response()
//! }
//! ```
//!
//! Mark only answers given before any effect: a marked answer is forgotten,
//! and its retry runs the handler again.
//!
//! # Streams
//!
//! [`StorePolicy::should_store`] sees the response head only, before any of
//! the body is read, so it is the way to let streams through: a response it
//! declines is neither stored nor buffered, in either mode, and the key is
//! given back. In transactional mode, where a stored response is read whole
//! before the commit, this is the only way for a `text/event-stream` to
//! reach its caller before it ends:
//!
//! ```
//! use http::{HeaderMap, StatusCode};
//! use tower_idempotency::policy::{DefaultStorePolicy, StorePolicy};
//!
//! let not_event_streams = |status: StatusCode, headers: &HeaderMap| {
//!     DefaultStorePolicy.should_store(status, headers)
//!         && headers.get("content-type").is_none_or(|v| v != "text/event-stream")
//! };
//! let mut sse = HeaderMap::new();
//! sse.insert("content-type", "text/event-stream".parse().unwrap());
//! assert!(!not_event_streams.should_store(StatusCode::OK, &sse));
//! assert!(not_event_streams.should_store(StatusCode::OK, &HeaderMap::new()));
//! ```

use http::{HeaderMap, StatusCode};

/// A response extension by which a handler says "nothing happened, do not
/// store this answer": the layer releases the key instead of completing the
/// record (in transactional mode, the transaction rolls back), so a retry
/// with the same key, e.g. with a corrected body, runs the handler again.
/// It overrides the [`StorePolicy`]. See
/// [the module docs](crate::policy#validation-failures-donotstore).
///
/// Insert it with `response.extensions_mut().insert(DoNotStore)`, or as
/// `axum::Extension(DoNotStore)` in a handler's answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DoNotStore;

/// A response extension by which a handler says "I cannot tell whether my
/// effect happened": a commit whose answer was lost with its connection, a
/// call to a provider that timed out after it was sent. The layer neither
/// stores the answer nor gives the key back: it answers 503 `outcome-unknown`
/// with `Retry-After` (RFC 9457 problem details; see
/// [`types::OUTCOME_UNKNOWN`](crate::problem::types::OUTCOME_UNKNOWN)) instead of the
/// handler's response, and stops renewing the lease.
///
/// * **Separate mode**: the key stays in flight until its lease ends, so no
///   retry runs the operation while its outcome may still land (a `COMMIT`
///   still on its way). A retry after that takes the key over
///   ([`ClaimedKey::taken_over`](crate::key::ClaimedKey::taken_over)) and
///   runs the handler, which must then find the effect if it happened: keep
///   the idempotency key with the effect (a unique column), as the ledger
///   example does with its credits, and answer with what it finds.
/// * **Transactional mode**: the layer's own commit decides the database's
///   outcome, so the handler's writes are rolled back and the key ends as
///   for any answer the layer does not store; use separate mode for an
///   effect outside the database whose outcome can be unknown.
///
/// Insert it as `axum::Extension(OutcomeUnknown)` in the handler's answer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutcomeUnknown;

/// Decides whether the inner service's response is stored (the record
/// completes) or the record is released.
///
/// It is asked twice: [`StorePolicy::should_store`] with the response head,
/// before the body is read; then, if the response ends with trailers,
/// [`StorePolicy::should_store_trailers`] with them, before the record is
/// completed. gRPC needs the second: its status may come only in the trailers
/// (`grpc-status`). A response larger than the layer's response limit is
/// completed before its trailers arrive, so only the first question applies
/// to it.
pub trait StorePolicy: Send + Sync + 'static {
    /// `true` to store and replay this response; `false` to release the key.
    fn should_store(&self, status: StatusCode, headers: &HeaderMap) -> bool;

    /// `true` (the default) to store a response that ended with these
    /// trailers; `false` to release the key instead.
    fn should_store_trailers(&self, trailers: &HeaderMap) -> bool {
        let _ = trailers;
        true
    }
}

impl<F> StorePolicy for F
where
    F: Fn(StatusCode, &HeaderMap) -> bool + Send + Sync + 'static,
{
    fn should_store(&self, status: StatusCode, headers: &HeaderMap) -> bool {
        self(status, headers)
    }
}

/// Stores 1xx-3xx and every 4xx except 408 Request Timeout, 425 Too Early and
/// 429 Too Many Requests; releases on those three and on every 5xx.
///
/// A 4xx is the handler's considered answer to this request (a retry would
/// get the same), so it is replayed, as Stripe does for its 4xx answers. The
/// three transient 4xx and every 5xx invite a retry, so they release the key.
#[derive(Debug, Clone, Copy, Default)]
pub struct DefaultStorePolicy;

impl StorePolicy for DefaultStorePolicy {
    fn should_store(&self, status: StatusCode, _headers: &HeaderMap) -> bool {
        !(status.is_server_error()
            || matches!(
                status,
                StatusCode::REQUEST_TIMEOUT | StatusCode::TOO_MANY_REQUESTS
            )
            || status.as_u16() == 425)
    }
}

/// Whether a response is the rejection of one of axum's extractors (`Json`,
/// `Form`, `Query`, `Path`, `Bytes`, `String`), refused before the handler
/// ran: a 400, 413, 415 or 422 with axum's `text/plain; charset=utf-8` body
/// that starts with one of the texts axum 0.8 gives those rejections
/// ("Failed to deserialize the JSON body into the target type", "Expected
/// request with `Content-Type: application/json`", "Invalid URL", ...).
///
/// The layer never stores such a response (feature `axum`): nothing
/// happened, so the key is given back, as Stripe saves no result for a
/// request refused before its endpoint runs, and the corrected request runs
/// under the same key. Without this, the rejection would be replayed to the
/// corrected request under the crate's own 422 `mismatch`: one status, two
/// meanings.
///
/// ```
/// use http::{HeaderMap, HeaderValue, StatusCode};
/// use tower_idempotency::policy::is_axum_rejection;
///
/// let mut headers = HeaderMap::new();
/// headers.insert("content-type", HeaderValue::from_static("text/plain; charset=utf-8"));
/// let body = b"Failed to deserialize the JSON body into the target type: missing field `amount`";
/// assert!(is_axum_rejection(StatusCode::UNPROCESSABLE_ENTITY, &headers, body));
/// // The handler's own 422, with its own words, is its answer: stored.
/// assert!(!is_axum_rejection(StatusCode::UNPROCESSABLE_ENTITY, &headers, b"card declined"));
/// ```
pub fn is_axum_rejection(status: StatusCode, headers: &HeaderMap, body: &[u8]) -> bool {
    const TEXTS: [&[u8]; 12] = [
        b"Failed to deserialize the JSON body into the target type",
        b"Failed to parse the request body as JSON",
        b"Expected request with `Content-Type: application/json`",
        b"Form requests must have `Content-Type: application/x-www-form-urlencoded`",
        b"Failed to deserialize form",
        b"Failed to deserialize query string",
        b"Failed to buffer the request body",
        b"Request body didn't contain valid UTF-8",
        b"Invalid URL",
        b"Wrong number of path arguments",
        b"No paths parameters found for matched route",
        b"Cannot have two request body extractors",
    ];
    matches!(status.as_u16(), 400 | 413 | 415 | 422)
        && headers.get(http::header::CONTENT_TYPE).is_some_and(|v| {
            v.as_bytes()
                .eq_ignore_ascii_case(b"text/plain; charset=utf-8")
        })
        && TEXTS.iter().any(|text| body.starts_with(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_policy_table() {
        let p = DefaultStorePolicy;
        let h = HeaderMap::new();
        for code in [200, 201, 204, 301, 303, 400, 401, 403, 404, 409, 410, 422] {
            assert!(
                p.should_store(StatusCode::from_u16(code).unwrap(), &h),
                "{code}"
            );
        }
        for code in [408, 425, 429, 500, 502, 503, 504] {
            assert!(
                !p.should_store(StatusCode::from_u16(code).unwrap(), &h),
                "{code}"
            );
        }
    }
}
