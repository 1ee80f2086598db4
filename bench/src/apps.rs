//! The servers under test: axum apps on 127.0.0.1 with an ephemeral port, run
//! on the server runtime, and the requests and checks each scenario uses.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::request::Parts;
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http::Request;
use http_body_util::Full;
use tokio::runtime::Runtime;
use tower_idempotency::rusqlite;
use tower_idempotency::store::{SqliteTransaction, Synchronous};
use tower_idempotency::{IdempotencyLayer, MemoryStore, SqliteStore};

/// The body every POST carries (52 bytes).
pub const REQUEST_BODY: &str = r#"{"account":"acct-1","amount":500,"currency":"EUR"}"#;

/// Handler runs, counted by every app's handler.
pub type Runs = Arc<AtomicU64>;

/// A running server; [`Server::stop`] shuts it down gracefully.
pub struct Server {
    pub addr: SocketAddr,
    shutdown: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    /// Serves `app` on the server runtime.
    pub fn start(rt: &Runtime, app: Router) -> Server {
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind 127.0.0.1:0");
            let addr = listener.local_addr().expect("local address");
            let (shutdown, stopped) = tokio::sync::oneshot::channel::<()>();
            let task = tokio::spawn(async move {
                axum::serve(listener, app)
                    .with_graceful_shutdown(async move {
                        let _ = stopped.await;
                    })
                    .await
                    .expect("serve");
            });
            Server {
                addr,
                shutdown,
                task,
            }
        })
    }

    /// Stops accepting, waits (at most 10 s) for open connections to end.
    pub fn stop(self, rt: &Runtime) {
        let _ = self.shutdown.send(());
        rt.block_on(async move {
            let _ = tokio::time::timeout(Duration::from_secs(10), self.task).await;
        });
    }
}

/// The handler every scenario runs: a ~110-byte JSON answer, 201 to a POST
/// and 200 to a GET.
async fn credit(State(runs): State<Runs>, method: Method, body: Bytes) -> Response {
    let n = runs.fetch_add(1, Ordering::Relaxed) + 1;
    let json = format!(
        r#"{{"credit_id":{n:010},"account":"acct-1","amount":500,"currency":"EUR","status":"credited","request_bytes":{}}}"#,
        body.len()
    );
    let status = if method == Method::GET {
        StatusCode::OK
    } else {
        StatusCode::CREATED
    };
    (status, [(header::CONTENT_TYPE, "application/json")], json).into_response()
}

/// The caller's scope, as the README's example takes it.
fn caller(parts: &Parts) -> String {
    parts
        .headers
        .get("x-user")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("anonymous")
        .to_owned()
}

fn routes() -> Router<Runs> {
    Router::new().route("/credits", post(credit).get(credit))
}

/// (a) No middleware at all.
pub fn bare(runs: Runs) -> Router {
    routes().with_state(runs)
}

/// The layer over `store` (separate mode, defaults otherwise).
pub fn layered<St: tower_idempotency::Store>(store: St, runs: Runs) -> Router {
    routes()
        .route_layer(IdempotencyLayer::new(store, caller))
        .with_state(runs)
}

/// The layer over a [`MemoryStore`] with a short TTL and a purge task (the
/// memory check); the task runs on the server runtime.
pub fn layered_memory_purged(
    rt: &Runtime,
    ttl: Duration,
    purge_every: Duration,
    runs: Runs,
) -> (Router, MemoryStore, tokio::task::JoinHandle<()>) {
    let store = MemoryStore::new();
    let purge = {
        let _guard = rt.enter();
        tower_idempotency::store::spawn_purge_task(store.clone(), purge_every)
    };
    let app = routes()
        .route_layer(IdempotencyLayer::new(store.clone(), caller).ttl(ttl))
        .with_state(runs);
    (app, store, purge)
}

pub fn sqlite_store(rt: &Runtime, path: &Path, synchronous: Synchronous) -> SqliteStore {
    let path = path.to_owned();
    rt.block_on(async move {
        SqliteStore::builder(&path)
            .synchronous(synchronous)
            .open()
            .await
            .expect("open the SQLite store")
    })
}

const LEDGER_SCHEMA: &str = "
CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL);
CREATE TABLE credits (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    account_id INTEGER NOT NULL REFERENCES accounts (id),
    amount INTEGER NOT NULL
);
INSERT INTO accounts (id, balance) VALUES (1, 0);
";

/// The amount each transactional credit adds.
pub const CREDIT_AMOUNT: i64 = 5;

