//! The axum side of handlers (feature `axum`): the answer of an extractor
//! whose value the request lacks because the route is configured wrong.

use std::sync::Once;

use axum_core::body::Body;
use http::{HeaderValue, Response, StatusCode, header};

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
