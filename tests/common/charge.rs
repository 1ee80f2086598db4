//! The `POST /charge` app that the fault tests of every store share: what
//! its handler answers, how a test sends a charge, and what it asserts of
//! the answer.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::problem::types;

use super::{Harness, Raw, send, serve};

/// The scope of every request: the `x-user` header.
pub fn user(parts: &Parts) -> String {
    parts
        .headers
        .get("x-user")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("anonymous")
        .to_owned()
}

/// The handler of separate mode: counts the run, waits at its gate if
/// asked, answers as [`answer`].
pub async fn charge(State(h): State<Harness>, headers: HeaderMap) -> Response {
    let n = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
    h.wait_at_gate(&headers).await;
    answer(n, &headers)
}

/// Serves `/charge` ([`charge`]) behind a separate-mode layer on `store`,
/// scoped by [`user`].
pub async fn serve_separate<St: tower_idempotency::Store>(store: St, h: &Harness) -> SocketAddr {
    let app = Router::new()
        .route("/charge", post(charge))
        .route_layer(IdempotencyLayer::new(store, |p: &Parts| user(p)));
    serve(app.with_state(h.clone())).await
}

/// The answer of a handler's `n`th run: 201, `x-charge: n`, and `charge n`,
/// or `x-size` bytes of `x` when the request asks for a large body.
pub fn answer(n: usize, headers: &HeaderMap) -> Response {
    let size: usize = headers
        .get("x-size")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .unwrap_or(0);
    let body = if size > 0 {
        vec![b'x'; size]
    } else {
        format!("charge {n}").into_bytes()
    };
    (StatusCode::CREATED, [("x-charge", n.to_string())], body).into_response()
}

/// POST /charge with `key` as alice; `extra` header fields on top.
pub async fn request(addr: SocketAddr, key: &str, extra: &[(&str, &[u8])]) -> Raw {
    let key = format!("\"{key}\"");
    let mut headers: Vec<(&str, &[u8])> =
        vec![("idempotency-key", key.as_bytes()), ("x-user", b"alice")];
    headers.extend_from_slice(extra);
    send(addr, "POST", "/charge", &headers, b"amount=5").await
}

/// The 503 `store-unavailable` problem with `Retry-After: 1`, not a replay.
#[track_caller]
pub fn assert_unavailable(r: &Raw) {
    assert_eq!(r.assert_problem(503), types::STORE_UNAVAILABLE, "{r:?}");
    assert_eq!(r.header_str("retry-after"), Some("1"), "{r:?}");
    assert_eq!(r.header("idempotent-replayed"), None, "{r:?}");
}

/// A first response of the handler's `n`th run (not a replay), with the
/// body `charge n` unless the request asked for a large one.
#[track_caller]
pub fn assert_ran(r: &Raw, n: usize) {
    assert_eq!(r.status, 201, "{r:?}");
    assert_eq!(r.header("idempotent-replayed"), None, "{r:?}");
    assert_eq!(r.header_str("x-charge"), Some(n.to_string().as_str()));
    if !r.body.iter().all(|b| *b == b'x') || r.body.is_empty() {
        assert_eq!(r.body, format!("charge {n}").into_bytes());
    }
}

/// The 409 `in-flight` problem, with `Retry-After` in seconds.
#[track_caller]
pub fn assert_in_flight(r: &Raw, retry_after: &str) {
    assert_eq!(r.assert_problem(409), types::IN_FLIGHT, "{r:?}");
    assert_eq!(r.header_str("retry-after"), Some(retry_after), "{r:?}");
    assert_eq!(r.header("idempotent-replayed"), None, "{r:?}");
}

/// `again` replays `first` byte for byte: status, fields in order, body.
#[track_caller]
pub fn assert_replay_of(again: &Raw, first: &Raw) {
    assert!(again.replayed(), "{again:?}");
    assert_eq!(again.status, first.status);
    assert_eq!(again.stable_headers(), first.stable_headers());
    assert_eq!(again.body, first.body);
}
