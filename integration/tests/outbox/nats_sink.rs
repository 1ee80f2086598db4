//! The outbox's JetStream sink against a real NATS server (JetStream
//! enabled) at `TOWER_IDEMPOTENCY_NATS_URL` (default
//! `nats://127.0.0.1:4222`). These tests FAIL when it is unreachable.
//!
//! Each test makes a stream of its own (a random name, on a random
//! subject prefix) and deletes it at the end.

#![cfg(all(feature = "sqlite", feature = "outbox-nats"))]

use crate::outbox_support;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_nats::jetstream::{self, Context, stream};
use outbox_support::{WAIT, rusqlite_conn, until_async};
use tokio::sync::mpsc;
use tower_idempotency_outbox::nats::NatsSink;
use tower_idempotency_outbox::{self as outbox, Delivery, Message, Outbox, Outcome, Sink, from_fn};

async fn jetstream() -> Context {
    let url = crate::common::services::nats_url();
    let client = tokio::time::timeout(Duration::from_secs(10), async_nats::connect(&url))
        .await
        .unwrap_or_else(|_| panic!("NATS at {url} did not answer in 10 s"))
        .unwrap_or_else(|e| panic!("NATS at {url} is unreachable: {e}"));
    jetstream::new(client)
}

/// A fresh stream on `<name>.>`; returns its name (also the subject prefix).
async fn fresh_stream(js: &Context) -> String {
    let mut b = [0u8; 6];
    getrandom::fill(&mut b).unwrap();
    let name = format!(
        "outbox2_{}",
        b.iter().map(|b| format!("{b:02x}")).collect::<String>()
    );
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![format!("{name}.>")],
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await
    .unwrap();
    name
}

/// Every message in stream `name`: (Nats-Msg-Id, subject, body), in order.
async fn read_stream(js: &Context, name: &str) -> Vec<(String, String, Vec<u8>)> {
    let mut s = js.get_stream(name).await.unwrap();
    let info = s.info().await.unwrap().clone();
    let mut out = Vec::new();
    for seq in info.state.first_sequence..=info.state.last_sequence {
        if info.state.messages == 0 {
            break;
        }
        let m = s.get_raw_message(seq).await.unwrap();
        let id = m
            .headers
            .get(async_nats::header::NATS_MESSAGE_ID)
            .unwrap()
            .to_string();
        out.push((id, m.subject.to_string(), m.payload.to_vec()));
    }
    out
}

/// Enqueues `(key, subject, body)` messages, each in a transaction of its
/// own with an `orders` row; commits it when `commit`, else rolls it back.
fn enqueue(db: &Path, messages: &[(String, String, String)], commit: bool) {
    let mut conn = rusqlite_conn(db);
    conn.execute(
        "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY)",
        [],
    )
    .unwrap();
    for (key, subject, body) in messages {
        let m = Message::with_key(key, subject, "application/json", body.clone()).unwrap();
        let tx = conn.transaction().unwrap();
        tx.execute("INSERT INTO orders DEFAULT VALUES", []).unwrap();
        assert!(outbox::sqlite::enqueue(&tx, &m).unwrap());
        if commit {
            tx.commit().unwrap();
        } else {
            tx.rollback().unwrap();
        }
    }
}

fn messages(prefix: &str, tag: &str, n: usize) -> Vec<(String, String, String)> {
    (0..n)
        .map(|i| {
            (
                format!("{prefix}-{tag}-{i}"),
                format!("{prefix}.orders.{}", i % 3),
                format!("{{\"{tag}\":{i}}}"),
            )
        })
        .collect()
}

fn as_map(v: &[(String, String, Vec<u8>)]) -> BTreeMap<String, (String, Vec<u8>)> {
    v.iter()
        .map(|(k, s, b)| (k.clone(), (s.clone(), b.clone())))
        .collect()
}

