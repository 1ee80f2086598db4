//! `Retry-After` (RFC 9110 §10.2.3) as a wait: the parser that the crate's
//! client and the outbox relay share.
//!
//! # Example
//!
//! ```
//! use std::time::{Duration, SystemTime};
//! use http::HeaderMap;
//! use tower_idempotency::retry_after;
//!
//! let mut headers = HeaderMap::new();
//! headers.insert("retry-after", "5".parse().unwrap());
//! assert_eq!(retry_after::wait(&headers), Some(Duration::from_secs(5)));
//!
//! // An HTTP date: the time from `now` until then (zero once it has passed).
//! headers.insert("retry-after", "Sun, 06 Nov 1994 08:49:37 GMT".parse().unwrap());
//! let now = SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_767);
//! assert_eq!(retry_after::wait_at(&headers, now), Some(Duration::from_secs(10)));
//! ```
//!
//! The field's value is either delay-seconds (one or more digits) or an
//! HTTP-date in any of the three forms RFC 9110 §5.6.7 makes a recipient
//! accept (IMF-fixdate, RFC 850, asctime). Anything else (a negative or
//! fractional number, a second field line, text) is no `Retry-After`: the
//! caller falls back to its own backoff. The caller caps the wait.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, header};

/// The wait that `headers`' `Retry-After` asks for, from now; `None` when
/// there is no valid one.
pub fn wait(headers: &HeaderMap) -> Option<Duration> {
    wait_at(headers, SystemTime::now())
}

/// [`wait`] as seen at `now`: an HTTP date in the past is a wait of zero.
pub fn wait_at(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let mut fields = headers.get_all(header::RETRY_AFTER).iter();
    let (value, None) = (fields.next()?, fields.next()) else {
        return None;
    };
    let value = value.to_str().ok()?.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // Past u64's range the number means "a very long time".
        return Some(Duration::from_secs(value.parse().unwrap_or(u64::MAX)));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(value: &str, now_secs: u64) -> Option<Duration> {
        let mut headers = HeaderMap::new();
        headers.insert(header::RETRY_AFTER, value.parse().unwrap());
        wait_at(
            &headers,
            SystemTime::UNIX_EPOCH + Duration::from_secs(now_secs),
        )
    }

    #[test]
    fn seconds_and_the_three_date_forms() {
        let now = 784_111_767; // Sun, 06 Nov 1994 08:49:27 GMT
        assert_eq!(at("0", now), Some(Duration::ZERO));
        assert_eq!(at(" 120 ", now), Some(Duration::from_secs(120)));
        assert_eq!(
            at("99999999999999999999999", now),
            Some(Duration::from_secs(u64::MAX))
        );
        for date in [
            "Sun, 06 Nov 1994 08:49:37 GMT",
            "Sunday, 06-Nov-94 08:49:37 GMT",
            "Sun Nov  6 08:49:37 1994",
        ] {
            assert_eq!(at(date, now), Some(Duration::from_secs(10)), "{date}");
        }
        // A date already past asks for no wait.
        assert_eq!(
            at("Sun, 06 Nov 1994 08:49:37 GMT", now + 60),
            Some(Duration::ZERO)
        );
    }

    #[test]
    fn anything_else_is_no_retry_after() {
        for value in ["", "-5", "1.5", "5s", "soon", "Sun, 06 Nov 1994"] {
            assert_eq!(at(value, 0), None, "{value:?}");
        }
        assert_eq!(wait_at(&HeaderMap::new(), SystemTime::now()), None);
        let mut twice = HeaderMap::new();
        twice.append(header::RETRY_AFTER, "1".parse().unwrap());
        twice.append(header::RETRY_AFTER, "2".parse().unwrap());
        assert_eq!(wait_at(&twice, SystemTime::now()), None);
    }
}
