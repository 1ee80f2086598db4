//! Opening a store or an outbox whose tables are already there logs
//! nothing: PostgreSQL answers each `CREATE ... IF NOT EXISTS` of an
//! existing table with a NOTICE ("relation ... already exists, skipping"),
//! which tokio-postgres and sqlx log at INFO on every start of every app
//! server. Both PostgreSQL stores and the outbox over both drivers are
//! opened twice on one database (`TOWER_IDEMPOTENCY_POSTGRES_URL`, or the
//! local `test` database). One test in this binary: it installs the
//! process's log collector.

#![cfg(all(feature = "postgres", feature = "sqlx-postgres", feature = "outbox"))]

mod common;

use std::sync::Mutex;

use tower_idempotency::store::FencingToken;
use tower_idempotency_outbox::Outbox;
use tower_idempotency_postgres::PostgresStore;
use tower_idempotency_sqlx::SqlxPostgresStore;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Every event of the process that logs a NOTICE of the server.
static NOTICES: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// tokio-postgres logs "NOTICE: ..."; sqlx logs the notice's text under
/// its target `sqlx::postgres::notice`.
fn is_notice(_: &tracing::Level, text: &str) -> bool {
    text.starts_with("message=NOTICE") || text.contains("log.target=\"sqlx::postgres::notice\"")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opening_over_existing_tables_logs_no_notice() {
    // With the `log` records of tokio-postgres and sqlx.
    tracing_subscriber::registry()
        .with(common::logs::Collector {
            keep: is_notice,
            into: &NOTICES,
        })
        .try_init()
        .unwrap();
    let url = common::services::postgres_url();
    let table = format!("idem_notices_{:016x}", FencingToken::random().0);
    let pool = sqlx::PgPool::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {url} is required: {e}"));
    for _ in 0..2 {
        let store = PostgresStore::builder(&url)
            .table(table.clone())
            .open()
            .await
            .unwrap();
        Outbox::postgres(&store).await.unwrap();
        let sqlx_store = SqlxPostgresStore::builder(pool.clone())
            .table(table.clone())
            .open()
            .await
            .unwrap();
        Outbox::sqlx_postgres(&sqlx_store).await.unwrap();
    }
    assert_eq!(*NOTICES.lock().unwrap(), Vec::<String>::new());

    // The collector does see a NOTICE where there is one.
    let store = PostgresStore::builder(&url)
        .table(table.clone())
        .open()
        .await
        .unwrap();
    let client = store.pool().get().await.unwrap();
    client
        .batch_execute("DO $$ BEGIN RAISE NOTICE 'a probe'; END $$")
        .await
        .unwrap();
    drop(client);
    common::eventually(std::time::Duration::from_secs(10), || {
        !NOTICES.lock().unwrap().is_empty()
    })
    .await;
    let seen = NOTICES.lock().unwrap().clone();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert!(seen[0].contains("NOTICE: a probe"), "{seen:?}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&pool)
        .await
        .unwrap();
}
