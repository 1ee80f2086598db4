//! The client side against the real ledger: a proxy drops the connection of
//! the first two attempts after the ledger has applied the credit and before
//! the answer reaches the client. The client's retries carry the same key,
//! so the ledger credits once and the third attempt gets the replay.

use crate::driver;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::retry::RetryLayer;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_idempotency::client::{IdempotencyKeyLayer, RetryPolicy};

/// Forwards connections to `upstream`. The first `drops` connections are cut
/// as soon as the upstream starts answering: the request was processed, the
/// client never sees the answer. Returns the proxy's address and the count of
/// connections seen.
async fn flaky_proxy(
    upstream: std::net::SocketAddr,
    drops: usize,
) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(AtomicUsize::new(0));
    let count = seen.clone();
    tokio::spawn(async move {
        loop {
            let (mut client, _) = listener.accept().await.unwrap();
            let n = count.fetch_add(1, Ordering::SeqCst);
            let mut server = TcpStream::connect(upstream).await.unwrap();
            tokio::spawn(async move {
                if n < drops {
                    let (mut client_read, _client_write) = client.split();
                    let (mut server_read, mut server_write) = server.split();
                    let forward = async {
                        let mut buf = [0u8; 4096];
                        loop {
                            let read = client_read.read(&mut buf).await.unwrap_or(0);
                            if read == 0 || server_write.write_all(&buf[..read]).await.is_err() {
                                return;
                            }
                        }
                    };
                    let mut first = [0u8; 1];
                    tokio::select! {
                        _ = forward => {}
                        _ = server_read.read(&mut first) => {} // the answer starts: cut
                    }
                } else {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    (addr, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_through_dropped_connections_credit_once() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = driver::Ledger::start(
        &driver::ledger_beside_tests(),
        &dir.path().join("l.sqlite3"),
        "transactional",
        2,
    );
    let account = driver::request(
        ledger.addr,
        "POST",
        "/accounts",
        &[("idempotency-key", "acct")],
        r#"{"name":"c"}"#,
    )
    .expect("create an account");
    assert_eq!(account.status, 201);
    let (proxy, connections) = flaky_proxy(ledger.addr, 2).await;

    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut client = ServiceBuilder::new()
        .layer(IdempotencyKeyLayer::new())
        .layer(RetryLayer::new(
            RetryPolicy::new().base_delay(Duration::from_millis(10)),
        ))
        .service(http);
    let request = Request::post(format!("http://{proxy}/accounts/1/credits"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(br#"{"amount":500}"#)))
        .unwrap();
    let response = client.ready().await.unwrap().call(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(response.headers()["idempotent-replayed"], "true");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let credit: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        (credit["amount"].as_i64(), credit["balance"].as_i64()),
        (Some(500), Some(500))
    );
    assert_eq!(
        connections.load(Ordering::SeqCst),
        3,
        "two cut attempts, then the replay"
    );

    let balance = driver::request(ledger.addr, "GET", "/accounts/1", &[], "").unwrap();
    let balance: serde_json::Value = serde_json::from_str(&balance.body).unwrap();
    assert_eq!(balance["balance"], 500, "credited exactly once");
}
