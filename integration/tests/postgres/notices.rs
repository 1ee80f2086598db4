//! Opening a store or an outbox whose tables are already there logs
//! nothing: PostgreSQL answers each `CREATE ... IF NOT EXISTS` of an
//! existing table with a NOTICE ("relation ... already exists, skipping"),
//! which tokio-postgres and sqlx log at INFO on every start of every app
//! server. Both PostgreSQL stores and the outbox over both drivers are
//! opened twice on one database (`TOWER_IDEMPOTENCY_POSTGRES_URL`, or the
//! local `test` database). The test reads its own thread's log
//! (`common::logs`), on a current-thread runtime.

use crate::common;

use tower_idempotency::store::FencingToken;
use tower_idempotency_outbox::Outbox;
use tower_idempotency_postgres::PostgresStore;
use tower_idempotency_sqlx::SqlxPostgresStore;

/// tokio-postgres logs "NOTICE: ..."; sqlx logs the notice's text under
/// its target `sqlx::postgres::notice`.
fn is_notice(_: &tracing::Level, text: &str) -> bool {
    text.starts_with("message=NOTICE") || text.contains("log.target=\"sqlx::postgres::notice\"")
}

#[tokio::test]
async fn opening_over_existing_tables_logs_no_notice() {
    // With the `log` records of tokio-postgres and sqlx.
    let notices = common::logs::capture(is_notice);
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
    assert_eq!(notices.kept(), Vec::<String>::new());

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
        !notices.kept().is_empty()
    })
    .await;
    let seen = notices.kept();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert!(seen[0].contains("NOTICE: a probe"), "{seen:?}");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&pool)
        .await
        .unwrap();
}
