//! An app on sqlx's SQLite driver that also uses tower-idempotency's
//! rusqlite store: both stores, one SQLite library.

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use tower_idempotency::{SqliteStore, Store};
use tower_idempotency_sqlx::SqlxSqliteStore;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("sqlx-sqlite-app-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let options = SqliteConnectOptions::new()
        .filename(dir.join("sqlx.sqlite3"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal);
    let pool = SqlitePoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await?;
    let through_sqlx = SqlxSqliteStore::from_pool(pool).await?;
    let through_rusqlite = SqliteStore::open(dir.join("rusqlite.sqlite3")).await?;
    assert_eq!(through_sqlx.purge_expired().await?, 0);
    assert_eq!(through_rusqlite.purge_expired().await?, 0);
    std::fs::remove_dir_all(&dir)?;
    println!("SqlxSqliteStore and SqliteStore in one process");
    Ok(())
}
