//! The outbox's tests, one module per subject in one binary (`cargo test -p
//! integration --features outbox,sqlite --test outbox`; the server stores'
//! modules need their features, as each `cfg` says). A test's SQLite files
//! are its own; on PostgreSQL and MySQL a test works in a database of its own
//! (`errors`, `migrate_in_tx`, `mysql_charset`, `sqlx_stores`) or under a
//! prefix of its own in the shared `test` database (`postgres_store`), so
//! modules run side by side: no test empties a table another one uses.

#[path = "../../../tests/common/mod.rs"]
mod common;
#[path = "../../../tests/common/ledger_driver.rs"]
mod driver;
mod outbox_support;

#[cfg(feature = "sqlite")]
mod crash;
#[cfg(all(feature = "postgres", feature = "mysql"))]
mod errors;
#[cfg(feature = "sqlite")]
mod fence;
#[cfg(feature = "sqlx-postgres")]
mod migrate_in_tx;
#[cfg(feature = "mysql")]
mod mysql_charset;
#[cfg(feature = "sqlite")]
mod namespace;
#[cfg(all(feature = "sqlite", feature = "outbox-nats"))]
mod nats_sink;
#[cfg(feature = "postgres")]
mod postgres_store;
#[cfg(feature = "sqlite")]
mod relay;
#[cfg(feature = "sqlite")]
mod retry_after;
#[cfg(feature = "sqlite")]
mod sqlite_store;
mod sqlx_stores;

/// `name`, a database of its own on the PostgreSQL server, made if missing:
/// for a module whose relays take any row of the database's outbox table,
/// or whose tests empty it, so that no other module's messages are there.
#[cfg(feature = "postgres")]
async fn postgres_database(name: &str) -> String {
    use tokio_postgres::error::SqlState;
    let server = common::services::postgres_url();
    let (admin, connection) = tokio_postgres::connect(&server, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {server} is required: {e}"));
    tokio::spawn(connection);
    let exists = admin
        .query_opt("SELECT 1 FROM pg_database WHERE datname = $1", &[&name])
        .await
        .unwrap()
        .is_some();
    if !exists
        && let Err(e) = admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
    {
        // Made meanwhile by another test of the module.
        let made = [SqlState::DUPLICATE_DATABASE, SqlState::UNIQUE_VIOLATION];
        assert!(e.code().is_some_and(|c| made.contains(c)), "{e}");
    }
    common::services::with_database(&server, name)
}

/// `name`, a database of its own on the MySQL/MariaDB server, made if
/// missing (as [`postgres_database`]).
#[cfg(feature = "mysql")]
async fn mysql_database(name: &str) -> String {
    let server = common::services::mysql_url();
    let admin = sqlx::MySqlPool::connect(&server)
        .await
        .unwrap_or_else(|e| panic!("MySQL/MariaDB at {server} is required: {e}"));
    let create = format!("CREATE DATABASE IF NOT EXISTS {name}");
    sqlx::query(sqlx::AssertSqlSafe(create))
        .execute(&admin)
        .await
        .unwrap();
    common::services::with_database(&server, name)
}
