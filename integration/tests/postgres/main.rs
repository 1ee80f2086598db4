//! PostgreSQL, both drivers (tokio-postgres: `PostgresStore`; sqlx:
//! `SqlxPostgresStore`), one module per subject in one binary (`cargo test -p
//! integration --features postgres --test postgres`; more features where a
//! `cfg` says): the store against the server (`store`, `sqlx_store`), its
//! replays beside a session that holds the key's lock (`replay`), a claim
//! beside the table's own brief locks (`storage_locks`), transactional mode
//! over sqlx (`sqlx_transactional`), faults on private clusters and cut
//! connections (`faults`, `sqlx_faults`), TLS (`tls`, ports 15510-15514), a
//! primary's crash and a standby's promotion (`failover`, 15520-15521), a
//! network partition through a proxy (`partition`, 15530-15533), the
//! two-phase claim's cancel and takeover and a stray cancel of a pooled
//! connection (`two_phase_cancel`, `two_phase_takeover`,
//! `two_phase_stray_cancel`, `sqlx_stray_cancel`, through `stall_proxy`), the notifications that
//! wake another server's waiters, and what is logged (`notices`,
//! `sqlx_misconfigured`). Private clusters have ports and directories of
//! their own; on the shared `test` database each test has tables of its own,
//! the lock waits a test watches are its own tables' or its own advisory
//! lock's (`common::services::ADVISORY_WAITERS`), and the log it reads is its
//! own thread's (`common::logs`), so modules run side by side.

#[path = "../../../tests/common/mod.rs"]
mod common;
#[path = "../../../tests/common/ledger_driver.rs"]
mod driver;
#[path = "../../../tests/common/pgcluster.rs"]
mod pgcluster;

#[cfg(feature = "sqlite")]
mod failover;
mod faults;
#[cfg(all(feature = "sqlx-postgres", feature = "outbox"))]
mod notices;
#[cfg(feature = "sqlite")]
mod partition;
#[cfg(feature = "sqlx-postgres")]
mod replay;
#[cfg(all(feature = "sqlx-postgres", feature = "axum"))]
mod sqlx_faults;
#[cfg(all(feature = "sqlx-postgres", feature = "sqlx-sqlite", feature = "axum"))]
mod sqlx_misconfigured;
#[cfg(feature = "sqlx-postgres")]
mod sqlx_store;
#[cfg(all(feature = "sqlx-postgres", feature = "axum"))]
mod sqlx_stray_cancel;
#[cfg(all(feature = "sqlx-postgres", feature = "axum"))]
mod sqlx_transactional;
mod stall_proxy;
mod storage_locks;
mod store;
#[cfg(all(feature = "sqlite", feature = "postgres-tls"))]
mod tls;
mod two_phase_cancel;
mod two_phase_stray_cancel;
#[cfg(all(feature = "sqlx-postgres", feature = "mysql"))]
mod two_phase_takeover;
#[cfg(feature = "redis")]
mod wake_other_server;
