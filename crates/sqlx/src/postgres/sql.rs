//! The statements of [`SqlxPostgresStore`](super::SqlxPostgresStore) as
//! sqlx keeps them. Text, schema and advisory lock keys are
//! `store::kit::pg_sql`'s, shared with `PostgresStore` (`tower-idempotency-postgres`).

use std::sync::Arc;

use sqlx::postgres::{PgArguments, Postgres};
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

pub(super) use tower_idempotency::store::kit::pg_sql::{
    PgSql, advisory_key, schema, schema_current,
};

/// The statements, with the table name in them: PostgreSQL's one set.
pub(super) type Sql = PgSql<SqlStr>;

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
