//! Replays by response size: `POST /layer/{bytes}` answers `bytes` bytes
//! kept in memory under [`IdempotencyLayer`] (a [`SqliteStore`] set up as
//! the ledger example sets up its own: WAL, `synchronous = FULL`, a replay
//! cache of 1,024 records), and `POST /naive/{bytes}` answers the same bytes
//! without the layer: the handler a user would write without us.
//!
//! ```text
//! replay-size --db PATH [--listen ADDR]
//! ```
//!
//! The first request with a key runs the handler and stores its answer;
//! every repeat is a replay read back from the store (or its cache: records
//! over 64 KiB are never cached, so the 1 MiB replays read SQLite each time).
//! Prints `listening on http://HOST:PORT` once it accepts connections.

use std::net::SocketAddr;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::post;
use tower_idempotency::{IdempotencyLayer, SqliteStore, scope};

/// The largest response served, in bytes (1 MiB).
const MAX: usize = 1024 * 1024;

async fn blob(State(bytes): State<Bytes>, Path(n): Path<usize>) -> Result<Bytes, StatusCode> {
    if n > MAX {
        return Err(StatusCode::BAD_REQUEST);
    }
    Ok(bytes.slice(..n))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (mut db, mut listen) = (None, SocketAddr::from(([127, 0, 0, 1], 0)));
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--db" => db = Some(value),
            "--listen" => listen = value.parse()?,
            _ => return Err(format!("unknown flag {flag}").into()),
        }
    }
    let db = db.ok_or("--db PATH is required")?;
    // Printable bytes, so that a reader of one answer sees what it got.
    let bytes: Bytes = (0..MAX).map(|i| b'a' + (i % 26) as u8).collect::<Vec<u8>>().into();
    let store = SqliteStore::builder(&db)
        .replay_cache(1024)
        .replay_cache_bytes(16 << 20)
        .open()
        .await?;
    let layer = IdempotencyLayer::new(store, scope::header("x-user"))
        .require_key(true)
        .max_response_body(MAX);
    let app = Router::new()
        .route("/layer/{bytes}", post(blob).route_layer(layer))
        .route("/naive/{bytes}", post(blob))
        .with_state(bytes);
    let listener = tokio::net::TcpListener::bind(listen).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
