#![doc = include_str!("../README.md")]
// Source map (for contributors; docs/architecture.md maps every file):
// `transaction.rs` holds `SqlxTransaction`, the handler's transaction on
// every store here, and `Dialect`, what each database supplies to it;
// `error.rs` holds `SqlxError`, the handler's error on every store here;
// `postgres/`, `sqlite/` and `mysql/` one store each: its `mod.rs` the store,
// its builder and its `Store` methods, `transaction.rs` its transaction
// (PostgreSQL and MySQL on the core kit's two phases), `inspect.rs`
// `Inspect` in SQL, and its statements
// (`sql.rs`, `claim.rs`); `postgres/listen.rs` the LISTEN connection that
// wakes waiting repeats (`notify_waiters`, on the kit's feed). The PostgreSQL statements are the core kit's
// (`store::kit::pg_sql`), shared with `tower-idempotency-postgres`; the
// SQLite schema is the kit's too (`store::kit::sqlite_sql`), shared with the
// core's `SqliteStore`.
#![deny(unsafe_code, unreachable_pub)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod error;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod read_first;
#[cfg(any(feature = "postgres", feature = "mysql"))]
mod renewals;
#[cfg(feature = "sqlite")]
mod sqlite;
mod transaction;

pub use error::SqlxError;
#[cfg(feature = "mysql")]
pub use mysql::{MySqlStore, MySqlStoreBuilder, MySqlTransaction};
#[cfg(feature = "postgres")]
pub use postgres::{
    SqlxPostgresError, SqlxPostgresStore, SqlxPostgresStoreBuilder, SqlxPostgresTransaction,
};
#[cfg(feature = "sqlite")]
pub use sqlite::{SqlxSqliteError, SqlxSqliteStore, SqlxSqliteStoreBuilder, SqlxSqliteTransaction};
/// The sqlx this crate is built with (0.9), for the statements a handler
/// runs through a transaction's `connection()`.
pub use sqlx;
pub use transaction::{Dialect, SqlxConnection, SqlxTransaction};

/// The long form, one page a database, with examples that compile.
pub mod guide {
    #[cfg(feature = "postgres")]
    #[doc = include_str!("../docs/postgres.md")]
    pub mod postgres {}

    #[cfg(feature = "sqlite")]
    #[doc = include_str!("../docs/sqlite.md")]
    pub mod sqlite {}

    #[cfg(feature = "mysql")]
    #[doc = include_str!("../docs/mysql.md")]
    pub mod mysql {}
}
