//! Key sources: where the layer finds a request's idempotency key.
//!
//! The default is the `Idempotency-Key` header field (or the field named by
//! [`IdempotencyLayer::header_name`](crate::IdempotencyLayer::header_name)),
//! parsed by the strict rules of [`crate::key`] before the body is read. Many
//! senders put the key elsewhere: Stripe's webhook events carry their id in
//! the JSON body (`{"id": "evt_...", "type": ..., "data": ...}`). For them:
//!
//! - [`IdempotencyLayer::key_from_json`](crate::IdempotencyLayer::key_from_json)
//!   reads the key at an RFC 6901 JSON pointer (`/id`) of the body: a
//!   string, or an integer written in decimal;
//! - [`IdempotencyLayer::key_from_fn`](crate::IdempotencyLayer::key_from_fn)
//!   takes any function of the request head and the body bytes;
//! - [`IdempotencyLayer::key_from`](crate::IdempotencyLayer::key_from) takes
//!   any [`KeySource`].
//!
//! # Example
//!
//! ```
//! use axum::{Router, routing::post, http::{Request, StatusCode}, body::Body};
//! use std::sync::{Arc, atomic::{AtomicUsize, Ordering}};
//! use tower::ServiceExt;
//! use tower_idempotency::{IdempotencyLayer, MemoryStore, scope::GlobalScope};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let runs = Arc::new(AtomicUsize::new(0));
//! let counter = runs.clone();
//! let app = Router::new()
//!     .route("/stripe", post(move || async move {
//!         counter.fetch_add(1, Ordering::SeqCst);
//!         StatusCode::OK
//!     }))
//!     .route_layer(
//!         IdempotencyLayer::new(MemoryStore::new(), GlobalScope)
//!             .key_from_json("/id")
//!             .require_key(true),
//!     );
//! let event = |body: &'static str| Request::post("/stripe").body(Body::from(body)).unwrap();
//! let delivery = r#"{"id":"evt_1","type":"charge.succeeded","data":{}}"#;
//! let first = app.clone().oneshot(event(delivery)).await.unwrap();
//! let again = app.clone().oneshot(event(delivery)).await.unwrap();
//! assert_eq!(again.headers()["idempotent-replayed"], "true");
//! assert_eq!(runs.load(Ordering::SeqCst), 1, "the event was handled once");
//!
//! // No id: 400 (`missing-key`); not JSON: 400 (`invalid-key`).
//! let no_id = app.clone().oneshot(event(r#"{"type":"ping"}"#)).await.unwrap();
//! assert_eq!(no_id.status(), StatusCode::BAD_REQUEST);
//! let not_json = app.clone().oneshot(event("id=evt_1")).await.unwrap();
//! assert_eq!(not_json.status(), StatusCode::BAD_REQUEST);
//! # let _ = first;
//! # }
//! ```
//!
//! # What changes with a body source
//!
//! - **When the key is known.** A header key is parsed before anything else;
//!   a key from the body only after the body is buffered (up to the layer's
//!   [`max_request_body`](crate::IdempotencyLayer::max_request_body), 413
//!   past it). So with a body source the body is read before the scope is
//!   asked (401) and before a missing key is refused (400).
//! - **The same rules for the key.** A key from a body source is 1 to
//!   [`MAX_KEY_LEN`] characters of printable ASCII (a space included); there
//!   is no quoting. A bad key is the 400 `invalid-key` problem, no key is the
//!   400 `missing-key` problem, or, with `require_key(false)`, the request
//!   passes through (with its buffered body) and is never deduplicated.
//! - **A body that is not JSON** when a JSON pointer is configured is the 400
//!   `invalid-key` problem ([`KeyError::BodyNotJson`]), never a
//!   pass-through. A JSON `null` at the pointer counts as no key; any other
//!   value that is neither a string nor an integer is
//!   [`KeyError::UnsupportedType`].
//! - **The header is not read** at all: the source replaces it.

use std::fmt;

use http::request::Parts;

use crate::key::{KeyError, MAX_KEY_LEN};

/// Finds the idempotency key of a request in its head and its buffered body.
///
/// Implemented by [`JsonPointer`], by [`FromFn`], and by every
/// `Fn(&Parts, &[u8]) -> Result<Option<String>, KeyError>`. The layer checks
/// what it returns with [`check_key`], so an implementation need not.
pub trait KeySource: Send + Sync + 'static {
    /// The key, `Ok(None)` when the request carries none, or why what it
    /// carries is not a key (400 `invalid-key`).
    fn key(&self, parts: &Parts, body: &[u8]) -> Result<Option<String>, KeyError>;
}

impl<F> KeySource for F
where
    F: Fn(&Parts, &[u8]) -> Result<Option<String>, KeyError> + Send + Sync + 'static,
{
    fn key(&self, parts: &Parts, body: &[u8]) -> Result<Option<String>, KeyError> {
        self(parts, body)
    }
}

/// A key source from a function of the head and the body; see [`from_fn`].
#[derive(Clone, Copy)]
pub struct FromFn<F>(F);

impl<F> fmt::Debug for FromFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FromFn").finish_non_exhaustive()
    }
}

/// A key source from `f`, without the argument types a bare closure needs
/// written out (`|parts: &Parts, body: &[u8]| ...`).
pub fn from_fn<F>(f: F) -> FromFn<F>
where
    F: Fn(&Parts, &[u8]) -> Result<Option<String>, KeyError> + Send + Sync + 'static,
{
    FromFn(f)
}

impl<F> KeySource for FromFn<F>
where
    F: Fn(&Parts, &[u8]) -> Result<Option<String>, KeyError> + Send + Sync + 'static,
{
    fn key(&self, parts: &Parts, body: &[u8]) -> Result<Option<String>, KeyError> {
        (self.0)(parts, body)
    }
}

