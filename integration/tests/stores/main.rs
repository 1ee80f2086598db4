//! Every store against one contract, one module per subject in one binary
//! (`cargo test -p integration --test stores`; the server stores need their
//! features): the store suite (`suite`), model-based property tests
//! (`model`), and the SQLite stores under faults and over sqlx
//! (`sqlite_faults`, `sqlx_sqlite`, `sqlx_sqlite_faults`). Each test has
//! tables, key prefixes or SQLite files of its own, and the model's Redis
//! Cluster its own ports (15630-15632), so modules run side by side.

#[path = "../../../tests/common/mod.rs"]
mod common;
#[path = "../../../tests/common/rediscluster.rs"]
mod rediscluster;

mod model;
mod sqlite_faults;
#[cfg(feature = "sqlx-sqlite")]
mod sqlx_sqlite;
#[cfg(feature = "sqlx-sqlite")]
mod sqlx_sqlite_faults;
mod suite;
