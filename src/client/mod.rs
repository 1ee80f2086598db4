//! The client side: one idempotency key per logical request, kept across
//! retries, and a retry policy that retries only what is safe to retry.
//!
//! # Example
//!
//! ```
//! use std::convert::Infallible;
//! use std::sync::{Arc, Mutex};
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use tower::{Service, ServiceBuilder, ServiceExt, retry::RetryLayer};
//! use tower_idempotency::client::{IdempotencyKeyLayer, RetryPolicy};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! // A stand-in for an HTTP client: fails the first attempt with a 503.
//! let seen = Arc::new(Mutex::new(Vec::new()));
//! let log = seen.clone();
//! let client = tower::service_fn(move |req: Request<Full<Bytes>>| {
//!     let mut log = log.lock().unwrap();
//!     log.push(req.headers()["idempotency-key"].clone());
//!     let status = if log.len() == 1 { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::CREATED };
//!     let mut response = Response::new(());
//!     *response.status_mut() = status;
//!     async move { Ok::<_, Infallible>(response) }
//! });
//! let mut client = ServiceBuilder::new()
//!     .layer(IdempotencyKeyLayer::new())          // outside the retries: one key per call
//!     .layer(RetryLayer::new(RetryPolicy::new())) // every attempt carries it
//!     .service(client);
//! let request = Request::post("https://api.example/charges").body(Full::new(Bytes::from("amount=5"))).unwrap();
//! let response = client.ready().await.unwrap().call(request).await.unwrap();
//! assert_eq!(response.status(), StatusCode::CREATED);
//! let seen = seen.lock().unwrap();
//! assert_eq!(seen.len(), 2);
//! assert_eq!(seen[0], seen[1], "both attempts carried the same key");
//! # }
//! ```
//!
//! The key only helps if every retry of one operation carries it, and no other
//! operation does. So [`IdempotencyKeyLayer`] sits outside `tower::retry`
//! and gives each call a key, unless the request already has one. By default
//! ([`RandomKey`], [`new_key`]) that is 128 bits from the operating system's
//! CSPRNG, sent as an RFC 9651 sf-string: no key can be guessed from another,
//! which matters when a server scopes keys globally (whoever sends a known key
//! first owns it, or gets its owner's stored response).
//! [`IdempotencyKeyLayer::with_maker`] takes another scheme (UUIDv7, keys
//! derived from the application's own ids): any [`MakeIdempotencyKey`],
//! closures included. [`RetryPolicy`] retries connection errors, 5xx and 409
//! (the server's "still in flight", honouring `Retry-After`), and never any
//! other 4xx: those are the server's considered answer.
//!
//! Each call the layer gives a key also carries `Repeatability-First-Sent`
//! (OASIS Repeatable Requests), the time of its first attempt, on every
//! retry ([`FirstSent`]): a server with
//! [`refuse_expired_retries`](crate::IdempotencyLayer::refuse_expired_retries)
//! refuses a retry that outlived its record instead of running it again.
//!
//! The layer's error type is [`BoxError`]: the inner service's error, or the
//! maker's ([`KeyUnavailable`] when the OS generator fails; the request is
//! then not sent).

mod first_sent;
mod key;
mod retry;

pub use key::{
    BoxError, FirstSent, IdempotencyKey, IdempotencyKeyLayer, KeyUnavailable, MakeIdempotencyKey,
    RandomKey, ResponseFuture, new_key,
};
pub use retry::RetryPolicy;
