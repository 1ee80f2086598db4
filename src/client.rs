//! The client side: one idempotency key per logical request, kept across
//! retries, and a retry policy that retries only what is safe to retry.
//!
//! # Example
//!
//! ```
//! use std::convert::Infallible;
//! use std::sync::{Arc, Mutex};
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use tower::{Service, ServiceBuilder, ServiceExt, retry::RetryLayer};
//! use tower_idempotency::client::{IdempotencyKeyLayer, RetryPolicy};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! // A stand-in for an HTTP client: fails the first attempt with a 503.
//! let seen = Arc::new(Mutex::new(Vec::new()));
//! let log = seen.clone();
//! let client = tower::service_fn(move |req: Request<Full<Bytes>>| {
//!     let mut log = log.lock().unwrap();
//!     log.push(req.headers()["idempotency-key"].clone());
//!     let status = if log.len() == 1 { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::CREATED };
//!     let mut response = Response::new(());
//!     *response.status_mut() = status;
//!     async move { Ok::<_, Infallible>(response) }
//! });
//! let mut client = ServiceBuilder::new()
//!     .layer(IdempotencyKeyLayer::new())          // outside the retries: one key per call
//!     .layer(RetryLayer::new(RetryPolicy::new())) // every attempt carries it
//!     .service(client);
//! let request = Request::post("https://api.example/charges").body(Full::new(Bytes::from("amount=5"))).unwrap();
//! let response = client.ready().await.unwrap().call(request).await.unwrap();
//! assert_eq!(response.status(), StatusCode::CREATED);
//! let seen = seen.lock().unwrap();
//! assert_eq!(seen.len(), 2);
//! assert_eq!(seen[0], seen[1], "both attempts carried the same key");
//! # }
//! ```
//!
//! The key only helps if every retry of one operation carries it, and no other
//! operation does. So [`IdempotencyKeyLayer`] sits outside `tower::retry`
//! and gives each call a fresh random key (128 bits, sent as an RFC 8941
//! sf-string), unless the request already has one. [`RetryPolicy`] retries
//! connection errors, 5xx and 409 (the server's "still in flight",
//! honouring `Retry-After`), and never any other 4xx: those are the server's
//! considered answer.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{HeaderName, HeaderValue, Request, Response, StatusCode, header};
use tower_layer::Layer;
use tower_service::Service;

/// Adds a fresh idempotency key to every request that has none.
#[derive(Debug, Clone)]
#[must_use]
pub struct IdempotencyKeyLayer {
    header: HeaderName,
}

impl Default for IdempotencyKeyLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotencyKeyLayer {
    /// Keys in `Idempotency-Key`.
    pub fn new() -> Self {
        IdempotencyKeyLayer {
            header: HeaderName::from_static("idempotency-key"),
        }
    }

    /// Keys in another field.
    pub fn header_name(mut self, name: HeaderName) -> Self {
        self.header = name;
        self
    }
}

impl<S> Layer<S> for IdempotencyKeyLayer {
    type Service = IdempotencyKey<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyKey {
            inner,
            header: self.header.clone(),
        }
    }
}

/// The service made by [`IdempotencyKeyLayer`].
#[derive(Debug, Clone)]
pub struct IdempotencyKey<S> {
    inner: S,
    header: HeaderName,
}

/// A new key: 128 random bits as 32 hex digits, quoted as an sf-string.
pub fn new_key() -> HeaderValue {
    let mut bytes = [0u8; 16];
    for chunk in bytes.chunks_mut(8) {
        chunk.copy_from_slice(&crate::store::FencingToken::random().0.to_be_bytes());
    }
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    HeaderValue::from_str(&format!("\"{hex}\"")).unwrap_or(HeaderValue::from_static("\"\""))
}

impl<S, B> Service<Request<B>> for IdempotencyKey<S>
where
    S: Service<Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        if !req.headers().contains_key(&self.header) {
            req.headers_mut().insert(self.header.clone(), new_key());
        }
        self.inner.call(req)
    }
}