/// The key at an RFC 6901 JSON pointer of the body (`/id`, `/event/id`):
/// a string as it is, an integer in decimal. See [`json_pointer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonPointer(String);

/// A key source reading the body's JSON at `pointer` (RFC 6901, as
/// [`serde_json::Value::pointer`] reads it: `""` for the whole document, or
/// `/`-separated tokens with `~1` for `/` and `~0` for `~`).
///
/// # Panics
///
/// When `pointer` is neither empty nor starts with `/`: such a pointer
/// selects nothing, so every request would count as keyless. The mistake
/// shows when the layer is built, not as a silent pass-through.
pub fn json_pointer(pointer: impl Into<String>) -> JsonPointer {
    let pointer = pointer.into();
    assert!(
        pointer.is_empty() || pointer.starts_with('/'),
        "a JSON pointer (RFC 6901) is empty or starts with `/`; got {pointer:?}"
    );
    JsonPointer(pointer)
}

impl KeySource for JsonPointer {
    fn key(&self, _parts: &Parts, body: &[u8]) -> Result<Option<String>, KeyError> {
        let document: serde_json::Value =
            serde_json::from_slice(body).map_err(|_| KeyError::BodyNotJson)?;
        match document.pointer(&self.0) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(key)) => Ok(Some(key.clone())),
            Some(serde_json::Value::Number(n)) if n.is_i64() || n.is_u64() => {
                Ok(Some(n.to_string()))
            }
            Some(_) => Err(KeyError::UnsupportedType),
        }
    }
}

/// The rules every key from a [`KeySource`] must meet: 1 to [`MAX_KEY_LEN`]
/// characters, each printable ASCII (`0x20..=0x7E`).
///
/// ```
/// use tower_idempotency::key::KeyError;
/// use tower_idempotency::key_source::check_key;
///
/// assert_eq!(check_key("evt_1NG8Du2eZvKYlo2C"), Ok(()));
/// assert_eq!(check_key(""), Err(KeyError::Empty));
/// assert_eq!(check_key("évènement"), Err(KeyError::NotPrintableAscii));
/// assert_eq!(check_key(&"k".repeat(256)), Err(KeyError::TooLong));
/// ```
pub fn check_key(key: &str) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if !key.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
        return Err(KeyError::NotPrintableAscii);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    Ok(())
}

/// The source's key for this request, checked.
pub(crate) fn find_key(
    source: &dyn KeySource,
    parts: &Parts,
    body: &[u8],
) -> Result<Option<String>, KeyError> {
    let key = source.key(parts, body)?;
    if let Some(key) = &key {
        check_key(key)?;
    }
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head() -> Parts {
        http::Request::post("/").body(()).unwrap().into_parts().0
    }

    fn at(pointer: &str, body: &str) -> Result<Option<String>, KeyError> {
        find_key(&json_pointer(pointer), &head(), body.as_bytes())
    }

    #[test]
    fn strings_and_integers_are_keys() {
        assert_eq!(at("/id", r#"{"id":"evt_1"}"#), Ok(Some("evt_1".into())));
        assert_eq!(at("/id", r#"{"id":42}"#), Ok(Some("42".into())));
        assert_eq!(at("/id", r#"{"id":-7}"#), Ok(Some("-7".into())));
        assert_eq!(
            at("/data/object/id", r#"{"data":{"object":{"id":"ch_9"}}}"#),
            Ok(Some("ch_9".into()))
        );
        assert_eq!(at("/a~1b", r#"{"a/b":"x"}"#), Ok(Some("x".into())));
        assert_eq!(at("/0", r#"["first"]"#), Ok(Some("first".into())));
        assert_eq!(at("", r#""whole""#), Ok(Some("whole".into())));
    }

    #[test]
    fn absent_and_null_are_no_key() {
        assert_eq!(at("/id", r#"{"type":"ping"}"#), Ok(None));
        assert_eq!(at("/id", r#"{"id":null}"#), Ok(None));
        assert_eq!(at("/id", "[]"), Ok(None));
    }

    #[test]
    fn bad_bodies_and_values_are_key_errors() {
        assert_eq!(at("/id", "id=evt_1"), Err(KeyError::BodyNotJson));
        assert_eq!(at("/id", ""), Err(KeyError::BodyNotJson));
        assert_eq!(
            at("/id", r#"{"id":"a"} trailing"#),
            Err(KeyError::BodyNotJson)
        );
        for value in ["1.5", "true", "{}", "[\"a\"]"] {
            let body = format!(r#"{{"id":{value}}}"#);
            assert_eq!(at("/id", &body), Err(KeyError::UnsupportedType), "{value}");
        }
        assert_eq!(at("/id", r#"{"id":""}"#), Err(KeyError::Empty));
        assert_eq!(
            at("/id", r#"{"id":"a\nb"}"#),
            Err(KeyError::NotPrintableAscii)
        );
        let long = format!(r#"{{"id":"{}"}}"#, "k".repeat(256));
        assert_eq!(at("/id", &long), Err(KeyError::TooLong));
        let longest = format!(r#"{{"id":"{}"}}"#, "k".repeat(255));
        assert_eq!(at("/id", &longest).unwrap().unwrap().len(), 255);
    }

    #[test]
    fn functions_are_checked_too() {
        let source = from_fn(|parts: &Parts, _: &[u8]| {
            Ok(Some(parts.uri.path().trim_start_matches('/').to_owned()))
        });
        assert_eq!(find_key(&source, &head(), b""), Err(KeyError::Empty));
    }

    #[test]
    #[should_panic(expected = "starts with `/`")]
    fn a_pointer_without_a_slash_is_a_configuration_error() {
        let _ = json_pointer("id");
    }
}
