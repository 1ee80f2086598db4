//! A key from the body ([`crate::key_source`]): the body is buffered, then
//! the layer's source is asked for the key.

use bytes::Bytes;
use http::HeaderMap;
use http::request::Parts;
use http_body::Body;

use super::BoxError;
use crate::body::buffer_request;
use crate::config::Settings;
use crate::key_source::find_key;
use crate::problem::Rejection;

/// What the body said.
pub(super) enum Found {
    /// A key, with the request's head and its buffered body.
    Key(String, Parts, Bytes, Option<HeaderMap>),
    /// No key, and the layer does not require one: the request passes
    /// through with its buffered body.
    None(Parts, Bytes, Option<HeaderMap>),
    /// 413 (body too large), 400 (unreadable body, missing or invalid key).
    Rejected(Rejection),
}

/// Buffers `body` (up to the layer's limit) and reads the key from it.
pub(super) async fn find<B>(settings: &Settings, parts: Parts, body: B) -> Found
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let Some(source) = settings.key_source.as_deref() else {
        // Not reached: the service looks for a header key when there is no source.
        return Found::Rejected(Rejection::MissingKey);
    };
    let (bytes, trailers) = match buffer_request(body, settings.max_request_body).await {
        Ok(buffered) => buffered,
        Err(rejection) => return Found::Rejected(rejection),
    };
    match find_key(source, &parts, &bytes) {
        Ok(Some(key)) => Found::Key(key, parts, bytes, trailers),
        Ok(None) if !settings.require_key => Found::None(parts, bytes, trailers),
        Ok(None) => Found::Rejected(Rejection::MissingKey),
        Err(e) => Found::Rejected(Rejection::InvalidKey(e)),
    }
}
