//! The ledger: an axum service that credits accounts, where a credit
//! delivered twice must be applied once.
//!
//! ```text
//! cargo run --example ledger -- [--db PATH|postgres://...|mysql://...] [--db-driver rusqlite|sqlx]
//!     [--mode transactional|separate] [--listen ADDR] [--lease-secs N] [--fault-injection]
//!     [--admin-listen ADDR]
//! ```
//!
//! `--db-driver sqlx` with a `postgres://` `--db` (a build with `--features
//! sqlx-postgres`) runs the ledger and its records on one `sqlx::PgPool`
//! through `SqlxPostgresStore` (`sqlx_pg.rs`) instead of tokio-postgres.
//!
//! `--admin-listen ADDR` (a build with `--features admin`) also serves
//! `tower_idempotency::admin::router` over the idempotency store on a second
//! listener: stuck records, counts, purge. It has no authentication: give it
//! a loopback address, never the public one.
//!
//! `--db-driver sqlx` (a build with `--features sqlx-sqlite`) runs a SQLite
//! `--db` through one `sqlx::SqlitePool` with `SqlxSqliteStore`, in either
//! mode (`sqlx_sqlite.rs`); the default is rusqlite with `SqliteStore`.
//!
//! The contract it keeps is `examples/ledger/README.md`; `check_ledger.py`
//! drives it over real HTTP.

mod db;
#[cfg(feature = "mysql")]
mod mysql;
mod notify;
#[cfg(feature = "postgres")]
mod pg;
#[cfg(feature = "sqlx-postgres")]
mod sqlx_pg;
#[cfg(feature = "sqlx-sqlite")]
mod sqlx_sqlite;

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

const USAGE: &str = "usage: ledger [--db PATH] [--db-driver rusqlite|sqlx] \
[--mode transactional|separate] [--key-store URL[,URL...]] [--key-store-ca PEM-PATH] [--listen ADDR] \
[--lease-secs N] [--fault-injection] [--admin-listen ADDR] [--notify-url URL]";

/// When the idempotency record is written (see `tower_idempotency::mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The credit, the record and the stored response in one commit.
    Transactional,
    /// The credit commits, then the record is completed in a second write.
    Separate,
}

/// Which client library talks to the --db database.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Driver {
    /// rusqlite for a SQLite path (tokio-postgres for a URL): the default.
    Native,
    /// The app's own sqlx pool (`SqlxSqliteStore` for a SQLite path).
    Sqlx,
}

#[derive(Debug)]
struct Args {
    db: PathBuf,
    driver: Driver,
    /// `None`: transactional wherever the store supports it.
    mode: Option<Mode>,
    /// One Redis URL, or a cluster's seed URLs separated by commas.
    key_store: Option<String>,
    /// The CA (PEM file) a `rediss://` key store's certificate chains to.
    key_store_ca: Option<PathBuf>,
    listen: SocketAddr,
    lease: Option<Duration>,
    fault_injection: bool,
    /// Where the operators' admin router listens; `None`: not served.
    admin_listen: Option<SocketAddr>,
    /// Where credits are notified (`notify.rs`); `None`: not at all.
    notify_url: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        db: PathBuf::from("ledger.sqlite3"),
        driver: Driver::Native,
        mode: None,
        key_store: None,
        key_store_ca: None,
        listen: SocketAddr::from(([127, 0, 0, 1], 3000)),
        lease: None,
        fault_injection: false,
        admin_listen: None,
        notify_url: None,
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
                args.db = PathBuf::from(value()?);
            }
            "--db-driver" => {
                args.driver = match value()?.as_str() {
                    "rusqlite" => Driver::Native,
                    "sqlx" => Driver::Sqlx,
                    other => return Err(format!("unknown --db-driver {other:?}\n{USAGE}")),
                }
            }
            "--key-store" => {
                let urls = value()?;
                for url in urls.split(',') {
                    if !url.starts_with("redis://") && !url.starts_with("rediss://") {
                        return Err(format!(
                            "--key-store {url}: only redis:// and rediss:// URLs are supported"
                        ));
                    }
                    if url.starts_with("rediss://") && !cfg!(feature = "redis-tls") {
                        return Err(
                            "--key-store rediss://... needs a build with `--features redis-tls`"
                                .into(),
                        );
                    }
                }
                if !cfg!(feature = "redis") {
                    return Err(
                        "--key-store redis://... needs a build with `--features redis`".into(),
                    );
                }
                args.key_store = Some(urls);
            }
            "--key-store-ca" => {
                if !cfg!(feature = "redis-tls") {
                    return Err("--key-store-ca needs a build with `--features redis-tls`".into());
                }
                args.key_store_ca = Some(PathBuf::from(value()?));
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
            "--notify-url" => args.notify_url = Some(notify::parse_url(&value()?)?),
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    let url = args.db.to_string_lossy();
    let postgres = url.starts_with("postgres://") || url.starts_with("postgresql://");
    let sqlx = args.driver == Driver::Sqlx;
    if url.starts_with("mysql://") && !cfg!(feature = "mysql") {
        return Err("--db mysql://... needs a build with `--features mysql`".into());
    }
    if postgres && !sqlx && !cfg!(feature = "postgres") {
        return Err("--db postgres://... needs a build with `--features postgres`".into());
    }
    if postgres && sqlx && !cfg!(feature = "sqlx-postgres") {
        return Err(
            "--db postgres://... --db-driver sqlx needs a build with `--features sqlx-postgres`"
                .into(),
        );
    }
    if sqlx && !postgres && !cfg!(feature = "sqlx-sqlite") {
        return Err(
            "--db-driver sqlx with a SQLite path needs a build with `--features sqlx-sqlite`"
                .into(),
        );
    }
    if args.key_store_ca.is_some() && args.key_store.is_none() {
        return Err("--key-store-ca needs --key-store rediss://...".into());
    }
    if args.key_store.is_some() && args.mode == Some(Mode::Transactional) {
        return Err("--mode transactional needs the records in the --db database; with --key-store only --mode separate is possible".into());
    }
    if args.notify_url.is_some() && (sqlx || url.starts_with("mysql://")) {
        return Err(
            "--notify-url works with the default drivers on SQLite and PostgreSQL only".into(),
        );
    }
    if args.notify_url.is_some() && (args.mode == Some(Mode::Separate) || args.key_store.is_some())
    {
        return Err(
            "--notify-url needs --mode transactional: a notification commits with its credit"
                .into(),
        );
    }
    Ok(args)
}

