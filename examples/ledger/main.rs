//! The ledger: an axum service that credits accounts, where a credit
//! delivered twice must be applied once. Its contract (command line and
//! HTTP) is `examples/ledger/README.md`; `cargo run --example ledger --
//! --help` lists the flags. Below: the layer, the routes, the credit
//! handler; then the other handlers and the set-up. Each database driver is
//! a module implementing `db::Ledger`.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{FromRequestParts, Path, State};
use axum::http::{StatusCode, request::Parts};
use axum::middleware::from_fn_with_state;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use serde::Deserialize;
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::key::ClaimedKey;
use tower_idempotency::policy::{DoNotStore, OutcomeUnknown};
use tower_idempotency::problem::WithProblem;
use tower_idempotency::store::{Inspect, Store, TransactionalStore};

use cli::{Args, Backend, LayerOptions, Mode};
use db::{BoxError, Json, Ledger, LedgerError, Op, Tx, Write};

/// The routes. The POSTs go behind the idempotency layer (`protect` applies
/// it), the GET does not: a POST to a GET-only path is a plain 405, not a
/// missing-key 400. The credit route also takes the test headers
/// (`faults.rs`).
fn app<D: Ledger>(state: App<D>, protect: impl FnOnce(Routes<D>) -> Routes<D>) -> Router {
    let faults = from_fn_with_state(state.fault_injection, faults::inject);
    let writes = Router::new()
        .route("/accounts", post(create_account::<D>))
        .route("/accounts/{id}/credits", post(credit::<D>).layer(faults));
    Router::new()
        .route("/accounts/{id}", get(account::<D>))
        .merge(protect(writes))
        .fallback(|| async { problem(StatusCode::NOT_FOUND, "Not Found", "no such resource") })
        .method_not_allowed_fallback(|| async {
            let detail = "this resource does not accept that method";
            problem(StatusCode::METHOD_NOT_ALLOWED, "Method Not Allowed", detail)
        })
        .with_state(state)
}

/// `POST /accounts/{id}/credits {"amount": N}`: 201 with the credit and the
/// account's new balance.
async fn credit<D: Ledger>(
    writer: Writer<D>,
    AccountId(account_id): AccountId,
    JsonBody(NewCredit { amount }): JsonBody<NewCredit>,
) -> Result<Response, ApiError> {
    if !(1..=1_000_000_000).contains(&amount) {
        let detail = "amount must be an integer in 1..=1000000000";
        return Err(ApiError::BadRequest(detail.into()));
    }
    let credit = writer.run(Op::Credit { account_id, amount }).await?;
    Ok(created(credit))
}

#[derive(Deserialize)]
struct NewCredit {
    amount: i64,
}

/// The idempotency layer: a key is required, keys are scoped per caller,
/// and otherwise the crate's defaults: a short lease (10 s, or
/// `--lease-secs`) renewed while a credit runs, up to the default max hold
/// (60 s), so a crashed process's keys are free soon and a slow credit is
/// never taken over. A repeat of a credit
/// in flight waits up to `--wait-in-flight-ms` for its replay; a record is
/// replayed for the crate's TTL (24 h) or `--ttl-secs`. With
/// `--encryption-key-file`, stored responses are sealed at rest.
fn idempotency<St: Store>(
    store: St,
    options: LayerOptions,
) -> IdempotencyLayer<St, fn(&Parts) -> String> {
    let layer = IdempotencyLayer::new(store, caller as fn(&Parts) -> String)
        .require_key(true)
        .wait_in_flight(options.wait_in_flight);
    let layer = match options.keys {
        Some(keys) => layer.encrypt_at_rest(keys),
        None => layer,
    };
    let layer = match options.ttl {
        Some(ttl) => layer.ttl(ttl),
        None => layer,
    };
    match options.lease {
        Some(lease) => layer.lease(lease),
        None => layer,
    }
}

/// The ledger's routes over driver `D`, and what puts them behind the layer.
type Routes<D> = Router<App<D>>;
type Protect<D> = Box<dyn FnOnce(Routes<D>) -> Routes<D>>;

