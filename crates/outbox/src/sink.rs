//! Where a relay delivers: [`Sink`], with [`HttpSink`] (any Tower HTTP
//! client) and [`from_fn`] (a closure).

use std::fmt::Display;
use std::future::Future;
use std::pin::Pin;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, StatusCode, header};
use http_body_util::Full;
use tower_service::Service;

/// One attempt at one message, as a sink gets it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Delivery {
    /// The message's idempotency key (unquoted): the same on every attempt.
    pub key: String,
    /// Where it goes (for [`HttpSink`], the URL).
    pub destination: String,
    /// Its media type.
    pub content_type: String,
    /// Its bytes: the same on every attempt.
    pub payload: Bytes,
    /// Which attempt this is: 1 for the first (after a
    /// [requeue](crate::Outbox::requeue), counting starts again).
    pub attempt: u32,
}

impl Delivery {
    /// An attempt as a relay would make it: for calling a [`Sink`]
    /// directly (in a test of a sink, say).
    pub fn new(
        key: impl Into<String>,
        destination: impl Into<String>,
        content_type: impl Into<String>,
        payload: impl Into<Bytes>,
        attempt: u32,
    ) -> Delivery {
        Delivery {
            key: key.into(),
            destination: destination.into(),
            content_type: content_type.into(),
            payload: payload.into(),
            attempt,
        }
    }
}

/// How an attempt ended, as a sink reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The receiver has the message: never sent again.
    Delivered,
    /// Try again after a backoff (a connection error, a timeout, a busy or
    /// failing receiver). The text is kept as the message's last error.
    Retry(String),
    /// Try again, no earlier than `after`: the receiver said when (its
    /// `Retry-After`). The relay waits the longer of `after`, capped by
    /// [`Relay::retry_after_max`](crate::Relay::retry_after_max), and its
    /// own backoff. It counts as an attempt, as `Retry` does.
    RetryAfter {
        /// Kept as the message's last error.
        error: String,
        /// The wait the receiver asked for.
        after: std::time::Duration,
    },
    /// The receiver refused it for good: a dead letter, kept for operators.
    Reject(String),
}

/// What a relay delivers through. Implement it for a broker of your own, or
/// use [`HttpSink`] or [`from_fn`].
///
/// A sink must not hide its own retries behind one call: the relay bounds
/// each call by its answer timeout, and the lease by that.
pub trait Sink: Send + Sync + 'static {
    /// Delivers one attempt.
    fn deliver(&self, delivery: Delivery) -> Pin<Box<dyn Future<Output = Outcome> + Send + '_>>;
}

/// What an HTTP status means for a message: 2xx [`Outcome::Delivered`];
/// 408, 409, 425, 429 and 5xx [`Outcome::Retry`]; anything else (other
/// 4xx, and 1xx or 3xx, which a client that does not follow redirects
/// cannot complete) [`Outcome::Reject`].
///
/// A 409 from an idempotent receiver (the
/// `draft-ietf-httpapi-idempotency-key-header` draft) means an earlier
/// attempt with the same key is still being processed there; 425 (RFC 8470)
/// and 429 (RFC 6585) ask to come back later; 408 means the request was not
/// received in time.
pub fn classify(status: StatusCode) -> Outcome {
    match status.as_u16() {
        200..=299 => Outcome::Delivered,
        408 | 409 | 425 | 429 | 500..=599 => Outcome::Retry(format!("HTTP {}", status.as_u16())),
        s => Outcome::Reject(format!("HTTP {s}")),
    }
}

/// Delivers each message as `POST <destination>` through any Tower HTTP
/// client (a hyper-util legacy `Client`, say), with `Content-Type` and
/// `Idempotency-Key: "<key>"` (an RFC 9651 sf-string), so that a receiver
/// behind an `IdempotencyLayer` applies each message once however often it
/// arrives. The answer's status is judged by [`classify`]; a client error
/// (connection refused, reset, hung up) is [`Outcome::Retry`]. A retried
/// status whose answer carries a valid `Retry-After` (seconds or an HTTP
/// date, RFC 9110 §10.2.3) is [`Outcome::RetryAfter`], as Standard Webhooks
/// asks of senders. The response body is not read, and no redirect is
/// followed: a 3xx is a dead letter.
#[derive(Debug, Clone)]
pub struct HttpSink<S> {
    client: S,
}

impl<S> HttpSink<S> {
    /// A sink over `client`, which is cloned for each attempt.
    pub fn new(client: S) -> Self {
        HttpSink { client }
    }
}

