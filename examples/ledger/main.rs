//! The ledger: an axum service that credits accounts, where a credit
//! delivered twice must be applied once.
//!
//! ```text
//! cargo run --example ledger -- [--db PATH] [--mode transactional|separate] [--listen ADDR]
//!     [--lease-secs N] [--fault-injection] [--admin-listen ADDR]
//! ```
//!
//! `--admin-listen ADDR` (a build with `--features admin`) also serves
//! `tower_idempotency::admin::router` over the idempotency store on a second
//! listener: stuck records, counts, purge. It has no authentication: give it
//! a loopback address, never the public one.
//!
//! The contract it keeps is `examples/ledger/README.md`; `check_ledger.py`
//! drives it over real HTTP.

mod db;
#[cfg(feature = "postgres")]
mod pg;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use tower_idempotency::store::{Inspect, SqliteTransaction, Store, TransactionalStore};
use tower_idempotency::{IdempotencyLayer, SqliteStore};

use db::{LedgerError, Op, SqliteDb};

const USAGE: &str = "usage: ledger [--db PATH] [--mode transactional|separate] \
[--listen ADDR] [--lease-secs N] [--fault-injection] [--admin-listen ADDR]";

/// When the idempotency record is written (see `tower_idempotency::mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The credit, the record and the stored response in one commit.
    Transactional,
    /// The credit commits, then the record is completed in a second write.
    Separate,
}

#[derive(Debug)]
struct Args {
    db: PathBuf,
    /// `None`: transactional wherever the store supports it.
    mode: Option<Mode>,
    key_store: Option<String>,
    listen: SocketAddr,
    lease: Option<Duration>,
    fault_injection: bool,
    /// Where the operators' admin router listens; `None`: not served.
    admin_listen: Option<SocketAddr>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        db: PathBuf::from("ledger.sqlite3"),
        mode: None,
        key_store: None,
        listen: SocketAddr::from(([127, 0, 0, 1], 3000)),
        lease: None,
        fault_injection: false,
        admin_listen: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        // Accept both `--flag value` and `--flag=value`.
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) => (f.to_owned(), Some(v.to_owned())),
            None => (arg.clone(), None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| it.next())
                .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))
        };
        match flag.as_str() {
            "--db" => {
                let db = value()?;
                let postgres = db.starts_with("postgres://") || db.starts_with("postgresql://");
                if postgres && !cfg!(feature = "postgres") {
                    return Err(
                        "--db postgres://... needs a build with `--features postgres`".into(),
                    );
                }
                args.db = PathBuf::from(db);
            }
            "--key-store" => {
                let url = value()?;
                if !url.starts_with("redis://") {
                    return Err(format!(
                        "--key-store {url}: only redis:// URLs are supported"
                    ));
                }
                if !cfg!(feature = "redis") {
                    return Err(
                        "--key-store redis://... needs a build with `--features redis`".into(),
                    );
                }
                args.key_store = Some(url);
            }
            "--mode" => {
                args.mode = match value()?.as_str() {
                    "separate" => Some(Mode::Separate),
                    "transactional" => Some(Mode::Transactional),
                    other => return Err(format!("unknown --mode {other:?}\n{USAGE}")),
                }
            }
            "--listen" => {
                args.listen = value()?
                    .parse()
                    .map_err(|e| format!("--listen: {e}\n{USAGE}"))?;
            }
            "--lease-secs" => {
                let secs: u64 = value()?
                    .parse()
                    .map_err(|e| format!("--lease-secs: {e}\n{USAGE}"))?;
                if secs == 0 {
                    return Err("--lease-secs must be at least 1".into());
                }
                args.lease = Some(Duration::from_secs(secs));
            }
            "--fault-injection" => args.fault_injection = true,
            "--admin-listen" => {
                let addr = value()?;
                if !cfg!(feature = "admin") {
                    return Err("--admin-listen needs a build with `--features admin`".into());
                }
                args.admin_listen = Some(
                    addr.parse()
                        .map_err(|e| format!("--admin-listen: {e}\n{USAGE}"))?,
                );
            }
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if args.key_store.is_some() && args.mode == Some(Mode::Transactional) {
        return Err("--mode transactional needs the records in the --db database; with --key-store only --mode separate is possible".into());
    }
    Ok(args)
}

/// The ledger's own tables: in the SQLite file, or in PostgreSQL.
#[derive(Clone)]
enum Db {
    Sqlite(SqliteDb),
    #[cfg(feature = "postgres")]
    Postgres(pg::PgDb),
}

impl Db {
    async fn account(&self, id: i64) -> Result<db::Account, LedgerError> {
        match self {
            Db::Sqlite(db) => db.account(id).await,
            #[cfg(feature = "postgres")]
            Db::Postgres(db) => db.account(id).await,
        }
    }

