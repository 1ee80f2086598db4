//! The outbox on MySQL/MariaDB in a database whose default character set is
//! not `utf8mb4` (latin1: MariaDB's default before 11.6): a destination or
//! an error outside that set is kept as given, never silently replaced by
//! `?` (which `INSERT IGNORE` would do) nor refused. Needs MySQL/MariaDB at
//! `TOWER_IDEMPOTENCY_MYSQL_URL` (default `mysql://root@127.0.0.1:3306/test`)
//! with the right to create and drop a database.

#![cfg(all(feature = "mysql", feature = "outbox"))]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tower_idempotency::store::FencingToken;
use tower_idempotency_outbox::{self as outbox, Delivery, Message, Outbox, Outcome, View, from_fn};
use tower_idempotency_sqlx::MySqlStore;

fn url() -> String {
    crate::common::services::mysql_url()
}

/// `url()` with its database replaced by `db`.
fn url_of(db: &str) -> String {
    let base = url();
    let cut = base.rfind('/').expect("a database in the URL");
    format!("{}/{db}", &base[..cut])
}

async fn until_async<F: std::future::Future<Output = bool>>(
    what: &str,
    mut check: impl FnMut() -> F,
) {
    for _ in 0..1_500 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting until {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latin1_database_keeps_destinations_and_errors_as_given() {
    let db = format!("brk_latin1_{:08x}", FencingToken::random().0 as u32);
    let admin = sqlx::MySqlPool::connect(&url())
        .await
        .unwrap_or_else(|e| panic!("MySQL/MariaDB at {} is required: {e}", url()));
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE DATABASE {db} CHARACTER SET latin1 COLLATE latin1_swedish_ci"
    )))
    .execute(&admin)
    .await
    .unwrap();

    let store = MySqlStore::builder(&url_of(&db))
        .table("records")
        .open()
        .await
        .unwrap();
    let outbox = Outbox::mysql(&store).await.unwrap();
    let destination = "http://127.0.0.1:9/заказы/日本?q=✓";
    let m = Message::with_key("charset-1", destination, "text/plain", b"x".to_vec()).unwrap();
    let enqueued = {
        let mut tx = store.pool().begin().await.unwrap();
        let enqueued = outbox::sqlx::enqueue(&mut tx, &m).await;
        tx.commit().await.unwrap();
        enqueued
    };

    let seen: Arc<Mutex<Vec<(u32, String)>>> = Arc::default();
    let log = seen.clone();
    let error = "нет ответа: 日本";
    let relay = outbox
        .relay(from_fn(move |d: Delivery| {
            log.lock().unwrap().push((d.attempt, d.destination));
            async move { Outcome::Retry(error.into()) }
        }))
        .max_attempts(Some(1_000))
        .backoff(Duration::from_secs(3_600), Duration::from_secs(3_600))
        .poll_interval(Duration::from_millis(10))
        .spawn();
    let outcome = async move {
        assert_eq!(
            enqueued.map_err(|e| e.to_string()),
            Ok(true),
            "the message is enqueued"
        );
        until_async("one attempt", || async { !seen.lock().unwrap().is_empty() }).await;
        relay.shutdown().await;
        assert_eq!(
            seen.lock().unwrap().clone(),
            vec![(1, destination.to_owned())],
            "delivered once, to the destination as given"
        );
        let pending = outbox.list(View::Pending, 10).await.unwrap();
        assert_eq!(pending.len(), 1, "the attempt was recorded: {pending:?}");
        assert_eq!(pending[0].destination, destination);
        assert_eq!(pending[0].attempts, 1);
        assert_eq!(pending[0].last_error.as_deref(), Some(error));
    };
    let result = tokio::spawn(outcome).await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE {db}")))
        .execute(&admin)
        .await
        .unwrap();
    if let Err(e) = result {
        std::panic::resume_unwind(e.into_panic());
    }
}