/// (g) Transactional mode: the handler inserts a credit and updates the
/// account's balance through [`SqliteTransaction::run`]; the layer commits
/// them with the record. The ledger tables live in the store's file.
pub fn transactional(rt: &Runtime, path: &Path, synchronous: Synchronous) -> Router {
    let conn = rusqlite::Connection::open(path).expect("create the ledger file");
    conn.execute_batch(LEDGER_SCHEMA).expect("ledger schema");
    drop(conn);
    let store = sqlite_store(rt, path, synchronous);
    Router::new()
        .route("/credits", post(transactional_credit))
        .route_layer(IdempotencyLayer::new(store, caller).transactional())
}

async fn transactional_credit(tx: SqliteTransaction) -> Response {
    let written = tx
        .run(|tx| -> rusqlite::Result<(i64, i64)> {
            let id = tx.query_row(
                "INSERT INTO credits (account_id, amount) VALUES (1, ?1) RETURNING id",
                [CREDIT_AMOUNT],
                |r| r.get(0),
            )?;
            let balance = tx.query_row(
                "UPDATE accounts SET balance = balance + ?1 WHERE id = 1 RETURNING balance",
                [CREDIT_AMOUNT],
                |r| r.get(0),
            )?;
            Ok((id, balance))
        })
        .await;
    match written {
        Ok((id, balance)) => (
            StatusCode::CREATED,
            [(header::CONTENT_TYPE, "application/json")],
            format!(
                r#"{{"credit_id":{id:010},"account_id":1,"amount":{CREDIT_AMOUNT},"balance":{balance:012},"status":"credited"}}"#
            ),
        )
            .into_response(),
        Err(e) => e.into_response(),
    }
}

/// The ledger's credits and balance after a transactional run.
pub fn ledger_totals(path: &Path) -> (i64, i64) {
    let conn = rusqlite::Connection::open(path).expect("open the ledger file");
    conn.query_row(
        "SELECT (SELECT count(*) FROM credits), (SELECT balance FROM accounts WHERE id = 1)",
        [],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )
    .expect("read the ledger")
}

/// (h) axum-idempotent in its direct-key mode (the `Idempotency-Key` header,
/// optional), records in ruts sessions kept in a moka in-memory store. It
/// caches only for requests that carry a session, so `POST /login` opens one
/// and its cookie goes on every request.
pub fn axum_idempotent(runs: Runs) -> Router {
    use axum_idempotent::{IdempotentLayer, IdempotentOptions};
    use ruts::store::moka::MokaStore;
    use ruts::{CookieOptions, SessionLayer};

    let sessions = Arc::new(MokaStore::builder().build());
    let options = IdempotentOptions::default()
        .use_idempotency_key_header(Some("idempotency-key"), false)
        .expire_after(3600);
    Router::new()
        .route("/credits", post(credit).get(credit))
        .route("/login", post(login))
        .with_state(runs)
        .layer(IdempotentLayer::<MokaStore>::new(options))
        .layer(
            SessionLayer::new(sessions).with_cookie_options(
                CookieOptions::build()
                    .name("session")
                    .max_age(3600)
                    .path("/"),
            ),
        )
        .layer(tower_cookies::CookieManagerLayer::new())
}

async fn login(session: ruts::Session<ruts::store::moka::MokaStore>) -> StatusCode {
    let ttl = ruts::store::Ttl::new(3600).expect("a valid TTL");
    match session.set("user", &"bench".to_owned(), ttl, None).await {
        Ok(()) => StatusCode::NO_CONTENT,
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// A POST to `/credits` with the JSON body, the caller `alice`, and these
/// extra fields.
pub fn post_credit(fields: &[(&'static str, HeaderValue)]) -> Request<Full<Bytes>> {
    let mut request = Request::post("/credits")
        .header(header::HOST, "127.0.0.1")
        .header(header::CONTENT_TYPE, "application/json")
        .header("x-user", "alice");
    for (name, value) in fields {
        request = request.header(*name, value.clone());
    }
    request
        .body(Full::new(Bytes::from_static(REQUEST_BODY.as_bytes())))
        .expect("a valid request")
}

pub fn get_credit() -> Request<Full<Bytes>> {
    Request::get("/credits")
        .header(header::HOST, "127.0.0.1")
        .header("x-user", "alice")
        .body(Full::new(Bytes::new()))
        .expect("a valid request")
}

/// A quoted (RFC 9651 sf-string) key.
pub fn key(text: &str) -> HeaderValue {
    HeaderValue::from_str(&format!("\"{text}\"")).expect("a printable key")
}
