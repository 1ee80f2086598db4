//! The store kit: what several stores share, written once. A store supplies
//! only what really differs (its SQL, its lock step, how it stops a
//! statement); the lifecycle around it lives here.
//!
//! * `claim.rs`: the claim of a SQL store (insert first, judge the record
//!   an insert met, take it over or refuse); the store supplies its
//!   statements.
//! * `fate.rs`: who ends a transaction, the layer or the max-hold timer.
//! * `release.rs`: giving a claimed key back, and the guard that does so
//!   when a request is cancelled between the claim and the hand-over.
//! * `two_phase.rs`: transactional mode in two phases (the claim commits
//!   first, then the handler's writes and the completion commit together),
//!   for PostgreSQL and MySQL/MariaDB.
//! * `table.rs`: the rule for a configurable table name; `builder.rs`: the
//!   settings of the SQL stores' builders that go with it (`table`,
//!   `max_hold`, `clock_offset`).

#[cfg(any(feature = "postgres", feature = "sqlx-postgres", feature = "mysql"))]
pub(crate) mod builder;
#[cfg(any(
    feature = "postgres",
    feature = "sqlx-postgres",
    feature = "mysql",
    feature = "sqlx-sqlite"
))]
pub(crate) mod claim;
#[cfg(any(
    feature = "postgres",
    feature = "sqlx-postgres",
    feature = "mysql",
    feature = "sqlx-sqlite"
))]
pub(crate) mod fate;
#[cfg(any(feature = "postgres", feature = "sqlx-postgres", feature = "mysql"))]
pub(crate) mod release;
#[cfg(any(feature = "postgres", feature = "sqlx-postgres", feature = "mysql"))]
pub(crate) mod table;
#[cfg(any(feature = "postgres", feature = "sqlx-postgres", feature = "mysql"))]
pub(crate) mod two_phase;
