//! Scopes: whom an idempotency key belongs to.
//!
//! # Example
//!
//! ```
//! use std::fmt;
//! use tower_idempotency::scope::{self, Scope};
//!
//! // The principal your authentication middleware put in the extensions.
//! #[derive(Clone)]
//! struct User(String);
//! impl fmt::Display for User {
//!     fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result { f.write_str(&self.0) }
//! }
//!
//! let by_user = scope::extension::<User>();
//! let (mut parts, ()) = http::Request::post("/payments").body(()).unwrap().into_parts();
//! assert_eq!(by_user.scope(&parts), None, "no principal: the layer answers 401");
//! parts.extensions.insert(User("alice".into()));
//! assert_eq!(by_user.scope(&parts).as_deref(), Some("alice"));
//! ```
//!
//! A record is identified by `(scope, key)`: keys of different scopes never
//! meet. Scope by the authenticated principal (user, API key, tenant), or by
//! the sender for webhooks, as Stripe scopes keys per account and brandur's
//! design makes keys unique per user.
//!
//! # Ready scopes
//!
//! - [`extension::<T>()`](extension): the `T` (a principal type with
//!   `Display`) that an authentication middleware inserted into the request's
//!   extensions;
//! - [`header(name)`](header): the value of a header that an authentication
//!   layer (or a gateway in front) sets, and strips from what clients send;
//! - [`from_fn(f)`](from_fn): any function of the request head, returning
//!   `Option<String>` (`None` refuses) or `String`;
//! - [`GlobalScope`]: one scope for everyone (read its warning).
//!
//! A closure passed straight to [`crate::IdempotencyLayer::new`] needs its
//! argument type written out (`|parts: &Parts| ...`), or rustc reports
//! "implementation of `Fn` is not general enough"; [`from_fn`] spares that.
//!
//! # No principal: 401, never a shared scope
//!
//! A scope answers `None` when the request has no principal. The layer then
//! answers 401 with the problem [`crate::problem::Rejection::Unauthenticated`]
//! (type `unauthenticated`), before the body is read and before the store is
//! touched: such a request is neither run nor replayed. The default answer
//! carries no `WWW-Authenticate` field (RFC 9110 §15.5.2 asks for one, and
//! only your authentication knows its scheme): add it with
//! [`crate::IdempotencyLayer::on_rejection`]. Requests without a key pass
//! through without a scope (they are never deduplicated, so nothing can be
//! replayed to them).
//!
//! # Put the layer inside authentication
//!
//! The scope reads what authentication put in the request, so the
//! idempotency layer must run AFTER the authentication middleware: inside
//! it. In axum (and with `tower::ServiceBuilder` the other way round):
//!
//! - `Router::layer` / `Router::route_layer`: each call wraps everything
//!   added before it, so the layer added LAST runs FIRST. Add the
//!   idempotency layer first and the authentication layer after it:
//!   `.route_layer(IdempotencyLayer::new(store, scope::extension::<User>())).route_layer(auth)`.
//! - `ServiceBuilder::new().layer(a).layer(b)`: `a` runs first. Put
//!   authentication before idempotency: `.layer(auth).layer(idempotency)`.
//!
//! If the order is wrong, the scope finds no principal and every request
//! with a key gets 401: the mistake shows at once and never leaks one
//! caller's stored response to another (`tests/core/handlers.rs` holds this).
//! A [`header`] scope is as safe only if the header cannot come from the
//! client: the authentication layer must overwrite or remove it.
//!
//! # Why the choice is explicit
//!
//! With one scope for everyone, a caller who learns or guesses another
//! caller's key receives that caller's stored response: a data leak. So
//! [`crate::IdempotencyLayer::new`] takes a scope as an argument, and the
//! global scope has to be named: [`GlobalScope`].

use std::fmt;
use std::marker::PhantomData;

use http::HeaderName;
use http::request::Parts;

/// Derives the scope of a request from its head.
///
/// Implemented by the ready scopes of this module, by [`GlobalScope`], and
/// by every `Fn(&Parts) -> R` where `R` is `Option<String>` or `String`
/// ([`IntoScope`]). Runs before the body is read and before the store is
/// touched.
pub trait Scope: Send + Sync + 'static {
    /// The scope this request's key belongs to, or `None` when the request
    /// has no principal: the layer then answers 401 (`unauthenticated`).
    fn scope(&self, parts: &Parts) -> Option<String>;
}

/// What a scope function may return: `Option<String>` (`None` refuses the
/// request with 401) or `String` (never refuses).
pub trait IntoScope {
    /// The scope, or `None` to refuse.
    fn into_scope(self) -> Option<String>;
}

impl IntoScope for Option<String> {
    fn into_scope(self) -> Option<String> {
        self
    }
}

impl IntoScope for String {
    fn into_scope(self) -> Option<String> {
        Some(self)
    }
}

impl<F, R> Scope for F
where
    F: Fn(&Parts) -> R + Send + Sync + 'static,
    R: IntoScope,
{
    fn scope(&self, parts: &Parts) -> Option<String> {
        self(parts).into_scope()
    }
}

/// A scope from a function of the request head; see [`from_fn`].
#[derive(Clone, Copy)]
pub struct FromFn<F>(F);

impl<F> fmt::Debug for FromFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FromFn").finish_non_exhaustive()
    }
}

