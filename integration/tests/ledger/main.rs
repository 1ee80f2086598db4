//! The ledger (the main job, `examples/ledger/`) driven as processes over
//! real HTTP, one module per subject in one binary (`cargo build
//! --all-features --examples`, then `cargo test -p integration --test
//! ledger`): its client, hot keys, leases and kills, faults, waits,
//! refusals, encryption at rest, crashes on SQLite, the admin router and
//! fleets of two processes. Each test starts its own ledgers on loopback
//! ports the system picks, on a SQLite file of its own or on the server's
//! database with keys and accounts of its own (a database of its own where
//! it kills every connection to it: `faults`), so modules run side by side.

#[path = "../../../tests/common/mod.rs"]
mod common;
#[path = "../../../tests/common/ledger_driver.rs"]
mod driver;
#[path = "../../../tests/fleet_support/mod.rs"]
mod fleet_support;

#[cfg(feature = "admin")]
mod admin;
#[cfg(feature = "client")]
mod client;
mod crash_sqlite;
mod encryption;
#[cfg(feature = "postgres")]
mod faults;
mod fleet;
mod hot_key;
mod lease;
mod refusals;
#[cfg(feature = "postgres")]
mod wait;
