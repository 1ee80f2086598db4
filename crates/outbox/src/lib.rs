//! A transactional outbox for [`tower-idempotency`](tower_idempotency):
//! effects beyond the database, delivered at least once under keys that
//! make them apply once.
//!
//! ```toml
//! [dependencies]
//! tower-idempotency = "0.1"
//! tower-idempotency-outbox = "0.1"  # SQLite; or postgres, sqlx-postgres, sqlx-sqlite, mysql; nats, admin, metrics
//! # The example below also uses:
//! axum = "0.8"
//! tokio = { version = "1", features = ["full"] }
//! hyper-util = { version = "0.1", features = ["client-legacy", "http1", "tokio"] }
//! ```
//!
//! The whole guide, with a service on axum, sqlx and PostgreSQL: [`guide`].
//!
//! # Example
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use hyper_util::{client::legacy::Client, rt::TokioExecutor};
//! use tower_idempotency::key::ClaimedKey;
//! use tower_idempotency_outbox::{self as outbox, HttpSink, Message, Outbox};
//! use tower_idempotency::store::{SqliteTransaction, TransactionError};
//! use tower_idempotency::{IdempotencyLayer, SqliteStore, scope};
//!
//! async fn order(tx: SqliteTransaction, claimed: ClaimedKey) -> Result<&'static str, TransactionError> {
//!     // Message 0 of this request: its key is derived from the request's
//!     // scope and idempotency key, so a retry enqueues the same key.
//!     let event = Message::new(&claimed, 0, "http://billing.internal/events", "application/json",
//!         br#"{"order":17}"#.to_vec()).expect("a valid message");
//!     tx.run(move |tx| {
//!         tx.execute("INSERT INTO orders (item) VALUES ('book')", [])?;
//!         outbox::sqlite::enqueue(tx, &event) // commits with the order, or not at all
//!     })
//!     .await?;
//!     Ok("ordered")
//! }
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = SqliteStore::open("app.sqlite3").await?;
//! let outbox = Outbox::sqlite(store.path()).await?; // creates its table
//! let client = Client::builder(TokioExecutor::new()).build_http();
//! outbox.relay(HttpSink::new(client)).spawn();      // one relay per process
//! let app: Router = Router::new()
//!     .route("/orders", post(order))
//!     .route_layer(IdempotencyLayer::new(store, scope::header("x-user-id"))
//!         .require_key(true) // the transaction extractor needs a key on every request
//!         .transactional());
//! # let _ = app; Ok(()) }
//! ```
//!
//! # Why
//!
//! A rollback cannot undo a call to another service: a handler that calls
//! out inside its transaction and is then rolled back and retried calls out
//! twice. So the handler writes the message as a row of its own
//! transaction (`sqlite::enqueue` inside
//! `SqliteTransaction::run`, or
//! `postgres::enqueue` through the
//! `PostgresTransaction` with the feature `postgres`, or
//! `mysql::enqueue` through the `MySqlTransaction` with the feature
//! `mysql`, or `sqlx::enqueue` on any sqlx store's connection): the row
//! commits with the handler's writes and the idempotency record, or neither
//! does. A [`Relay`] delivers committed rows afterwards.
//!
//! The relay can crash after the receiver acted and before the row is
//! marked done, so a message may arrive more than once. Each message
//! therefore carries a stable key ([`message_key`]: SHA-256 over the
//! request's scope, its idempotency key and the message's index), the same
//! on every attempt, after every restart, and for a request rolled back and
//! retried. [`HttpSink`] sends it as `Idempotency-Key`, so a receiver behind
//! `tower-idempotency`'s `IdempotencyLayer` applies each message once.
//!
//! Sinks: [`HttpSink`], [`from_fn`], and with the feature `nats`
//! `nats::NatsSink` (NATS JetStream, de-duplicated by `Nats-Msg-Id`).
//!
//! # What the relay promises
//!
//! * At least once: a message is retried until a sink reports it
//!   [`Outcome::Delivered`], it is rejected ([`Outcome::Reject`]) or it has
//!   used [`Relay::max_attempts`]; the last two make it a dead letter, which
//!   stays until an operator [requeues](Outbox::requeue) it.
//! * One holder at a time: a message is claimed under a lease, and no relay
//!   (in this process or another on the same database) claims it while the
//!   lease lasts. An attempt is cut off at the answer timeout, which is
//!   below the lease, so it ends before another relay may start one. A
//!   relay that dies leaves its messages claimed until the lease ends; then
//!   any relay delivers them.
//! * Times are the database's clock. If it steps back, a lease deadline
//!   further ahead than two leases counts as ended (a record's, one), so
//!   no message waits out the step while held; but a message's due time
//!   (its enqueue's, or its next retry's) is on the same clock, so one due
//!   within the step is attempted up to the step later. Late, never lost,
//!   as a record's TTL is longer by the step.
//! * No order. Messages are claimed oldest due first, but attempts run
//!   concurrently and a failing message is retried after a backoff while
//!   later messages go ahead: receivers must not rely on arrival order (a
//!   message that is retried never holds up the others).
//!
//! # Tables
//!
//! The outbox keeps its messages in its own table,
//! `tower_idempotency_outbox`, in the store's database, which
//! `Outbox::sqlite`, `Outbox::postgres`, `Outbox::sqlx_postgres`,
//! `Outbox::sqlx_sqlite` and `Outbox::mysql` create if missing.
//!
//! # Metrics (with the `metrics` feature)
//!
//! | name | kind | meaning |
//! |---|---|---|
//! | `tower_idempotency_outbox_deliveries_total` | counter | attempts that delivered |
//! | `tower_idempotency_outbox_retries_total` | counter | attempts that failed and will be retried |
//! | `tower_idempotency_outbox_dead_letters_total` | counter | messages that became dead letters |
//! | `tower_idempotency_outbox_oldest_pending_seconds` | gauge | age of the oldest undelivered message, in seconds (set every 10 s by each relay) |

