//! Several ledger processes on one database, as app servers behind a load
//! balancer: the database decides who is first, and a dead server's claim is
//! taken over once its lease ends. On a shared SQLite file always; on
//! PostgreSQL with `--features postgres` and a server
//! (`TOWER_IDEMPOTENCY_POSTGRES_URL`, or the local `test` database).

use crate::fleet_support;

#[cfg(feature = "postgres")]
#[cfg(feature = "postgres")]
use std::path::PathBuf;

use fleet_support::racing_servers_apply_once;
#[cfg(feature = "postgres")]
use fleet_support::{a_dead_servers_claim_dies_with_it, a_dead_servers_claim_is_taken_over};

#[cfg(feature = "postgres")]
fn url() -> String {
    crate::common::services::postgres_url()
}

/// The state of the record of idempotency key `key`, read straight from the
/// database (any scope).
#[cfg(feature = "postgres")]
fn record_state(key: &str) -> Option<String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let (client, connection) = tokio_postgres::connect(&url(), tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        client
            .query_opt(
                "SELECT state FROM idempotency_records WHERE key = $1",
                &[&key],
            )
            .await
            .unwrap()
            .map(|row| row.get(0))
    })
}

#[cfg(feature = "postgres")]
#[test]
fn two_servers_on_postgres_racing_one_key_apply_it_once_transactional() {
    racing_servers_apply_once(PathBuf::from(url()), "transactional");
}

#[cfg(feature = "postgres")]
#[test]
fn two_servers_on_postgres_racing_one_key_apply_it_once_separate() {
    racing_servers_apply_once(PathBuf::from(url()), "separate");
}

#[test]
fn two_processes_on_one_sqlite_file_racing_one_key_apply_it_once() {
    let dir = tempfile::tempdir().unwrap();
    for mode in ["transactional", "separate"] {
        racing_servers_apply_once(dir.path().join(format!("{mode}.sqlite3")), mode);
    }
}

/// Server one dies holding the claim inside its transaction (one phase, the
/// default); server two applies the credit once as soon as the database
/// rolled it back, before the lease (2 s) could end.
#[cfg(feature = "postgres")]
#[test]
fn a_dead_servers_claim_dies_with_its_transaction() {
    a_dead_servers_claim_dies_with_it(PathBuf::from(url()), record_state);
}

/// Server one dies holding the claim; server two answers 409 until the lease
/// (2 s) ends, then takes over and applies the credit once.
#[cfg(feature = "postgres")]
#[test]
fn a_dead_servers_claim_is_taken_over_after_the_lease_separate() {
    a_dead_servers_claim_is_taken_over(PathBuf::from(url()), "separate", record_state);
}
