//! What the layer tells operators: one tracing span per intercepted request
//! and, with the `metrics` feature, counters, gauges and a histogram through the
//! [`metrics`](https://docs.rs/metrics) facade.
//!
//! # Example
//!
//! ```
//! use axum::{Router, routing::post, http::Request, body::Body};
//! use tower::ServiceExt;
//! use tower_idempotency::{IdempotencyLayer, MemoryStore};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! // Any `tracing` subscriber sees the `idempotency` span of each request;
//! // this one prints it when the span closes.
//! let _guard = tracing::subscriber::set_default(
//!     tracing_subscriber::fmt()
//!         .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
//!         .finish(),
//! );
//! let app = Router::new()
//!     .route("/orders", post(|| async { "created" }))
//!     .route_layer(IdempotencyLayer::new(MemoryStore::new(), |_: &http::request::Parts| "alice".to_owned()));
//! let request = Request::post("/orders")
//!     .header("idempotency-key", "\"order-1\"")
//!     .body(Body::empty())
//!     .unwrap();
//! // Logs: idempotency{scope=alice key=<hash tag> claim="acquired" outcome="completed" claim_us=.. complete_us=..}
//! app.oneshot(request).await.unwrap();
//! # }
//! ```
//!
//! # The span
//!
//! Each request that carries a well-formed key is handled inside an `INFO`
//! span named `idempotency` with these fields (a request rejected before
//! that, for a missing or malformed key, is only counted, as `rejected`):
//!
//! | field | value |
//! |---|---|
//! | `scope` | the request's scope ([`crate::scope`]) |
//! | `key` | a tag of the key: 16 hex digits, the first 8 bytes of a SHA-256 keyed with a per-process secret, over scope and key (see [Key tags](#key-tags)); absent if the OS generator failed. The raw key never appears in a span or an event |
//! | `claim` | what the atomic claim found: `acquired`, `taken_over` (an in-flight record whose lease had ended), `replayed`, `in_flight`, `mismatch` or `store_error` |
//! | `outcome` | how the request ended (the [`Outcome`] names below) |
//! | `claim_us`, `complete_us`, `release_us` | the store's latency for that call, in microseconds |
//!
//! # Key tags
//!
//! The tag is SHA-256 over a 32-byte secret, the scope and the key (each
//! framed by its length), cut to its first 8 bytes. The secret comes from the
//! operating system's CSPRNG (`getrandom`), drawn once, on the first tagged
//! span, and never leaves the process. So:
//!
//! - within one process, the same scope and key always give the same tag:
//!   the spans of a request and of its retries can be matched;
//! - a process that restarts, and every other process of a fleet, tags the
//!   same key differently: tags do not correlate across processes or
//!   restarts. Join logs across them by another field (a request id);
//! - whoever reads the logs cannot check a guessed key against a tag (an
//!   unsalted hash of a short or structured key could be confirmed offline,
//!   and a confirmed key, under a global scope, replays its owner's response).
//!
//! If the OS generator fails, spans carry no `key` field at all rather than
//! an unsalted tag.
//!
//! # Metrics (feature `metrics`)
//!
//! Recorded through whatever recorder the application installed (Prometheus,
//! StatsD, ...); without one they cost a load and a branch.
//!
//! | name | kind | labels | meaning |
//! |---|---|---|---|
//! | `tower_idempotency_requests_total` | counter | `outcome` | requests the layer answered or ran, by [`Outcome`] |
//! | `tower_idempotency_takeovers_total` | counter | | in-flight records taken over after their lease ended (a holder crashed or was too slow) |
//! | `tower_idempotency_lease_renewals_total` | counter | | leases renewed while their request ran ([`max_hold`](crate::IdempotencyLayer::max_hold)) |
//! | `tower_idempotency_leases_lost_total` | counter | | leases lost while their request ran: taken over, not confirmed in time, or held past the max hold |
//! | `tower_idempotency_waits_total` | counter | `ended` = `woken`, `timed_out` or `full` | repeats that waited for their first request ([`wait_in_flight`](crate::IdempotencyLayer::wait_in_flight)): the key left the in-flight state, the wait passed its bound, or no place was free |
//! | `tower_idempotency_records_unopened_total` | counter | | stored responses sealed at rest that no configured key opened ([`crate::seal`]): never replayed, answered 503 |
//! | `tower_idempotency_store_duration_seconds` | histogram | `operation` = `claim`, `complete` or `release` | the store's latency per call, in seconds |
//!
//! Store crates add their own: `tower-idempotency-redis` names its eviction
//! gauges in its crate docs.
//!
//! ## The store's latency in OpenTelemetry's terms
//!
//! The store histogram is OpenTelemetry's stable database-client duration
//! (semantic conventions, "Database client metrics") under this crate's
//! prefix; a recorder that exports OTLP can rename it one for one:
//!
//! | this crate | OpenTelemetry | note |
//! |---|---|---|
//! | `tower_idempotency_store_duration_seconds` (histogram, seconds) | `db.client.operation.duration` (histogram, seconds) | one call to the store, timed from the layer |
//! | label `operation` (`claim`, `complete`, `release`) | attribute `db.operation.name` | the store's operation, not a SQL verb: a claim may run several statements |
//! | none | attribute `db.system.name` (`postgresql`, `mysql`, `mariadb`, `sqlite`, `redis`) | a layer has one store: set it as a constant attribute where the recorder is installed |
//! | none | attribute `error.type` | failed calls are counted by `tower_idempotency_requests_total{outcome="store_error"}` |

