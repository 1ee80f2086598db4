//! `PostgresStore` (tokio-postgres), one module per subject in one binary
//! (`cargo test -p integration --features postgres --test postgres`; more
//! features where a `cfg` says): the store against the server (`store`),
//! faults on private clusters (`faults`), TLS (`tls`, ports 15510-15514),
//! a primary's crash and a standby's promotion (`failover`, 15520-15521),
//! a network partition through a proxy (`partition`, 15530-15533), the
//! two-phase claim's cancel and takeover, and the notifications that wake
//! another server's waiters. Private clusters have ports and directories of
//! their own; on the shared `test` database each test has tables of its own,
//! and the lock waits a test watches are its own tables' (`store`,
//! `wake_other_server`), so modules run side by side. Tests that watch the
//! whole database's lock waits stay binaries of their own
//! (`tests/postgres_replay.rs`, `tests/*_stray_cancel.rs`).

#[path = "../../../tests/common/mod.rs"]
mod common;
#[path = "../../../tests/common/ledger_driver.rs"]
mod driver;
#[path = "../../../tests/common/pgcluster.rs"]
mod pgcluster;

#[cfg(feature = "sqlite")]
mod failover;
mod faults;
#[cfg(feature = "sqlite")]
mod partition;
mod store;
#[cfg(all(feature = "sqlite", feature = "postgres-tls"))]
mod tls;
mod two_phase_cancel;
#[cfg(all(feature = "sqlx-postgres", feature = "mysql"))]
mod two_phase_takeover;
#[cfg(feature = "redis")]
mod wake_other_server;
