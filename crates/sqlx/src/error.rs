//! [`SqlxError`]: what a transactional handler on a sqlx store returns
//! (`SqlxPostgresStore`, `SqlxSqliteStore`, `MySqlStore`), so that each of
//! its calls takes `?`.

use tower_idempotency::store::StoreError;

/// The error of a handler that writes through a sqlx store's transaction
/// (`SqlxPostgresTransaction`,
/// `SqlxSqliteTransaction`,
/// `MySqlTransaction`): the transaction
/// could not be had (its `connection()` failed), a statement failed, or
/// the handler built a value that a library refuses (an outbox message:
/// `tower-idempotency-outbox` converts its `MessageError` with `From`).
/// `From` each, so a handler returning `Result<_, SqlxError>` uses `?` on
/// every call.
///
/// With the `axum` feature it is a response, always a 5xx, which the default
/// store policy does not store, so the transaction rolls back and the key
/// is free for a retry:
///
/// * `Store`: the store's problem (503 `store-unavailable` with
///   `Retry-After`).
/// * `Sql`: on SQLite, `SQLITE_BUSY` answers as that same 503, logged with
///   its likely cause (see
///   `SqlxSqliteStore::explain_busy`);
///   any other statement error as a 500 problem whose detail does not echo
///   the SQL error (it is logged at error level instead).
/// * `Invalid`: a 500 problem, logged (the handler built a value that is
///   refused, such as a message the outbox cannot hold: a bug to fix, not a
///   condition to retry).
#[derive(Debug)]
#[non_exhaustive]
pub enum SqlxError {
    /// The transaction has ended or cannot be had: see [`StoreError`].
    Store(StoreError),
    /// A statement failed.
    Sql(sqlx::Error),
    /// The handler built a value that is refused (see [`SqlxError::invalid`]).
    Invalid(Box<dyn std::error::Error + Send + Sync>),
}

impl SqlxError {
    /// An `Invalid` error: `e` says what the handler built that a library
    /// (such as the outbox) refuses. Answered as a logged 500.
    pub fn invalid(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        SqlxError::Invalid(e.into())
    }
}

/// The error of a handler on [`SqlxPostgresStore`](crate::SqlxPostgresStore).
#[cfg(feature = "postgres")]
pub type SqlxPostgresError = SqlxError;

/// The error of a handler on [`SqlxSqliteStore`](crate::SqlxSqliteStore).
#[cfg(feature = "sqlite")]
pub type SqlxSqliteError = SqlxError;

impl From<StoreError> for SqlxError {
    fn from(e: StoreError) -> Self {
        SqlxError::Store(e)
    }
}

impl From<sqlx::Error> for SqlxError {
    fn from(e: sqlx::Error) -> Self {
        SqlxError::Sql(e)
    }
}

impl std::fmt::Display for SqlxError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SqlxError::Store(e) => e.fmt(f),
            SqlxError::Sql(e) => write!(f, "SQL in the idempotency transaction failed: {e}"),
            SqlxError::Invalid(e) => write!(f, "the handler built a value that is refused: {e}"),
        }
    }
}

impl std::error::Error for SqlxError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SqlxError::Store(e) => Some(e),
            SqlxError::Sql(e) => Some(e),
            SqlxError::Invalid(e) => Some(e.as_ref()),
        }
    }
}

#[cfg(feature = "axum")]
impl axum_core::response::IntoResponse for SqlxError {
    fn into_response(self) -> axum_core::response::Response {
        match self {
            SqlxError::Store(e) => e.into_response(),
            SqlxError::Sql(e) => {
                #[cfg(feature = "sqlite")]
                if let Some(busy) = crate::SqlxSqliteStore::explain_busy(&e) {
                    return busy.into_response();
                }
                tracing::error!(error = %e, "a handler's SQL failed; answering 500");
                tower_idempotency::__private::internal_error(
                    "a database statement failed while this request was processed",
                )
            }
            SqlxError::Invalid(e) => {
                tracing::error!(error = %e, "a handler built a value that is refused; answering 500");
                tower_idempotency::__private::internal_error(
                    "a value built while this request was processed was refused",
                )
            }
        }
    }
}
