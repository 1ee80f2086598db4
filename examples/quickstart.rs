use std::sync::atomic::{AtomicU64, Ordering};

use axum::http::{StatusCode, request::Parts};
use axum::{Router, extract::Request, middleware::Next, response::Response, routing::post};
use tower_idempotency::{IdempotencyLayer, SqliteStore};

/// The caller, as your authentication established it.
#[derive(Clone)]
struct Caller(String);

/// A stand-in for real authentication: trusts `x-user-id` and refuses a request
/// without it (401), so no request reaches the layer without a caller.
async fn authenticate(mut request: Request, next: Next) -> Result<Response, StatusCode> {
    let id = request
        .headers()
        .get("x-user-id")
        .and_then(|v| v.to_str().ok());
    let caller = Caller(id.ok_or(StatusCode::UNAUTHORIZED)?.to_owned());
    request.extensions_mut().insert(caller);
    Ok(next.run(request).await)
}

/// The scope: keys belong to the authenticated caller, never to a shared value.
fn caller_scope(parts: &Parts) -> String {
    match parts.extensions.get::<Caller>() {
        Some(Caller(id)) => format!("user:{id}"),
        // Not reached behind `authenticate`; were it, a scope of its own that no
        // other request shares, so it could replay nothing.
        None => format!(
            "none:{:016x}",
            tower_idempotency::store::FencingToken::random().0
        ),
    }
}

static ORDERS: AtomicU64 = AtomicU64::new(0);

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store = SqliteStore::open("quickstart.sqlite3").await?;
    let app = Router::new()
        .route(
            "/orders",
            post(|| async {
                let n = ORDERS.fetch_add(1, Ordering::SeqCst) + 1;
                (StatusCode::CREATED, format!("order {n}\n"))
            }),
        )
        .route_layer(IdempotencyLayer::new(store, caller_scope).require_key(true))
        .route_layer(axum::middleware::from_fn(authenticate)); // outside: runs first
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    println!("listening on http://127.0.0.1:3000");
    axum::serve(listener, app).await?;
    Ok(())
}
