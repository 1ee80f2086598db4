//! The axum side of handlers (feature `axum`): the [`ClaimedKey`]
//! extractor, and the answer of an extractor whose value the request lacks
//! because the route is configured wrong.

use std::sync::Once;

use axum_core::body::Body;
use http::{HeaderValue, Response, StatusCode, header};

use crate::key::ClaimedKey;

/// The 500 problem of an extractor that found nothing in the request, with
/// `detail` saying how to fix the route. The server's fault, not the
/// client's, so it is also logged at error level, once per process for each
/// `logged` (one per extractor type): every request of that route would
/// repeat it.
pub fn misconfigured(logged: &'static Once, detail: &str) -> Response<Body> {
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
pub fn internal_error(detail: &str) -> Response<Body> {
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

impl<S: Sync> axum_core::extract::FromRequestParts<S> for ClaimedKey {
    type Rejection = http::Response<axum_core::body::Body>;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        static LOGGED: std::sync::Once = std::sync::Once::new();
        parts.extensions.get::<ClaimedKey>().cloned().ok_or_else(|| {
            misconfigured(
                &LOGGED,
                "this handler needs the request's idempotency key, and the request has none: put the route behind an IdempotencyLayer with require_key(true), or take Option<ClaimedKey>",
            )
        })
    }
}

/// `Option<_>`: `None` for requests that passed through without a key.
impl<S: Sync> axum_core::extract::OptionalFromRequestParts<S> for ClaimedKey {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<ClaimedKey>().cloned())
    }
}
