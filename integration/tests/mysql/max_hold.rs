//! `MySqlStore`'s max hold time with every pooled connection in use: the
//! timer's `KILL QUERY` must still stop the handler's statement at once, so
//! it cannot wait for a pooled connection (the one it would stop holds the
//! last). Needs MySQL/MariaDB at `TOWER_IDEMPOTENCY_MYSQL_URL` (default
//! `mysql://root@127.0.0.1:3306/test`).

#![cfg(feature = "mysql")]

use crate::common;

use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use sqlx::{AssertSqlSafe, Connection, Executor};
use tokio::sync::mpsc;
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::FencingToken;
use tower_idempotency_sqlx::MySqlStore;
use tower_idempotency_sqlx::MySqlTransaction;

fn url() -> String {
    crate::common::services::mysql_url()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_past_the_max_hold_is_stopped_with_the_pool_exhausted() {
    let table = format!("idem_brk_{:016x}", FencingToken::random().0);
    let rows = format!("{table}_rows");
    // One pooled connection, taken by the request's transaction.
    let store = MySqlStore::builder(&url())
        .table(&table)
        .pool_size(1)
        .wait_timeout(Duration::from_secs(5))
        .open()
        .await
        .unwrap_or_else(|e| panic!("MySQL/MariaDB at {} is required: {e}", url()));
    // The test's own connection holds the row the handler updates.
    let mut locker = sqlx::MySqlConnection::connect(&url()).await.unwrap();
    locker
        .execute(AssertSqlSafe(format!(
            "CREATE TABLE {rows} (id INT PRIMARY KEY, v INT NOT NULL) ENGINE=InnoDB"
        )))
        .await
        .unwrap();
    locker
        .execute(AssertSqlSafe(format!("INSERT INTO {rows} VALUES (1, 0)")))
        .await
        .unwrap();
    locker.execute("BEGIN").await.unwrap();
    locker
        .execute(AssertSqlSafe(format!(
            "SELECT v FROM {rows} WHERE id = 1 FOR UPDATE"
        )))
        .await
        .unwrap();

    let (saw, mut seen) = mpsc::unbounded_channel::<String>();
    let update = format!("UPDATE {rows} SET v = v + 1 WHERE id = 1");
    let app = Router::new()
        .route(
            "/update",
            post(move |tx: MySqlTransaction| {
                let (saw, update) = (saw.clone(), update.clone());
                async move {
                    let mut conn = tx.connection().await.unwrap();
                    // Longer than the wait for a pooled connection, far
                    // longer than the max hold.
                    conn.execute("SET SESSION innodb_lock_wait_timeout = 20")
                        .await
                        .unwrap();
                    let outcome = match conn.execute(AssertSqlSafe(update)).await {
                        Ok(_) => "updated".to_owned(),
                        Err(e) => e.to_string(),
                    };
                    saw.send(outcome).unwrap();
                    drop(conn);
                    StatusCode::OK.into_response()
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(store.clone(), GlobalScope)
                .max_hold(Duration::from_secs(1))
                .transactional(),
        );
    let addr = common::serve(app).await;
    let request = tokio::spawn(async move {
        common::send(
            addr,
            "POST",
            "/update",
            &[("idempotency-key", b"\"k\"")],
            b"{}",
        )
        .await
    });
    let outcome = tokio::time::timeout(Duration::from_secs(60), seen.recv())
        .await
        .unwrap()
        .unwrap();
    locker.execute("ROLLBACK").await.unwrap();
    let status = request.await.unwrap().status;
    locker
        .execute(AssertSqlSafe(format!("DROP TABLE {rows}, {table}")))
        .await
        .unwrap();
    assert!(
        outcome.contains("interrupted"),
        "the statement was stopped at the max hold time, not left to its lock wait: {outcome}"
    );
    assert_eq!(status, 503, "held past its max hold time");
    assert_eq!(store.transactions_held_too_long(), 1);
}