/// `POST /accounts {"name": "..."}`: 201 with the new account.
async fn create_account<D: Ledger>(
    writer: Writer<D>,
    JsonBody(NewAccount { name }): JsonBody<NewAccount>,
) -> Result<Response, ApiError> {
    if !(1..=100).contains(&name.chars().count()) || name.contains('\0') {
        let detail = "name must be 1 to 100 characters, without NUL";
        return Err(ApiError::BadRequest(detail.into()));
    }
    let account = writer.run(Op::CreateAccount { name }).await?;
    Ok(created(account))
}

#[derive(Deserialize)]
struct NewAccount {
    name: String,
}

/// `GET /accounts/{id}`.
async fn account<D: Ledger>(
    State(state): State<App<D>>,
    AccountId(id): AccountId,
) -> Result<Response, ApiError> {
    let account = state.db.account(id).await?;
    Ok(axum::Json(account).into_response())
}

#[derive(Clone)]
struct App<D> {
    db: D,
    mode: Mode,
    fault_injection: bool,
    notify: Option<notify::Notifier>,
}

/// Runs a request's write: inside its idempotency transaction
/// (transactional mode) or in a transaction of its own (separate mode).
/// Either way the write failing rolls it back.
struct Writer<D: Ledger> {
    app: App<D>,
    tx: Option<Tx<D>>,
    claimed: Option<ClaimedKey>,
    fail_after_effect: bool,
}

impl<D: Ledger> FromRequestParts<App<D>> for Writer<D> {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, app: &App<D>) -> Result<Self, Infallible> {
        Ok(Writer {
            app: app.clone(),
            tx: parts.extensions.get::<Tx<D>>().cloned(),
            claimed: parts.extensions.get::<ClaimedKey>().cloned(),
            fail_after_effect: parts.extensions.get::<faults::FailAfterEffect>().is_some(),
        })
    }
}

impl<D: Ledger> Writer<D> {
    async fn run(self, op: Op) -> Result<Json, ApiError> {
        // The layer requires a key: every write has its claim.
        let Some(claimed) = self.claimed else {
            return Err(no_transaction());
        };
        // --notify-url: a credit's notification commits with it.
        let notify = match (&op, self.app.notify) {
            (Op::Credit { .. }, Some(notifier)) => Some(notify::Notify {
                notifier,
                claimed: claimed.clone(),
            }),
            _ => None,
        };
        let separate = self.app.mode == Mode::Separate;
        let write = Write {
            op,
            request: separate.then(|| request_of(&claimed)),
            // A key taken over in separate mode: its earlier holder's
            // credit may have committed; find it rather than credit again.
            resolve: separate && claimed.taken_over(),
            notify,
            fail_after_effect: self.fail_after_effect,
        };
        // An `Err` makes the handler answer 4xx/5xx; in transactional mode
        // the layer then rolls the transaction back (every `ApiError` is
        // either released or marked `DoNotStore`).
        Ok(match (self.app.mode, self.tx) {
            (Mode::Separate, _) => {
                // Fenced: a request paused past its lease, whose key another
                // request took over meanwhile, writes nothing.
                claimed.confirm().await.map_err(ApiError::NotConfirmed)?;
                let lost = claimed.lease_lost();
                self.app.db.in_transaction(write, lost).await?
            }
            (Mode::Transactional, Some(tx)) => D::in_request(&tx, write).await?,
            (Mode::Transactional, None) => return Err(no_transaction()),
        })
    }
}

