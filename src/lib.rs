//! Idempotency keys for Tower services: a retried `POST` runs once.
//!
//! [`IdempotencyLayer`] intercepts POST and PATCH requests that carry an
//! `Idempotency-Key` header, claims the key in a [`Store`] whose unique
//! constraint decides who is first, runs the inner service once, stores its
//! response and replays it byte for byte to exact repeats, marked
//! `Idempotent-Replayed: true`. A key reused with a different request gets
//! 422; a repeat while the first is still in flight gets 409 with
//! `Retry-After` (IETF draft `draft-ietf-httpapi-idempotency-key-header`).
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
//! # Where things are
//!
//! * [`store`] (`store/mod.rs`): the [`Store`] and
//!   [`store::TransactionalStore`] traits and the contract of one record.
//!   Beside it: `error.rs` ([`StoreError`]), `inspect.rs`
//!   ([`store::Inspect`], for operators), `extractor.rs` (the axum extractor
//!   of every store's transaction), `pg_sql.rs` (SQL both PostgreSQL stores
//!   share), `sqlite_sql.rs` (the schema both SQLite stores share, and its
//!   migration), `decide.rs` (the state machine of one record, shared by the
//!   stores written in Rust), `clock.rs` ([`store::Clock`]), and one file or
//!   folder per store: `memory.rs` ([`MemoryStore`]), `sqlite/`
//!   ([`SqliteStore`]: `builder.rs`, `claim.rs`, `writer.rs` (the writer
//!   thread: group commit, max hold time) with `queue.rs` (what it is sent)
//!   and `batch.rs` (the requests open in one batch), `cache.rs`,
//!   `transaction.rs`, `inspect.rs`), `postgres/`
//!   (`PostgresStore`: `transaction.rs` with `transaction/hold.rs` for its
//!   max hold time, `inspect.rs`), `redis/` (`RedisStore`: its Lua
//!   scripts as `.lua` files, `inspect.rs`) and `sqlx_sqlite/`
//!   (`SqlxSqliteStore` over the app's `sqlx::SqlitePool`: `claim.rs`,
//!   `transaction.rs` with `transaction/hold.rs` and `transaction/error.rs`,
//!   `inspect.rs`). `postgres/` also holds `connect.rs` (libpq's URL
//!   parameters) and `tls.rs` (feature `postgres-tls`); `sqlx_postgres/`
//!   is `SqlxPostgresStore` over the app's `sqlx::PgPool` (`sql.rs`,
//!   `transaction.rs`, `inspect.rs`); `mysql/` is `MySqlStore`
//!   (`transaction.rs`, `hold.rs`, `inspect.rs`); `redis/` splits into
//!   `builder.rs`, `conn.rs` (one server or a cluster) and `reply.rs`.
//! * `fencing.rs`: [`store::FencingToken`] and its generator.
//! * `config.rs`: what a layer is configured with, and the body limits
//!   ([`DEFAULT_MAX_REQUEST_BODY`], [`DEFAULT_MAX_RESPONSE_BODY`]); the
//!   record's [`DEFAULT_LEASE`] and [`DEFAULT_TTL`] are the store's.
//! * [`IdempotencyLayer`] (in `layer.rs`): the configuration's builder.
//! * [`Idempotency`] (in `service.rs`): the path a request walks; its
//!   response's record in `record.rs` (streamed through `tee.rs`).
//! * [`mode`]: separate or transactional, i.e. when the record is written.
//! * [`key`], [`fingerprint`], [`scope`], [`policy`], [`response`],
//!   [`problem`]: one rule each.
//! * [`telemetry`]: the tracing span and the metrics (feature `metrics`).
//! * `extract.rs` (feature `axum`): the [`key::ClaimedKey`] extractor, and
//!   the logged 500 answer of an extractor (it, the stores' transactions)
//!   on a route configured without what it needs. [`StoreError`] answers as
//!   a problem from [`problem`].
//! * `admin` (feature `admin`): an axum router for operators over a store's
//!   [`store::Inspect`]: stuck records, counts, purge.
//! * `outbox/` (feature `outbox`): a transactional outbox: messages
//!   enqueued in the handler's transaction (`sqlite.rs`, `postgres.rs`) with
//!   stable keys (`message.rs`), delivered by a leased relay (`relay.rs`)
//!   through sinks (`sink.rs`); `admin.rs` with the `admin` feature.
//! * `test_util/` (feature `test-util`): the store contract as a test suite
//!   (`store_suite!`, the checks in `suite.rs`) and `ManualClock`, for tests
//!   of this crate's stores and of stores written elsewhere.
//!
//! # Guarantees and their limits
//!
//! * The store's unique constraint decides who is first: one claim per
//!   `(scope, key)` wins, across threads and, for SQLite, across processes
//!   sharing the file.
//! * A completed record is replayed until its TTL ends; a repeat never runs
//!   the handler while a live record exists.
//! * A store that cannot answer gets 503, never a replay and never a silent
//!   pass-through.
//! * [`mode::Transactional`]: the handler's writes, the record and the
//!   response commit together. A crash, an error, a panic or a cancelled
//!   request before that commit leaves neither effect nor key, so the retry
//!   runs exactly once.
//! * [`mode::Separate`] (the default): the record is completed in its own
//!   write after the handler's. A request whose client goes away still runs
//!   to completion and is recorded. But a process that dies between the
//!   handler's commit and that write leaves the key in flight; when the lease
//!   ends, a retry runs the handler again.
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
pub mod key;
mod layer;
pub mod mode;
#[cfg(feature = "outbox")]
pub mod outbox;
pub mod policy;
pub mod problem;
mod record;
pub mod response;
pub mod scope;
mod service;
pub mod store;
mod tee;
pub mod telemetry;
#[cfg(feature = "test-util")]
pub mod test_util;

pub use body::{RequestBody, ResponseBody};

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
pub use service::{Idempotency, ResponseFuture};
/// The sqlx this crate is built with (0.9), for the statements a handler
/// runs through [`store::MySqlTransaction::connection`].
#[cfg(feature = "mysql")]
pub use sqlx;
#[cfg(feature = "mysql")]
pub use store::MySqlStore;
#[cfg(feature = "postgres")]
pub use store::PostgresStore;
#[cfg(feature = "redis")]
pub use store::RedisStore;
#[cfg(feature = "sqlite")]
pub use store::SqliteStore;
#[cfg(feature = "sqlx-postgres")]
pub use store::SqlxPostgresStore;
#[cfg(feature = "sqlx-sqlite")]
pub use store::SqlxSqliteStore;
pub use store::{DEFAULT_LEASE, DEFAULT_TTL};
pub use store::{MemoryStore, Store, StoreError};
/// The tokio-postgres this crate is built with, for the statements a handler
/// runs through [`store::PostgresTransaction::client`].
#[cfg(feature = "postgres")]
pub use tokio_postgres;
