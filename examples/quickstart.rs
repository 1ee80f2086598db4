use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::http::StatusCode;
use axum::{Json, Router, extract::Request, middleware::Next, response::Response, routing::post};
use serde::Deserialize;
use tower_idempotency::{IdempotencyLayer, SqliteStore, scope};

/// The caller, as your authentication established it; its `Display` is the scope.
#[derive(Clone)]
struct Caller(String);

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "user:{}", self.0)
    }
}

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

#[derive(Deserialize)]
struct NewOrder {
    item: String,
    quantity: u32,
}

static ORDERS: AtomicU64 = AtomicU64::new(0);

/// A body that `Json` refuses (422, 415, 400) is answered and not stored,
/// so the corrected request may keep its key.
async fn new_order(Json(order): Json<NewOrder>) -> (StatusCode, String) {
    let n = ORDERS.fetch_add(1, Ordering::SeqCst) + 1;
    let body = format!("order {n}: {} x {}\n", order.quantity, order.item);
    (StatusCode::CREATED, body)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The causes of 500s and 503s are logged here, never sent to the client.
    tracing_subscriber::fmt::init();
    let store = SqliteStore::open("quickstart.sqlite3").await?;
    // Keys belong to the authenticated caller; a request with a key and no
    // `Caller` would get 401, never a shared scope.
    let idempotency = IdempotencyLayer::new(store, scope::extension::<Caller>()).require_key(true);
    let app = Router::new()
        .route("/orders", post(new_order))
        .route_layer(idempotency) // added first: inside, runs second
        .route_layer(axum::middleware::from_fn(authenticate)); // added last: outside, runs first
    let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
    println!("listening on http://127.0.0.1:8080");
    axum::serve(listener, app).await?;
    Ok(())
}