/// The request's idempotency key as its credit keeps it: SHA-256 over the
/// layer's namespace, the scope and the key (each length-prefixed), in hex.
fn request_of(claimed: &ClaimedKey) -> String {
    use sha2::{Digest, Sha256};
    let mut hash = Sha256::new();
    let parts = [
        claimed.namespace().unwrap_or(""),
        claimed.scope(),
        claimed.key(),
    ];
    for part in parts {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    hex(&hash.finalize())
}

fn no_transaction() -> ApiError {
    ApiError::Ledger(LedgerError::database(
        "no idempotency transaction for this request",
    ))
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

// ------------------------------------------------------------------ answers

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
    /// The claim could not be confirmed right before the write.
    NotConfirmed(tower_idempotency::key::NotConfirmed),
    BadRequest(String),
    /// A body sent with a `Content-Encoding` the ledger does not decode.
    UnsupportedEncoding,
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
            // Refusals given before any effect are not stored: nothing
            // happened, so a retry, or the corrected request, may use the
            // same key (in transactional mode the transaction rolls back).
            ApiError::BadRequest(detail) => {
                let refusal = problem(StatusCode::BAD_REQUEST, "Bad Request", detail);
                (Extension(DoNotStore), refusal).into_response()
            }
            ApiError::UnsupportedEncoding => {
                let detail = "the body must be sent without a Content-Encoding (identity)";
                let refusal = problem(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "Unsupported Media Type",
                    detail,
                );
                (Extension(DoNotStore), refusal).into_response()
            }
            ApiError::Ledger(LedgerError::NoSuchAccount) => {
                let refusal = problem(StatusCode::NOT_FOUND, "Not Found", "no such account");
                (Extension(DoNotStore), refusal).into_response()
            }
            ApiError::NotConfirmed(e) => {
                tracing::warn!(error = %e, "a credit's claim was not confirmed; nothing was written");
                unavailable(
                    "this request no longer holds its idempotency key; nothing was written; retry with the same key",
                )
            }
            ApiError::Ledger(LedgerError::OutcomeUnknown(e)) => {
                tracing::error!(error = %e, "a credit's commit went unanswered");
                // The layer answers `outcome-unknown` and keeps the key.
                let unknown = problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "Service Unavailable",
                    "whether the credit was written is not known",
                );
                (Extension(OutcomeUnknown), unknown).into_response()
            }
            ApiError::Ledger(LedgerError::InjectedFailure) => problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "Internal Server Error",
                "injected failure after the credit was written; the transaction was rolled back",
            ),
            ApiError::Ledger(LedgerError::Database(e)) => {
                tracing::error!(error = %e, "ledger database error");
                unavailable("the ledger database could not be reached")
            }
        }
    }
}

/// 503 with `Retry-After: 1`: worth a retry with the same key.
fn unavailable(detail: &str) -> Response {
    let problem = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "Service Unavailable",
        detail,
    );
    ([("retry-after", "1")], problem).into_response()
}

fn created(body: Json) -> Response {
    let json = [("content-type", "application/json")];
    (StatusCode::CREATED, json, body.0).into_response()
}

/// A JSON request body: one sent with a `Content-Encoding` other than
/// `identity` (gzip, say) is refused 415, one that is not the JSON expected
/// 400; neither is stored, so the corrected request may keep its key.
struct JsonBody<T>(T);

impl<S: Send + Sync, T: for<'de> Deserialize<'de>> axum::extract::FromRequest<S> for JsonBody<T> {
    type Rejection = Response;

    async fn from_request(request: axum::extract::Request, state: &S) -> Result<Self, Response> {
        let encoding = request.headers().get(axum::http::header::CONTENT_ENCODING);
        if encoding.is_some_and(|e| !e.as_bytes().eq_ignore_ascii_case(b"identity")) {
            return Err(ApiError::UnsupportedEncoding.into_response());
        }
        let WithProblem(body) = WithProblem::<Bytes>::from_request(request, state)
            .await
            .map_err(IntoResponse::into_response)?;
        serde_json::from_slice(&body)
            .map(JsonBody)
            .map_err(|e| ApiError::BadRequest(format!("invalid JSON body: {e}")).into_response())
    }
}

/// The `{id}` of the path. One that is not a decimal integer, whatever its
/// bytes (`abc`, `%FF`, which is not UTF-8), names no account: 404.
struct AccountId(i64);

impl<S: Send + Sync> FromRequestParts<S> for AccountId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let id = Path::<String>::from_request_parts(parts, state).await.ok();
        let id = id.and_then(|Path(id)| id.parse().ok());
        id.map(AccountId)
            .ok_or(ApiError::Ledger(LedgerError::NoSuchAccount))
    }
}