    /// Runs `op` in a transaction of its own (separate mode).
    async fn in_transaction(&self, op: Op) -> Result<db::Json, LedgerError> {
        match self {
            Db::Sqlite(db) => db.in_transaction(move |conn| op.on_sqlite(conn)).await,
            #[cfg(feature = "postgres")]
            Db::Postgres(db) => db.in_transaction(op).await,
        }
    }
}

/// The request's idempotency transaction, if the layer opened one.
enum Tx {
    None,
    Sqlite(SqliteTransaction),
    #[cfg(feature = "postgres")]
    Postgres(tower_idempotency::store::PostgresTransaction),
}

impl<S: Sync> axum::extract::FromRequestParts<S> for Tx {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        #[cfg(feature = "postgres")]
        if let Some(tx) = parts
            .extensions
            .get::<tower_idempotency::store::PostgresTransaction>()
        {
            return Ok(Tx::Postgres(tx.clone()));
        }
        Ok(match parts.extensions.get::<SqliteTransaction>() {
            Some(tx) => Tx::Sqlite(tx.clone()),
            None => Tx::None,
        })
    }
}

#[derive(Clone)]
struct AppState {
    db: Db,
    mode: Mode,
    fault_injection: bool,
}

/// Keys are scoped per caller: `Authorization: Bearer <token>` names the
/// caller (a stand-in for real authentication; the scheme is
/// case-insensitive, RFC 9110 §11.1). Only a request without the header is
/// `anonymous`; any other value is a caller of its own, so that no malformed
/// header can share anonymous's records.
///
/// The scope is a SHA-256 of the credential (first 16 bytes, hex), never the
/// credential itself: scopes are stored with every record, appear in the
/// `idempotency` span and in the admin router's answers.
fn caller(parts: &Parts) -> String {
    use sha2::{Digest, Sha256};
    let Some(value) = parts.headers.get("authorization") else {
        return "anonymous".to_owned();
    };
    let bytes = value.as_bytes();
    let (kind, credential) = match bytes.get(..7) {
        Some(scheme) if scheme.eq_ignore_ascii_case(b"bearer ") => {
            ("bearer", bytes[7..].trim_ascii())
        }
        _ => ("authorization", bytes),
    };
    format!("{kind}:{}", hex(&Sha256::digest(credential)[..16]))
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[usize::from(b >> 4)] as char);
        out.push(DIGITS[usize::from(b & 15)] as char);
    }
    out
}

/// The idempotency layer: a key is required, keys are scoped per caller.
fn idempotency<St: Store>(
    store: St,
    lease: Option<Duration>,
) -> IdempotencyLayer<St, fn(&Parts) -> String> {
    let layer = IdempotencyLayer::new(store, caller as fn(&Parts) -> String).require_key(true);
    match lease {
        Some(lease) => layer.lease(lease),
        None => layer,
    }
}

/// The POST routes, to be put behind the layer: a POST to a GET-only path is
/// then a plain 405, not a missing-key 400.
fn writes() -> Router<AppState> {
    Router::new()
        .route("/accounts", post(create_account))
        .route("/accounts/{id}/credits", post(credit))
}

/// The writes behind a store that offers both modes.
fn layered<St: TransactionalStore>(
    mode: Mode,
    store: St,
    lease: Option<Duration>,
) -> Router<AppState> {
    match mode {
        Mode::Transactional => writes().route_layer(idempotency(store, lease).transactional()),
        Mode::Separate => writes().route_layer(idempotency(store, lease)),
    }
}

fn app(state: AppState, writes: Router<AppState>) -> Router {
    Router::new()
        .route("/accounts/{id}", get(account))
        .merge(writes)
        .fallback(|| async { problem(StatusCode::NOT_FOUND, "Not Found", "no such resource") })
        .method_not_allowed_fallback(|| async {
            problem(
                StatusCode::METHOD_NOT_ALLOWED,
                "Method Not Allowed",
                "this resource does not accept that method",
            )
        })
        .with_state(state)
}

