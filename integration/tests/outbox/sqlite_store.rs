//! The outbox on SQLite, end to end: requests through a transactional
//! `IdempotencyLayer` enqueue messages, relays deliver them over real HTTP to
//! a downstream behind its own `IdempotencyLayer`, which counts its effects.

#![cfg(all(feature = "sqlite", feature = "outbox"))]

use crate::common;
use crate::outbox_support;

use std::collections::HashSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use outbox_support::{Answer, Downstream, WAIT, http_sink, script, until, until_async};
use tower_idempotency::key::ClaimedKey;
use tower_idempotency::store::SqliteTransaction;
use tower_idempotency::{IdempotencyLayer, SqliteStore};
use tower_idempotency_outbox::{self as outbox, Message, Outbox};

/// The upstream: `POST /orders` enqueues `n` messages (header `x-messages`,
/// default 1) to `url` and writes an order row, all in the request's
/// transaction; `x-fail: yes` answers 500 after enqueueing (a rollback).
/// Every key it enqueued, committed or not, goes to `enqueued`.
async fn upstream(
    path: &Path,
    url: String,
    enqueued: Arc<Mutex<Vec<String>>>,
) -> std::net::SocketAddr {
    let store = SqliteStore::open(path).await.unwrap();
    let handler =
        move |tx: SqliteTransaction, claimed: ClaimedKey, headers: axum::http::HeaderMap| {
            let (url, enqueued) = (url.clone(), enqueued.clone());
            async move {
                let n: u32 = headers
                    .get("x-messages")
                    .map_or(1, |v| v.to_str().unwrap().parse().unwrap());
                let fail = headers.contains_key("x-fail");
                let messages: Vec<Message> = (0..n)
                    .map(|i| {
                        let body = format!("{{\"order\":\"{}\",\"part\":{i}}}", claimed.key());
                        Message::new(&claimed, i, url.clone(), "application/json", body).unwrap()
                    })
                    .collect();
                enqueued
                    .lock()
                    .unwrap()
                    .extend(messages.iter().map(|m| m.key().to_owned()));
                tx.run(move |tx| {
                    tx.execute(
                        "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY)",
                        [],
                    )?;
                    tx.execute("INSERT INTO orders DEFAULT VALUES", [])?;
                    for m in &messages {
                        assert!(outbox::sqlite::enqueue(tx, m)?);
                    }
                    Ok(())
                })
                .await
                .unwrap();
                let status = if fail {
                    StatusCode::INTERNAL_SERVER_ERROR
                } else {
                    StatusCode::CREATED
                };
                Ok::<Response, std::convert::Infallible>(status.into_response())
            }
        };
    let app = Router::new().route("/orders", post(handler)).route_layer(
        IdempotencyLayer::new(store, |_: &axum::http::request::Parts| "alice".to_owned())
            .transactional(),
    );
    common::serve(app).await
}

async fn order(addr: std::net::SocketAddr, key: &str, extra: &[(&str, &[u8])]) -> u16 {
    let quoted = format!("\"{key}\"");
    let mut headers: Vec<(&str, &[u8])> = vec![("idempotency-key", quoted.as_bytes())];
    headers.extend_from_slice(extra);
    common::send(addr, "POST", "/orders", &headers, b"{}")
        .await
        .status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_message_is_applied_once_through_lost_answers_and_client_retries() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.sqlite3");
    // Attempt 1 fails before the receiver; attempt 2 is applied but its
    // answer is lost; attempt 3 is replayed by the receiver's layer.
    let ds = Downstream::start(
        script(|_, _, n| match n {
            0 => Answer::FailBefore(503),
            1 => Answer::FailAfter(502),
            _ => Answer::Pass,
        }),
        Duration::ZERO,
    )
    .await;
    let enqueued = Arc::new(Mutex::new(Vec::new()));
    let addr = upstream(&db, ds.url(), enqueued.clone()).await;
    let outbox = Outbox::sqlite(&db).await.unwrap();
    let _relay = outbox
        .relay(http_sink())
        .backoff(Duration::from_millis(5), Duration::from_millis(50))
        .poll_interval(Duration::from_millis(10))
        .spawn();
    for i in 0..10 {
        let key = format!("order-{i}");
        assert_eq!(order(addr, &key, &[("x-messages", b"2")]).await, 201);
        // The client retries: a replay, which enqueues nothing.
        assert_eq!(order(addr, &key, &[("x-messages", b"2")]).await, 201);
    }
    let keys: HashSet<String> = enqueued.lock().unwrap().iter().cloned().collect();
    assert_eq!(
        keys.len(),
        20,
        "10 orders of 2 messages, each under a key of its own"
    );
    until_async(WAIT, "20 messages done", || async {
        outbox.counts().await.unwrap().done == 20
    })
    .await;
    let effects = ds.effects();
    assert_eq!(effects.len(), 20);
    for key in &keys {
        assert_eq!(effects.get(key), Some(&1), "{key}");
        assert_eq!(ds.attempts_of(key), 3, "{key}");
    }
    // Every attempt for a key carried the same body.
    for key in &keys {
        let bodies: HashSet<Vec<u8>> = ds
            .attempts()
            .into_iter()
            .filter(|a| &a.key == key)
            .map(|a| a.body)
            .collect();
        assert_eq!(bodies.len(), 1, "{key}");
    }
    let counts = outbox.counts().await.unwrap();
    assert_eq!(
        (counts.pending, counts.in_flight, counts.dead, counts.done),
        (0, 0, 0, 20)
    );
    assert_eq!(counts.oldest_pending_age_ms, None);
    // Delivered rows go at their retention's end.
    assert_eq!(outbox.purge_delivered(Duration::ZERO).await.unwrap(), 20);
    assert_eq!(outbox.counts().await.unwrap().done, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rolled_back_request_sends_nothing_and_its_retry_reuses_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.sqlite3");
    let ds = Downstream::start(script(|_, _, _| Answer::Pass), Duration::ZERO).await;
    let enqueued = Arc::new(Mutex::new(Vec::new()));
    let addr = upstream(&db, ds.url(), enqueued.clone()).await;
    let outbox = Outbox::sqlite(&db).await.unwrap();
    assert_eq!(order(addr, "k-1", &[("x-fail", b"yes")]).await, 500);
    // The rollback took the message with it: the table is empty.
    assert_eq!(outbox.counts().await.unwrap(), outbox::Counts::default());
    let _relay = outbox
        .relay(http_sink())
        .poll_interval(Duration::from_millis(10))
        .spawn();
    assert_eq!(order(addr, "k-1", &[]).await, 201);
    until(WAIT, "one effect", || ds.effects().len() == 1).await;
    let tried = enqueued.lock().unwrap().clone();
    assert_eq!(tried.len(), 2);
    assert_eq!(
        tried[0], tried[1],
        "the retry enqueued under the rolled-back attempt's key"
    );
    assert_eq!(ds.effects().get(&tried[0]), Some(&1));
    until_async(WAIT, "done", || async {
        outbox.counts().await.unwrap().done == 1
    })
    .await;
    assert_eq!(ds.attempts().len(), 1);
}
