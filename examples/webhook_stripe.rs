//! The Stripe-shaped route of `examples/webhook.rs`: events whose id is in
//! the JSON body, not in a header.
//!
//! A Stripe event is `{"id": "evt_...", "type": "...", "data": {...}}`, and
//! a redelivery carries the same `id`. `POST /stripe/events` reads the key at
//! the JSON pointer `/id` ([`IdempotencyLayer::key_from_json`]), so each
//! event is handled once: a redelivery gets the stored answer (marked
//! `idempotent-replayed: true`), or 409 while the first delivery is still
//! being handled; the same id with another body gets 422; an event without
//! an id gets 400 (`missing-key`), a body that is not JSON 400
//! (`invalid-key`).
//!
//! Stripe signs its deliveries (`Stripe-Signature`); a real receiver
//! verifies that before this layer, as [`super::verify_signature`] does for
//! Standard Webhooks, and scopes the keys by the verified account. This demo
//! route has one sender and skips the signature.

use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde::Deserialize;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::{IdempotencyLayer, Store};

use super::{MAX_BODY, RECORD_TTL};

/// The events handled so far: `(id, type)`, in the order they ran.
#[derive(Debug, Clone, Default)]
pub struct Handled(Arc<Mutex<Vec<(String, String)>>>);

impl Handled {
    /// Every event handled, in order.
    pub fn all(&self) -> Vec<(String, String)> {
        self.0.lock().unwrap().clone()
    }
}

#[derive(Deserialize)]
struct Event {
    id: String,
    #[serde(rename = "type")]
    kind: String,
}

/// Handles one event: it runs once per event id.
async fn handle(State(handled): State<Handled>, body: axum::body::Bytes) -> Response {
    // The layer found a string id at `/id`, so the body is JSON with one.
    let Ok(event) = serde_json::from_slice::<Event>(&body) else {
        return StatusCode::BAD_REQUEST.into_response();
    };
    let count = {
        let mut all = handled.0.lock().unwrap();
        all.push((event.id.clone(), event.kind.clone()));
        all.len()
    };
    let body = serde_json::json!({ "received": event.id, "type": event.kind, "handled": count });
    (StatusCode::OK, axum::Json(body)).into_response()
}

/// `POST /stripe/events`, deduplicated by the body's `/id`.
pub fn router<St: Store>(store: St, handled: Handled) -> Router {
    // One sender, so one scope; scope by the verified account when there are more.
    let idempotency = IdempotencyLayer::new(store, GlobalScope)
        .key_from_json("/id")
        .require_key(true)
        .ttl(RECORD_TTL)
        .max_request_body(MAX_BODY);
    Router::new()
        .route("/stripe/events", post(handle))
        .route_layer(idempotency)
        .with_state(handled)
}
