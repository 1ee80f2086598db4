//! The ledger (the main job, `examples/ledger/`) driven as processes over
//! real HTTP, one module per subject in one binary (`cargo build
//! --all-features --examples`, then `cargo test -p integration --test
//! ledger`): its client, hot keys, leases and kills, faults, waits,
//! refusals, the TTL, encryption at rest, crashes on SQLite, the admin router and
//! fleets of two processes. Each test starts its own ledgers on loopback
//! ports the system picks, on a SQLite file of its own or on the server's
//! database with keys and accounts of its own, or a database of its own
//! where it kills connections (`faults`), holds a transaction for long
//! (`lease`, `startup`) or has a short lease beside them (`wait`'s MySQL
//! tests), so modules run side by side.

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
mod startup;
mod ttl;
#[cfg(feature = "postgres")]
mod wait;

/// A database of the test's own on the server `url` names: its URL.
#[cfg(feature = "postgres")]
fn fresh_postgres_database(name: &str) -> String {
    let url = common::services::postgres_url();
    block_on(async {
        let (client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("connect to PostgreSQL");
        tokio::spawn(connection);
        let drop_it = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
        client.batch_execute(&drop_it).await.unwrap();
        client
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
    });
    let (base, _) = url.rsplit_once('/').expect("a database in the URL");
    format!("{base}/{name}")
}

/// Runs `future` to its end on a runtime of its own.
#[cfg(any(feature = "postgres", feature = "mysql"))]
fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(future)
}

/// A database of the test's own on the MySQL/MariaDB server: its URL.
#[cfg(feature = "mysql")]
fn fresh_mysql_database(name: &str) -> String {
    use tower_idempotency_sqlx::sqlx::{self, Executor};
    let url = common::services::mysql_url();
    block_on(async {
        let pool = sqlx::MySqlPool::connect(&url)
            .await
            .expect("connect to MySQL/MariaDB");
        pool.execute(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name}"
        )))
        .await
        .unwrap();
        pool.execute(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .await
            .unwrap();
    });
    common::services::with_database(&url, name)
}
