//! An HTTP view of a store for operators (the `admin` cargo feature): the
//! records stuck in flight, how many records there are, and a purge.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use axum::{body::Body, http::Request};
//! use http_body_util::BodyExt;
//! use tower::ServiceExt;
//! use tower_idempotency::{MemoryStore, admin};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let store = MemoryStore::new();
//! // Mount it on the operators' own listener, behind their authentication
//! // (see below), e.g. `Router::new().nest("/idempotency", admin::router(store))`.
//! let app = admin::router(store);
//!
//! let counts = app
//!     .oneshot(Request::get("/records/counts").body(Body::empty()).unwrap())
//!     .await
//!     .unwrap();
//! assert_eq!(counts.status(), 200);
//! let body = counts.into_body().collect().await.unwrap().to_bytes();
//! assert_eq!(body, r#"{"in_flight":0,"stuck":0,"completed":0,"expired":0}"#);
//! # }
//! ```
//!
//! # Mount it behind your own authentication, never on the public listener
//!
//! The router has no authentication of its own. It answers anyone who reaches
//! it with the scopes (who the keys belong to: user ids, tenants, tokens,
//! depending on the layer's scope function) and the idempotency keys of
//! records, and lets them purge. Serve it on a separate listener that only
//! operators reach (a loopback or internal address), behind the same
//! authentication as the rest of the operators' tools.
//!
//! # Endpoints
//!
//! Every figure is judged by the store's clock ([`Inspect`]); durations are
//! in milliseconds.
//!
//! * `GET /records/stuck?limit=N`: a JSON array of the in-flight records
//!   whose lease has ended, oldest lease end first, at most `N` (an integer
//!   in 1..=1000, default 100): their holder crashed or overran its lease, and
//!   the next retry takes them over. Each is
//!   `{"scope":…,"key":…,"fingerprint":"<64 hex digits>","lease_ended_ms_ago":…,"ttl_remaining_ms":…}`.
//! * `GET /records/counts`: `{"in_flight":…,"stuck":…,"completed":…,"expired":…}`
//!   ([`RecordCounts`]).
//! * `POST /records/purge`: deletes the records past their TTL
//!   ([`Store::purge_expired`]) and answers `{"purged":N}`.
//!
//! A store error is answered 503 with the crate's `store-unavailable`
//! problem ([`crate::problem`]); a `limit` that is not an integer in
//! 1..=1000, or any other query parameter, 400 with an `about:blank` problem
//! (RFC 9457 §4.2.1). Both are `application/problem+json`.
//!
//! [`Store::purge_expired`]: crate::Store::purge_expired

use axum::Router;
use axum::body::Body;
use axum::extract::{Query, State, rejection::QueryRejection};
use axum::routing::{get, post};
use http::{HeaderValue, Response, StatusCode, header};

use crate::problem::Rejection;
use crate::store::{Inspect, RecordCounts, RecordSummary, StoreError};

/// `limit` when the query has none.
pub const DEFAULT_LIMIT: usize = 100;
/// The largest `limit` accepted.
pub const MAX_LIMIT: usize = 1000;

/// The operators' router over `store`: `GET /records/stuck?limit=N`,
/// `GET /records/counts`, `POST /records/purge` (see the module docs).
/// Mount it only behind the operators' own authentication.
pub fn router<S: Inspect>(store: S) -> Router {
    Router::new()
        .route("/records/stuck", get(stuck::<S>))
        .route("/records/counts", get(counts::<S>))
        .route("/records/purge", post(purge::<S>))
        .with_state(store)
}

async fn stuck<S: Inspect>(
    State(store): State<S>,
    query: Result<Query<Vec<(String, String)>>, QueryRejection>,
) -> Response<Body> {
    let limit = match query {
        Ok(Query(pairs)) => match parse_limit(&pairs) {
            Ok(limit) => limit,
            Err(detail) => return bad_request(&detail),
        },
        Err(e) => return bad_request(&format!("the query string is malformed: {e}")),
    };
    match store.stuck(limit).await {
        Ok(records) => {
            let items: Vec<String> = records.iter().map(summary_json).collect();
            json(format!("[{}]", items.join(",")))
        }
        Err(e) => unavailable(&e),
    }
}

