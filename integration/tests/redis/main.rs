//! `RedisStore`'s tests that need more than the shared server, one module
//! per subject in one binary (`cargo test -p integration --features redis
//! --test redis`): faults on private servers killed and restarted
//! (`faults`), a private Redis Cluster (`cluster`, ports 15600-15602), TLS
//! (`tls`, port 15640), and eviction policies (`eviction`). Each private
//! server is its own process on its own ports, and every key carries a
//! prefix of its test, so modules run side by side. The store contract on
//! the shared server is `integration/tests/stores/suite.rs`.

#[path = "../../../tests/common/mod.rs"]
mod common;
#[path = "../../../tests/common/rediscluster.rs"]
mod rediscluster;

mod cluster;
mod eviction;
mod faults;
#[cfg(feature = "redis-tls")]
mod tls;