fn expected(v: &[(String, String, String)]) -> BTreeMap<String, (String, Vec<u8>)> {
    v.iter()
        .map(|(k, s, b)| (k.clone(), (s.clone(), b.clone().into_bytes())))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn committed_messages_reach_the_stream_once_each_and_rolled_back_ones_never() {
    let js = jetstream().await;
    let name = fresh_stream(&js).await;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.sqlite3");
    let outbox = Outbox::sqlite(&db).await.unwrap();
    let committed = messages(&name, "c", 30);
    let rolled_back = messages(&name, "r", 5);
    enqueue(&db, &committed, true);
    enqueue(&db, &rolled_back, false);
    let relay = outbox
        .relay(NatsSink::new(js.clone()))
        .poll_interval(Duration::from_millis(10))
        .spawn();
    until_async(WAIT, "30 delivered", || async {
        outbox.counts().await.unwrap().done == 30
    })
    .await;
    relay.shutdown().await;
    let c = outbox.counts().await.unwrap();
    assert_eq!((c.pending, c.in_flight, c.dead, c.done), (0, 0, 0, 30));
    let stored = read_stream(&js, &name).await;
    assert_eq!(stored.len(), 30);
    assert_eq!(as_map(&stored), expected(&committed));
    js.delete_stream(&name).await.unwrap();
}

/// A relay that publishes and then dies before recording it: after its
/// lease ends another relay publishes the same messages again, the stream's
/// de-duplication drops the copies, and each is stored once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_relay_killed_between_publish_and_record_leaves_one_copy_each() {
    let js = jetstream().await;
    let name = fresh_stream(&js).await;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("app.sqlite3");
    let outbox = Outbox::sqlite(&db).await.unwrap();
    let sent = messages(&name, "k", 12);
    enqueue(&db, &sent, true);
    // The first relay's sink publishes, reports it, and never answers.
    let (published_tx, mut published) = mpsc::channel::<Outcome>(64);
    let inner = NatsSink::new(js.clone());
    let doomed = outbox
        .relay(from_fn(move |d: Delivery| {
            let (inner, published_tx) = (inner.clone(), published_tx.clone());
            async move {
                let outcome = inner.deliver(d).await;
                published_tx.send(outcome).await.unwrap();
                std::future::pending::<Outcome>().await
            }
        }))
        .lease(Duration::from_secs(1))
        .answer_timeout(Duration::from_secs(60))
        .poll_interval(Duration::from_millis(10))
        .spawn();
    for _ in 0..12 {
        let outcome = tokio::time::timeout(WAIT, published.recv())
            .await
            .expect("12 publishes")
            .unwrap();
        assert_eq!(outcome, Outcome::Delivered);
    }
    doomed.abort();
    assert_eq!(read_stream(&js, &name).await.len(), 12);
    assert_eq!(outbox.counts().await.unwrap().done, 0);
    // The second relay re-publishes each message once (counted): the
    // stream acknowledges each as a duplicate.
    let resent = Arc::new(AtomicUsize::new(0));
    let (inner, counter) = (NatsSink::new(js.clone()), resent.clone());
    let relay = outbox
        .relay(from_fn(move |d: Delivery| {
            let (inner, counter) = (inner.clone(), counter.clone());
            async move {
                counter.fetch_add(1, Ordering::SeqCst);
                inner.deliver(d).await
            }
        }))
        .lease(Duration::from_secs(1))
        .poll_interval(Duration::from_millis(10))
        .spawn();
    until_async(WAIT, "12 delivered", || async {
        outbox.counts().await.unwrap().done == 12
    })
    .await;
    relay.shutdown().await;
    assert_eq!(resent.load(Ordering::SeqCst), 12);
    let stored = read_stream(&js, &name).await;
    assert_eq!(stored.len(), 12);
    assert_eq!(as_map(&stored), expected(&sent));
    let mut s = js.get_stream(&name).await.unwrap();
    assert_eq!(s.info().await.unwrap().state.last_sequence, 12);
    js.delete_stream(&name).await.unwrap();
}

/// The same message published twice through the sink: two deliveries, one
/// stored copy; a direct re-publish is acknowledged as a duplicate.
#[tokio::test]
async fn publishing_twice_stores_once() {
    let js = jetstream().await;
    let name = fresh_stream(&js).await;
    let sink = NatsSink::with_subject(js.clone(), format!("{name}.fixed"));
    let d = |attempt| {
        let mut d = sample(&format!("{name}-twice"));
        d.attempt = attempt;
        d
    };
    assert_eq!(sink.deliver(d(1)).await, Outcome::Delivered);
    assert_eq!(sink.deliver(d(2)).await, Outcome::Delivered);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert(
        async_nats::header::NATS_MESSAGE_ID,
        format!("{name}-twice").as_str(),
    );
    let ack = js
        .publish_with_headers(format!("{name}.fixed"), headers, "other".into())
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(ack.duplicate);
    assert_eq!(ack.sequence, 1);
    let stored = read_stream(&js, &name).await;
    assert_eq!(
        stored,
        vec![(
            format!("{name}-twice"),
            format!("{name}.fixed"),
            b"{\"n\":1}".to_vec()
        )]
    );
    // No stream on the subject: retried, not a dead letter; a bad subject
    // is refused.
    let nowhere = NatsSink::with_subject(js.clone(), format!("{name}_none.x"));
    assert!(matches!(nowhere.deliver(d(1)).await, Outcome::Retry(_)));
    let bad = NatsSink::with_subject(js.clone(), format!("{name}.*"));
    assert!(matches!(bad.deliver(d(1)).await, Outcome::Reject(_)));
    js.delete_stream(&name).await.unwrap();
}

fn sample(key: &str) -> Delivery {
    Delivery::new(key, "unused", "application/json", &b"{\"n\":1}"[..], 1)
}