#![deny(unsafe_code, unreachable_pub)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[doc = include_str!("../docs/guide.md")]
pub mod guide {}

#[cfg(feature = "admin")]
pub mod admin;
#[cfg(any(
    feature = "sqlite",
    feature = "postgres",
    feature = "sqlx-postgres",
    feature = "sqlx-sqlite",
    feature = "mysql"
))]
mod exec;
mod message;
#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "postgres")]
pub mod postgres;
mod queue;
mod relay;
mod sink;
#[cfg(any(
    feature = "sqlite",
    feature = "postgres",
    feature = "sqlx-postgres",
    feature = "sqlx-sqlite",
    feature = "mysql"
))]
mod sql;
#[cfg(feature = "sqlite")]
pub mod sqlite;
#[cfg(any(feature = "sqlx-postgres", feature = "sqlx-sqlite", feature = "mysql"))]
pub mod sqlx;
#[cfg(feature = "test-util")]
pub mod test_util;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

pub use message::{MAX_KEY_LEN, MAX_PAYLOAD, Message, MessageError, message_key};
pub use queue::{Counts, Entry, View};
pub use relay::{Relay, RelayHandle};
pub use sink::{Delivery, FnSink, HttpSink, Outcome, Sink, classify, from_fn, request, sf_string};

use queue::Queue;
use tower_idempotency::StoreError;

/// The outbox's table.
#[cfg_attr(
    not(any(
        feature = "sqlite",
        feature = "postgres",
        feature = "sqlx-postgres",
        feature = "sqlx-sqlite",
        feature = "mysql"
    )),
    allow(dead_code)
)]
pub(crate) const TABLE: &str = "tower_idempotency_outbox";

#[cfg(feature = "metrics")]
pub(crate) const METRIC_DELIVERIES: &str = "tower_idempotency_outbox_deliveries_total";
#[cfg(feature = "metrics")]
pub(crate) const METRIC_RETRIES: &str = "tower_idempotency_outbox_retries_total";
#[cfg(feature = "metrics")]
pub(crate) const METRIC_DEAD_LETTERS: &str = "tower_idempotency_outbox_dead_letters_total";
#[cfg(feature = "metrics")]
pub(crate) const METRIC_OLDEST_PENDING: &str = "tower_idempotency_outbox_oldest_pending_seconds";

/// The largest `limit` of [`Outbox::list`].
pub const MAX_LIST: usize = 1000;

/// The outbox table of one database: start relays on it, and inspect and
/// repair it. Cheap to clone.
#[derive(Clone)]
pub struct Outbox {
    queue: Arc<dyn Queue>,
    wake: Arc<Notify>,
}

impl std::fmt::Debug for Outbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbox").finish_non_exhaustive()
    }
}

impl Outbox {
    /// The outbox in the SQLite file at `path` (the store's, e.g.
    /// [`SqliteStore::path`](tower_idempotency::SqliteStore::path)), over a connection
    /// of its own (WAL, 5 s busy timeout). Creates its table if missing.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the file cannot be opened or the
    /// table created.
    #[cfg(feature = "sqlite")]
    pub async fn sqlite(path: impl AsRef<std::path::Path>) -> Result<Outbox, StoreError> {
        let exec = sqlite::SqliteExec::open(path.as_ref()).await?;
        Outbox::over(exec, sql::OutboxSql::sqlite()).await
    }

    /// The outbox in the PostgreSQL database of `store`, over its pool.
    /// Creates its table if missing.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when no connection can be had or the
    /// table cannot be created.
    #[cfg(feature = "postgres")]
    pub async fn postgres(
        store: &tower_idempotency_postgres::PostgresStore,
    ) -> Result<Outbox, StoreError> {
        let exec = postgres::PostgresExec(store.pool().clone());
        Outbox::over(exec, sql::OutboxSql::postgres()).await
    }