/// Retries connection errors, 5xx and 409; never any other 4xx. Waits
/// `Retry-After` seconds on a 409 or 503 that carries it (capped at the
/// largest delay), otherwise an exponential backoff with full jitter.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    attempts_left: usize,
    attempt: u32,
    base: Duration,
    max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl RetryPolicy {
    /// Up to 5 retries, backoff from 100 ms, no wait longer than 10 s.
    pub fn new() -> Self {
        RetryPolicy {
            attempts_left: 5,
            attempt: 0,
            base: Duration::from_millis(100),
            max_delay: Duration::from_secs(10),
        }
    }

    /// How many retries after the first attempt.
    pub fn retries(mut self, n: usize) -> Self {
        self.attempts_left = n;
        self
    }

    /// The first backoff delay (doubled for each further retry).
    pub fn base_delay(mut self, delay: Duration) -> Self {
        self.base = delay;
        self
    }

    /// The longest wait between attempts, `Retry-After` included.
    pub fn max_delay(mut self, delay: Duration) -> Self {
        self.max_delay = delay;
        self
    }

    fn backoff(&self) -> Duration {
        let ceiling = self
            .base
            .saturating_mul(1u32 << self.attempt.min(16))
            .min(self.max_delay);
        let fraction = (crate::store::FencingToken::random().0 as u64 % 1001) as u32;
        ceiling * fraction / 1000
    }
}

fn retry_after<B>(response: &Response<B>) -> Option<Duration> {
    let secs: u64 = response
        .headers()
        .get(header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_secs(secs))
}

impl<B: Clone, ResB, E> tower::retry::Policy<Request<B>, Response<ResB>, E> for RetryPolicy {
    type Future = Pin<Box<tokio::time::Sleep>>;

    fn retry(
        &mut self,
        _req: &mut Request<B>,
        result: &mut Result<Response<ResB>, E>,
    ) -> Option<Self::Future> {
        let delay = match result {
            Err(_) => self.backoff(),
            Ok(r) if r.status() == StatusCode::CONFLICT || r.status().is_server_error() => {
                retry_after(r).map_or_else(|| self.backoff(), |d| d.min(self.max_delay))
            }
            Ok(_) => return None,
        };
        if self.attempts_left == 0 {
            return None;
        }
        self.attempts_left -= 1;
        self.attempt += 1;
        Some(Box::pin(tokio::time::sleep(delay)))
    }

    fn clone_request(&mut self, req: &Request<B>) -> Option<Request<B>> {
        let mut clone = Request::new(req.body().clone());
        *clone.method_mut() = req.method().clone();
        *clone.uri_mut() = req.uri().clone();
        *clone.version_mut() = req.version();
        *clone.headers_mut() = req.headers().clone();
        *clone.extensions_mut() = req.extensions().clone();
        Some(clone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::retry::Policy;

    fn response(status: u16, retry_after: Option<&str>) -> Result<Response<()>, ()> {
        let mut r = Response::new(());
        *r.status_mut() = StatusCode::from_u16(status).unwrap();
        if let Some(v) = retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, v.parse().unwrap());
        }
        Ok(r)
    }

    #[tokio::test]
    async fn retries_errors_5xx_and_409_only() {
        let mut req = Request::new(());
        for (result, retried) in [
            (Err(()), true),
            (response(500, None), true),
            (response(503, None), true),
            (response(409, Some("1")), true),
            (response(400, None), false),
            (response(404, None), false),
            (response(422, None), false),
            (response(429, None), false),
            (response(201, None), false),
        ] {
            let mut result = result;
            let mut policy = RetryPolicy::new();
            let decision =
                Policy::<Request<()>, Response<()>, ()>::retry(&mut policy, &mut req, &mut result);
            assert_eq!(decision.is_some(), retried, "{result:?}");
        }
    }

    #[tokio::test]
    async fn gives_up_after_the_retries() {
        let mut req = Request::new(());
        let mut policy = RetryPolicy::new().retries(2).base_delay(Duration::ZERO);
        for expected in [true, true, false] {
            let mut result = response(503, None);
            let decision =
                Policy::<Request<()>, Response<()>, ()>::retry(&mut policy, &mut req, &mut result);
            assert_eq!(decision.is_some(), expected);
        }
    }

    #[test]
    fn keys_are_128_bit_sf_strings() {
        let key = new_key();
        let parsed = crate::key::parse_value(key.as_bytes()).unwrap();
        assert_eq!(parsed.len(), 32);
        assert!(parsed.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_ne!(new_key(), key);
    }
}
