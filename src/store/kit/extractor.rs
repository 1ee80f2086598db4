//! The axum extractor of every store's transaction type, as one macro.

/// Makes a store's transaction type (`Clone`, put in the request's
/// extensions by the layer) an axum extractor: `T` answers a request
/// without one with a 500 problem (the handler would otherwise write outside
/// the idempotency transaction), and logs the misconfiguration once per
/// process and type; `Option<T>` is `None` for requests that passed through
/// without a key.
///
/// `transaction_extractor!(MyTransaction)` for a concrete type;
/// `transaction_extractor!([DB: Dialect] MyTransaction<DB>, name, logged)`
/// for a type generic over its database, where `name` (a `&str`
/// expression, e.g. an associated constant of `DB`) is how the
/// misconfiguration's answer names the type, and `logged` (a
/// `&'static std::sync::Once`, one per database: a `static` inside a
/// generic function is one for all of them) says whether it was logged.
///
/// The impls are compiled when this crate is built with its `axum`
/// feature, whatever the features of the crate that invokes the macro are
/// named.
#[doc(hidden)]
#[macro_export]
macro_rules! __transaction_extractor {
    ([$($generics:tt)*] $transaction:ty, $name:expr, $logged:expr) => {
        // The core's `axum` feature decides, not the calling crate's.
        $crate::__if_axum! {
            /// Extracts the request's transaction in a handler behind a
            /// `IdempotencyLayer::transactional` layer. A request without
            /// one (a route whose layer is not `.transactional()`, or has no
            /// `require_key(true)`) is answered with a 500 problem saying so, and
            /// the first such request of the process is logged at error level.
            /// The compiler cannot catch this: the extractor does not see the
            /// layer's type.
            impl<S: Sync, $($generics)*> $crate::__private::axum_core::extract::FromRequestParts<S> for $transaction {
                type Rejection = $crate::__private::http::Response<$crate::__private::axum_core::body::Body>;

                async fn from_request_parts(
                    parts: &mut $crate::__private::http::request::Parts,
                    _state: &S,
                ) -> Result<Self, Self::Rejection> {
                    let logged: &'static std::sync::Once = $logged;
                    parts
                        .extensions
                        .get::<$transaction>()
                        .cloned()
                        .ok_or_else(|| {
                            $crate::__private::misconfigured(
                                logged,
                                &format!(
                                    "this handler takes a {}, and the request has none: put the route behind IdempotencyLayer::transactional() with require_key(true)",
                                    $name,
                                ),
                            )
                        })
                }
            }

            /// `Option<_>`: `None` for requests that passed through without a key.
            impl<S: Sync, $($generics)*> $crate::__private::axum_core::extract::OptionalFromRequestParts<S> for $transaction {
                type Rejection = std::convert::Infallible;

                async fn from_request_parts(
                    parts: &mut $crate::__private::http::request::Parts,
                    _state: &S,
                ) -> Result<Option<Self>, Self::Rejection> {
                    Ok(parts.extensions.get::<$transaction>().cloned())
                }
            }
        }
    };
    ($transaction:ty) => {
        $crate::__transaction_extractor!([] $transaction, stringify!($transaction), {
            static LOGGED: std::sync::Once = std::sync::Once::new();
            &LOGGED
        });
    };
}

/// Its tokens when the core is built with `axum`, else nothing: the kit's
/// macros expand in the store's crate, whose features are its own.
#[doc(hidden)]
#[macro_export]
#[cfg(feature = "axum")]
macro_rules! __if_axum {
    ($($tokens:tt)*) => { $($tokens)* };
}

/// Its tokens when the core is built with `axum`, else nothing.
#[doc(hidden)]
#[macro_export]
#[cfg(not(feature = "axum"))]
macro_rules! __if_axum {
    ($($tokens:tt)*) => {};
}

/// Its tokens when the core is built with `test-util`, else nothing.
#[doc(hidden)]
#[macro_export]
#[cfg(feature = "test-util")]
macro_rules! __if_test_util {
    ($($tokens:tt)*) => { $($tokens)* };
}

/// Its tokens when the core is built with `test-util`, else nothing.
#[doc(hidden)]
#[macro_export]
#[cfg(not(feature = "test-util"))]
macro_rules! __if_test_util {
    ($($tokens:tt)*) => {};
}