async fn counts<S: Inspect>(State(store): State<S>) -> Response<Body> {
    match store.counts().await {
        Ok(counts) => json(counts_json(&counts)),
        Err(e) => unavailable(&e),
    }
}

async fn purge<S: Inspect>(State(store): State<S>) -> Response<Body> {
    match store.purge_expired().await {
        Ok(purged) => {
            tracing::info!(
                purged,
                "purged expired idempotency records on an operator's request"
            );
            json(format!("{{\"purged\":{purged}}}"))
        }
        Err(e) => unavailable(&e),
    }
}

/// `limit` from a router's query pairs: absent ([`DEFAULT_LIMIT`]), or once,
/// an integer in 1..=[`MAX_LIMIT`]; any other parameter is an error that names it.
/// For routers beside [`router`] with the same rules (the outbox's).
///
/// # Errors
///
/// The detail of the 400 to answer ([`bad_request`]).
pub fn parse_limit(pairs: &[(String, String)]) -> Result<usize, String> {
    if let Some((name, _)) = pairs.iter().find(|(name, _)| name != "limit") {
        return Err(format!(
            "unknown query parameter {}; only limit is accepted",
            string(name)
        ));
    }
    match pairs {
        [] => Ok(DEFAULT_LIMIT),
        [(_, value)] => value
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_LIMIT).contains(n))
            .ok_or_else(|| format!("limit must be an integer in 1..={MAX_LIMIT}")),
        _ => Err("limit must be given at most once".into()),
    }
}

/// `s` as a JSON string, quoted and escaped.
pub fn string(s: &str) -> String {
    serde_json::Value::from(s).to_string()
}

// Written member by member, so the order is fixed whatever serde_json's
// features are.
fn summary_json(s: &RecordSummary) -> String {
    format!(
        "{{\"scope\":{},\"key\":{},\"fingerprint\":\"{}\",\"lease_ended_ms_ago\":{},\"ttl_remaining_ms\":{}}}",
        string(&s.scope),
        string(&s.key),
        s.fingerprint_hex(),
        s.lease_ended_ms_ago,
        s.ttl_remaining_ms,
    )
}

fn counts_json(c: &RecordCounts) -> String {
    format!(
        "{{\"in_flight\":{},\"stuck\":{},\"completed\":{},\"expired\":{}}}",
        c.in_flight, c.stuck, c.completed, c.expired
    )
}

/// A 200 answer with `body`, which must be JSON, as `application/json`.
pub fn json(body: String) -> Response<Body> {
    let mut response = Response::new(Body::from(body));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// 503 with the crate's `store-unavailable` problem and `Retry-After: 1`
/// (RFC 9457), for a store or table that cannot be read; `e` is logged at
/// WARN, never echoed.
pub fn unavailable(e: &StoreError) -> Response<Body> {
    tracing::warn!(error = %e, "the admin router could not read the idempotency store");
    Rejection::StoreUnavailable {
        retry_after_secs: 1,
    }
    .to_problem()
    .map(Body::from)
}

/// 400 with an `about:blank` problem whose `detail` is `detail` (RFC 9457
/// §4.2.1: the title is the status's reason phrase).
pub fn bad_request(detail: &str) -> Response<Body> {
    let body = format!(
        "{{\"type\":\"about:blank\",\"title\":\"Bad Request\",\"status\":400,\"detail\":{}}}",
        string(detail)
    );
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = StatusCode::BAD_REQUEST;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn limits() {
        assert_eq!(parse_limit(&pairs(&[])), Ok(100));
        assert_eq!(parse_limit(&pairs(&[("limit", "1")])), Ok(1));
        assert_eq!(parse_limit(&pairs(&[("limit", "1000")])), Ok(1000));
        for bad in ["0", "1001", "-1", "", "1.5", "ten", " 5"] {
            assert_eq!(
                parse_limit(&pairs(&[("limit", bad)])),
                Err("limit must be an integer in 1..=1000".into()),
                "{bad:?}"
            );
        }
        assert_eq!(
            parse_limit(&pairs(&[("limit", "1"), ("limit", "2")])),
            Err("limit must be given at most once".into())
        );
        assert_eq!(
            parse_limit(&pairs(&[("limit", "1"), ("limt", "2")])),
            Err("unknown query parameter \"limt\"; only limit is accepted".into())
        );
    }
}
