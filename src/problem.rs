//! The layer's own answers: problem details (RFC 9457) for every rejection.
//!
//! # Example
//!
//! ```
//! use tower_idempotency::problem::Rejection;
//!
//! let response = Rejection::InFlight { retry_after_secs: 3 }.to_problem();
//! assert_eq!(response.status(), 409);
//! assert_eq!(response.headers()["content-type"], "application/problem+json");
//! assert_eq!(response.headers()["retry-after"], "3");
//! ```
//!
//! Each rejection has a stable `type` URI (the constants in [`types`]), a
//! `title`, the `status`, and a `detail` that never echoes the key or the body.
//! To answer differently (another format, gRPC statuses), give the layer a
//! closure with [`crate::IdempotencyLayer::on_rejection`].
//!
//! # Problem types
//!
//! Each `type` URI points at one of the sections below.
//!
//! ## missing-key
//!
//! Status 400. The route requires an `Idempotency-Key` and the request has none.
//! Send a new unique key (a UUID, say) with each new operation and the same
//! key with every retry of it.
//!
//! ## invalid-key
//!
//! Status 400. The key field is malformed: empty, over 255 characters, bytes outside
//! printable ASCII, an unterminated or wrongly escaped sf-string, a list,
//! parameters, a bare value that is a structured date, display string, byte
//! sequence or boolean rather than a string (RFC 9651 §3.3), or the field sent
//! twice (see [`crate::key`]). Nothing was recorded.
//!
//! ## body-too-large
//!
//! Status 413. The request body is over the layer's limit. Nothing was recorded;
//! the key is still free.
//!
//! ## unreadable-body
//!
//! Status 400. The body could not be read, or the fingerprint could not be computed
//! from it (a JSON fingerprint and a body that is not JSON). Nothing was
//! recorded.
//!
//! ## mismatch
//!
//! Status 422. The key was first used with a different request (method, path,
//! query or body, as the fingerprint sees them). Use a new key for a new
//! operation.
//!
//! ## in-flight
//!
//! Status 409. The first request with this key is still running. `Retry-After`
//! gives whole seconds: the layer's hint
//! ([`IdempotencyLayer::in_flight_retry_after`](crate::IdempotencyLayer::in_flight_retry_after),
//! default 1 s), never more than what is left of its lease; a retry after
//! the first request finished gets the stored answer.
//!
//! ## store-unavailable
//!
//! Status 503. The store could not answer (a lock held past the busy timeout, an
//! I/O error), or, in transactional mode, the commit failed. The request did
//! not run, or ran and was rolled back; nothing was replayed. Retry after
//! `Retry-After` seconds with the same key.
//!
//! ## held-too-long
//!
//! Status 503. The request ran past its max hold time in transactional mode
//! (the layer's `max_hold`), so its
//! transaction was rolled back: nothing of it happened and its key is free.
//! The store was reachable; the handler was slow. Retry after `Retry-After`
//! seconds with the same key; if it happens again, the handler needs more
//! time than its max hold allows.
//!
//! ## record-sealed
//!
//! Status 503. The request's key has a stored response, sealed at rest
//! ([`crate::seal`]) with a key this server does not hold (a rotation that
//! reached another server first, a keyring missing a retired key). It is
//! never replayed unopened, and the request is not run again. Retry after
//! `Retry-After` seconds with the same key: a server with the key answers
//! it. Operators: the keyring of this server lacks that key.
//!
//! ## outcome-unknown
//!
//! Status 503. The handler could not tell whether its effect happened (a
//! commit whose answer was lost with its connection) and said so
//! ([`crate::policy::OutcomeUnknown`]). In separate mode the key stays in
//! flight until its lease ends, so that no retry runs the operation while
//! its outcome may still land; a retry after that runs the handler, which
//! must find the effect if it happened (the ledger records the idempotency
//! key with each credit). Retry after `Retry-After` seconds with the same
//! key.
//!
//! ## store-full
//!
//! Status 503. The store holds as many live records as its capacity allows
//! (`MemoryStore::with_max_records`; 100 000 by default), so no new key can be
//! recorded. The request did not run. Retry after `Retry-After` seconds with
//! the same key; repeats of keys already recorded are answered as before.
//!
//! ## response-not-stored
//!
//! Status 410. The request with this key completed, but its response was larger
//! than the layer's response limit and was not kept. It will not run again.
//!
//! ## unauthenticated
//!
//! Status 401. The request carries an idempotency key but no principal that
//! the layer's scope recognises (see [`crate::scope`]): it was not run,
//! nothing was recorded and nothing was replayed. Authenticate and retry.
//! If every request gets this, the idempotency layer probably runs before
//! the authentication middleware instead of inside it. The default answer
//! has no `WWW-Authenticate` field; add one with
//! [`crate::IdempotencyLayer::on_rejection`].
//!
//! ## expired-retry
//!
//! Status 412. The request says (`Repeatability-First-Sent`) that it was first
//! sent longer ago than this server keeps idempotency keys, and no record of
//! its key is left: it may have run already, so it was not run again (see
//! [`crate::first_sent`]). Find out whether the operation took effect before
//! sending it again as a new operation, with a new key.
//!
//! ## invalid-first-sent
//!
//! Status 400. The `Repeatability-First-Sent` field is not an HTTP date, is
//! sent twice, or is more than a minute ahead of the server's clock. Nothing
//! was recorded.
//!
//! ## store-misconfigured
//!
//! Status 500. The store reported its own configuration as invalid
//! ([`crate::store::StoreError::Config`]): a server fault that a retry does
//! not fix, so no `Retry-After`. The request did not run and nothing was
//! replayed. The stores of this crate report it only from `open`, never on
//! a request.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

