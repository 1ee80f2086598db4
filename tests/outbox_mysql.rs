//! The outbox on MySQL/MariaDB: messages enqueued through the request's
//! `MySqlTransaction` commit with it or not at all, each is delivered once
//! to a counting sink, and two relays on one database never hold one
//! message at once. Needs the server at `TOWER_IDEMPOTENCY_MYSQL_URL`
//! (default `mysql://root@127.0.0.1:3306/test`); an unreachable server
//! fails every test. The outbox table is shared by the database, so the
//! tests take turns and each starts by emptying it.

#![cfg(all(feature = "mysql", feature = "outbox"))]

mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use tower_idempotency::key::ClaimedKey;
use tower_idempotency::outbox::{self, Delivery, Message, Outbox, Outcome, from_fn};
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::{FencingToken, MySqlTransaction};
use tower_idempotency::{IdempotencyLayer, MySqlStore};

/// Per message key: (relay, attempt number) of each attempt, in order.
type Attempts = BTreeMap<String, Vec<(usize, u32)>>;

const WAIT: Duration = Duration::from_secs(30);

/// The tests share the database's outbox table: one at a time.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn url() -> String {
    std::env::var("TOWER_IDEMPOTENCY_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// A store on a table of its own, and its outbox, emptied.
async fn setup() -> (MySqlStore, Outbox, String) {
    let table = format!("obx_idem_{:016x}", FencingToken::random().0);
    let store = MySqlStore::builder(&url())
        .table(&table)
        .open()
        .await
        .unwrap_or_else(|e| panic!("MySQL/MariaDB at {} is required: {e}", url()));
    let outbox = Outbox::mysql(&store).await.unwrap();
    sqlx::query("DELETE FROM tower_idempotency_outbox")
        .execute(store.pool())
        .await
        .unwrap();
    (store, outbox, table)
}

async fn teardown(store: &MySqlStore, table: &str) {
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {table}")))
        .execute(store.pool())
        .await
        .unwrap();
    sqlx::query("DELETE FROM tower_idempotency_outbox")
        .execute(store.pool())
        .await
        .unwrap();
}

/// Polls `outbox` until `done` messages are delivered (bounded by [`WAIT`]).
async fn until_done(outbox: &Outbox, done: u64) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let c = outbox.counts().await.unwrap();
        if c.done == done {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{done} delivered within {WAIT:?}: {c:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `POST /orders` through a transactional layer: enqueues one message
/// (body `{"order":"<key>"}`) through the request's transaction; `x-fail`
/// answers 500 after enqueueing, which rolls it back.
async fn order(tx: MySqlTransaction, claimed: ClaimedKey, headers: HeaderMap) -> Response {
    let body = format!("{{\"order\":\"{}\"}}", claimed.key());
    let m = Message::new(&claimed, 0, "orders", "application/json", body).unwrap();
    {
        let mut conn = tx.connection().await.unwrap();
        assert!(outbox::mysql::enqueue(&mut conn, &m).await.unwrap());
    }
    if headers.contains_key("x-fail") {
        StatusCode::INTERNAL_SERVER_ERROR.into_response()
    } else {
        StatusCode::CREATED.into_response()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rolled_back_requests_send_nothing_and_committed_ones_are_delivered_once() {
    let _turn = TURN.lock().await;
    let (store, outbox, table) = setup().await;
    let app = Router::new()
        .route("/orders", post(order))
        .route_layer(IdempotencyLayer::new(store.clone(), GlobalScope).transactional());
    let addr = common::serve(app).await;
    let send = |key: String, fail: bool| async move {
        let quoted = format!("\"{key}\"");
        let mut headers: Vec<(&str, &[u8])> = vec![("idempotency-key", quoted.as_bytes())];
        if fail {
            headers.push(("x-fail", b"yes"));
        }
        common::send(addr, "POST", "/orders", &headers, b"{}")
            .await
            .status
    };
    for i in 0..5 {
        assert_eq!(send(format!("failed-{i}"), true).await, 500);
    }
    for i in 0..20 {
        assert_eq!(send(format!("order-{i}"), false).await, 201);
        // A replay enqueues nothing.
        assert_eq!(send(format!("order-{i}"), false).await, 201);
    }
    let c = outbox.counts().await.unwrap();
    assert_eq!((c.pending, c.in_flight, c.dead, c.done), (20, 0, 0, 0));
    let seen: Arc<Mutex<BTreeMap<String, Vec<Vec<u8>>>>> = Arc::default();
    let log = seen.clone();
    let relay = outbox
        .relay(from_fn(move |d: Delivery| {
            log.lock()
                .unwrap()
                .entry(d.key)
                .or_default()
                .push(d.payload.to_vec());
            async { Outcome::Delivered }
        }))
        .poll_interval(Duration::from_millis(10))
        .spawn();
    until_done(&outbox, 20).await;
    relay.shutdown().await;
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 20);
    let bodies: HashSet<Vec<u8>> = seen
        .values()
        .map(|v| {
            assert_eq!(v.len(), 1, "delivered once");
            v[0].clone()
        })
        .collect();
    let expected: HashSet<Vec<u8>> = (0..20)
        .map(|i| format!("{{\"order\":\"order-{i}\"}}").into_bytes())
        .collect();
    assert_eq!(bodies, expected);
    let c = outbox.counts().await.unwrap();
    assert_eq!((c.pending, c.in_flight, c.dead, c.done), (0, 0, 0, 20));
    teardown(&store, &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_never_hold_one_message_at_once() {
    let _turn = TURN.lock().await;
    let (store, outbox, table) = setup().await;
    {
        let mut tx = store.pool().begin().await.unwrap();
        for i in 0..40 {
            let m = Message::with_key(format!("m-{i}"), "d", "text/plain", vec![b'x']).unwrap();
            assert!(outbox::mysql::enqueue(&mut tx, &m).await.unwrap());
        }
        // A key names one message.
        let dup = Message::with_key("m-0", "d", "text/plain", vec![b'y']).unwrap();
        assert!(!outbox::mysql::enqueue(&mut tx, &dup).await.unwrap());
        tx.commit().await.unwrap();
    }
    // Each message fails its first attempt and is delivered at its second,
    // so it is claimed twice, by either relay.
    let holding: Arc<Mutex<HashSet<String>>> = Arc::default();
    let overlaps = Arc::new(Mutex::new(0u32));
    let attempts: Arc<Mutex<Attempts>> = Arc::default();
    let sink = |relay: usize| {
        let (holding, overlaps, attempts) = (holding.clone(), overlaps.clone(), attempts.clone());
        from_fn(move |d: Delivery| {
            let (holding, overlaps, attempts) =
                (holding.clone(), overlaps.clone(), attempts.clone());
            async move {
                if !holding.lock().unwrap().insert(d.key.clone()) {
                    *overlaps.lock().unwrap() += 1;
                }
                attempts
                    .lock()
                    .unwrap()
                    .entry(d.key.clone())
                    .or_default()
                    .push((relay, d.attempt));
                // Hold it a while, so an overlap would be seen.
                tokio::time::sleep(Duration::from_millis(20)).await;
                holding.lock().unwrap().remove(&d.key);
                if d.attempt == 1 {
                    Outcome::Retry("first attempt fails".into())
                } else {
                    Outcome::Delivered
                }
            }
        })
    };
    let relays: Vec<_> = (0..2)
        .map(|i| {
            outbox
                .relay(sink(i))
                .batch_size(4)
                .backoff(Duration::from_millis(1), Duration::from_millis(5))
                .poll_interval(Duration::from_millis(10))
                .spawn()
        })
        .collect();
    until_done(&outbox, 40).await;
    for r in relays {
        r.shutdown().await;
    }
    assert_eq!(*overlaps.lock().unwrap(), 0);
    let attempts = attempts.lock().unwrap().clone();
    assert_eq!(attempts.len(), 40);
    let by_relay = |r| attempts.values().flatten().filter(|(i, _)| *i == r).count();
    eprintln!("attempts by relay: {} and {}", by_relay(0), by_relay(1));
    assert_eq!(by_relay(0) + by_relay(1), 80);
    for (key, a) in &attempts {
        let numbers: Vec<u32> = a.iter().map(|(_, n)| *n).collect();
        assert_eq!(numbers, vec![1, 2], "{key}");
    }
    let c = outbox.counts().await.unwrap();
    assert_eq!((c.pending, c.in_flight, c.dead, c.done), (0, 0, 0, 40));
    teardown(&store, &table).await;
}
