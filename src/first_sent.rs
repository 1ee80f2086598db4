//! No second run after a key expired: the `Repeatability-First-Sent` guard.
//!
//! A record is kept for the layer's TTL. A retry that comes after its record
//! expired finds the key free, and without more to go on the layer runs it
//! again. The OASIS specification *Repeatable Requests Version 1.0* (the OData
//! TC, 2020; the field is registered, provisionally, in IANA's HTTP field
//! registry) gives the client a way to say how old its operation is: every
//! attempt carries `Repeatability-First-Sent`, the time of the first attempt
//! as an HTTP date (IMF-fixdate, e.g. `Sun, 06 Nov 1994 08:49:37 GMT`), the
//! same on every retry. A server that tracks requests for a limited time
//! refuses one first sent before that time with `412 Precondition Failed`
//! (Microsoft's Azure Communication Services document the same for their
//! repeatable requests, with a 400 for a malformed date; the Azure REST API
//! guidelines ask services to support the OASIS headers on POST).
//!
//! With [`IdempotencyLayer::refuse_expired_retries`](crate::IdempotencyLayer::refuse_expired_retries):
//!
//! | the request | the answer |
//! |---|---|
//! | no `Repeatability-First-Sent` | as without the guard: **the guard needs the field** |
//! | first sent within the TTL | as without the guard |
//! | first sent longer ago than the TTL, and the claim found a live record | that record's answer (replay, 409, 422) |
//! | first sent longer ago than the TTL, and the claim found no live record | the claim is given back, the handler does not run: 412 [`Rejection::ExpiredRetry`](crate::problem::Rejection::ExpiredRetry) |
//! | the field is not an HTTP date, or is sent twice | 400 [`Rejection::InvalidFirstSent`](crate::problem::Rejection::InvalidFirstSent), before the store is touched |
//! | first sent more than [`FIRST_SENT_MAX_SKEW`] ahead of the layer's clock | 400 [`Rejection::InvalidFirstSent`](crate::problem::Rejection::InvalidFirstSent) |
//!
//! Why the TTL is the bound: the record is claimed no earlier than the first
//! attempt, so while the first attempt is younger than the TTL a record it
//! made is still live, and its retry is answered from it. Once the first
//! attempt is older, a missing record may be one that expired. A takeover
//! (an in-flight record whose lease ended) is not refused: its record is live.
//! The three forms of HTTP date (RFC 9110 §5.6.7) are accepted; the ages are
//! judged by the layer's [`clock`](crate::IdempotencyLayer::clock), which the
//! client's clock should be close to.
//!
//! The crate's client layer (`client::IdempotencyKeyLayer`, feature
//! `client`) sends the field with every key it makes.
//!
//! # Advertising the retention
//!
//! [`IdempotencyLayer::advertise_retention`](crate::IdempotencyLayer::advertise_retention)
//! puts the TTL in whole seconds in a response field of first responses and
//! replays, so a client knows how long its retries are safe. No field is
//! standard: the IETF draft `draft-ietf-httpapi-idempotency-key-header` leaves
//! the expiry to each server, and its issue #49 proposes `Idempotency-TTL`
//! ([`IDEMPOTENCY_TTL`]), which is the name suggested here.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use axum::{Router, routing::post, http::{Request, StatusCode}, body::Body};
//! use tower::ServiceExt;
//! use tower_idempotency::{IdempotencyLayer, MemoryStore, scope::GlobalScope};
//! use tower_idempotency::first_sent::IDEMPOTENCY_TTL;
//! use tower_idempotency::test_util::{ManualClock, START_MS};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let clock = ManualClock::new(START_MS);
//! let app = Router::new()
//!     .route("/charges", post(|| async { StatusCode::CREATED }))
//!     .route_layer(
//!         IdempotencyLayer::new(MemoryStore::with_clock(clock.clone()), GlobalScope)
//!             .ttl(Duration::from_secs(3600))
//!             .refuse_expired_retries()
//!             .advertise_retention(IDEMPOTENCY_TTL)
//!             .clock(clock.clone()),
//!     );
//! // The clock reads 2027-01-15T08:00:00Z; the first attempt was at 08:00:00.
//! let attempt = || Request::post("/charges")
//!     .header("idempotency-key", "\"k1\"")
//!     .header("repeatability-first-sent", "Fri, 15 Jan 2027 08:00:00 GMT")
//!     .body(Body::empty())
//!     .unwrap();
//! let first = app.clone().oneshot(attempt()).await.unwrap();
//! assert_eq!(first.status(), StatusCode::CREATED);
//! assert_eq!(first.headers()["idempotency-ttl"], "3600");
//!
//! // Two hours later the record has expired: the retry is refused, not run.
//! clock.advance(Duration::from_secs(2 * 3600));
//! let late = app.clone().oneshot(attempt()).await.unwrap();
//! assert_eq!(late.status(), StatusCode::PRECONDITION_FAILED);
//! # }
//! ```

