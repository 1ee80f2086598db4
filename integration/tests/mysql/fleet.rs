//! Several ledger processes on one MySQL/MariaDB database, as app servers
//! behind a load balancer: the database decides who is first, and a dead
//! server's claim is taken over once its lease ends (separate mode) or dies
//! with its transaction (transactional mode). Needs
//! the ledger example built with `--features mysql` beside the tests (a
//! whole `cargo test --features mysql` builds it) and the server at
//! `TOWER_IDEMPOTENCY_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`).

#![cfg(feature = "mysql")]

use crate::fleet_support;

use std::path::PathBuf;

use fleet_support::{
    a_dead_servers_claim_dies_with_it, a_dead_servers_claim_is_taken_over,
    racing_servers_apply_once,
};
use tower_idempotency_sqlx::sqlx;

fn url() -> String {
    crate::common::services::mysql_url()
}

/// The state of the ledger's record of idempotency key `key` (any scope),
/// read straight from the database.
fn record_state(key: &str) -> Option<String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let pool = sqlx::MySqlPool::connect(&url()).await.unwrap();
        sqlx::query_scalar("SELECT state FROM idempotency_records WHERE `key` = ?")
            .bind(key)
            .fetch_optional(&pool)
            .await
            .unwrap()
    })
}

#[test]
fn two_servers_on_mysql_racing_one_key_apply_it_once_transactional() {
    racing_servers_apply_once(PathBuf::from(url()), "transactional");
}

#[test]
fn two_servers_on_mysql_racing_one_key_apply_it_once_separate() {
    racing_servers_apply_once(PathBuf::from(url()), "separate");
}

/// Server one dies holding the claim inside its transaction (one phase, the
/// default); server two applies the credit once as soon as the database
/// rolled it back, before the lease (2 s) could end.
#[test]
fn a_dead_servers_claim_dies_with_its_transaction() {
    a_dead_servers_claim_dies_with_it(PathBuf::from(url()), record_state);
}

/// Server one is killed holding the claim; server two answers 409 until the
/// lease (2 s) ends, then takes over and applies the credit once.

#[test]
fn a_dead_servers_claim_is_taken_over_after_the_lease_separate() {
    a_dead_servers_claim_is_taken_over(PathBuf::from(url()), "separate", record_state);
}