#[cfg(feature = "axum")]
pub use crate::extract::WithProblem;

use crate::first_sent::FirstSentError;
use crate::key::KeyError;
use crate::store::StoreError;

/// The stable `type` URIs of the problems this crate sends.
pub mod types {
    macro_rules! problem_type {
        ($name:ident, $anchor:literal) => {
            #[doc = concat!("`", "https://docs.rs/tower-idempotency/latest/tower_idempotency/problem/#", $anchor, "`")]
            pub const $name: &str = concat!(
                "https://docs.rs/tower-idempotency/latest/tower_idempotency/problem/#",
                $anchor
            );
        };
    }
    problem_type!(MISSING_KEY, "missing-key");
    problem_type!(INVALID_KEY, "invalid-key");
    problem_type!(BODY_TOO_LARGE, "body-too-large");
    problem_type!(UNREADABLE_BODY, "unreadable-body");
    problem_type!(MISMATCH, "mismatch");
    problem_type!(IN_FLIGHT, "in-flight");
    problem_type!(STORE_UNAVAILABLE, "store-unavailable");
    problem_type!(RESPONSE_NOT_STORED, "response-not-stored");
    problem_type!(STORE_FULL, "store-full");
    problem_type!(HELD_TOO_LONG, "held-too-long");
    problem_type!(RECORD_SEALED, "record-sealed");
    problem_type!(OUTCOME_UNKNOWN, "outcome-unknown");
    problem_type!(STORE_MISCONFIGURED, "store-misconfigured");
    problem_type!(UNAUTHENTICATED, "unauthenticated");
    problem_type!(EXPIRED_RETRY, "expired-retry");
    problem_type!(INVALID_FIRST_SENT, "invalid-first-sent");
}

/// `Retry-After` on 503 when the store cannot answer, in seconds.
pub(crate) const STORE_RETRY_AFTER_SECS: u64 = 1;