use std::time::{Duration, UNIX_EPOCH};

use http::{HeaderMap, HeaderName, HeaderValue};

use crate::store::duration_ms;

/// `Repeatability-First-Sent` (OASIS Repeatable Requests 1.0): when the
/// operation was first sent, as an HTTP date.
pub const REPEATABILITY_FIRST_SENT: HeaderName =
    HeaderName::from_static("repeatability-first-sent");

/// `Idempotency-TTL`: the retention in whole seconds, as proposed in issue
/// #49 of the IETF draft's repository (not standard).
pub const IDEMPOTENCY_TTL: HeaderName = HeaderName::from_static("idempotency-ttl");

/// How far ahead of the layer's clock a first-sent time may be (the two
/// clocks' skew) before it is refused as invalid: 60 s.
pub const FIRST_SENT_MAX_SKEW: Duration = Duration::from_secs(60);

/// Why a `Repeatability-First-Sent` field was refused (400).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FirstSentError {
    /// The field appears more than once.
    Repeated,
    /// The value is not an HTTP date.
    NotADate,
    /// The time is more than [`FIRST_SENT_MAX_SKEW`] ahead of the server's clock.
    Ahead,
}

impl FirstSentError {
    /// A sentence for the problem's `detail`.
    pub fn describe(self) -> &'static str {
        match self {
            FirstSentError::Repeated => "the Repeatability-First-Sent field appears more than once",
            FirstSentError::NotADate => {
                "the Repeatability-First-Sent field is not an HTTP date (IMF-fixdate, e.g. Sun, 06 Nov 1994 08:49:37 GMT)"
            }
            FirstSentError::Ahead => {
                "the Repeatability-First-Sent time is more than 60 s ahead of this server's clock"
            }
        }
    }
}

/// The first-sent time of a request, ms since the Unix epoch (in the
/// request's extensions between the checks before and after the claim).
#[derive(Debug, Clone, Copy)]
pub(crate) struct FirstSent(pub(crate) i64);

/// The first-sent time in `headers`, in ms since the Unix epoch, judged at
/// `now_ms`: `Ok(None)` without the field.
pub fn parse(headers: &HeaderMap, now_ms: i64) -> Result<Option<i64>, FirstSentError> {
    let mut values = headers.get_all(&REPEATABILITY_FIRST_SENT).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(FirstSentError::Repeated);
    }
    let text = value.to_str().map_err(|_| FirstSentError::NotADate)?;
    let time = httpdate::parse_http_date(text.trim()).map_err(|_| FirstSentError::NotADate)?;
    let ms = match time.duration_since(UNIX_EPOCH) {
        Ok(since) => duration_ms(since),
        Err(before) => -duration_ms(before.duration()),
    };
    if ms.saturating_sub(now_ms) > duration_ms(FIRST_SENT_MAX_SKEW) {
        return Err(FirstSentError::Ahead);
    }
    Ok(Some(ms))
}

/// The field's value for an attempt first sent at `ms` since the Unix epoch:
/// an IMF-fixdate.
pub fn format(ms: i64) -> HeaderValue {
    let since = Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    let text = httpdate::fmt_http_date(UNIX_EPOCH + since);
    // An IMF-fixdate is visible ASCII.
    HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static(""))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 2027-01-15T08:00:00Z.
    const NOW: i64 = 1_800_000_000_000;

    fn at(values: &[&str]) -> Result<Option<i64>, FirstSentError> {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append(REPEATABILITY_FIRST_SENT, v.parse().unwrap());
        }
        parse(&headers, NOW)
    }

    #[test]
    fn dates_in_the_three_forms() {
        assert_eq!(format(NOW), "Fri, 15 Jan 2027 08:00:00 GMT");
        assert_eq!(at(&["Fri, 15 Jan 2027 08:00:00 GMT"]), Ok(Some(NOW)));
        assert_eq!(
            at(&["Friday, 15-Jan-27 07:00:00 GMT"]),
            Ok(Some(NOW - 3_600_000))
        );
        assert_eq!(at(&["Fri Jan 15 07:59:00 2027"]), Ok(Some(NOW - 60_000)));
        assert_eq!(at(&[]), Ok(None));
    }

    #[test]
    fn skew_bounds_the_future() {
        assert_eq!(
            at(&["Fri, 15 Jan 2027 08:01:00 GMT"]),
            Ok(Some(NOW + 60_000))
        );
        assert_eq!(
            at(&["Fri, 15 Jan 2027 08:01:01 GMT"]),
            Err(FirstSentError::Ahead)
        );
    }

    #[test]
    fn malformed_and_repeated_fields() {
        for bad in ["", "yesterday", "1800000000", "2027-01-15T08:00:00Z"] {
            assert_eq!(at(&[bad]), Err(FirstSentError::NotADate), "{bad:?}");
        }
        let date = "Fri, 15 Jan 2027 08:00:00 GMT";
        assert_eq!(at(&[date, date]), Err(FirstSentError::Repeated));
    }
}