// ------------------------------------------------------------------- set-up

use tokio::net::TcpListener;

mod cli;
mod db;
mod faults;
#[cfg(feature = "mysql")]
mod mysql;
mod notify;
#[cfg(feature = "postgres")]
mod pg;
mod sqlite;
#[cfg(any(feature = "sqlx-postgres", feature = "sqlx-sqlite", feature = "mysql"))]
mod sqlx;
#[cfg(feature = "sqlx-postgres")]
mod sqlx_pg;
#[cfg(feature = "sqlx-sqlite")]
mod sqlx_sqlite;

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,tower_idempotency=info".into()),
        )
        .init();
    let args = Args::parse_checked();
    if let Err(e) = run(args).await {
        eprintln!("ledger: {e}");
        std::process::exit(1);
    }
}

/// Binds the listeners, opens the database `--db` names with its driver
/// (its tables, and its store unless `--key-store`), then serves.
async fn run(args: Args) -> Result<(), BoxError> {
    let listener = TcpListener::bind(args.listen).await?;
    let admin_listener = match args.admin_listen {
        Some(addr) => Some(TcpListener::bind(addr).await?),
        None => None,
    };
    let on = (listener, admin_listener);
    let (url, records) = (args.db_url(), args.key_store.is_none());
    // `--relay-db` is a server URL, so never SQLite (`Args::parse_checked`).
    match args.backend() {
        Backend::Sqlite => serve(sqlite::open(&args.db, records).await?, None, args, on).await,
        #[cfg(feature = "postgres")]
        Backend::Postgres => {
            let relay = relay_store(args.relay_db.clone(), |url| async move {
                pg::open(&url, true).await
            });
            serve(pg::open(&url, records).await?, relay.await?, args, on).await
        }
        #[cfg(feature = "sqlx-postgres")]
        Backend::SqlxPostgres => {
            let relay = relay_store(args.relay_db.clone(), |url| async move {
                sqlx_pg::open(&url, true).await
            });
            serve(sqlx_pg::open(&url, records).await?, relay.await?, args, on).await
        }
        #[cfg(feature = "sqlx-sqlite")]
        Backend::SqlxSqlite => {
            serve(sqlx_sqlite::open(&args.db, records).await?, None, args, on).await
        }
        #[cfg(feature = "mysql")]
        Backend::MySql => {
            let relay = relay_store(args.relay_db.clone(), |url| async move {
                mysql::open(&url, true).await
            });
            serve(mysql::open(&url, records).await?, relay.await?, args, on).await
        }
        // `Args::parse_checked` refused a driver this build does not have.
        #[allow(unreachable_patterns)]
        other => Err(format!("this build has no {other:?} driver ({url})").into()),
    }
}

/// `--relay-db URL`: the store of the same database through another server,
/// opened as `--db` is; the outbox relay works through it.
#[cfg(any(feature = "postgres", feature = "sqlx-postgres", feature = "mysql"))]
async fn relay_store<D, S, F>(
    url: Option<String>,
    open: impl FnOnce(String) -> F,
) -> Result<Option<S>, BoxError>
where
    F: Future<Output = Result<(D, Option<S>), BoxError>>,
{
    match url {
        Some(url) => Ok(open(url).await?.1),
        None => Ok(None),
    }
}