    /// The outbox in the PostgreSQL database of `store` (the app's own
    /// `sqlx::PgPool`), over its pool. Creates its table if missing; the
    /// table is the one `Outbox::postgres` uses.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when no connection can be had or the
    /// table cannot be created.
    #[cfg(feature = "sqlx-postgres")]
    pub async fn sqlx_postgres(
        store: &tower_idempotency_sqlx::SqlxPostgresStore,
    ) -> Result<Outbox, StoreError> {
        let exec = sqlx::SqlxExec(store.pool().clone());
        Outbox::over(exec, sql::OutboxSql::postgres()).await
    }

    /// The outbox in the SQLite database of `store` (the app's own
    /// `sqlx::SqlitePool`), over its pool. Creates its table if missing; the
    /// table is the one `Outbox::sqlite` uses.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when no connection can be had or the
    /// table cannot be created.
    #[cfg(feature = "sqlx-sqlite")]
    pub async fn sqlx_sqlite(
        store: &tower_idempotency_sqlx::SqlxSqliteStore,
    ) -> Result<Outbox, StoreError> {
        let exec = sqlx::SqlxExec(store.pool().clone());
        Outbox::over(exec, sql::OutboxSql::sqlite()).await
    }

    /// The outbox in the MySQL (8.0.1+) or MariaDB (10.6+) database of
    /// `store`, over its pool. Creates its table if missing.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when no connection can be had or the
    /// table cannot be created.
    #[cfg(feature = "mysql")]
    pub async fn mysql(store: &tower_idempotency_sqlx::MySqlStore) -> Result<Outbox, StoreError> {
        let exec = sqlx::SqlxExec(store.pool().clone());
        Outbox::over(exec, sql::OutboxSql::mysql()).await
    }

    /// The outbox over a driver's `exec`, in its dialect, with the table
    /// created if missing.
    #[cfg(any(
        feature = "sqlite",
        feature = "postgres",
        feature = "sqlx-postgres",
        feature = "sqlx-sqlite",
        feature = "mysql"
    ))]
    async fn over<E: exec::Exec>(
        exec: E,
        sql: &'static sql::OutboxSql,
    ) -> Result<Outbox, StoreError> {
        let queue = exec::SqlQueue::open(exec, sql).await?;
        Ok(Outbox {
            queue: Arc::new(queue),
            wake: Arc::new(Notify::new()),
        })
    }

    /// The outbox over a table of the caller's own: for tests that run the
    /// real [`Relay`] against a queue they control (the deterministic
    /// simulation in `tests/simulation/` reaches one over a simulated
    /// network).
    #[cfg(feature = "test-util")]
    pub fn from_queue(queue: impl Queue) -> Outbox {
        Outbox {
            queue: Arc::new(queue),
            wake: Arc::new(Notify::new()),
        }
    }

    /// A relay delivering this outbox's messages through `sink`, with the
    /// default settings (see [`Relay`]); start it with [`Relay::spawn`].
    pub fn relay<S: Sink>(&self, sink: S) -> Relay {
        Relay {
            queue: self.queue.clone(),
            sink: Arc::new(sink),
            wake: self.wake.clone(),
            config: relay::Config::default(),
        }
    }

    /// Wakes this process's idle relays to look for due messages now rather
    /// than at their next poll: call it after a transaction that enqueued
    /// has committed, to save the wait.
    pub fn wake(&self) {
        self.wake.notify_waiters();
    }

    /// Up to `limit` (at most [`MAX_LIST`]) messages in the state `view`,
    /// oldest first.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the database does not answer.
    pub async fn list(&self, view: View, limit: usize) -> Result<Vec<Entry>, StoreError> {
        self.queue.list(view, limit.min(MAX_LIST)).await
    }

    /// Makes dead letter `id` pending again, due now, with its attempts
    /// counted from zero. `false` when `id` is not a dead letter.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the database does not answer.
    pub async fn requeue(&self, id: i64) -> Result<bool, StoreError> {
        let done = self.queue.requeue(id).await?;
        self.wake();
        Ok(done)
    }

    /// How many messages are in each state, and the oldest pending one's age.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the database does not answer.
    pub async fn counts(&self) -> Result<Counts, StoreError> {
        self.queue.counts().await
    }

    /// Deletes every message delivered more than `older_than` ago, in
    /// statements of at most 1,000 rows (relays do this by themselves, see
    /// [`Relay::retention`] and [`Relay::purge`]); returns how many.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when the database does not answer.
    pub async fn purge_delivered(&self, older_than: Duration) -> Result<u64, StoreError> {
        let batch = tower_idempotency::store::Purge::default().batch_rows();
        tower_idempotency::store::kit::purge::in_batches(batch, |rows| {
            self.queue.purge(older_than, rows as usize)
        })
        .await
    }
}
