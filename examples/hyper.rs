//! A plain hyper 1 server (no framework) with the idempotency layer in front
//! of a `tower::service_fn` handler.
//!
//! ```text
//! cargo run --example hyper -- [--listen 127.0.0.1:3001] [--db hyper.sqlite3]
//! curl -si -X POST localhost:3001/orders -H 'Idempotency-Key: "o-1"' -d 'sku=42'   # runs
//! curl -si -X POST localhost:3001/orders -H 'Idempotency-Key: "o-1"' -d 'sku=42'   # replayed
//! ```

#![allow(dead_code)] // tests/core/hyper.rs includes this file for `service` and `serve`

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tower::{Layer, Service, ServiceExt};
use tower_idempotency::store::Store;
use tower_idempotency::{IdempotencyLayer, RequestBody};

/// The handler: creates an order from the body and answers 201 with its
/// number. `orders` counts how often it really ran.
async fn create_order(
    orders: Arc<AtomicU64>,
    req: Request<RequestBody<Incoming>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let body = match req.into_body().collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => {
            let mut bad = Response::new(Full::new(Bytes::from_static(b"unreadable body")));
            *bad.status_mut() = StatusCode::BAD_REQUEST;
            return Ok(bad);
        }
    };
    let n = orders.fetch_add(1, Ordering::SeqCst) + 1;
    let mut created = Response::new(Full::new(Bytes::from(format!(
        "order {n}: {}",
        String::from_utf8_lossy(&body)
    ))));
    *created.status_mut() = StatusCode::CREATED;
    created.headers_mut().insert(
        "location",
        format!("/orders/{n}").parse().expect("a header value"),
    );
    Ok(created)
}

/// The layered service: POST and PATCH with a key run once per key (one
/// global scope: this demo has one caller).
pub fn service<St: Store>(
    store: St,
    orders: Arc<AtomicU64>,
) -> impl Service<
    Request<Incoming>,
    Response = Response<tower_idempotency::ResponseBody<Full<Bytes>>>,
    Error = Infallible,
    Future: Send,
> + Clone
+ Send
+ 'static {
    let handler = tower::service_fn(move |req| create_order(orders.clone(), req));
    IdempotencyLayer::new(store, tower_idempotency::scope::GlobalScope).layer(handler)
}

/// Accepts connections on `listener` and serves each with hyper (HTTP/1.1
/// and HTTP/2), until the task is dropped.
pub async fn serve<S>(listener: tokio::net::TcpListener, service: S)
where
    S: Service<
            Request<Incoming>,
            Response = Response<tower_idempotency::ResponseBody<Full<Bytes>>>,
            Error = Infallible,
            Future: Send,
        > + Clone
        + Send
        + 'static,
{
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let service = TowerToHyperService::new(service.clone().boxed_clone());
        tokio::spawn(async move {
            let connection = auto::Builder::new(TokioExecutor::new());
            if let Err(e) = connection
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                eprintln!("connection error: {e}");
            }
        });
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str, default: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
            .unwrap_or_else(|| default.to_owned())
    };
    let store = tower_idempotency::SqliteStore::open(arg("--db", "hyper.sqlite3")).await?;
    let listener = tokio::net::TcpListener::bind(arg("--listen", "127.0.0.1:3001")).await?;
    println!("listening on http://{}", listener.local_addr()?);
    serve(listener, service(store, Arc::default())).await;
    Ok(())
}