/// Serves the ledger on `db`, its records in `store` (or in Redis); the
/// outbox relay works through `relay` when given (`--relay-db`), else
/// through `store`.
async fn serve<D: Ledger>(
    (db, store): (D, Option<D::Store>),
    relay: Option<D::Store>,
    args: Args,
    (listener, admin_listener): (TcpListener, Option<TcpListener>),
) -> Result<(), BoxError> {
    let mode = args.mode();
    let options = args.layer_options()?;
    // `--notify-url` needs transactional mode (`Args::parse_checked`), so
    // the store is the database's.
    #[cfg(feature = "outbox")]
    let notify = match (args.notify_url.clone(), &store) {
        (Some(url), Some(store)) => {
            let outbox = D::outbox(relay.as_ref().unwrap_or(store)).await?;
            Some(notify::start(url, outbox, options.keys.clone()))
        }
        _ => None,
    };
    #[cfg(not(feature = "outbox"))]
    let (notify, _) = (None, relay);
    let (protect, admin): (Protect<D>, _) = match store {
        #[cfg(feature = "redis")]
        _ if args.key_store.is_some() => {
            let store = redis_store(&args).await?;
            let admin = admin_router(&store, &args);
            (
                Box::new(move |r: Routes<D>| r.route_layer(idempotency(store, options))),
                admin,
            )
        }
        Some(store) => {
            let admin = admin_router(&store, &args);
            (protected(store, mode, options), admin)
        }
        None => unreachable!("the store is opened unless --key-store"),
    };
    let state = App {
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
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let stopped = move || {
        let mut stopping = stopping.clone();
        async move { drop(stopping.wait_for(|stop| *stop).await) }
    };
    let public =
        axum::serve(listener, app(state, protect)).with_graceful_shutdown(stopped.clone()());
    let servers = async {
        match (admin_listener, admin) {
            // Either server failing ends the process.
            (Some(admin_listener), Some(admin)) => {
                tokio::try_join!(async { public.await }, async {
                    axum::serve(admin_listener, admin)
                        .with_graceful_shutdown(stopped())
                        .await
                })
                .map(drop)
            }
            _ => public.await,
        }
    };
    tokio::select! {
        served = servers => served?,
        () = drain_after_signal(stop) => {}
    }
    Ok(())
}

/// The longest the ledger waits, after SIGTERM or SIGINT, for the requests
/// in flight to be answered.
const DRAIN: Duration = Duration::from_secs(30);

/// Waits for SIGTERM or SIGINT, tells the servers to stop accepting (they
/// answer the requests in flight, then end), and returns once `DRAIN` has
/// passed without their end: the requests still running are then cut off
/// as by a crash (transactional mode rolls them back, so their keys are free
/// at once; in separate mode a key stays in flight until its lease ends).
async fn drain_after_signal(stop: tokio::sync::watch::Sender<bool>) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            },
            Err(_) => drop(tokio::signal::ctrl_c().await),
        }
    }
    #[cfg(not(unix))]
    drop(tokio::signal::ctrl_c().await);
    eprintln!("ledger: stopping; answering the requests in flight (at most {DRAIN:?})");
    stop.send_replace(true);
    tokio::time::sleep(DRAIN).await;
    eprintln!("ledger: requests still in flight after {DRAIN:?} are cut off");
}

/// The layer over a store that offers both modes, in `mode`.
fn protected<D: Ledger, St: TransactionalStore>(
    store: St,
    mode: Mode,
    options: LayerOptions,
) -> Protect<D> {
    match mode {
        Mode::Transactional => {
            Box::new(move |r: Routes<D>| r.route_layer(idempotency(store, options).transactional()))
        }
        Mode::Separate => Box::new(move |r: Routes<D>| r.route_layer(idempotency(store, options))),
    }
}

/// The operators' router over `store`, when `--admin-listen` asked for one
/// (only a build with `--features admin` accepts the flag).
fn admin_router<St: Inspect>(store: &St, args: &Args) -> Option<Router> {
    #[cfg(feature = "admin")]
    if args.admin_listen.is_some() {
        return Some(tower_idempotency::admin::router(store.clone()));
    }
    let _ = (store, args);
    None
}

/// Records in Redis (one server, or a cluster through its seeds), the
/// ledger's data in --db: separate mode only.
#[cfg(feature = "redis")]
async fn redis_store(args: &Args) -> Result<tower_idempotency_redis::RedisStore, BoxError> {
    use tower_idempotency_redis::RedisStore;
    let urls = args.key_store.as_deref().unwrap_or_default();
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
    Ok(builder
        .replay_cache(crate::db::REPLAY_CACHE)
        .open()
        .await
        .map_err(|e| format!("--key-store: {e}"))?)
}
