//! The axum side of handlers (feature `axum`): [`StoreError`] as a
//! response, and the answer of an extractor whose value the request lacks
//! because the route is configured wrong.

use std::sync::Once;

use axum_core::body::Body;
use axum_core::response::IntoResponse;
use http::{HeaderValue, Response, StatusCode, header};

use crate::problem::Rejection;
use crate::service::STORE_RETRY_AFTER_SECS;
use crate::store::StoreError;

/// The layer's own answer to a store failure, so a handler can use `?` on
/// the store's calls ([`crate::store::SqliteTransaction::run`],
/// `PostgresTransaction::client`): 503 `store-unavailable` with
/// `Retry-After` (seconds), 503 `store-full` with the store's hint, or 500
/// `store-misconfigured` for [`StoreError::Config`] (see [`crate::problem`]).
/// The error itself is logged, not sent.
impl IntoResponse for StoreError {
    fn into_response(self) -> Response<Body> {
        tracing::error!(error = %self, "a handler's store call failed; answering with a problem");
        Rejection::store_failed(&self, STORE_RETRY_AFTER_SECS)
            .to_problem()
            .map(Body::from)
    }
}

/// The 500 problem of an extractor that found nothing in the request, with
/// `detail` saying how to fix the route. The server's fault, not the
/// client's, so it is also logged at error level, once per process for each
/// `logged` (one per extractor type): every request of that route would
/// repeat it.
pub(crate) fn misconfigured(logged: &'static Once, detail: &'static str) -> Response<Body> {
    logged.call_once(|| {
        tracing::error!(
            detail,
            "a handler's extractor found nothing in the request: the route is configured wrong; answering 500 (logged once per process)"
        );
    });
    internal_error(detail)
}

/// A 500 `application/problem+json` answer (`type` `about:blank`) with
/// `detail`.
pub(crate) fn internal_error(detail: &str) -> Response<Body> {
    let body = format!(
        r#"{{"type":"about:blank","title":"Internal Server Error","status":500,"detail":{}}}"#,
        serde_json::Value::from(detail)
    );
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}
