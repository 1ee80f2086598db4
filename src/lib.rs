//! Idempotency keys for Tower services: a retried `POST` runs once.
//!
//! [`IdempotencyLayer`] intercepts POST and PATCH requests that carry an
//! `Idempotency-Key` header, claims the key in a [`Store`] whose unique
//! constraint decides who is first, runs the inner service once, stores its
//! response and replays it byte for byte to exact repeats, marked
//! `Idempotent-Replayed: true`. A key reused with a different request gets
//! 422; a repeat while the first is still in flight gets 409 with
//! `Retry-After` (IETF draft `draft-ietf-httpapi-idempotency-key-header`).
//! It wraps axum routes, hyper and any `tower::Service<http::Request<B>>`.
//!
//! # Example
//!
//! ```
//! use axum::{Router, routing::post, http::{Request, StatusCode}, body::Body};
//! use std::sync::{Arc, atomic::{AtomicUsize, Ordering}};
//! use tower::ServiceExt;
//! use tower_idempotency::{IdempotencyLayer, MemoryStore, scope};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let charges = Arc::new(AtomicUsize::new(0));
//! let counter = charges.clone();
//! let app = Router::new()
//!     .route("/charges", post(move || async move {
//!         let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
//!         (StatusCode::CREATED, format!("charge {n}"))
//!     }))
//!     // Keys belong to the caller named by `x-user`, which the authentication
//!     // in front sets; a request without it gets 401 (see `scope`).
//!     .route_layer(IdempotencyLayer::new(
//!         MemoryStore::new(),
//!         scope::header("x-user"),
//!     ));
//!
//! let charge = || Request::post("/charges")
//!     .header("idempotency-key", "\"order-17\"")
//!     .header("x-user", "alice")
//!     .body(Body::from("amount=5"))
//!     .unwrap();
//! let first = app.clone().oneshot(charge()).await.unwrap();
//! let again = app.clone().oneshot(charge()).await.unwrap();
//! assert_eq!(first.status(), StatusCode::CREATED);
//! assert_eq!(again.status(), StatusCode::CREATED);
//! assert_eq!(again.headers()["idempotent-replayed"], "true");
//! assert_eq!(charges.load(Ordering::SeqCst), 1, "the handler ran once");
//! # }
//! ```
//!
//! A real service keeps its records in a durable store (`SqliteStore` by
//! default, compiled in) and takes the scope from its authentication; the
//! README's quick start (`examples/quickstart.rs`) is such a service.
//!
//! # Where to go next
//!
//! * **Choose a mode** ([`guide::modes`]): [`mode::Separate`] (the default,
//!   every store) completes the record after the handler's own commit;
//!   [`mode::Transactional`] commits the handler's writes, the record and the
//!   response together, exactly once across crashes.
//! * **Choose a store** ([`guide::stores`]): [`MemoryStore`], `SqliteStore`
//!   (default feature `sqlite`); `PostgresStore` in the crate
//!   `tower-idempotency-postgres`; `SqlxPostgresStore`, `SqlxSqliteStore`
//!   and `MySqlStore` in `tower-idempotency-sqlx` (one feature each); and
//!   `RedisStore` in `tower-idempotency-redis`.
//! * **Configure the layer** ([`guide::configuration`]): the scope (whose key
//!   it is), the layer's place inside authentication, lease, TTL, body
//!   limits, fingerprint, which responses are stored.
//! * **Run it** ([`guide::operations`]): tracing, metrics, the admin router,
//!   what is stored and for how long.
//! * **What is promised** ([`guide::limits`]): what one claim decides, the
//!   guarantees and every bound. Callers: [`guide::clients`].
//! * Every guide, including the pages of each server store: [`guide`].
//!   Effects beyond the database (webhooks, messages) go through a
//!   transactional outbox: the crate `tower-idempotency-outbox`.
//!
//! # Guarantees, in short
//!
//! * The store's unique constraint decides who is first: one claim per
//!   `(scope, key)` wins, across threads and across processes sharing the
//!   store.
//! * A completed record is replayed until its TTL ends; a repeat never runs
//!   the handler while a live record exists.
//! * A store that cannot answer gets 503, never a replay and never a silent
//!   pass-through.
//! * [`mode::Transactional`]: a crash, an error, a panic or a cancelled
//!   request before the commit leaves neither effect nor key, so the retry
//!   runs exactly once. [`mode::Separate`]: a process that dies between the
//!   handler's commit and the record's leaves the key in flight; when the
//!   lease ends, a retry runs the handler again.
//! * A handler still running when its lease ends may be overtaken by a
//!   retry; the fencing token stops the first holder from overwriting the
//!   second's record, but both executions happened. Set the lease above the
//!   handler's longest run.

#![deny(unsafe_code, unreachable_pub)]
#![warn(missing_docs)]
// docs.rs (`--cfg docsrs`, nightly): each feature-gated item is marked with
// the feature it needs. `doc_cfg` does this by itself now that `doc_auto_cfg`
// has been merged into it (naming `doc_auto_cfg` is error E0557 on nightly).
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "admin")]
pub mod admin;
mod body;
#[cfg(feature = "client")]
pub mod client;
mod config;
#[cfg(feature = "axum")]
mod extract;
mod fencing;
pub mod fingerprint;
pub mod first_sent;
pub mod guide;
pub mod hooks;
pub mod key;
pub mod key_source;
mod layer;
pub mod mode;
pub mod policy;
pub mod problem;
mod record;
mod renew;
pub mod response;
pub mod retry_after;
pub mod scope;
pub mod seal;
mod service;
pub mod store;
mod tee;
pub mod telemetry;
#[cfg(feature = "test-util")]
pub mod test_util;
mod wait;

pub use body::{RequestBody, ResponseBody};

/// What the kit's macros expand to in a store crate; not an API.
#[doc(hidden)]
#[cfg(feature = "axum")]
pub mod __private {
    pub use crate::extract::{internal_error, misconfigured};
    pub use axum_core;
    pub use http;
}

/// The README's Rust examples, compiled and run as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
pub use config::{
    DEFAULT_IN_FLIGHT_RETRY_AFTER, DEFAULT_MAX_REQUEST_BODY, DEFAULT_MAX_RESPONSE_BODY,
};
pub use layer::IdempotencyLayer;
pub use response::{StoredBody, StoredResponse};
/// The rusqlite this crate is built with, for the SQL a handler runs through
/// [`store::SqliteTransaction::run`] (its types must be this version's).
///
/// Only with the `sqlite` feature. rusqlite is below 1.0: a release of this
/// crate that moves to a newer rusqlite is a breaking release.
#[cfg(feature = "sqlite")]
pub use rusqlite;
pub use service::{Idempotency, LayerTypes, ResponseFuture};
#[cfg(feature = "sqlite")]
pub use store::SqliteStore;
pub use store::{DEFAULT_LEASE, DEFAULT_MAX_HOLD, DEFAULT_TTL};
pub use store::{MemoryStore, Store, StoreError};
pub use wait::{DEFAULT_MAX_WAITERS, DEFAULT_MAX_WAITING_BYTES, DEFAULT_SIGNALLED_POLL};
