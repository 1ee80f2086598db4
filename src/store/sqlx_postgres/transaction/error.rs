//! [`SqlxPostgresError`]: what a transactional handler on
//! [`SqlxPostgresStore`](crate::store::SqlxPostgresStore) returns, so that
//! both of its calls take `?`.

use crate::store::StoreError;

/// The error of a handler writing through a
/// [`SqlxPostgresTransaction`](super::SqlxPostgresTransaction): the
/// transaction could not be had ([`SqlxPostgresTransaction::connection`](super::SqlxPostgresTransaction::connection)
/// failed), or a statement failed. `From` both, so a handler returning
/// `Result<_, SqlxPostgresError>` uses `?` on each call and gets one flat
/// `Result`.
///
/// With the `axum` feature it is a response: `Store` as the store's problem
/// (503 `store-unavailable` with `Retry-After`), `Sql` as a 500 problem whose
/// detail does not echo the SQL error (it is logged at error level instead).
/// Either is a 5xx, which the default store policy does not store: the
/// transaction rolls back and the key is given back for a retry.
#[derive(Debug)]
#[non_exhaustive]
pub enum SqlxPostgresError {
    /// The transaction has ended or cannot be had: see [`StoreError`].
    Store(StoreError),
    /// A statement failed.
    Sql(sqlx::Error),
}

impl From<StoreError> for SqlxPostgresError {
    fn from(e: StoreError) -> Self {
        SqlxPostgresError::Store(e)
    }
}

impl From<sqlx::Error> for SqlxPostgresError {
    fn from(e: sqlx::Error) -> Self {
        SqlxPostgresError::Sql(e)
    }
}

impl std::fmt::Display for SqlxPostgresError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SqlxPostgresError::Store(e) => e.fmt(f),
            SqlxPostgresError::Sql(e) => {
                write!(f, "SQL in the idempotency transaction failed: {e}")
            }
        }
    }
}

impl std::error::Error for SqlxPostgresError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SqlxPostgresError::Store(e) => Some(e),
            SqlxPostgresError::Sql(e) => Some(e),
        }
    }
}

#[cfg(feature = "axum")]
impl axum_core::response::IntoResponse for SqlxPostgresError {
    fn into_response(self) -> axum_core::response::Response {
        match self {
            SqlxPostgresError::Store(e) => e.into_response(),
            SqlxPostgresError::Sql(e) => {
                tracing::error!(error = %e, "a handler's SQL failed; answering 500");
                crate::extract::internal_error(
                    "a database statement failed while this request was processed",
                )
            }
        }
    }
}