/// Why the layer answered instead of the inner service.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rejection {
    /// 400: the layer requires a key and the request has none (IETF draft §2.7).
    MissingKey,
    /// 400: the key field is malformed (IETF draft §2.1, RFC 9651 §3.3.3).
    InvalidKey(KeyError),
    /// 413: the request body is larger than the limit, in bytes. No record
    /// was created.
    BodyTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// 400: the request body could not be read, or the fingerprinter could
    /// not process it (e.g. not JSON for a JSON fingerprint).
    UnreadableBody(String),
    /// 422: the key was used before with a different request (IETF draft §2.7).
    Mismatch,
    /// 409: the first request with this key is still being processed (IETF
    /// draft §2.7). `Retry-After` is the layer's hint, at most the lease left.
    InFlight {
        /// Seconds until the holder's lease ends, at least 1.
        retry_after_secs: u64,
    },
    /// 503: the store could not answer, so nothing is known about the key;
    /// the request did not run and nothing was replayed.
    StoreUnavailable {
        /// Seconds to wait before retrying, at least 1.
        retry_after_secs: u64,
    },
    /// 410: the key's request completed, but its response was larger than the
    /// response limit and was not kept. The request is not run again.
    ResponseNotStored,
    /// 503: the store is full of live records ([`StoreError::Full`]); the
    /// request did not run.
    StoreFull {
        /// Seconds to wait before retrying: the store's hint rounded up to
        /// whole seconds, at least 1.
        retry_after_secs: u64,
    },
    /// 500: the store reported its configuration as invalid
    /// ([`crate::store::StoreError::Config`]); the request did not run and
    /// nothing was replayed. Retrying does not help.
    StoreMisconfigured,
    /// 401: the request has a key but its scope found no principal (see
    /// [`crate::scope`]); nothing was run, recorded or replayed.
    Unauthenticated,
    /// 412: the request was first sent longer ago than the retention and no
    /// record of its key is left; it was not run (see [`crate::first_sent`]).
    ExpiredRetry {
        /// The layer's TTL, in whole seconds.
        retention_secs: u64,
    },
    /// 400: the `Repeatability-First-Sent` field is unusable.
    InvalidFirstSent(FirstSentError),
    /// 503: the request held its transaction past its max hold time and was
    /// rolled back ([`StoreError::HeldTooLong`]); nothing of it happened.
    HeldTooLong {
        /// Seconds to wait before retrying, at least 1.
        retry_after_secs: u64,
    },
    /// 503: the key's stored response is sealed with a key this server
    /// lacks; it is neither replayed nor run again.
    RecordSealed {
        /// Seconds to wait before retrying, at least 1.
        retry_after_secs: u64,
    },
    /// 503: the handler could not tell whether its effect happened
    /// ([`crate::policy::OutcomeUnknown`]); in separate mode its key stays in
    /// flight until its lease ends.
    OutcomeUnknown {
        /// Seconds until the key may be claimed again, at least 1.
        retry_after_secs: u64,
    },
}

impl Rejection {
    /// The HTTP status of this rejection.
    pub fn status(&self) -> StatusCode {
        match self {
            Rejection::MissingKey
            | Rejection::InvalidKey(_)
            | Rejection::UnreadableBody(_)
            | Rejection::InvalidFirstSent(_) => StatusCode::BAD_REQUEST,
            Rejection::ExpiredRetry { .. } => StatusCode::PRECONDITION_FAILED,
            Rejection::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Rejection::Mismatch => StatusCode::UNPROCESSABLE_ENTITY,
            Rejection::InFlight { .. } => StatusCode::CONFLICT,
            Rejection::StoreUnavailable { .. }
            | Rejection::StoreFull { .. }
            | Rejection::HeldTooLong { .. }
            | Rejection::RecordSealed { .. }
            | Rejection::OutcomeUnknown { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Rejection::ResponseNotStored => StatusCode::GONE,
            Rejection::StoreMisconfigured => StatusCode::INTERNAL_SERVER_ERROR,
            Rejection::Unauthenticated => StatusCode::UNAUTHORIZED,
        }
    }

    /// The problem `type` URI (one of [`types`]).
    pub fn problem_type(&self) -> &'static str {
        match self {
            Rejection::MissingKey => types::MISSING_KEY,
            Rejection::InvalidKey(_) => types::INVALID_KEY,
            Rejection::BodyTooLarge { .. } => types::BODY_TOO_LARGE,
            Rejection::UnreadableBody(_) => types::UNREADABLE_BODY,
            Rejection::Mismatch => types::MISMATCH,
            Rejection::InFlight { .. } => types::IN_FLIGHT,
            Rejection::StoreUnavailable { .. } => types::STORE_UNAVAILABLE,
            Rejection::ResponseNotStored => types::RESPONSE_NOT_STORED,
            Rejection::StoreFull { .. } => types::STORE_FULL,
            Rejection::StoreMisconfigured => types::STORE_MISCONFIGURED,
            Rejection::Unauthenticated => types::UNAUTHENTICATED,
            Rejection::ExpiredRetry { .. } => types::EXPIRED_RETRY,
            Rejection::InvalidFirstSent(_) => types::INVALID_FIRST_SENT,
            Rejection::HeldTooLong { .. } => types::HELD_TOO_LONG,
            Rejection::RecordSealed { .. } => types::RECORD_SEALED,
            Rejection::OutcomeUnknown { .. } => types::OUTCOME_UNKNOWN,
        }
    }