/// `key` as an RFC 9651 sf-string: quoted, `"` and `\` escaped.
pub fn sf_string(key: &str) -> String {
    let mut out = String::with_capacity(key.len() + 2);
    out.push('"');
    for c in key.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// The request [`HttpSink`] sends for `d`.
///
/// # Errors
///
/// A destination that is not a URI, or a key or content type that cannot be
/// a header value.
pub fn request(d: &Delivery) -> Result<Request<Full<Bytes>>, String> {
    let key = HeaderValue::try_from(sf_string(&d.key)).map_err(|e| format!("key: {e}"))?;
    let ctype =
        HeaderValue::try_from(d.content_type.as_str()).map_err(|e| format!("content type: {e}"))?;
    Request::builder()
        .method(Method::POST)
        .uri(d.destination.as_str())
        .header(header::CONTENT_TYPE, ctype)
        .header("idempotency-key", key)
        .body(Full::new(d.payload.clone()))
        .map_err(|e| format!("destination: {e}"))
}

impl<S, B> Sink for HttpSink<S>
where
    S: Service<Request<Full<Bytes>>, Response = http::Response<B>> + Clone + Send + Sync + 'static,
    S::Future: Send,
    S::Error: Display,
    B: Send + 'static,
{
    fn deliver(&self, delivery: Delivery) -> Pin<Box<dyn Future<Output = Outcome> + Send + '_>> {
        let mut client = self.client.clone();
        Box::pin(async move {
            let req = match request(&delivery) {
                Ok(req) => req,
                // The message can never be sent as it is.
                Err(e) => return Outcome::Reject(e),
            };
            if let Err(e) = std::future::poll_fn(|cx| client.poll_ready(cx)).await {
                return Outcome::Retry(format!("client not ready: {e}"));
            }
            match client.call(req).await {
                Ok(response) => judge(&response),
                Err(e) => Outcome::Retry(format!("request failed: {e}")),
            }
        })
    }
}

/// [`classify`] the answer's status; a retry also honours its `Retry-After`.
fn judge<B>(response: &http::Response<B>) -> Outcome {
    match classify(response.status()) {
        Outcome::Retry(error) => match tower_idempotency::retry_after::wait(response.headers()) {
            Some(after) => Outcome::RetryAfter {
                error: format!("{error}, Retry-After {} s", after.as_secs()),
                after,
            },
            None => Outcome::Retry(error),
        },
        outcome => outcome,
    }
}

/// A sink that calls `f` for each attempt. See [`from_fn`].
pub struct FnSink<F> {
    f: F,
}

impl<F> std::fmt::Debug for FnSink<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FnSink").finish_non_exhaustive()
    }
}

/// A sink from a closure returning a future of the [`Outcome`]: for a
/// broker, a queue or a call of your own.
///
/// ```
/// use tower_idempotency_outbox::{Delivery, Outcome, from_fn};
///
/// let sink = from_fn(|d: Delivery| async move {
///     println!("{} -> {}", d.key, d.destination);
///     Outcome::Delivered
/// });
/// # let _ = sink;
/// ```
pub fn from_fn<F, Fut>(f: F) -> FnSink<F>
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Outcome> + Send + 'static,
{
    FnSink { f }
}

impl<F, Fut> Sink for FnSink<F>
where
    F: Fn(Delivery) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Outcome> + Send + 'static,
{
    fn deliver(&self, delivery: Delivery) -> Pin<Box<dyn Future<Output = Outcome> + Send + '_>> {
        Box::pin((self.f)(delivery))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_classified() {
        for s in [200, 201, 204, 299] {
            assert_eq!(
                classify(StatusCode::from_u16(s).unwrap()),
                Outcome::Delivered
            );
        }
        for s in [408, 409, 425, 429, 500, 502, 503, 599] {
            assert_eq!(
                classify(StatusCode::from_u16(s).unwrap()),
                Outcome::Retry(format!("HTTP {s}"))
            );
        }
        for s in [100, 301, 400, 401, 403, 404, 410, 422, 499] {
            assert_eq!(
                classify(StatusCode::from_u16(s).unwrap()),
                Outcome::Reject(format!("HTTP {s}"))
            );
        }
    }

    #[test]
    fn a_retried_answer_honours_retry_after() {
        let answer = |status: u16, retry_after: Option<&str>| {
            let mut response = http::Response::new(());
            *response.status_mut() = StatusCode::from_u16(status).unwrap();
            if let Some(value) = retry_after {
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, value.parse().unwrap());
            }
            judge(&response)
        };
        let later = |status: u16, secs: u64| Outcome::RetryAfter {
            error: format!("HTTP {status}, Retry-After {secs} s"),
            after: std::time::Duration::from_secs(secs),
        };
        assert_eq!(answer(429, Some("5")), later(429, 5));
        assert_eq!(answer(503, Some("4")), later(503, 4));
        assert_eq!(answer(409, Some("3")), later(409, 3));
        assert_eq!(answer(503, Some("soon")), Outcome::Retry("HTTP 503".into()));
        assert_eq!(answer(503, None), Outcome::Retry("HTTP 503".into()));
        // Only a retried status looks at the field.
        assert_eq!(answer(201, Some("5")), Outcome::Delivered);
        assert_eq!(answer(400, Some("5")), Outcome::Reject("HTTP 400".into()));
        assert_eq!(answer(301, Some("5")), Outcome::Reject("HTTP 301".into()));
    }

    #[test]
    fn keys_are_sf_strings() {
        assert_eq!(sf_string("obx1-ab"), "\"obx1-ab\"");
        assert_eq!(sf_string("a\"b\\c"), "\"a\\\"b\\\\c\"");
    }
}
