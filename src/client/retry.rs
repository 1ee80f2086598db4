//! [`RetryPolicy`]: which answers are retried, and how long to wait.

use std::pin::Pin;
use std::time::Duration;

use http::{Request, Response, StatusCode};

/// Retries connection errors, 5xx and 409; never any other 4xx. Waits
/// what `Retry-After` asks (seconds or an HTTP date) on a 409 or 5xx that
/// carries it (capped at the largest delay), otherwise an exponential backoff with full jitter.
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

    /// A uniform wait between zero and the attempt's ceiling. The jitter is
    /// not a secret: should the OS generator fail, the wait is the ceiling.
    fn backoff(&self) -> Duration {
        let ceiling = self
            .base
            .saturating_mul(1u32 << self.attempt.min(16))
            .min(self.max_delay);
        let fraction = getrandom::u32().map_or(1000, |r| r % 1001);
        ceiling * fraction / 1000
    }
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
                crate::retry_after::wait(r.headers())
                    .map_or_else(|| self.backoff(), |d| d.min(self.max_delay))
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
    use http::header;
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
    fn backoff_stays_within_its_ceiling() {
        let mut policy = RetryPolicy::new()
            .base_delay(Duration::from_millis(100))
            .max_delay(Duration::from_millis(250));
        policy.attempt = 5; // 100 ms * 32, capped at 250 ms
        for _ in 0..1000 {
            assert!(policy.backoff() <= Duration::from_millis(250));
        }
    }
}