/// Runs one write: inside the idempotency transaction, or in a transaction of
/// its own. Either way the op failing rolls its writes back.
async fn write(state: &AppState, tx: Tx, op: Op) -> Result<db::Json, ApiError> {
    let sql_error =
        |e: tower_idempotency::store::TransactionError| LedgerError::Database(Box::new(e));
    match (state.mode, tx) {
        (Mode::Separate, _) => Ok(state.db.in_transaction(op).await?),
        // An `Err` makes the handler answer 4xx/5xx; the layer then rolls the
        // transaction back or commits the refusal with its record.
        // The op's own error (a ledger refusal) travels inside the `Ok`.
        (Mode::Transactional, Tx::Sqlite(tx)) => Ok(tx
            .run(move |tx| Ok(op.on_sqlite(tx)))
            .await
            .map_err(sql_error)??),
        #[cfg(feature = "postgres")]
        (Mode::Transactional, Tx::Postgres(tx)) => {
            let client = tx
                .client()
                .await
                .map_err(|e| LedgerError::Database(Box::new(e)))?;
            Ok(op.on_postgres(&*client).await?)
        }
        (Mode::Transactional, Tx::None) => Err(ApiError::Ledger(LedgerError::Database(
            "no idempotency transaction for this request".into(),
        ))),
    }
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,tower_idempotency=info".into()),
        )
        .init();
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(args).await {
        eprintln!("ledger: {e}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let listener = tokio::net::TcpListener::bind(args.listen).await?;
    let admin_listener = match args.admin_listen {
        Some(addr) => Some(tokio::net::TcpListener::bind(addr).await?),
        None => None,
    };
    let url = args.db.to_string_lossy().into_owned();
    let postgres = url.starts_with("postgres://") || url.starts_with("postgresql://");
    let mode = args.mode.unwrap_or(if args.key_store.is_some() {
        Mode::Separate
    } else {
        Mode::Transactional
    });
    let (db, (writes, admin)) = if postgres {
        postgres_app(&url, mode, &args).await?
    } else {
        let db = Db::Sqlite(SqliteDb::open(&args.db).await?);
        let writes = match &args.key_store {
            Some(redis) => redis_writes(redis, &args).await?,
            None => {
                // Credits are short and rarely fail: let up to 32 run their
                // SQL back to back in one batch; replays from memory (see
                // BENCHMARKS.md).
                let store = SqliteStore::builder(&args.db)
                    .concurrent_transactions(32)
                    .replay_cache(1024)
                    .open()
                    .await?;
                let admin = admin_router(&store, &args);
                (layered(mode, store, args.lease), admin)
            }
        };
        (db, writes)
    };
    let state = AppState {
        db,
        mode,
        fault_injection: args.fault_injection,
    };
    let addr = listener.local_addr()?;
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on http://{addr}")?;
        if let Some(admin) = &admin_listener {
            // Printed after the line above, which clients wait for.
            writeln!(out, "admin router on http://{}", admin.local_addr()?)?;
        }
        out.flush()?;
    }
    let public = axum::serve(listener, app(state, writes));
    match (admin_listener, admin) {
        (Some(admin_listener), Some(admin)) => {
            // Either server failing ends the process.
            tokio::try_join!(async { public.await }, async {
                axum::serve(admin_listener, admin).await
            },)?;
        }
        _ => public.await?,
    }
    Ok(())
}

/// The routes behind the layer, and the admin router if one was asked for.
type Writes = (Router<AppState>, Option<Router>);
type Built = (Db, Writes);

/// The operators' router over `store`, when `--admin-listen` asked for one
/// (only a build with `--features admin` accepts the flag).
#[cfg(feature = "admin")]
fn admin_router<St: Inspect>(store: &St, args: &Args) -> Option<Router> {
    args.admin_listen
        .map(|_| tower_idempotency::admin::router(store.clone()))
}

#[cfg(not(feature = "admin"))]
fn admin_router<St: Inspect>(_: &St, _: &Args) -> Option<Router> {
    None
}

#[cfg(feature = "postgres")]
async fn postgres_app(
    url: &str,
    mode: Mode,
    args: &Args,
) -> Result<Built, Box<dyn std::error::Error>> {
    let store = tower_idempotency::PostgresStore::open(url).await?;
    let db = Db::Postgres(pg::PgDb::open(store.pool().clone()).await?);
    let writes = match &args.key_store {
        Some(redis) => redis_writes(redis, args).await?,
        None => {
            let admin = admin_router(&store, args);
            (layered(mode, store, args.lease), admin)
        }
    };
    Ok((db, writes))
}

#[cfg(not(feature = "postgres"))]
async fn postgres_app(_: &str, _: Mode, _: &Args) -> Result<Built, Box<dyn std::error::Error>> {
    Err("this build has no PostgreSQL store: build with `--features postgres`".into())
}

/// Records in Redis, the ledger's data in --db: separate mode only.
#[cfg(feature = "redis")]
async fn redis_writes(url: &str, args: &Args) -> Result<Writes, Box<dyn std::error::Error>> {
    let store = tower_idempotency::RedisStore::open(url).await?;
    let admin = admin_router(&store, args);
    Ok((writes().route_layer(idempotency(store, args.lease)), admin))
}

