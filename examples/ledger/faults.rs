//! `--fault-injection`: the test headers of the credit route, as a
//! middleware between the idempotency layer and the handler (so after the
//! key is claimed):
//!
//! - `X-Ledger-Delay-Ms: N` (0..=30000): sleeps N ms before the handler;
//! - `X-Ledger-Pause-After-Effect-Ms: N` (0..=30000): sleeps N ms after a
//!   handler that succeeded, before its answer reaches the layer;
//! - `X-Ledger-Fail: after-effect`: marks the request (`FailAfterEffect`)
//!   so that its write fails once the credit is written, before it commits.
//!
//! Without the flag the headers are ignored.

use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::Next;
use axum::response::Response;

use crate::problem;

/// The request asked for `X-Ledger-Fail: after-effect`.
#[derive(Clone, Copy)]
pub struct FailAfterEffect;

/// The middleware; its state is `--fault-injection`.
pub async fn inject(State(enabled): State<bool>, mut request: Request, next: Next) -> Response {
    if !enabled {
        return next.run(request).await;
    }
    let headers = request.headers();
    let (before, after_effect) = match (
        delay(headers, "x-ledger-delay-ms"),
        delay(headers, "x-ledger-pause-after-effect-ms"),
    ) {
        (Ok(before), Ok(after)) => (before, after),
        (Err(detail), _) | (_, Err(detail)) => {
            return problem(StatusCode::BAD_REQUEST, "Bad Request", detail);
        }
    };
    if headers
        .get("x-ledger-fail")
        .is_some_and(|v| v.as_bytes() == b"after-effect")
    {
        request.extensions_mut().insert(FailAfterEffect);
    }
    pause(before).await;
    let response = next.run(request).await;
    // Separate mode: the credit is committed. Transactional mode: it commits
    // with the record once this response reaches the layer.
    if response.status().is_success() {
        pause(after_effect).await;
    }
    response
}

/// A delay header, in milliseconds (0..=30000).
fn delay(headers: &HeaderMap, name: &str) -> Result<Duration, String> {
    let Some(value) = headers.get(name) else {
        return Ok(Duration::ZERO);
    };
    value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|ms| *ms <= 30_000)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("{name} must be an integer in 0..=30000"))
}

/// Sleeps for a fault-injection delay, and not at all when it is zero: Tokio's
/// timer rounds up to its 1 ms tick, so even a zero sleep can cost a
/// millisecond, and in transactional mode this runs while the request holds
/// the SQLite writer, which would serialise every credit behind it.
async fn pause(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}