    /// The problem `title`: short, fixed per type.
    pub fn title(&self) -> &'static str {
        match self {
            Rejection::MissingKey => "Idempotency key required",
            Rejection::InvalidKey(_) => "Invalid idempotency key",
            Rejection::BodyTooLarge { .. } => "Request body too large",
            Rejection::UnreadableBody(_) => "Request body unreadable",
            Rejection::Mismatch => "Idempotency key reused with a different request",
            Rejection::InFlight { .. } => "Request with this idempotency key in flight",
            Rejection::StoreUnavailable { .. } => "Idempotency store unavailable",
            Rejection::ResponseNotStored => "Response not available for replay",
            Rejection::StoreFull { .. } => "Idempotency store full",
            Rejection::StoreMisconfigured => "Idempotency store misconfigured",
            Rejection::Unauthenticated => "Authentication required",
            Rejection::ExpiredRetry { .. } => "Retry past the idempotency key's retention",
            Rejection::InvalidFirstSent(_) => "Invalid Repeatability-First-Sent",
            Rejection::HeldTooLong { .. } => "Request held past its max hold time",
            Rejection::RecordSealed { .. } => "Stored response sealed with an unknown key",
            Rejection::OutcomeUnknown { .. } => "Outcome of the request unknown",
        }
    }

    /// The problem `detail`: what happened and what the client can do.
    pub fn detail(&self) -> String {
        match self {
            Rejection::MissingKey => {
                "this endpoint requires an idempotency key (the Idempotency-Key header, or where the endpoint documents it); send a new unique key with each new operation and reuse it for retries".into()
            }
            Rejection::InvalidKey(e) => e.describe().into(),
            Rejection::BodyTooLarge { limit } => {
                format!("the request body is larger than {limit} bytes; nothing was recorded")
            }
            Rejection::UnreadableBody(why) => why.clone(),
            Rejection::Mismatch => {
                "this idempotency key was first used with a different method, path, query or body; use a new key for a new operation".into()
            }
            Rejection::InFlight { retry_after_secs } => format!(
                "the first request with this idempotency key has not finished; retry in {retry_after_secs} s"
            ),
            Rejection::StoreUnavailable { .. } => {
                "the idempotency store is busy or unreachable and did not answer in time; the request was not processed; retry with the same key".into()
            }
            Rejection::ResponseNotStored => {
                "the request with this idempotency key completed, but its response was too large to keep for replay; it will not be run again".into()
            }
            Rejection::StoreFull { retry_after_secs } => format!(
                "the idempotency store has no room for a new key; the request was not processed; retry in {retry_after_secs} s"
            ),
            Rejection::StoreMisconfigured => {
                "the idempotency store is misconfigured; the request was not processed".into()
            }
            Rejection::Unauthenticated => {
                "this request has an idempotency key but no authenticated principal to scope it to; the request was not processed".into()
            }
            Rejection::ExpiredRetry { retention_secs } => format!(
                "this request was first sent more than {retention_secs} s ago, longer than idempotency keys are kept, and its key has no record left; it may have been processed already, so it was not processed again; check the operation's outcome before sending it anew with a new key"
            ),
            Rejection::InvalidFirstSent(e) => e.describe().into(),
            Rejection::HeldTooLong { retry_after_secs } => format!(
                "the request ran past its max hold time and was rolled back; nothing of it happened; retry in {retry_after_secs} s with the same key"
            ),
            Rejection::RecordSealed { retry_after_secs } => format!(
                "this idempotency key has a stored response this server cannot open; it was neither replayed nor processed again; retry in {retry_after_secs} s with the same key"
            ),
            Rejection::OutcomeUnknown { retry_after_secs } => format!(
                "whether this request took effect is not known yet; it is not processed again before its outcome can be found; retry in {retry_after_secs} s with the same key"
            ),
        }
    }

    fn retry_after(&self) -> Option<u64> {
        match self {
            Rejection::InFlight { retry_after_secs }
            | Rejection::StoreUnavailable { retry_after_secs }
            | Rejection::StoreFull { retry_after_secs }
            | Rejection::HeldTooLong { retry_after_secs }
            | Rejection::RecordSealed { retry_after_secs }
            | Rejection::OutcomeUnknown { retry_after_secs } => Some(*retry_after_secs),
            _ => None,
        }
    }

    /// The answer to a claim that failed with `error`: [`Rejection::StoreFull`]
    /// with the store's hint for [`StoreError::Full`], otherwise
    /// [`Rejection::StoreUnavailable`] with `retry_after_secs`.
    pub(crate) fn store_failed(error: &StoreError, retry_after_secs: u64) -> Rejection {
        match error {
            // Rounded up: a retry at once after the wait finds the room.
            StoreError::Full { retry_after, .. } => Rejection::StoreFull {
                retry_after_secs: retry_after
                    .as_secs()
                    .saturating_add(u64::from(retry_after.subsec_nanos() > 0))
                    .max(1),
            },
            // A retry cannot fix the configuration: 500, no Retry-After.
            StoreError::Config(_) => Rejection::StoreMisconfigured,
            StoreError::HeldTooLong { .. } => Rejection::HeldTooLong { retry_after_secs },
            _ => Rejection::StoreUnavailable { retry_after_secs },
        }
    }

    /// The default answer: an `application/problem+json` body with `type`,
    /// `title`, `status` and `detail`, plus `Retry-After` (seconds) on 409
    /// and 503.
    pub fn to_problem(&self) -> Response<Bytes> {
        // Members in the order RFC 9457 §3.1 lists them; strings escaped by serde_json.
        let string = |s: &str| serde_json::Value::from(s).to_string();
        let body = Bytes::from(format!(
            "{{\"type\":{},\"title\":{},\"status\":{},\"detail\":{}}}",
            string(self.problem_type()),
            string(self.title()),
            self.status().as_u16(),
            string(&self.detail()),
        ));
        let mut response = Response::new(body);
        *response.status_mut() = self.status();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(secs) = self.retry_after() {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.title(), self.detail())
    }
}

