//! Scopes: whom an idempotency key belongs to.
//!
//! # Example
//!
//! ```
//! use http::request::Parts;
//! use tower_idempotency::scope::Scope;
//!
//! #[derive(Clone)]
//! struct User(String);
//!
//! // The principal your authentication middleware put in the extensions.
//! let by_user = |parts: &Parts| {
//!     parts.extensions.get::<User>().map_or_else(|| "anonymous".to_owned(), |u| u.0.clone())
//! };
//! let (mut parts, ()) = http::Request::post("/payments").body(()).unwrap().into_parts();
//! parts.extensions.insert(User("alice".into()));
//! assert_eq!(by_user.scope(&parts), "alice");
//! ```
//!
//! A record is identified by `(scope, key)`: keys of different scopes never
//! meet. Scope by the authenticated principal (user, API key, tenant), or by
//! the sender for webhooks, as Stripe scopes keys per account and brandur's
//! design makes keys unique per user.
//!
//! # Why the choice is explicit
//!
//! With one scope for everyone, a caller who learns or guesses another
//! caller's key receives that caller's stored response: a data leak. So
//! [`crate::IdempotencyLayer::new`] takes a scope as an argument, and the
//! global scope has to be named: [`GlobalScope`].

use http::request::Parts;

/// Derives the scope of a request from its head.
///
/// Implemented by every `Fn(&Parts) -> String` closure and by [`GlobalScope`].
/// Runs before the body is read and before the store is touched.
pub trait Scope: Send + Sync + 'static {
    /// The scope this request's key belongs to.
    fn scope(&self, parts: &Parts) -> String;
}

impl<F> Scope for F
where
    F: Fn(&Parts) -> String + Send + Sync + 'static,
{
    fn scope(&self, parts: &Parts) -> String {
        self(parts)
    }
}

/// One scope for every caller.
///
/// # Warning
///
/// Every caller shares one key space: whoever sends another caller's key
/// with the same request gets that caller's stored response. Use it only
/// where there is one caller (an internal queue consumer, a single trusted
/// client) or where keys are unguessable and responses hold nothing private.
#[derive(Debug, Clone, Copy, Default)]
pub struct GlobalScope;

impl Scope for GlobalScope {
    fn scope(&self, _parts: &Parts) -> String {
        String::new()
    }
}