use std::future::Future;
use std::time::Instant;

/// How an intercepted request ended: the `outcome` span field and the
/// `outcome` label of `tower_idempotency_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The handler ran and its response is stored for replays.
    Completed,
    /// The handler ran; its response was larger than the response limit, so
    /// repeats get 410 (the record is kept, without the body).
    CompletedWithoutBody,
    /// A stored response was replayed.
    Replayed,
    /// A repeat of a record completed without its body: 410.
    NotStored,
    /// A repeat while the first request holds its lease: 409.
    InFlight,
    /// The key was used with another request: 422.
    Mismatch,
    /// The handler's answer is not stored (a 5xx, 408, 425, 429, an error,
    /// a transient trailer status) and the key was given back: a retry runs again.
    Released,
    /// The handler ran, but its lease had been taken over meanwhile: its
    /// response was not stored.
    Fenced,
    /// The store could not answer: 503, nothing replayed.
    StoreError,
    /// The response body failed before it could be stored.
    ResponseFailed,
    /// Bad input: a missing or malformed key (400), a body over the limit
    /// (413) or an unreadable body (400).
    Rejected,
    /// The handler could not tell whether its effect happened
    /// ([`OutcomeUnknown`](crate::policy::OutcomeUnknown)): 503, the key
    /// kept until its lease ends (separate mode).
    OutcomeUnknown,
}

impl Outcome {
    /// The name used in spans and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::CompletedWithoutBody => "completed_without_body",
            Outcome::Replayed => "replayed",
            Outcome::NotStored => "not_stored",
            Outcome::InFlight => "in_flight",
            Outcome::Mismatch => "mismatch",
            Outcome::Released => "released",
            Outcome::Fenced => "fenced",
            Outcome::StoreError => "store_error",
            Outcome::ResponseFailed => "response_failed",
            Outcome::Rejected => "rejected",
            Outcome::OutcomeUnknown => "outcome_unknown",
        }
    }
}

/// The span of one intercepted request.
pub(crate) fn request_span(scope: &str, key: &str) -> tracing::Span {
    let span = tracing::info_span!(
        "idempotency",
        scope = %scope,
        key = tracing::field::Empty,
        claim = tracing::field::Empty,
        wait = tracing::field::Empty,
        outcome = tracing::field::Empty,
        claim_us = tracing::field::Empty,
        complete_us = tracing::field::Empty,
        release_us = tracing::field::Empty,
    );
    // The tag costs a SHA-256: only for a span that someone records.
    if !span.is_disabled()
        && let Some(tag) = key_tag(scope, key)
    {
        span.record("key", tag);
    }
    span
}

/// A short tag of the key for logs, keyed with [`tag_secret`] (see
/// [Key tags](self#key-tags)): 16 hex digits, or `None` without a secret.
pub(crate) fn key_tag(scope: &str, key: &str) -> Option<String> {
    let secret = tag_secret()?;
    let mut hasher = crate::fingerprint::Hasher::new("tower-idempotency/log/v2");
    hasher
        .part(secret)
        .part(scope.as_bytes())
        .part(key.as_bytes());
    Some(
        hasher.finish().0[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect(),
    )
}

/// The process's 32-byte tag secret: drawn from `getrandom` on first use,
/// then the same for the life of the process. `None` if the OS generator
/// failed (the draw is not retried: every tag of a process uses one secret).
fn tag_secret() -> Option<&'static [u8; 32]> {
    static SECRET: std::sync::OnceLock<Option<[u8; 32]>> = std::sync::OnceLock::new();
    SECRET
        .get_or_init(|| {
            let mut secret = [0u8; 32];
            match getrandom::fill(&mut secret) {
                Ok(()) => Some(secret),
                Err(e) => {
                    tracing::error!(error = %e, "no secret for key tags from the OS random number generator; spans carry no key tag");
                    None
                }
            }
        })
        .as_ref()
}