/// The layer's own answer to a store failure, so a handler can use `?` on
/// the store's calls (`SqliteTransaction::run`,
/// `PostgresTransaction::client`): 503 `store-unavailable` with
/// `Retry-After` (seconds), 503 `store-full` with the store's hint, or 500
/// `store-misconfigured` for [`StoreError::Config`] (see [`crate::problem`]).
/// The error itself is logged, not sent.
#[cfg(feature = "axum")]
impl axum_core::response::IntoResponse for StoreError {
    fn into_response(self) -> axum_core::response::Response {
        tracing::error!(error = %self, "a handler's store call failed; answering with a problem");
        Rejection::store_failed(&self, STORE_RETRY_AFTER_SECS)
            .to_problem()
            .map(axum_core::body::Body::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rejection_is_a_complete_problem() {
        let all = [
            Rejection::MissingKey,
            Rejection::InvalidKey(KeyError::Empty),
            Rejection::BodyTooLarge { limit: 10 },
            Rejection::UnreadableBody("x".into()),
            Rejection::Mismatch,
            Rejection::InFlight {
                retry_after_secs: 2,
            },
            Rejection::StoreUnavailable {
                retry_after_secs: 1,
            },
            Rejection::ResponseNotStored,
            Rejection::StoreFull {
                retry_after_secs: 7,
            },
            Rejection::StoreMisconfigured,
            Rejection::Unauthenticated,
            Rejection::ExpiredRetry { retention_secs: 60 },
            Rejection::InvalidFirstSent(FirstSentError::Ahead),
        ];
        let expected = [
            400, 400, 413, 400, 422, 409, 503, 410, 503, 500, 401, 412, 400,
        ];
        for (rejection, status) in all.iter().zip(expected) {
            let response = rejection.to_problem();
            assert_eq!(response.status(), status);
            let doc: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
            assert_eq!(doc["status"], status);
            assert_eq!(doc["type"], rejection.problem_type());
            assert_eq!(doc["title"], rejection.title());
            assert!(doc["detail"].as_str().is_some_and(|d| !d.is_empty()));
        }
    }

    #[test]
    fn a_full_store_is_a_store_full_problem_with_its_hint() {
        let full = StoreError::Full {
            capacity: 3,
            retry_after: std::time::Duration::from_millis(4_500),
        };
        let rejection = Rejection::store_failed(&full, 1);
        assert_eq!(
            rejection,
            Rejection::StoreFull {
                retry_after_secs: 5
            }
        );
        let response = rejection.to_problem();
        assert_eq!(response.status(), 503);
        assert_eq!(response.headers()["retry-after"], "5");
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
        assert_eq!(
            response.body(),
            &Bytes::from(concat!(
                r#"{"type":"https://docs.rs/tower-idempotency/latest/tower_idempotency/problem/#store-full","#,
                r#""title":"Idempotency store full","status":503,"#,
                r#""detail":"the idempotency store has no room for a new key; the request was not processed; retry in 5 s"}"#
            ))
        );
        let short = StoreError::Full {
            capacity: 3,
            retry_after: std::time::Duration::from_millis(10),
        };
        assert_eq!(
            Rejection::store_failed(&short, 1),
            Rejection::StoreFull {
                retry_after_secs: 1
            }
        );
        let down = StoreError::unavailable("down");
        assert_eq!(
            Rejection::store_failed(&down, 2),
            Rejection::StoreUnavailable {
                retry_after_secs: 2
            }
        );
    }
}
