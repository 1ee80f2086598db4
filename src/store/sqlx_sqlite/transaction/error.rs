//! [`SqlxSqliteError`]: the error of a transactional handler's statements,
//! answered as a problem.

#[cfg(any(doc, feature = "axum"))]
use crate::store::SqlxSqliteStore;
use crate::store::StoreError;

/// The error of a handler that writes through a
/// [`SqlxSqliteTransaction`](super::SqlxSqliteTransaction): the transaction
/// has ended, or a statement failed. `From` both, so `?` works on
/// [`SqlxSqliteTransaction::connection`](super::SqlxSqliteTransaction::connection)
/// and on sqlx's calls alike.
///
/// With the `axum` feature it is a response: `Store` as the store's problem
/// (503 `store-unavailable` with `Retry-After`); `Sql` with `SQLITE_BUSY` as
/// that same 503, logged with its likely cause (a write that did not go
/// through the request's transaction waits for the lock the request holds;
/// see [`SqlxSqliteStore::explain_busy`]); any other `Sql` as a 500 problem
/// whose detail does not echo the SQL error (it is logged instead). Either
/// answer is not stored by the default policy, so the transaction rolls back
/// and the key is free for a retry.
#[derive(Debug)]
#[non_exhaustive]
pub enum SqlxSqliteError {
    /// The transaction has ended: see [`StoreError`].
    Store(StoreError),
    /// A statement failed.
    Sql(sqlx::Error),
}

impl From<StoreError> for SqlxSqliteError {
    fn from(e: StoreError) -> Self {
        SqlxSqliteError::Store(e)
    }
}

impl From<sqlx::Error> for SqlxSqliteError {
    fn from(e: sqlx::Error) -> Self {
        SqlxSqliteError::Sql(e)
    }
}

impl std::fmt::Display for SqlxSqliteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SqlxSqliteError::Store(e) => e.fmt(f),
            SqlxSqliteError::Sql(e) => {
                write!(f, "SQL in the idempotency transaction failed: {e}")
            }
        }
    }
}

impl std::error::Error for SqlxSqliteError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SqlxSqliteError::Store(e) => Some(e),
            SqlxSqliteError::Sql(e) => Some(e),
        }
    }
}

#[cfg(feature = "axum")]
impl axum_core::response::IntoResponse for SqlxSqliteError {
    fn into_response(self) -> axum_core::response::Response {
        match self {
            SqlxSqliteError::Store(e) => e.into_response(),
            SqlxSqliteError::Sql(e) => match SqlxSqliteStore::explain_busy(&e) {
                Some(busy) => busy.into_response(),
                None => {
                    tracing::error!(error = %e, "a handler's SQL failed; answering 500");
                    crate::extract::internal_error(
                        "a database statement failed while this request was processed",
                    )
                }
            },
        }
    }
}
