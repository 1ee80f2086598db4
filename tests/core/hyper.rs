//! The layer in a plain hyper 1 server (`examples/hyper.rs`), over a real
//! socket, with no framework in between.

#[path = "../../examples/hyper.rs"]
mod example;

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use common::send;
use tower_idempotency::MemoryStore;

#[tokio::test]
async fn hyper_server_runs_once_and_replays() {
    let orders = Arc::new(AtomicU64::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(example::serve(
        listener,
        example::service(MemoryStore::new(), orders.clone()),
    ));

    let first = send(
        addr,
        "POST",
        "/orders",
        &[("idempotency-key", b"\"o-1\"")],
        b"sku=42",
    )
    .await;
    let again = send(
        addr,
        "POST",
        "/orders",
        &[("idempotency-key", b"o-1")],
        b"sku=42",
    )
    .await;
    assert_eq!(
        (first.status, &first.body[..]),
        (201, &b"order 1: sku=42"[..])
    );
    assert_eq!(
        (again.status, &again.body[..]),
        (201, &b"order 1: sku=42"[..])
    );
    assert!(!first.replayed() && again.replayed());
    assert_eq!(again.header("location"), Some(&b"/orders/1"[..]));
    let changed = send(
        addr,
        "POST",
        "/orders",
        &[("idempotency-key", b"o-1")],
        b"sku=43",
    )
    .await;
    changed.assert_problem(422);
    let no_key = send(addr, "POST", "/orders", &[], b"sku=42").await;
    assert_eq!(
        (no_key.status, &no_key.body[..]),
        (201, &b"order 2: sku=42"[..])
    );
    assert_eq!(orders.load(Ordering::SeqCst), 2);
}
