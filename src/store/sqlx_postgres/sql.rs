//! The statements of [`SqlxPostgresStore`](super::SqlxPostgresStore), with
//! the table name in them. Text, schema and advisory lock keys are those of
//! `PostgresStore` (feature `postgres`): the two stores read and write the
//! same records, and exclude each other on the same keys.

use std::sync::Arc;

use sqlx::postgres::{PgArguments, Postgres};
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

use crate::fingerprint::Hasher;

pub(super) struct Sql {
    pub(super) table: String,
    /// The key's advisory lock, then the server's clock (unix ms) plus `$2`.
    pub(super) lock_now: SqlStr,
    /// The read-first replay (see `store::pg_sql`).
    pub(super) completed: SqlStr,
    pub(super) insert: SqlStr,
    pub(super) select: SqlStr,
    pub(super) take_over: SqlStr,
    pub(super) complete: SqlStr,
    pub(super) release: SqlStr,
    pub(super) purge: SqlStr,
    pub(super) stuck: SqlStr,
    pub(super) counts: SqlStr,
}

/// A statement whose only dynamic part is the table name, which
/// `SqlxPostgresStoreBuilder::open` has checked (ASCII letters, digits and
/// underscores): every value is a bind parameter.
pub(super) fn checked(sql: String) -> SqlStr {
    AssertSqlSafe(Arc::<str>::from(sql)).into_sql_str()
}

/// `sqlx::query` of a prepared statement of [`Sql`] (a cheap clone).
pub(super) fn query(sql: &SqlStr) -> sqlx::query::Query<'static, Postgres, PgArguments> {
    sqlx::query(sql.clone())
}

/// The server's clock in unix milliseconds, shifted by parameter `$n` (ms).
fn now_ms(n: u8) -> String {
    format!("(floor(extract(epoch from clock_timestamp()) * 1000)::bigint + ${n}::bigint)")
}

impl Sql {
    pub(super) fn new(table: &str) -> Sql {
        Sql {
            table: table.to_owned(),
            lock_now: checked(crate::store::pg_sql::lock_now()),
            completed: checked(crate::store::pg_sql::completed(table)),
            insert: checked(format!(
                "INSERT INTO {table} (scope, key, fingerprint, token, state, lease_until, expires_at)
                 VALUES ($1, $2, $3, $4, 'in_flight', $5, $6)
                 ON CONFLICT (scope, key) DO NOTHING"
            )),
            select: checked(format!(
                "SELECT fingerprint, state, lease_until, expires_at, response
                 FROM {table} WHERE scope = $1 AND key = $2 FOR UPDATE"
            )),
            take_over: checked(format!(
                "UPDATE {table}
                 SET fingerprint = $3, token = $4, state = 'in_flight',
                     lease_until = $5, expires_at = $6, response = NULL
                 WHERE scope = $1 AND key = $2"
            )),
            complete: checked(format!(
                "UPDATE {table} SET state = 'completed', response = $4
                 WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_flight'"
            )),
            release: checked(format!(
                "DELETE FROM {table}
                 WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_flight'"
            )),
            purge: checked(format!(
                "DELETE FROM {table} WHERE expires_at <= {}",
                now_ms(1)
            )),
            // The clock is read once per statement (a MATERIALIZED CTE is
            // evaluated once), so every row is judged at the same instant.
            stuck: checked(format!(
                "WITH now AS MATERIALIZED (SELECT {} AS ms)
                 SELECT scope, key, fingerprint, lease_until, expires_at, now.ms
                 FROM {table}, now
                 WHERE state = 'in_flight' AND lease_until <= now.ms AND expires_at > now.ms
                 ORDER BY lease_until, scope, key
                 LIMIT $2",
                now_ms(1)
            )),
            counts: checked(format!(
                "WITH now AS MATERIALIZED (SELECT {} AS ms)
                 SELECT
                    count(*) FILTER (WHERE expires_at > now.ms AND state = 'in_flight' AND lease_until > now.ms),
                    count(*) FILTER (WHERE expires_at > now.ms AND state = 'in_flight' AND lease_until <= now.ms),
                    count(*) FILTER (WHERE expires_at > now.ms AND state = 'completed'),
                    count(*) FILTER (WHERE expires_at <= now.ms)
                 FROM {table}, now",
                now_ms(1)
            )),
        }
    }

    /// The table and its index, created if missing.
    pub(super) fn schema(&self) -> SqlStr {
        let table = &self.table;
        checked(format!(
            "CREATE TABLE IF NOT EXISTS {table} (
                scope       TEXT   NOT NULL,
                key         TEXT   NOT NULL,
                fingerprint BYTEA  NOT NULL,
                token       BIGINT NOT NULL,
                state       TEXT   NOT NULL CHECK (state IN ('in_flight', 'completed')),
                lease_until BIGINT NOT NULL, -- unix ms, server clock
                expires_at  BIGINT NOT NULL, -- unix ms, server clock
                response    BYTEA,
                PRIMARY KEY (scope, key)
            );
            CREATE INDEX IF NOT EXISTS {table}_expires_at ON {table} (expires_at);"
        ))
    }
}

/// The advisory lock key of a record: 64 bits of SHA-256 over table, scope
/// and key, framed so no two records share an input (`PostgresStore`'s).
pub(super) fn advisory_key(table: &str, scope: &str, key: &str) -> i64 {
    let mut hasher = Hasher::new("tower-idempotency/pg-lock/v1");
    hasher
        .part(table.as_bytes())
        .part(scope.as_bytes())
        .part(key.as_bytes());
    let digest = hasher.finish().0;
    i64::from_be_bytes([
        digest[0], digest[1], digest[2], digest[3], digest[4], digest[5], digest[6], digest[7],
    ])
}
