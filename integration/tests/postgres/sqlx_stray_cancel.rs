//! The max-hold timer's cancel on `SqlxPostgresStore` (`pg_cancel_backend`
//! from a connection of its own) must only ever stop a statement of its own
//! transaction: the layer, rolling back a transaction held past its max
//! hold, waits for the cancel to be through before the connection goes back
//! to the pool, where the next request's statement would be cancelled.
//!
//! A TCP proxy between the pool and PostgreSQL holds the timer's cancel
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
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgConnection};
use tokio::sync::{Notify, mpsc};
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::FencingToken;
use tower_idempotency_sqlx::{SqlxPostgresStore, SqlxPostgresTransaction};

fn url() -> String {
    crate::common::services::postgres_url()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_max_hold_cancel_never_stops_the_next_request_on_the_same_connection() {
    let p = Proxy::start().await;
    let via_proxy = p.url.clone();
    let table = format!("idem_brk_{:016x}", FencingToken::random().0);
    // One pooled connection: B's transaction runs on the backend A's ran on.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(30))
        .connect(&via_proxy)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {} is required: {e}", url()));
    let store = SqlxPostgresStore::builder(pool)
        .table(table.clone())
        .open()
        .await
        .unwrap();
    // The test's own connection, straight to the server: holds the lock B
    // waits on, and watches B.
    let mut watcher = PgConnection::connect(&url()).await.unwrap();
    let lock = 0x6272_6c00_i64 + i64::from(FencingToken::random().0 as u16);
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(lock)
        .execute(&mut watcher)
        .await
        .unwrap();

    let (holding, mut holding_rx) = mpsc::channel::<i32>(1);
    let a_go = Arc::new(Notify::new());
    let go = a_go.clone();
    let app = Router::new()
        .route(
            "/a",
            post(move |tx: SqlxPostgresTransaction| {
                let (holding, go) = (holding.clone(), go.clone());
                async move {
                    let mut conn = tx.connection().await.unwrap();
                    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
                        .fetch_one(&mut *conn)
                        .await
                        .unwrap();
                    holding.send(pid).await.unwrap();
                    // Holds the connection, idle, past the max hold time.
                    go.notified().await;
                    drop(conn);
                    (StatusCode::OK, "a").into_response()
                }
            }),
        )
        .route(
            "/b",
            post(move |tx: SqlxPostgresTransaction| async move {
                let mut conn = tx.connection().await.unwrap();
                match sqlx::query("SELECT pg_advisory_lock($1)")
                    .bind(lock)
                    .execute(&mut *conn)
                    .await
                {
                    Ok(_) => {
                        let _ = sqlx::query("SELECT pg_advisory_unlock($1)")
                            .bind(lock)
                            .execute(&mut *conn)
                            .await;
                        (StatusCode::OK, "b".to_owned()).into_response()
                    }
                    Err(e) => {
                        let why = e
                            .as_database_error()
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
                .max_hold(Duration::from_secs(3))
                .transactional(),
        );
    let addr = common::serve(app).await;

    // A holds its transaction's connection past the max hold time; the
    // timer's cancel (a connection of its own) is held by the proxy.
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
    // A lets go while the cancel is on its way.
    a_go.notify_one();
    let b = tokio::spawn(async move {
        common::send(addr, "POST", "/b", &[("idempotency-key", b"\"b\"")], b"{}").await
    });
    let waiting = common::services::ADVISORY_WAITERS;
    // If A's connection went back to the pool already, B waits for the
    // lock on it now (bounded: with the connection held until the cancel
    // is through, B cannot start).
    for _ in 0..50 {
        let rows: Vec<i32> = sqlx::query_scalar(waiting)
            .bind(lock)
            .fetch_all(&mut watcher)
            .await
            .unwrap();
        if !rows.is_empty() {
            eprintln!("A ran on backend {a_pid}; B waits on backend {}", rows[0]);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The cancel goes through now.
    p.resume.notify_one();
    tokio::time::timeout(Duration::from_secs(30), p.done.notified())
        .await
        .expect("the cancel went through");
    // B ends (cancelled), or waits for the lock: then the lock is let go.
    for _ in 0..1_500 {
        if b.is_finished() {
            break;
        }
        let rows: Vec<i32> = sqlx::query_scalar(waiting)
            .bind(lock)
            .fetch_all(&mut watcher)
            .await
            .unwrap();
        if !rows.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(lock)
        .execute(&mut watcher)
        .await
        .unwrap();
    assert_eq!(a.await.unwrap().status, 503, "A was held past its max hold");
    let b = b.await.unwrap();
    assert_eq!(
        (b.status, String::from_utf8_lossy(&b.body).into_owned()),
        (200, "b".to_owned()),
        "B's statement was not cancelled by A's max-hold timer"
    );
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&mut watcher)
        .await
        .unwrap();
}
