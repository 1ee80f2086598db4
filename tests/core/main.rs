//! The core crate's tests, one module per subject, in one test binary
//! (`cargo test --test core`; one subject: `cargo test --test core layer::`).
//! They need no server: the stores are in memory or SQLite files of their
//! own, the servers on loopback ports the system picks, so modules run side
//! by side; the modules that read what they logged (`telemetry`,
//! `misconfigured_route`) read their own thread's (`common::logs`).
//!
//! The binary needs the default features (`sqlite`, `axum`); a module that
//! needs more says so with its `cfg`.

#[path = "../common/mod.rs"]
mod common;

/// `examples/webhook.rs`, for `webhook` and `webhook_stripe` (its `main` and
/// command line are not used here).
#[allow(dead_code)]
#[path = "../../examples/webhook.rs"]
mod webhook_example;

#[cfg(feature = "admin")]
mod admin;
mod browser_keys;
mod catch_panic;
#[cfg(feature = "client")]
mod client_keys;
mod do_not_store;
mod encryption_at_rest;
#[cfg(all(feature = "client", feature = "test-util"))]
mod first_sent;
#[cfg(feature = "client")]
mod grpc;
mod handlers;
mod hooks;
mod hyper;
mod key_source;
mod layer;
#[cfg(feature = "test-util")]
mod lease_renewal;
mod memory_capacity;
mod misconfigured_route;
mod readme;
mod service;
mod sqlite_concurrent_transactions;
mod sqlite_transactional;
mod sqlite_transactional_panic;
mod streaming;
mod telemetry;
#[cfg(feature = "test-util")]
mod wait_abandoned;
#[cfg(feature = "test-util")]
mod wait_in_flight;
#[cfg(feature = "test-util")]
mod wait_stream;
mod webhook;
mod webhook_stripe;
