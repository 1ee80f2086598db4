//! `outbox::sqlx::migrate` accepts a `sqlx::Transaction` and the
//! transactional stores' connection guards: run inside the request's
//! transaction on PostgreSQL it must stay inside it, never commit the
//! handler's writes made so far nor leave the ones after it outside the
//! transaction. In a database of its own. Needs PostgreSQL
//! (`TOWER_IDEMPOTENCY_POSTGRES_URL`, or the local `test` database) and the
//! right to create databases.

#![cfg(all(feature = "outbox", feature = "sqlx-postgres"))]

use sqlx::{AssertSqlSafe, Connection, Executor, PgConnection};
use tower_idempotency::store::FencingToken;
use tower_idempotency_outbox as outbox;

fn url() -> String {
    crate::common::services::postgres_url()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_inside_a_rolled_back_transaction_keeps_nothing() {
    let db = format!("brk_mig_{:08x}", FencingToken::random().0 as u32);
    let mut admin = PgConnection::connect(&url())
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {} is required: {e}", url()));
    admin
        .execute(AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .await
        .unwrap();
    let outcome = {
        let db = db.clone();
        tokio::spawn(async move {
            let mut conn =
                PgConnection::connect(&crate::common::services::with_database(&url(), &db))
                    .await
                    .unwrap();
            conn.execute("CREATE TABLE credits (id INT PRIMARY KEY)")
                .await
                .unwrap();
            let mut tx = conn.begin().await.unwrap();
            tx.execute("INSERT INTO credits VALUES (1)").await.unwrap();
            outbox::sqlx::migrate(&mut tx).await.unwrap();
            tx.execute("INSERT INTO credits VALUES (2)").await.unwrap();
            tx.rollback().await.unwrap();
            let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM credits")
                .fetch_one(&mut conn)
                .await
                .unwrap();
            let outbox_table: Option<String> =
                sqlx::query_scalar("SELECT to_regclass('tower_idempotency_outbox')::text")
                    .fetch_one(&mut conn)
                    .await
                    .unwrap();
            assert_eq!(
                (kept, outbox_table),
                (0, None),
                "the rolled-back transaction kept none of its writes, the table included"
            );
            // Outside a transaction it creates the table.
            outbox::sqlx::migrate(&mut conn).await.unwrap();
            let outbox_table: Option<String> =
                sqlx::query_scalar("SELECT to_regclass('tower_idempotency_outbox')::text")
                    .fetch_one(&mut conn)
                    .await
                    .unwrap();
            assert_eq!(outbox_table.as_deref(), Some("tower_idempotency_outbox"));
            conn.close().await.unwrap();
        })
        .await
    };
    admin
        .execute(AssertSqlSafe(format!("DROP DATABASE {db} WITH (FORCE)")))
        .await
        .unwrap();
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
}

/// The same on MySQL/MariaDB, where `CREATE TABLE` commits the transaction
/// it runs in (an implicit commit, even when the table exists).
#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "bug: on MySQL/MariaDB outbox::sqlx::migrate inside a transaction implicitly commits it (DDL); it should refuse to run inside one"]
async fn mysql_migrate_inside_a_rolled_back_transaction_keeps_nothing() {
    use sqlx::MySqlConnection;
    let url = crate::common::services::mysql_url();
    let db = format!("brk_mig_{:08x}", FencingToken::random().0 as u32);
    let mut admin = MySqlConnection::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("MySQL/MariaDB at {url} is required: {e}"));
    admin
        .execute(AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .await
        .unwrap();
    let outcome = {
        let url = crate::common::services::with_database(&url, &db);
        tokio::spawn(async move {
            let mut conn = MySqlConnection::connect(&url).await.unwrap();
            conn.execute("CREATE TABLE credits (id INT PRIMARY KEY) ENGINE=InnoDB")
                .await
                .unwrap();
            let mut tx = conn.begin().await.unwrap();
            tx.execute("INSERT INTO credits VALUES (1)").await.unwrap();
            // Refusing is as good as staying inside the transaction.
            let migrated = outbox::sqlx::migrate(&mut tx).await;
            tx.execute("INSERT INTO credits VALUES (2)").await.unwrap();
            tx.rollback().await.unwrap();
            let kept: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM credits")
                .fetch_one(&mut conn)
                .await
                .unwrap();
            assert_eq!(
                kept, 0,
                "the rolled-back transaction kept none of its writes (migrate: {migrated:?})"
            );
        })
        .await
    };
    admin
        .execute(AssertSqlSafe(format!("DROP DATABASE {db}")))
        .await
        .unwrap();
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
}