#[cfg(not(feature = "redis"))]
async fn redis_writes(_: &str, _: &Args) -> Result<Writes, Box<dyn std::error::Error>> {
    Err("this build has no Redis store: build with `--features redis`".into())
}

// ------------------------------------------------------------------ handlers

#[derive(Deserialize)]
struct NewAccount {
    name: String,
}

#[derive(Deserialize)]
struct NewCredit {
    amount: i64,
}

/// A `application/problem+json` answer (RFC 9457).
fn problem(status: StatusCode, title: &str, detail: impl Into<String>) -> Response {
    let body = serde_json::json!({
        "type": "about:blank",
        "title": title,
        "status": status.as_u16(),
        "detail": detail.into(),
    });
    (
        status,
        [("content-type", "application/problem+json")],
        body.to_string(),
    )
        .into_response()
}

/// Why a request failed; each answers with a problem.
enum ApiError {
    BadRequest(String),
    Ledger(LedgerError),
}

impl From<LedgerError> for ApiError {
    fn from(e: LedgerError) -> Self {
        ApiError::Ledger(e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            ApiError::BadRequest(detail) => problem(StatusCode::BAD_REQUEST, "Bad Request", detail),
            ApiError::Ledger(e) => e.into_response(),
        }
    }
}

fn created(body: db::Json) -> Response {
    (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        body.0,
    )
        .into_response()
}

impl IntoResponse for LedgerError {
    fn into_response(self) -> Response {
        match self {
            LedgerError::NoSuchAccount => {
                problem(StatusCode::NOT_FOUND, "Not Found", "no such account")
            }
            LedgerError::InjectedFailure => problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Internal Server Error",
                "injected failure after the credit was written; the transaction was rolled back",
            ),
            LedgerError::Database(e) => {
                tracing::error!(error = %e, "ledger database error");
                problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "Service Unavailable",
                    "the ledger database could not be reached",
                )
            }
        }
    }
}

/// A fault-injection delay header, in milliseconds (0..=30000).
fn delay(state: &AppState, headers: &HeaderMap, name: &str) -> Result<Duration, ApiError> {
    let Some(value) = headers.get(name).filter(|_| state.fault_injection) else {
        return Ok(Duration::ZERO);
    };
    value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|ms| *ms <= 30_000)
        .map(Duration::from_millis)
        .ok_or_else(|| ApiError::BadRequest(format!("{name} must be an integer in 0..=30000")))
}

fn parse_json<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::BadRequest(format!("invalid JSON body: {e}")))
}

/// An id that is not an integer names no account.
fn parse_id(id: &str) -> Result<i64, ApiError> {
    id.parse()
        .map_err(|_| ApiError::Ledger(LedgerError::NoSuchAccount))
}

async fn create_account(
    State(state): State<AppState>,
    tx: Tx,
    body: Bytes,
) -> Result<Response, ApiError> {
    let new: NewAccount = parse_json(&body)?;
    if !(1..=100).contains(&new.name.chars().count()) || new.name.contains('\0') {
        return Err(ApiError::BadRequest(
            "name must be 1 to 100 characters, without NUL".into(),
        ));
    }
    let account = write(&state, tx, Op::CreateAccount { name: new.name }).await?;
    Ok(created(account))
}

async fn account(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let account = state.db.account(parse_id(&id)?).await?;
    Ok(axum::Json(account).into_response())
}

async fn credit(
    State(state): State<AppState>,
    Path(id): Path<String>,
    tx: Tx,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let id = parse_id(&id)?;
    let new: NewCredit = parse_json(&body)?;
    if !(1..=1_000_000_000).contains(&new.amount) {
        return Err(ApiError::BadRequest(
            "amount must be an integer in 1..=1000000000".into(),
        ));
    }
    let before = delay(&state, &headers, "x-ledger-delay-ms")?;
    let after_effect = delay(&state, &headers, "x-ledger-pause-after-effect-ms")?;
    let fail_after_effect = state.fault_injection
        && headers
            .get("x-ledger-fail")
            .is_some_and(|v| v.as_bytes() == b"after-effect");
    pause(before).await;
    let op = Op::Credit {
        account_id: id,
        amount: new.amount,
        fail_after_effect,
    };
    let credit = write(&state, tx, op).await?;
    // Separate mode: the credit is committed. Transactional mode: it commits
    // with the record once this response is returned.
    pause(after_effect).await;
    Ok(created(credit))
}

/// Sleeps for a fault-injection delay, and not at all when it is zero: Tokio's
/// timer rounds up to its 1 ms tick, so even a zero sleep can cost a
/// millisecond, and in transactional mode this runs while the request holds
/// the SQLite writer, which would serialise every credit behind it.
async fn pause(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}
