//! The app of the waiting tests (`wait_in_flight.rs`, `wake_other_server.rs`):
//! one `/credit` route whose runs are counted and whose first request can be
//! held at a gate, and the requests they send.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::Store;

use super::{Harness, Raw, send, serve};

/// Each run answers 201 with its number, or 500 (the key is given back)
/// when asked to fail (`x-fail`); a request with `x-gate` waits at that
/// gate first.
pub async fn credit(State(h): State<Harness>, headers: HeaderMap) -> (StatusCode, String) {
    let n = h.runs.fetch_add(1, Ordering::SeqCst) + 1;
    h.wait_at_gate(&headers).await;
    if headers.contains_key("x-fail") {
        return (StatusCode::INTERNAL_SERVER_ERROR, format!("run {n} failed"));
    }
    (StatusCode::CREATED, format!("run {n}"))
}

/// `/credit` behind `layer` (a key required), served on loopback.
pub async fn server<St: Store>(
    layer: IdempotencyLayer<St, GlobalScope>,
    h: &Harness,
) -> SocketAddr {
    let app = Router::new()
        .route("/credit", post(credit))
        .route_layer(layer.require_key(true))
        .with_state(h.clone());
    serve(app).await
}

/// A credit under the key `k`, with `extra` header fields.
pub async fn post_key(addr: SocketAddr, extra: &[(&str, &[u8])]) -> Raw {
    let mut headers: Vec<(&str, &[u8])> = vec![("idempotency-key", b"\"k\"")];
    headers.extend_from_slice(extra);
    send(addr, "POST", "/credit", &headers, b"{\"amount\":5}").await
}

/// Whether an answer is a replay.
pub fn replayed(r: &Raw) -> bool {
    r.header("idempotent-replayed") == Some(b"true")
}
