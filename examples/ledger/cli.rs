//! The command line (the contract in `examples/ledger/README.md`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{CommandFactory, Parser, ValueEnum};
use tower_idempotency::seal::{Keyring, SealingKey};

use crate::notify;

/// The ledger: an HTTP service that credits accounts, where a credit
/// delivered twice is applied once.
#[derive(Debug, Parser)]
#[command(name = "ledger", args_override_self = true)]
pub struct Args {
    /// Where accounts, credits and (by default) the idempotency records live:
    /// a SQLite file, a postgres:// URL or a mysql:// URL
    #[arg(long, value_name = "PATH|URL", default_value = "ledger.sqlite3")]
    pub db: PathBuf,

    /// The client library for --db (MySQL always uses sqlx)
    #[arg(long, value_enum, default_value_t = Driver::Rusqlite)]
    pub db_driver: Driver,

    /// When the idempotency record is written [default: transactional
    /// wherever the store supports it]
    #[arg(long, value_enum)]
    pub mode: Option<Mode>,

    /// Keep the idempotency records in Redis (separate mode only); several
    /// comma-separated URLs are a Redis Cluster's seeds
    #[arg(long, value_name = "URL[,URL...]", value_parser = key_store)]
    pub key_store: Option<String>,

    /// The CA (PEM file) a rediss:// key store's certificate chains to
    #[arg(long, value_name = "PEM-PATH")]
    pub key_store_ca: Option<PathBuf>,

    /// Where the ledger listens (port 0 picks a free port)
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:3000")]
    pub listen: SocketAddr,

    /// How long an in-flight claim holds [default: the crate's lease]
    #[arg(long = "lease-secs", value_name = "N", value_parser = lease_secs)]
    pub lease: Option<Duration>,

    /// How long a record is replayed, from its claim; past it the key is
    /// new again [default: the crate's TTL, 24 h]
    #[arg(long = "ttl-secs", value_name = "N", value_parser = lease_secs)]
    pub ttl: Option<Duration>,

    /// A repeat that arrives while its first request is in flight waits up
    /// to N ms for its answer (0: 409 at once)
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub wait_in_flight_ms: u64,

    /// Honour the X-Ledger-* test headers
    #[arg(long)]
    pub fault_injection: bool,

    /// Also serve the operators' admin router here (no authentication: a
    /// loopback address only)
    #[arg(long, value_name = "ADDR")]
    pub admin_listen: Option<SocketAddr>,

    /// Notify every applied credit to this http:// URL (the outbox;
    /// transactional mode only)
    #[arg(long, value_name = "URL", value_parser = notify::parse_url)]
    pub notify_url: Option<String>,

    /// The outbox relay reads and marks notifications through this URL: the
    /// --db database reached through another server (a node of the same
    /// multi-master cluster) [default: --db]
    #[arg(long, value_name = "URL")]
    pub relay_db: Option<String>,

    /// Seal stored responses at rest with the 32-byte key in PATH; repeat
    /// it to rotate: the first key seals, every key opens
    #[arg(long = "encryption-key-file", value_name = "PATH")]
    pub encryption_key_files: Vec<PathBuf>,
}

/// What every idempotency layer of the ledger is configured with.
pub struct LayerOptions {
    /// `--lease-secs`, or the crate's lease.
    pub lease: Option<Duration>,
    /// `--ttl-secs`, or the crate's TTL.
    pub ttl: Option<Duration>,
    /// `--encryption-key-file`s, if any.
    pub keys: Option<Keyring>,
    /// `--wait-in-flight-ms`: zero answers 409 at once.
    pub wait_in_flight: Duration,
}

/// Which client library talks to the --db database.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Driver {
    /// rusqlite for a SQLite path, tokio-postgres for a postgres:// URL
    Rusqlite,
    /// One sqlx pool for the ledger and its records
    Sqlx,
}

/// When the idempotency record is written (see `tower_idempotency::mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// The credit, the record and the stored response in one commit
    Transactional,
    /// The credit commits, then the record is completed in a second write
    Separate,
}

/// The database and driver `--db` and `--db-driver` name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    SqlxSqlite,
    Postgres,
    SqlxPostgres,
    MySql,
}

impl Backend {
    /// What this build lacks for it: the flags that name it and the feature.
    fn missing(self) -> Option<(&'static str, &'static str)> {
        let (built, what, feature) = match self {
            Backend::Sqlite => return None,
            Backend::SqlxSqlite => (
                cfg!(feature = "sqlx-sqlite"),
                "--db-driver sqlx with a SQLite path",
                "sqlx-sqlite",
            ),
            Backend::Postgres => (
                cfg!(feature = "postgres"),
                "--db postgres://...",
                "postgres",
            ),
            Backend::SqlxPostgres => (
                cfg!(feature = "sqlx-postgres"),
                "--db postgres://... --db-driver sqlx",
                "sqlx-postgres",
            ),
            Backend::MySql => (cfg!(feature = "mysql"), "--db mysql://...", "mysql"),
        };
        (!built).then_some((what, feature))
    }
}

