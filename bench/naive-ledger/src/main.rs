//! The naive ledger: the three endpoints of `examples/ledger` (its README is
//! the contract), written the way a user writes them before adding
//! tower-idempotency: no idempotency key, one transaction per credit.
//!
//! ```text
//! naive-ledger [--db PATH|postgres://...|mysql://...] [--db-driver tokio-postgres|sqlx]
//!              [--listen ADDR]
//! ```
//!
//! * SQLite (a path): WAL, `synchronous = FULL`, an r2d2 pool of 8
//!   connections, each call on Tokio's blocking pool, one `BEGIN IMMEDIATE`
//!   transaction per write.
//! * PostgreSQL (a `postgres://` URL): tokio-postgres over a deadpool pool of
//!   16 (the size of the crate's `PostgresStore` pool, which the ledger's own
//!   tables share), one transaction per write. With `--db-driver sqlx`:
//!   sqlx's `PgPool` of 16 instead, the same SQL (the ledger's
//!   `--db-driver sqlx`).
//! * MySQL/MariaDB (a `mysql://` URL): sqlx's `MySqlPool` of 16, one
//!   transaction per write, the SQL of the ledger's MySQL backend.
//!
//! Prints `listening on http://HOST:PORT` once it accepts connections, like
//! the ledger, so `bench/ledger/compare.sh` drives both the same way.

mod mysql;
mod pg;
mod sqlite;
mod sqlx_pg;

use std::net::SocketAddr;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};

#[derive(Serialize)]
pub struct Account {
    pub id: i64,
    pub name: String,
    pub balance: i64,
}

#[derive(Serialize)]
pub struct Credit {
    pub credit_id: i64,
    pub account_id: i64,
    pub amount: i64,
    pub balance: i64,
}

/// Why a request failed; each answers with a problem (RFC 9457).
pub enum Error {
    BadRequest(String),
    NoSuchAccount,
    Database(String),
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let (status, title, detail) = match self {
            Error::BadRequest(d) => (StatusCode::BAD_REQUEST, "Bad Request", d),
            Error::NoSuchAccount => (StatusCode::NOT_FOUND, "Not Found", "no such account".into()),
            Error::Database(e) => {
                eprintln!("database error: {e}");
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "Service Unavailable",
                    "the ledger database could not be reached".into(),
                )
            }
        };
        let body = serde_json::json!({
            "type": "about:blank", "title": title, "status": status.as_u16(), "detail": detail,
        });
        (
            status,
            [("content-type", "application/problem+json")],
            body.to_string(),
        )
            .into_response()
    }
}

/// The ledger's tables, in SQLite, PostgreSQL or MySQL, through one client
/// library.
#[derive(Clone)]
enum Db {
    Sqlite(sqlite::Db),
    Postgres(pg::Db),
    SqlxPostgres(sqlx_pg::Db),
    MySql(mysql::Db),
}

/// `$call` on whichever backend `$db` holds (each has the same methods).
macro_rules! on {
    ($db:expr, $d:ident => $call:expr) => {
        match $db {
            Db::Sqlite($d) => $call,
            Db::Postgres($d) => $call,
            Db::SqlxPostgres($d) => $call,
            Db::MySql($d) => $call,
        }
    };
}

#[derive(Deserialize)]
struct NewAccount {
    name: String,
}

#[derive(Deserialize)]
struct NewCredit {
    amount: i64,
}

fn parse<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, Error> {
    serde_json::from_slice(body).map_err(|e| Error::BadRequest(format!("invalid JSON body: {e}")))
}

fn parse_id(id: &str) -> Result<i64, Error> {
    id.parse().map_err(|_| Error::NoSuchAccount)
}

fn created<T: Serialize>(value: &T) -> Response {
    let body = serde_json::to_string(value).unwrap_or_default();
    (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        body,
    )
        .into_response()
}

async fn create_account(State(db): State<Db>, body: Bytes) -> Result<Response, Error> {
    let new: NewAccount = parse(&body)?;
    if !(1..=100).contains(&new.name.chars().count()) || new.name.contains('\0') {
        return Err(Error::BadRequest(
            "name must be 1 to 100 characters, without NUL".into(),
        ));
    }
    let account = on!(db, d => d.create_account(new.name).await?);
    Ok(created(&account))
}

async fn credit(
    State(db): State<Db>,
    Path(id): Path<String>,
    body: Bytes,
) -> Result<Response, Error> {
    let id = parse_id(&id)?;
    let new: NewCredit = parse(&body)?;
    if !(1..=1_000_000_000).contains(&new.amount) {
        return Err(Error::BadRequest(
            "amount must be an integer in 1..=1000000000".into(),
        ));
    }
    let credit = on!(db, d => d.credit(id, new.amount).await?);
    Ok(created(&credit))
}

async fn account(State(db): State<Db>, Path(id): Path<String>) -> Result<Response, Error> {
    let id = parse_id(&id)?;
    let account = on!(db, d => d.account(id).await?);
    Ok(axum::Json(account).into_response())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let usage = "usage: naive-ledger [--db PATH|postgres://...|mysql://...] \
                 [--db-driver tokio-postgres|sqlx] [--listen ADDR]";
    let mut db = "naive-ledger.sqlite3".to_owned();
    let mut sqlx = false;
    let mut listen: SocketAddr = ([127, 0, 0, 1], 3001).into();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or(usage);
        match flag.as_str() {
            "--db" => db = value()?.to_owned(),
            "--db-driver" => match value()?.as_str() {
                "tokio-postgres" => sqlx = false,
                "sqlx" => sqlx = true,
                _ => return Err(usage.into()),
            },
            "--listen" => listen = value()?.parse()?,
            _ => return Err(usage.into()),
        }
    }
    let postgres = db.starts_with("postgres://") || db.starts_with("postgresql://");
    let db = if db.starts_with("mysql://") {
        Db::MySql(mysql::Db::open(&db).await?)
    } else if postgres && sqlx {
        Db::SqlxPostgres(sqlx_pg::Db::open(&db).await?)
    } else if postgres {
        Db::Postgres(pg::Db::open(&db).await?)
    } else if sqlx {
        return Err("--db-driver sqlx: only for a postgres:// URL (MySQL always uses sqlx)".into());
    } else {
        Db::Sqlite(sqlite::Db::open(&db)?)
    };
    let app = Router::new()
        .route("/accounts", post(create_account))
        .route("/accounts/{id}", get(account))
        .route("/accounts/{id}/credits", post(credit))
        .with_state(db);
    let listener = tokio::net::TcpListener::bind(listen).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
