//! The axum side of handlers (feature `axum`): the [`ClaimedKey`]
//! extractor, and the answer of an extractor whose value the request lacks
//! because the route is configured wrong.

use std::sync::Once;

use axum_core::body::Body;
use axum_core::response::IntoResponse;
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
    problem(StatusCode::INTERNAL_SERVER_ERROR, detail)
}

/// An `application/problem+json` answer (RFC 9457) of type `about:blank`:
/// the title is the status's reason phrase, as RFC 9457 §4.2.1 asks.
fn problem(status: StatusCode, detail: &str) -> Response<Body> {
    let title = status.canonical_reason().unwrap_or("Error");
    let string = |s: &str| serde_json::Value::from(s).to_string();
    let body = format!(
        r#"{{"type":"about:blank","title":{},"status":{},"detail":{}}}"#,
        string(title),
        status.as_u16(),
        string(detail)
    );
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
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

/// An axum extractor `E` whose rejection comes out as problem details and is
/// not stored.
///
/// axum's own extractors reject with `text/plain` (`Path` on a segment that
/// is not UTF-8, `Json` on a malformed body). Wrapped, the same rejection is
/// answered `application/problem+json` (RFC 9457, `type` `about:blank`) with
/// the same status and the rejection's text as `detail`, and it carries
/// [`DoNotStore`](crate::policy::DoNotStore): the handler never ran, so
/// nothing happened, and the key is given back (Stripe saves no result for a
/// request that fails validation before the endpoint runs). A retry with
/// the same key runs again; the corrected request may keep the key.
///
/// ```
/// use axum::{Router, routing::post, extract::Path, Json};
/// use tower_idempotency::problem::WithProblem;
///
/// async fn credit(
///     WithProblem(Path(account)): WithProblem<Path<u64>>,
///     WithProblem(Json(amount)): WithProblem<Json<u64>>,
/// ) -> String {
///     format!("credited {amount} to {account}")
/// }
///
/// let app: Router = Router::new().route("/accounts/{account}/credits", post(credit));
/// ```
///
/// A rejection's `detail` is cut at 1 KiB; its header fields other than
/// `Content-Type` and `Content-Length` are kept (a 401's
/// `WWW-Authenticate`, a 405's `Allow`).
#[derive(Debug, Clone, Copy, Default)]
pub struct WithProblem<E>(pub E);

impl<S, E> axum_core::extract::FromRequestParts<S> for WithProblem<E>
where
    S: Send + Sync,
    E: axum_core::extract::FromRequestParts<S>,
    E::Rejection: IntoResponse,
{
    type Rejection = Response<Body>;

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        let rejection = match E::from_request_parts(parts, state).await {
            Ok(value) => return Ok(WithProblem(value)),
            Err(rejection) => rejection.into_response(),
        };
        Err(early_rejection(rejection).await)
    }
}

impl<S, E> axum_core::extract::FromRequest<S> for WithProblem<E>
where
    S: Send + Sync,
    E: axum_core::extract::FromRequest<S>,
    E::Rejection: IntoResponse,
{
    type Rejection = Response<Body>;

    async fn from_request(
        request: http::Request<Body>,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        let rejection = match E::from_request(request, state).await {
            Ok(value) => return Ok(WithProblem(value)),
            Err(rejection) => rejection.into_response(),
        };
        Err(early_rejection(rejection).await)
    }
}

/// The problem that stands for an extractor's `rejection`: its status and
/// header fields (`WWW-Authenticate` on a 401, `Allow` on a 405), its text
/// (cut at [`DETAIL_LIMIT`] bytes) as `detail`, and `DoNotStore`.
async fn early_rejection(response: Response<Body>) -> Response<Body> {
    use http_body_util::BodyExt;
    let (parts, body) = response.into_parts();
    // Read a little more than is kept, so that a longer text is cut, not lost.
    let limited = http_body_util::Limited::new(body, 64 * DETAIL_LIMIT);
    let detail = match limited.collect().await {
        Ok(text) => {
            let text = text.to_bytes();
            let mut detail = String::from_utf8_lossy(&text).into_owned();
            if detail.len() > DETAIL_LIMIT {
                let mut end = DETAIL_LIMIT;
                while !detail.is_char_boundary(end) {
                    end -= 1;
                }
                detail.truncate(end);
            }
            detail
        }
        Err(_) => String::from("the request was refused before the handler ran"),
    };
    let mut answer = problem(parts.status, &detail);
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            answer.headers_mut().append(name, value.clone());
        }
    }
    answer.extensions_mut().insert(crate::policy::DoNotStore);
    answer
}

/// The most bytes of a rejection's text kept as `detail`.
const DETAIL_LIMIT: usize = 1024;
