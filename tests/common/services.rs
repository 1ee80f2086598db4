//! The servers the full test run needs, read in one place: each from its
//! `TOWER_IDEMPOTENCY_*_URL`, else the local default that `.ci/run` starts
//! (see `docs/testing.md`). A test that cannot reach its server fails; none
//! is skipped.

/// PostgreSQL: `TOWER_IDEMPOTENCY_POSTGRES_URL`, else the `test` database
/// on 127.0.0.1:5432.
pub fn postgres_url() -> String {
    from_env(
        "TOWER_IDEMPOTENCY_POSTGRES_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    )
}

/// MySQL or MariaDB: `TOWER_IDEMPOTENCY_MYSQL_URL`, else the `test`
/// database on 127.0.0.1:3306.
pub fn mysql_url() -> String {
    from_env(
        "TOWER_IDEMPOTENCY_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
    )
}

/// Redis: `TOWER_IDEMPOTENCY_REDIS_URL`, else 127.0.0.1:6379.
pub fn redis_url() -> String {
    from_env("TOWER_IDEMPOTENCY_REDIS_URL", "redis://127.0.0.1:6379")
}

/// NATS with JetStream: `TOWER_IDEMPOTENCY_NATS_URL`, else 127.0.0.1:4222.
pub fn nats_url() -> String {
    from_env("TOWER_IDEMPOTENCY_NATS_URL", "nats://127.0.0.1:4222")
}

/// `url` with its database replaced by `db`.
pub fn with_database(url: &str, db: &str) -> String {
    let cut = url.rfind('/').expect("a database in the URL");
    format!("{}/{db}", &url[..cut])
}

fn from_env(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// The sessions of the current database that wait for the advisory lock
/// `$1` (a `bigint`: PostgreSQL splits it into `classid`, the high 32 bits,
/// and `objid`, the low ones, with `objsubid` 1), as `pid`s. A test watches
/// its own lock's waiters, so tests on one database run side by side.
pub const ADVISORY_WAITERS: &str = "SELECT pid FROM pg_locks \
     WHERE locktype = 'advisory' AND NOT granted AND objsubid = 1 \
       AND ((classid::bigint << 32) | objid::bigint) = $1 \
       AND database = (SELECT oid FROM pg_database WHERE datname = current_database())";
