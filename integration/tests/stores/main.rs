//! Every store against one contract, one module per subject in one binary
//! (`cargo test -p integration --test stores`; the server stores need their
//! features): the store suite (`suite`), model-based property tests
//! (`model`), and the SQLite stores under faults and over sqlx
//! (`sqlite_faults`, `sqlx_sqlite`, `sqlx_sqlite_faults`), transactional
//! mode on every sqlx store (`sqlx_transactional`), and the replay of
//! the fuzz corpus through the fuzz targets' checks (`fuzz_corpus`, with
//! their counting allocator, which counts per thread). Each test has
//! tables, key prefixes or SQLite files of its own, and the model's Redis
//! Cluster its own ports (15630-15632), so modules run side by side.

#[path = "../../../tests/common/mod.rs"]
mod common;
#[path = "../fuzz_checks/mod.rs"]
mod fuzz_checks;
#[path = "../../../tests/common/rediscluster.rs"]
mod rediscluster;

#[global_allocator]
static ALLOC: fuzz_checks::CountingAlloc = fuzz_checks::CountingAlloc;

mod fuzz_corpus;
mod model;
mod sqlite_faults;
#[cfg(feature = "sqlx-sqlite")]
mod sqlx_sqlite;
#[cfg(feature = "sqlx-sqlite")]
mod sqlx_sqlite_faults;
#[cfg(all(
    feature = "axum",
    any(feature = "sqlx-postgres", feature = "sqlx-sqlite", feature = "mysql")
))]
mod sqlx_transactional;
mod suite;
