//! The outbox records whatever error a sink gives: one with a NUL character
//! (which PostgreSQL's `TEXT` refuses) or one longer than MySQL's `TEXT`
//! (64 KiB) must still be recorded, or the attempt's fate is lost, the lease
//! ends and the message is attempted again and again, never a dead letter.
//! On PostgreSQL (tokio-postgres) and MySQL/MariaDB, each in a database of
//! its own made for the test. Needs both servers
//! (`TOWER_IDEMPOTENCY_POSTGRES_URL`, `TOWER_IDEMPOTENCY_MYSQL_URL`, or the
//! local `test` databases) and the right to create databases.

#![cfg(all(feature = "outbox", feature = "postgres", feature = "mysql"))]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tower_idempotency::store::FencingToken;
use tower_idempotency_outbox::{Delivery, Message, Outbox, Outcome, View, from_fn};
use tower_idempotency_postgres::PostgresStore;
use tower_idempotency_sqlx::MySqlStore;

fn pg_url() -> String {
    crate::common::services::postgres_url()
}

fn mysql_url() -> String {
    crate::common::services::mysql_url()
}

/// The errors a sink gives, each on a message of its own.
fn errors() -> Vec<(&'static str, String)> {
    vec![
        ("nul", "upstream said: bad\0byte".to_owned()),
        ("long", format!("upstream said: {}", "x".repeat(70_000))),
        ("plain", "upstream said: no".to_owned()),
    ]
}

/// One relay, every message refused once (`Outcome::Reject` with its
/// error) or, past the first, retried with it and out of attempts: each is
/// delivered exactly once and ends a dead letter with its error recorded.
async fn each_error_is_recorded(outbox: &Outbox, enqueue: impl AsyncFnOnce(&[Message])) {
    let errors = errors();
    let messages: Vec<Message> = errors
        .iter()
        .map(|(key, _)| {
            Message::with_key(*key, "http://127.0.0.1:9/", "text/plain", b"x".to_vec()).unwrap()
        })
        .collect();
    enqueue(&messages).await;
    let attempts = Arc::new(AtomicUsize::new(0));
    let count = attempts.clone();
    let by_key = errors.clone();
    let relay = outbox
        .relay(from_fn(move |d: Delivery| {
            count.fetch_add(1, Ordering::SeqCst);
            let error = by_key
                .iter()
                .find(|(key, _)| *key == d.key)
                .map(|(_, e)| e.clone())
                .unwrap();
            async move { Outcome::Retry(error) }
        }))
        .max_attempts(Some(1))
        .poll_interval(Duration::from_millis(10))
        .spawn();
    // Every message attempted once; `shutdown` then waits for each attempt
    // to be recorded (or to fail to be).
    for _ in 0..1_500 {
        if attempts.load(Ordering::SeqCst) >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    relay.shutdown().await;
    let c = outbox.counts().await.unwrap();
    assert_eq!(
        (c.pending, c.in_flight, c.dead, c.done),
        (0, 0, 3, 0),
        "each message is a dead letter after its one attempt"
    );
    assert_eq!(attempts.load(Ordering::SeqCst), 3, "one attempt each");
    let mut listed = outbox.list(View::Dead, 10).await.unwrap();
    listed.sort_by(|a, b| a.key.cmp(&b.key));
    let keys: Vec<&str> = listed.iter().map(|e| e.key.as_str()).collect();
    assert_eq!(keys, ["long", "nul", "plain"]);
    for e in &listed {
        let error = e.last_error.as_deref().unwrap();
        assert!(
            error.starts_with("upstream said: "),
            "{}: the error is recorded: {:.80}",
            e.key,
            error
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_records_any_error() {
    let db = format!("brk_obx_{:08x}", FencingToken::random().0 as u32);
    let (admin, connection) = tokio_postgres::connect(&pg_url(), tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {} is required: {e}", pg_url()));
    tokio::spawn(connection);
    admin
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await
        .unwrap();
    let outcome = {
        let db = db.clone();
        tokio::spawn(async move {
            let store =
                PostgresStore::builder(&crate::common::services::with_database(&pg_url(), &db))
                    .open()
                    .await
                    .unwrap();
            let outbox = Outbox::postgres(&store).await.unwrap();
            each_error_is_recorded(&outbox, async |messages: &[Message]| {
                let pooled = store.pool().get().await.unwrap();
                let client: &tokio_postgres::Client = &pooled;
                for m in messages {
                    assert!(
                        tower_idempotency_outbox::postgres::enqueue(client, m)
                            .await
                            .unwrap()
                    );
                }
            })
            .await;
            store.pool().close();
        })
        .await
    };
    admin
        .batch_execute(&format!("DROP DATABASE {db} WITH (FORCE)"))
        .await
        .unwrap();
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_records_any_error() {
    let db = format!("brk_obx_{:08x}", FencingToken::random().0 as u32);
    let admin = sqlx::MySqlPool::connect(&mysql_url())
        .await
        .unwrap_or_else(|e| panic!("MySQL/MariaDB at {} is required: {e}", mysql_url()));
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .execute(&admin)
        .await
        .unwrap();
    let outcome = {
        let db = db.clone();
        tokio::spawn(async move {
            let store =
                MySqlStore::builder(&crate::common::services::with_database(&mysql_url(), &db))
                    .open()
                    .await
                    .unwrap();
            let outbox = Outbox::mysql(&store).await.unwrap();
            each_error_is_recorded(&outbox, async |messages: &[Message]| {
                let mut tx = store.pool().begin().await.unwrap();
                for m in messages {
                    assert!(
                        tower_idempotency_outbox::sqlx::enqueue(&mut tx, m)
                            .await
                            .unwrap()
                    );
                }
                tx.commit().await.unwrap();
            })
            .await;
        })
        .await
    };
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE {db}")))
        .execute(&admin)
        .await
        .unwrap();
    if let Err(e) = outcome {
        std::panic::resume_unwind(e.into_panic());
    }
}

/// A destination with a NUL character fits no PostgreSQL `TEXT`: the
/// handler's enqueue would fail (and abort the request's transaction) on
/// PostgreSQL only, while SQLite and MySQL keep it. `Message` refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_postgres_cannot_hold_is_refused_by_message() {
    assert_eq!(
        Message::with_key("k", "http://127.0.0.1:9/\0", "text/plain", b"x".to_vec()),
        Err(tower_idempotency_outbox::MessageError::InvalidField(
            "destination"
        ))
    );
    assert!(Message::with_key("k", "http://127.0.0.1:9/ok", "text/plain", b"x".to_vec()).is_ok());
}