/// Records what the claim found on the current span.
pub(crate) fn claim(found: &'static str) {
    tracing::Span::current().record("claim", found);
    #[cfg(feature = "metrics")]
    if found == "taken_over" {
        metrics::counter!("tower_idempotency_takeovers_total").increment(1);
    }
}

/// Records how a repeat's wait for its first request ended: `woken` (the
/// key left the in-flight state), `timed_out`, or `full` (no place among
/// the waiters).
pub(crate) fn wait(ended: &'static str) {
    tracing::Span::current().record("wait", ended);
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_idempotency_waits_total", "ended" => ended).increment(1);
}

/// Counts a sealed record that no configured key opened.
pub(crate) fn unopened() {
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_idempotency_records_unopened_total").increment(1);
}

/// Records how the request ended, on the current span and as a metric.
pub(crate) fn outcome(outcome: Outcome) {
    tracing::Span::current().record("outcome", outcome.as_str());
    #[cfg(feature = "metrics")]
    metrics::counter!("tower_idempotency_requests_total", "outcome" => outcome.as_str())
        .increment(1);
}

/// The store operations whose latency is recorded.
#[derive(Clone, Copy)]
pub(crate) enum Operation {
    Claim,
    Complete,
    Release,
}

/// Awaits one store call and records its latency.
pub(crate) async fn timed<T>(operation: Operation, call: impl Future<Output = T>) -> T {
    let start = Instant::now();
    let result = call.await;
    let elapsed = start.elapsed();
    let (field, label) = match operation {
        Operation::Claim => ("claim_us", "claim"),
        Operation::Complete => ("complete_us", "complete"),
        Operation::Release => ("release_us", "release"),
    };
    tracing::Span::current().record(
        field,
        u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX),
    );
    #[cfg(feature = "metrics")]
    metrics::histogram!("tower_idempotency_store_duration_seconds", "operation" => label)
        .record(elapsed.as_secs_f64());
    #[cfg(not(feature = "metrics"))]
    let _ = label;
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn a_key_has_one_tag_within_the_process() {
        let tag = key_tag("alice", "order-1").unwrap();
        assert_eq!(tag.len(), 16);
        assert!(
            tag.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        );
        assert_eq!(key_tag("alice", "order-1").unwrap(), tag);
    }

    #[test]
    fn different_keys_and_scopes_have_different_tags() {
        let tags: std::collections::HashSet<String> = [
            ("alice", "order-1"),
            ("alice", "order-2"),
            ("bob", "order-1"),
            ("aliceo", "rder-1"),
            ("", "aliceorder-1"),
        ]
        .iter()
        .map(|(scope, key)| key_tag(scope, key).unwrap())
        .collect();
        assert_eq!(tags.len(), 5);
    }

    #[test]
    fn the_tag_is_not_an_unsalted_hash() {
        let tag = key_tag("alice", "order-1").unwrap();
        // The previous scheme: the framed SHA-256 without a secret.
        let mut unsalted = crate::fingerprint::Hasher::new("tower-idempotency/log/v1");
        unsalted.part(b"alice").part(b"order-1");
        assert_ne!(tag, hex(&unsalted.finish().0[..8]));
        let mut v2 = crate::fingerprint::Hasher::new("tower-idempotency/log/v2");
        v2.part(b"alice").part(b"order-1");
        assert_ne!(tag, hex(&v2.finish().0[..8]));
        for plain in [&b"order-1"[..], b"aliceorder-1", b"alice\0order-1"] {
            assert_ne!(tag, hex(&Sha256::digest(plain)[..8]));
        }
        // With the process's secret in front, the tag is reproduced.
        let mut salted = crate::fingerprint::Hasher::new("tower-idempotency/log/v2");
        salted
            .part(tag_secret().unwrap())
            .part(b"alice")
            .part(b"order-1");
        assert_eq!(tag, hex(&salted.finish().0[..8]));
        assert_ne!(tag_secret().unwrap(), &[0u8; 32]);
    }
}