impl Args {
    /// Parses the command line; exits with status 2 and a message on a
    /// mistake.
    pub fn parse_checked() -> Args {
        let args = Args::parse();
        if let Err(message) = args.check() {
            Args::command()
                .error(clap::error::ErrorKind::ArgumentConflict, message)
                .exit();
        }
        args
    }

    /// The `--db` text: a path or a URL.
    pub fn db_url(&self) -> String {
        self.db.to_string_lossy().into_owned()
    }

    pub fn backend(&self) -> Backend {
        let url = self.db_url();
        let sqlx = self.db_driver == Driver::Sqlx;
        if url.starts_with("mysql://") {
            Backend::MySql
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            [Backend::Postgres, Backend::SqlxPostgres][usize::from(sqlx)]
        } else {
            [Backend::Sqlite, Backend::SqlxSqlite][usize::from(sqlx)]
        }
    }

    /// The layer's options; an `--encryption-key-file` that cannot be read,
    /// or does not hold exactly 32 bytes, is an error that names it.
    pub fn layer_options(&self) -> Result<LayerOptions, String> {
        let keys = self
            .encryption_key_files
            .iter()
            .map(|path| {
                SealingKey::from_file(path).map_err(|e| format!("--encryption-key-file: {e}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let keys = match keys.is_empty() {
            true => None,
            false => Some(Keyring::new(keys).map_err(|e| format!("--encryption-key-file: {e}"))?),
        };
        Ok(LayerOptions {
            lease: self.lease,
            ttl: self.ttl,
            keys,
            wait_in_flight: Duration::from_millis(self.wait_in_flight_ms),
        })
    }

    /// Transactional unless the records live elsewhere (`--key-store`).
    pub fn mode(&self) -> Mode {
        match (self.mode, &self.key_store) {
            (Some(mode), _) => mode,
            (None, Some(_)) => Mode::Separate,
            (None, None) => Mode::Transactional,
        }
    }

    /// What no single flag can judge alone.
    fn check(&self) -> Result<(), String> {
        let backend = self.backend();
        if let Some((what, feature)) = backend.missing() {
            return Err(format!("{what} needs a build with `--features {feature}`"));
        }
        if self.key_store_ca.is_some() && !cfg!(feature = "redis-tls") {
            return Err("--key-store-ca needs a build with `--features redis-tls`".into());
        }
        if self.admin_listen.is_some() && !cfg!(feature = "admin") {
            return Err("--admin-listen needs a build with `--features admin`".into());
        }
        if self.key_store_ca.is_some() && self.key_store.is_none() {
            return Err("--key-store-ca needs --key-store rediss://...".into());
        }
        if self.key_store.is_some() && self.mode == Some(Mode::Transactional) {
            return Err("--mode transactional needs the records in the --db database; with --key-store only --mode separate is possible".into());
        }
        if self.notify_url.is_some() && self.mode() == Mode::Separate {
            return Err(
                "--notify-url needs --mode transactional: a notification commits with its credit"
                    .into(),
            );
        }
        if let Some(url) = &self.relay_db {
            if self.notify_url.is_none() {
                return Err("--relay-db needs --notify-url: it is where the relay works".into());
            }
            let db = self.db_url();
            if server_kind(url).is_none() || server_kind(url) != server_kind(&db) {
                return Err(format!(
                    "--relay-db {url}: want a URL of the same kind as --db {db} (postgres:// or mysql://)"
                ));
            }
        }
        Ok(())
    }
}

/// The kind of database server a URL names, if any (`--relay-db`).
fn server_kind(url: &str) -> Option<&'static str> {
    match url.split_once("://")?.0 {
        "mysql" => Some("mysql"),
        "postgres" | "postgresql" => Some("postgres"),
        _ => None,
    }
}

/// `--key-store`: `redis://` or `rediss://` URLs, separated by commas.
fn key_store(urls: &str) -> Result<String, String> {
    for url in urls.split(',') {
        if !url.starts_with("redis://") && !url.starts_with("rediss://") {
            return Err(format!(
                "{url}: only redis:// and rediss:// URLs are supported"
            ));
        }
        if url.starts_with("rediss://") && !cfg!(feature = "redis-tls") {
            return Err("rediss://... needs a build with `--features redis-tls`".into());
        }
    }
    if !cfg!(feature = "redis") {
        return Err("redis://... needs a build with `--features redis`".into());
    }
    Ok(urls.to_owned())
}

/// `--lease-secs`, `--ttl-secs`: whole seconds, at least 1.
fn lease_secs(secs: &str) -> Result<Duration, String> {
    match secs.parse::<u64>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(secs) => Ok(Duration::from_secs(secs)),
        Err(e) => Err(e.to_string()),
    }
}