/// A sqlx error is a database error of the ledger (any sqlx driver).
#[cfg(any(feature = "sqlx-postgres", feature = "sqlx-sqlite", feature = "mysql"))]
impl From<sqlx::Error> for LedgerError {
    fn from(e: sqlx::Error) -> Self {
        LedgerError::Database(Box::new(e))
    }
}

/// The ledger's own tables: in the SQLite file, or in PostgreSQL.
#[derive(Clone)]
enum Db {
    Sqlite(SqliteDb),
    #[cfg(feature = "postgres")]
    Postgres(pg::PgDb),
    #[cfg(feature = "sqlx-postgres")]
    SqlxPg(sqlx_pg::SqlxPgDb),
    #[cfg(feature = "sqlx-sqlite")]
    SqlxSqlite(sqlx_sqlite::SqlxDb),
    #[cfg(feature = "mysql")]
    MySql(mysql::MyDb),
}

impl Db {
    async fn account(&self, id: i64) -> Result<db::Account, LedgerError> {
        match self {
            Db::Sqlite(db) => db.account(id).await,
            #[cfg(feature = "postgres")]
            Db::Postgres(db) => db.account(id).await,
            #[cfg(feature = "sqlx-postgres")]
            Db::SqlxPg(db) => db.account(id).await,
            #[cfg(feature = "sqlx-sqlite")]
            Db::SqlxSqlite(db) => db.account(id).await,
            #[cfg(feature = "mysql")]
            Db::MySql(db) => db.account(id).await,
        }
    }

    /// Runs `op` in a transaction of its own (separate mode).
    async fn in_transaction(&self, op: Op) -> Result<db::Json, LedgerError> {
        match self {
            Db::Sqlite(db) => db.in_transaction(move |conn| op.on_sqlite(conn)).await,
            #[cfg(feature = "postgres")]
            Db::Postgres(db) => db.in_transaction(op).await,
            #[cfg(feature = "sqlx-postgres")]
            Db::SqlxPg(db) => db.in_transaction(op).await,
            #[cfg(feature = "sqlx-sqlite")]
            Db::SqlxSqlite(db) => db.in_transaction(op).await,
            #[cfg(feature = "mysql")]
            Db::MySql(db) => db.in_transaction(op).await,
        }
    }
}

