//! The operators' view of an outbox (feature `admin`): an axum
//! router beside [`tower_idempotency::admin::router`], with the same rules (no
//! authentication of its own: mount it only behind the operators').
//!
//! # Endpoints
//!
//! * `GET /outbox/pending?limit=N`, `GET /outbox/in-flight?limit=N`,
//!   `GET /outbox/dead?limit=N`: a JSON array of the messages in that state
//!   ([`View`]), oldest first, at most `N` (1..=1000, default 100), each
//!   `{"id":…,"key":…,"destination":…,"attempts":…,"age_ms":…,"due_in_ms":…,"lease_remaining_ms":…|null,"last_error":…|null}`.
//! * `GET /outbox/counts`:
//!   `{"pending":…,"in_flight":…,"dead":…,"done":…,"oldest_pending_age_ms":…|null}`.
//! * `POST /outbox/dead/{id}/requeue`: makes dead letter `id` pending again
//!   ([`Outbox::requeue`]): 200 `{"requeued":id}`; 404 problem when `id` is
//!   not a dead letter; 400 problem when `id` is not an integer.
//!
//! A database error is 503 with the `store-unavailable` problem.
//!
//! ```no_run
//! # async fn f(store: tower_idempotency::SqliteStore) -> Result<(), tower_idempotency::StoreError> {
//! use tower_idempotency::admin;
//! use tower_idempotency_outbox::{self as outbox, Outbox};
//! let outbox = Outbox::sqlite(store.path()).await?;
//! let operators = admin::router(store).merge(outbox::admin::router(outbox));
//! # let _ = operators; Ok(()) }
//! ```

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Query, State, rejection::QueryRejection};
use axum::routing::{get, post};
use http::{HeaderValue, Response, StatusCode, header};

use super::{Counts, Entry, Outbox, View};
use tower_idempotency::admin::{bad_request, json, parse_limit, string, unavailable};

/// The router over `outbox` (see the module docs).
pub fn router(outbox: Outbox) -> Router {
    Router::new()
        .route("/outbox/pending", get(|s, q| list(s, q, View::Pending)))
        .route("/outbox/in-flight", get(|s, q| list(s, q, View::InFlight)))
        .route("/outbox/dead", get(|s, q| list(s, q, View::Dead)))
        .route("/outbox/counts", get(counts))
        .route("/outbox/dead/{id}/requeue", post(requeue))
        .with_state(outbox)
}

async fn list(
    State(outbox): State<Outbox>,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
    view: View,
) -> Response<Body> {
    let limit = match query {
        Ok(Query(pairs)) => match parse_limit(&pairs) {
            Ok(limit) => limit,
            Err(detail) => return bad_request(&detail),
        },
        Err(e) => return bad_request(&format!("the query string is malformed: {e}")),
    };
    match outbox.list(view, limit).await {
        Ok(entries) => {
            let items: Vec<String> = entries.iter().map(entry_json).collect();
            json(format!("[{}]", items.join(",")))
        }
        Err(e) => unavailable(&e),
    }
}

async fn counts(State(outbox): State<Outbox>) -> Response<Body> {
    match outbox.counts().await {
        Ok(c) => json(counts_json(&c)),
        Err(e) => unavailable(&e),
    }
}

async fn requeue(State(outbox): State<Outbox>, Path(id): Path<String>) -> Response<Body> {
    let Ok(id) = id.parse::<i64>() else {
        return bad_request("the message id must be an integer");
    };
    match outbox.requeue(id).await {
        Ok(true) => {
            tracing::info!(
                id,
                "an outbox dead letter was requeued on an operator's request"
            );
            json(format!("{{\"requeued\":{id}}}"))
        }
        Ok(false) => not_found(id),
        Err(e) => unavailable(&e),
    }
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "null".to_owned(), |v| v.to_string())
}

fn entry_json(e: &Entry) -> String {
    format!(
        "{{\"id\":{},\"key\":{},\"destination\":{},\"attempts\":{},\"age_ms\":{},\"due_in_ms\":{},\"lease_remaining_ms\":{},\"last_error\":{}}}",
        e.id,
        string(&e.key),
        string(&e.destination),
        e.attempts,
        e.age_ms,
        e.due_in_ms,
        opt(e.lease_remaining_ms),
        opt(e.last_error.as_deref().map(string)),
    )
}

fn counts_json(c: &Counts) -> String {
    format!(
        "{{\"pending\":{},\"in_flight\":{},\"dead\":{},\"done\":{},\"oldest_pending_age_ms\":{}}}",
        c.pending,
        c.in_flight,
        c.dead,
        c.done,
        opt(c.oldest_pending_age_ms)
    )
}

/// 404 with an `about:blank` problem.
fn not_found(id: i64) -> Response<Body> {
    let body = format!(
        "{{\"type\":\"about:blank\",\"title\":\"Not Found\",\"status\":404,\"detail\":\"message {id} is not a dead letter\"}}"
    );
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = StatusCode::NOT_FOUND;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}
