//! The max-hold timer's cancel must only ever stop a statement of its own
//! transaction. The timer sends it from a new connection when the handler
//! holds the transaction's connection; if that cancel is slow to arrive
//! and the layer meanwhile rolls the transaction back and returns the
//! connection to the pool, the cancel must not stop the next request's
//! statement on that same backend.
//!
//! A TCP proxy between the store and PostgreSQL holds the timer's cancel
//! connection until the test lets it through. Needs PostgreSQL:
//! `TOWER_IDEMPOTENCY_POSTGRES_URL`, or the local `test` database.

use crate::common;
use crate::stall_proxy::Proxy;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use tokio::sync::{Notify, mpsc};
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::FencingToken;
use tower_idempotency_postgres::PostgresStore;
use tower_idempotency_postgres::PostgresTransaction;

fn url() -> String {
    crate::common::services::postgres_url()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_max_hold_cancel_never_stops_the_next_request_on_the_same_connection() {
    let p = Proxy::start().await;
    let via_proxy = p.url.clone();
    let table = format!("idem_brk_{:016x}", FencingToken::random().0);
    // One pooled connection: B's transaction runs on the backend A's ran on.
    let store = PostgresStore::builder(&via_proxy)
        .table(table.clone())
        .pool_size(1)
        .open()
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {} is required: {e}", url()));
    // The test's own connection, straight to the server: holds the lock B
    // waits on, and watches B.
    let (watcher, connection) = tokio_postgres::connect(&url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let lock = 0x6272_6b00_i64 + i64::from(FencingToken::random().0 as u16);
    watcher
        .execute("SELECT pg_advisory_lock($1)", &[&lock])
        .await
        .unwrap();

    let (holding, mut holding_rx) = mpsc::channel::<i32>(1);
    let a_go = Arc::new(Notify::new());
    let go = a_go.clone();
    let app = Router::new()
        .route(
            "/a",
            post(move |tx: PostgresTransaction| {
                let (holding, go) = (holding.clone(), go.clone());
                async move {
                    let client = tx.client().await.unwrap();
                    let pid: i32 = client
                        .query_one("SELECT pg_backend_pid()", &[])
                        .await
                        .unwrap()
                        .get(0);
                    holding.send(pid).await.unwrap();
                    // Holds the connection, idle, past the max hold time.
                    go.notified().await;
                    drop(client);
                    (StatusCode::OK, "a").into_response()
                }
            }),
        )
        .route(
            "/b",
            post(move |tx: PostgresTransaction| async move {
                let client = tx.client().await.unwrap();
                match client
                    .execute("SELECT pg_advisory_lock($1)", &[&lock])
                    .await
                {
                    Ok(_) => {
                        let _ = client
                            .execute("SELECT pg_advisory_unlock($1)", &[&lock])
                            .await;
                        (StatusCode::OK, "b".to_owned()).into_response()
                    }
                    Err(e) => {
                        let why = e
                            .as_db_error()
                            .map_or(e.to_string(), |d| d.message().to_owned());
                        (StatusCode::INTERNAL_SERVER_ERROR, why).into_response()
                    }
                }
            }),
        )
        .layer(
            IdempotencyLayer::new(store.clone(), GlobalScope)
                // No lease renewal before the max hold: the renewals' own
                // connection would be the next one through the proxy.
                .lease(Duration::from_secs(60))
                .max_hold(Duration::from_secs(2))
                .transactional(),
        );
    let addr = common::serve(app).await;

    // A holds its transaction's connection past the max hold time; the
    // timer's cancel (a new connection) is held by the proxy.
    let a = tokio::spawn(async move {
        common::send(addr, "POST", "/a", &[("idempotency-key", b"\"a\"")], b"{}").await
    });
    let a_pid = tokio::time::timeout(Duration::from_secs(30), holding_rx.recv())
        .await
        .unwrap()
        .unwrap();
    p.stall_next.store(true, Ordering::SeqCst);
    tokio::time::timeout(Duration::from_secs(30), p.stalled.notified())
        .await
        .expect("the max-hold timer sent its cancel");
    assert_eq!(store.transactions_held_too_long(), 1);
    // A lets go: the layer rolls back (503) and the connection goes back to
    // the pool while the cancel is still on its way.
    a_go.notify_one();
    assert_eq!(a.await.unwrap().status, 503);

    // B runs a statement that waits for the test's lock.
    let b = tokio::spawn(async move {
        common::send(addr, "POST", "/b", &[("idempotency-key", b"\"b\"")], b"{}").await
    });
    let mut b_pid = None;
    for _ in 0..1_500 {
        let rows = watcher
            .query(common::services::ADVISORY_WAITERS, &[&lock])
            .await
            .unwrap();
        if let Some(row) = rows.first() {
            b_pid = Some(row.get::<_, i32>(0));
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let b_pid = b_pid.expect("B's statement waits for the lock");
    eprintln!("A ran on backend {a_pid}, B runs on backend {b_pid}");

    // The stale cancel arrives now.
    p.resume.notify_one();
    tokio::time::timeout(Duration::from_secs(30), p.done.notified())
        .await
        .expect("the cancel went through");
    // Give a stray cancel time to land (bounded: B's own hold is 2 s).
    for _ in 0..25 {
        let waiting = watcher
            .query(
                "SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'",
                &[&b_pid],
            )
            .await
            .unwrap();
        if waiting.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    watcher
        .execute("SELECT pg_advisory_unlock($1)", &[&lock])
        .await
        .unwrap();
    let b = b.await.unwrap();
    assert_eq!(
        (b.status, String::from_utf8_lossy(&b.body).into_owned()),
        (200, "b".to_owned()),
        "B's statement was not cancelled by A's max-hold timer"
    );
    watcher
        .batch_execute(&format!("DROP TABLE {table}"))
        .await
        .unwrap();
}