/// A scope from `f`, a function of the request head returning
/// `Option<String>` (`None`: no principal, 401) or `String`.
///
/// Its bound tells rustc the closure's argument type, so the closure needs
/// no annotation:
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, scope};
///
/// struct Tenant { id: u64 }
///
/// let layer = IdempotencyLayer::new(
///     MemoryStore::new(),
///     scope::from_fn(|parts| parts.extensions.get::<Tenant>().map(|t| format!("tenant-{}", t.id))),
/// );
/// # let _ = layer;
/// ```
pub fn from_fn<F, R>(f: F) -> FromFn<F>
where
    F: Fn(&Parts) -> R + Send + Sync + 'static,
    R: IntoScope,
{
    FromFn(f)
}

impl<F, R> Scope for FromFn<F>
where
    F: Fn(&Parts) -> R + Send + Sync + 'static,
    R: IntoScope,
{
    fn scope(&self, parts: &Parts) -> Option<String> {
        (self.0)(parts).into_scope()
    }
}

/// The value of one header; see [`header`].
#[derive(Debug, Clone)]
pub struct Header {
    name: HeaderName,
}

/// The scope is the value of the header `name`, which the authentication
/// layer in front of this one sets (`x-user-id`, `x-tenant`).
///
/// Refuses (401) when the header is absent, empty, sent more than once, or
/// not visible ASCII. The header must not be something a client can send:
/// the authentication layer (or the gateway) must overwrite or remove it,
/// or any client can name any scope.
///
/// `name` is a [`HeaderName`] or a string (any case: header names compare
/// case-insensitively, RFC 9110 §5.1).
///
/// ```
/// use tower_idempotency::scope::{self, Scope};
///
/// let by_tenant = scope::header("X-Tenant");
/// let (parts, ()) = http::Request::post("/").header("x-tenant", "acme").body(()).unwrap().into_parts();
/// assert_eq!(by_tenant.scope(&parts).as_deref(), Some("acme"));
/// ```
///
/// # Panics
///
/// When `name` is not a valid header name (RFC 9110 §5.1: a token): a
/// configuration mistake, reported when the layer is built rather than at
/// the first request.
pub fn header<N>(name: N) -> Header
where
    HeaderName: TryFrom<N>,
    <HeaderName as TryFrom<N>>::Error: std::fmt::Display,
{
    match HeaderName::try_from(name) {
        Ok(name) => Header { name },
        Err(e) => panic!("scope::header: not a valid header name: {e}"),
    }
}

impl Scope for Header {
    fn scope(&self, parts: &Parts) -> Option<String> {
        let mut values = parts.headers.get_all(&self.name).iter();
        let (Some(value), None) = (values.next(), values.next()) else {
            return None;
        };
        let value = value.to_str().ok()?;
        (!value.is_empty()).then(|| value.to_owned())
    }
}

/// The principal of type `T` in the request's extensions; see [`extension`].
pub struct Extension<T>(PhantomData<fn() -> T>);

impl<T> Clone for Extension<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Extension<T> {}

impl<T> fmt::Debug for Extension<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Extension")
            .field(&std::any::type_name::<T>())
            .finish()
    }
}

/// The scope is the `T` that an authentication middleware inserted into the
/// request's extensions, written with its `Display`. Refuses (401) when there
/// is no `T` or it displays as an empty string.
///
/// For a principal without `Display`, or to pick one of its fields, use
/// [`from_fn`]: `scope::from_fn(|p| p.extensions.get::<Claims>().map(|c| c.sub.clone()))`.
/// Two principal types whose values can be equal (a user id and an API key
/// id) share a key space; prefix them (`format!("user:{id}")`) to keep them
/// apart.
pub fn extension<T: fmt::Display + Send + Sync + 'static>() -> Extension<T> {
    Extension(PhantomData)
}

impl<T: fmt::Display + Send + Sync + 'static> Scope for Extension<T> {
    fn scope(&self, parts: &Parts) -> Option<String> {
        let scope = parts.extensions.get::<T>()?.to_string();
        (!scope.is_empty()).then_some(scope)
    }
}

/// One scope for every caller. Never refuses.
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
    fn scope(&self, _parts: &Parts) -> Option<String> {
        Some(String::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(headers: &[(&str, &[u8])]) -> Parts {
        let mut request = http::Request::post("/");
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        request.body(()).unwrap().into_parts().0
    }

    #[test]
    fn header_scope_refuses_what_is_not_one_clean_value() {
        let scope = header(HeaderName::from_static("x-user"));
        assert_eq!(
            scope.scope(&parts(&[("x-user", b"alice")])).as_deref(),
            Some("alice")
        );
        assert_eq!(scope.scope(&parts(&[])), None);
        assert_eq!(scope.scope(&parts(&[("x-user", b"")])), None);
        assert_eq!(scope.scope(&parts(&[("x-user", b"caf\xc3\xa9")])), None);
        assert_eq!(
            scope.scope(&parts(&[("x-user", b"alice"), ("x-user", b"bob")])),
            None
        );
    }

    #[test]
    fn closures_returning_string_or_option_are_scopes() {
        let always = |_: &Parts| "s".to_owned();
        let never = |_: &Parts| None::<String>;
        assert_eq!(always.scope(&parts(&[])).as_deref(), Some("s"));
        assert_eq!(never.scope(&parts(&[])), None);
        assert_eq!(GlobalScope.scope(&parts(&[])).as_deref(), Some(""));
    }

    #[test]
    fn an_empty_principal_is_no_principal() {
        #[derive(Clone)]
        struct Empty;
        impl fmt::Display for Empty {
            fn fmt(&self, _: &mut fmt::Formatter<'_>) -> fmt::Result {
                Ok(())
            }
        }
        let mut p = parts(&[]);
        p.extensions.insert(Empty);
        assert_eq!(extension::<Empty>().scope(&p), None);
    }
}
