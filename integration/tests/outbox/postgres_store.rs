//! The outbox on PostgreSQL: enqueued through the request's
//! `PostgresTransaction` (a rollback sends nothing), and two relays on one
//! database that never hold one message at once. Needs a PostgreSQL server:
//! `TOWER_IDEMPOTENCY_POSTGRES_URL`, or the local `test` database.

#![cfg(all(feature = "postgres", feature = "outbox"))]

use crate::common;
use crate::outbox_support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use outbox_support::{Answer, Downstream, until};
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::key::ClaimedKey;
use tower_idempotency_outbox::{self as outbox, HttpSink, Message, Outbox};
use tower_idempotency_postgres::PostgresStore;
use tower_idempotency_postgres::PostgresTransaction;

fn url() -> String {
    crate::common::services::postgres_url()
}

/// A prefix no other run shares: the outbox table is shared by every test
/// on the database.
fn run_id() -> String {
    let mut b = [0u8; 6];
    getrandom::fill(&mut b).unwrap();
    b.iter().map(|b| format!("{b:02x}")).collect()
}

fn tagged_sink(name: &'static str) -> impl outbox::Sink {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    HttpSink::new(
        tower::ServiceBuilder::new()
            .map_request(move |mut r: http::Request<Full<Bytes>>| {
                r.headers_mut()
                    .insert("x-relay", http::HeaderValue::from_static(name));
                r
            })
            .service(client),
    )
}

async fn rows_with_key(store: &PostgresStore, key: &str) -> i64 {
    let client = store.pool().get().await.unwrap();
    client
        .query_one(
            "SELECT count(*) FROM tower_idempotency_outbox WHERE msg_key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rolled_back_request_enqueues_nothing_and_its_retry_delivers_once() {
    let ds = Downstream::start(
        Arc::new(|_: &str, _: &[u8], _| Answer::Pass),
        Duration::ZERO,
    )
    .await;
    let store = PostgresStore::open(&url()).await.unwrap();
    let outbox = Outbox::postgres(&store).await.unwrap();
    let keys = Arc::new(Mutex::new(Vec::new()));
    let (dest, seen) = (ds.url(), keys.clone());
    let scope = run_id();
    let handler =
        move |tx: PostgresTransaction, claimed: ClaimedKey, headers: axum::http::HeaderMap| {
            let (dest, seen) = (dest.clone(), seen.clone());
            async move {
                let m = Message::new(&claimed, 0, dest, "application/json", b"{\"n\":1}".to_vec())
                    .unwrap();
                seen.lock().unwrap().push(m.key().to_owned());
                let client = tx.client().await.unwrap();
                assert!(outbox::postgres::enqueue(&*client, &m).await.unwrap());
                if headers.contains_key("x-fail") {
                    StatusCode::INTERNAL_SERVER_ERROR
                } else {
                    StatusCode::CREATED
                }
                .into_response()
            }
        };
    let app = Router::new().route("/orders", post(handler)).route_layer(
        IdempotencyLayer::new(store.clone(), move |_: &axum::http::request::Parts| {
            scope.clone()
        })
        .transactional(),
    );
    let addr = common::serve(app).await;
    let key = format!("\"{}\"", run_id());
    let failed = common::send(
        addr,
        "POST",
        "/orders",
        &[("idempotency-key", key.as_bytes()), ("x-fail", b"1")],
        b"",
    )
    .await;
    assert_eq!(failed.status, 500);
    let msg_key = keys.lock().unwrap()[0].clone();
    assert_eq!(
        rows_with_key(&store, &msg_key).await,
        0,
        "the rollback took the message with it"
    );
    let ok = common::send(
        addr,
        "POST",
        "/orders",
        &[("idempotency-key", key.as_bytes())],
        b"",
    )
    .await;
    assert_eq!(ok.status, 201);
    let committed = keys.lock().unwrap()[1].clone();
    assert_eq!(
        committed, msg_key,
        "the retry enqueued under the rolled-back attempt's key"
    );
    assert_eq!(rows_with_key(&store, &committed).await, 1);
    let _relay = outbox
        .relay(tagged_sink("a"))
        .poll_interval(Duration::from_millis(10))
        .spawn();
    // The downstream logs an attempt once it has answered, after its effect.
    until(Duration::from_secs(20), "delivered and answered", || {
        ds.effects().get(&committed) == Some(&1) && ds.attempts_of(&committed) > 0
    })
    .await;
    assert_eq!(
        ds.attempts_of(&committed),
        1,
        "the rolled-back attempt sent nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_on_one_database_never_hold_one_message_at_once() {
    let ds = Downstream::start(
        Arc::new(|_: &str, _: &[u8], n| {
            if n == 0 {
                Answer::FailBefore(503)
            } else {
                Answer::Pass
            }
        }),
        Duration::from_millis(30),
    )
    .await;
    let store = PostgresStore::open(&url()).await.unwrap();
    let (a, b) = (
        Outbox::postgres(&store).await.unwrap(),
        Outbox::postgres(&store).await.unwrap(),
    );
    let run = run_id();
    let keys: Vec<String> = (0..40).map(|i| format!("{run}-{i}")).collect();
    {
        let mut client = store.pool().get().await.unwrap();
        let tx = client.transaction().await.unwrap();
        for k in &keys {
            let m =
                Message::with_key(k.clone(), ds.url(), "application/json", b"{}".to_vec()).unwrap();
            assert!(outbox::postgres::enqueue(&*tx, &m).await.unwrap());
        }
        tx.commit().await.unwrap();
    }
    let mut relays = Vec::new();
    for (outbox, name) in [(&a, "a"), (&b, "b")] {
        relays.push(
            outbox
                .relay(tagged_sink(name))
                .batch_size(4)
                .max_in_flight(8)
                .backoff(Duration::from_millis(1), Duration::from_millis(10))
                .poll_interval(Duration::from_millis(10))
                .spawn(),
        );
    }
    until(Duration::from_secs(30), "40 delivered", || {
        keys.iter().all(|k| ds.effects().get(k) == Some(&1))
    })
    .await;
    for r in relays {
        r.shutdown().await;
    }
    assert_eq!(
        ds.max_overlap(),
        1,
        "a message was in flight at two relays at once"
    );
    for k in &keys {
        assert_eq!(ds.attempts_of(k), 2, "{k}: one 503, one delivery");
    }
    let mine: Vec<_> = ds
        .attempts()
        .into_iter()
        .filter(|x| keys.contains(&x.key))
        .collect();
    let by = |name: &str| {
        mine.iter()
            .filter(|x| x.relay.as_deref() == Some(name))
            .count()
    };
    assert_eq!(by("a") + by("b"), 80);
    assert!(
        by("a") > 0 && by("b") > 0,
        "both relays delivered: a {} b {}",
        by("a"),
        by("b")
    );
}
