//! MySQL/MariaDB (`--db mysql://...`, a build with `--features mysql`):
//! sqlx, whatever `--db-driver`. The ledger's tables share the idempotency
//! store's pool; MySQL has no `RETURNING` and writes `?` placeholders.

use sqlx::mysql::MySqlQueryResult;
use sqlx::{AssertSqlSafe, Executor, MySql, SqlSafeStr};
use tower_idempotency_sqlx::MySqlStore;

use crate::db::{BoxError, Done, REPLAY_CACHE, schema};
use crate::sqlx::{Dialect, SqlxDb};

/// Opens the store (its pool holds the ledger's tables too); it serves the
/// records when `records` (no `--key-store`).
pub async fn open(
    url: &str,
    records: bool,
) -> Result<(SqlxDb<MySql>, Option<MySqlStore>), BoxError> {
    let store = MySqlStore::builder(url)
        .replay_cache(REPLAY_CACHE)
        .open()
        .await?;
    let pool = store.pool().clone();
    let current = sqlx::query_scalar::<_, i64>(schema::MYSQL_CURRENT)
        .fetch_one(&pool)
        .await?
        == 1;
    for statement in schema::MYSQL.iter().filter(|_| !current) {
        match pool.execute(*statement).await {
            // The columns are there already (1060: duplicate column name).
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42S21") => {}
            done => {
                done?;
            }
        }
    }
    Ok((SqlxDb { pool }, records.then_some(store)))
}

impl Dialect for MySql {
    type Store = MySqlStore;

    #[cfg(feature = "outbox")]
    async fn outbox(
        store: &MySqlStore,
    ) -> Result<tower_idempotency_outbox::Outbox, tower_idempotency::StoreError> {
        tower_idempotency_outbox::Outbox::mysql(store).await
    }

    #[cfg(feature = "outbox")]
    fn enqueue<'a>(
        conn: &'a mut Self::Connection,
        message: &'a crate::notify::Message,
    ) -> impl std::future::Future<Output = Result<bool, sqlx::Error>> + Send + 'a {
        tower_idempotency_outbox::sqlx::enqueue(conn, message)
    }

    const RETURNING: bool = false;

    /// `$1`, `$2`, ... (always in order in the ledger's SQL) become `?`.
    fn sql(sql: &'static str) -> impl SqlSafeStr {
        let mut out = String::with_capacity(sql.len());
        let mut chars = sql.chars().peekable();
        while let Some(c) = chars.next() {
            if c == '$' {
                out.push('?');
                while chars.next_if(char::is_ascii_digit).is_some() {}
            } else {
                out.push(c);
            }
        }
        AssertSqlSafe(out)
    }

    fn done(result: &MySqlQueryResult) -> Done {
        Done {
            rows: result.rows_affected(),
            id: result.last_insert_id() as i64,
        }
    }
}