/// The request's idempotency transaction, if the layer opened one.
enum Tx {
    None,
    Sqlite(SqliteTransaction),
    #[cfg(feature = "postgres")]
    Postgres(tower_idempotency::store::PostgresTransaction),
    #[cfg(feature = "sqlx-postgres")]
    SqlxPg(tower_idempotency::store::SqlxPostgresTransaction),
    #[cfg(feature = "sqlx-sqlite")]
    SqlxSqlite(tower_idempotency::store::SqlxSqliteTransaction),
    #[cfg(feature = "mysql")]
    MySql(tower_idempotency::store::MySqlTransaction),
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
        #[cfg(feature = "sqlx-postgres")]
        if let Some(tx) = parts
            .extensions
            .get::<tower_idempotency::store::SqlxPostgresTransaction>()
        {
            return Ok(Tx::SqlxPg(tx.clone()));
        }
        #[cfg(feature = "sqlx-sqlite")]
        if let Some(tx) = parts
            .extensions
            .get::<tower_idempotency::store::SqlxSqliteTransaction>()
        {
            return Ok(Tx::SqlxSqlite(tx.clone()));
        }
        #[cfg(feature = "mysql")]
        if let Some(tx) = parts
            .extensions
            .get::<tower_idempotency::store::MySqlTransaction>()
        {
            return Ok(Tx::MySql(tx.clone()));
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
    notify: Option<notify::Notifier>,
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
        #[cfg(feature = "sqlx-postgres")]
        (Mode::Transactional, Tx::SqlxPg(tx)) => Ok(sqlx_pg::in_idempotency_tx(&tx, op).await?),
        #[cfg(feature = "sqlx-sqlite")]
        (Mode::Transactional, Tx::SqlxSqlite(tx)) => Ok(sqlx_sqlite::in_request(&tx, op).await?),
        #[cfg(feature = "mysql")]
        (Mode::Transactional, Tx::MySql(tx)) => {
            let mut conn = tx
                .connection()
                .await
                .map_err(|e| LedgerError::Database(Box::new(e)))?;
            Ok(op.on_mysql(&mut conn).await?)
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
    let (db, (writes, admin)) = if postgres && args.driver == Driver::Sqlx {
        sqlx_postgres_app(&url, mode, &args).await?
    } else if postgres {
        postgres_app(&url, mode, &args).await?
    } else if url.starts_with("mysql://") {
        mysql_app(&url, mode, &args).await?
    } else if args.driver == Driver::Sqlx {
        sqlx_sqlite_app(&args, mode).await?
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
    let notify = match args.notify_url.clone() {
        Some(notify_url) => Some(notify::start(notify_url, &url, postgres).await?),
        None => None,
    };
    let state = AppState {
        db,
        mode,
        fault_injection: args.fault_injection,
        notify,
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
    let lease = args
        .lease
        .unwrap_or(tower_idempotency::store::DEFAULT_LEASE);
    let db = Db::Postgres(pg::PgDb::open(store.pool().clone(), lease / 2).await?);
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

#[cfg(feature = "sqlx-postgres")]
use sqlx_pg::app as sqlx_postgres_app;

#[cfg(not(feature = "sqlx-postgres"))]
async fn sqlx_postgres_app(
    _: &str,
    _: Mode,
    _: &Args,
) -> Result<Built, Box<dyn std::error::Error>> {
    Err("this build has no sqlx PostgreSQL store: build with `--features sqlx-postgres`".into())
}

#[cfg(feature = "sqlx-sqlite")]
async fn sqlx_sqlite_app(args: &Args, mode: Mode) -> Result<Built, Box<dyn std::error::Error>> {
    sqlx_sqlite::app(&args.db, mode, args).await
}

#[cfg(not(feature = "sqlx-sqlite"))]
async fn sqlx_sqlite_app(_: &Args, _: Mode) -> Result<Built, Box<dyn std::error::Error>> {
    Err("--db-driver sqlx with a SQLite path needs a build with `--features sqlx-sqlite`".into())
}

#[cfg(feature = "mysql")]
use mysql::mysql_app;

#[cfg(not(feature = "mysql"))]
async fn mysql_app(_: &str, _: Mode, _: &Args) -> Result<Built, Box<dyn std::error::Error>> {
    Err("this build has no MySQL store: build with `--features mysql`".into())
}

/// Records in Redis (one server, or a cluster through its seeds), the
/// ledger's data in --db: separate mode only.
#[cfg(feature = "redis")]
async fn redis_writes(urls: &str, args: &Args) -> Result<Writes, Box<dyn std::error::Error>> {
    use tower_idempotency::RedisStore;
    let seeds: Vec<&str> = urls.split(',').collect();
    let builder = match seeds[..] {
        [url] => RedisStore::builder(url),
        _ => RedisStore::cluster_builder(seeds),
    };
    #[cfg(feature = "redis-tls")]
    let builder = match &args.key_store_ca {
        Some(path) => builder.ca_certificate(
            std::fs::read(path).map_err(|e| format!("--key-store-ca {}: {e}", path.display()))?,
        ),
        None => builder,
    };
    // An evicting maxmemory-policy is refused here (the message names it).
    let store = builder
        .open()
        .await
        .map_err(|e| format!("--key-store: {e}"))?;
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
    claimed: Option<tower_idempotency::key::ClaimedKey>,
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
    let credit = notify::write_credit(&state, tx, op, claimed).await?;
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
