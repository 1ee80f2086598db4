//! `--notify-url URL`: every applied credit enqueues, in the transaction that
//! writes it, one notification `POST URL` with the body
//! `{"credit_id":N,"account_id":N,"amount":N}`, which the ledger's outbox
//! relay delivers with a stable `Idempotency-Key` (see the README's
//! "Notifications").
//!
//! The key is message 0 of the credit request
//! (`tower_idempotency::outbox::message_key` over the caller's scope and the
//! request's idempotency key): the same on every attempt, after restarts,
//! and for a credit rolled back and retried; different for every other
//! credit, since each credit is one request with a key of its own.

#[cfg(not(feature = "outbox"))]
pub use disabled::*;
#[cfg(feature = "outbox")]
pub use enabled::*;

#[cfg(feature = "outbox")]
mod enabled {
    use std::time::Duration;

    use bytes::Bytes;
    use http_body_util::Full;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    use tower_idempotency::key::ClaimedKey;
    use tower_idempotency::outbox::{self, HttpSink, Message, Outbox};

    use crate::db::{Json, LedgerError, Op};
    use crate::{ApiError, AppState, Tx};

    /// Between attempts at most this long (the contract's "at most 2 s").
    const MAX_BACKOFF: Duration = Duration::from_secs(2);
    /// No answer within this long is a failed attempt.
    const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
    /// A relay holds a notification at most this long.
    const LEASE: Duration = Duration::from_secs(15);

    /// What a credit's handler needs to enqueue its notification.
    #[derive(Clone)]
    pub struct Notifier {
        url: String,
    }

    /// Checks `--notify-url`: an absolute `http://` URL.
    pub fn parse_url(url: &str) -> Result<String, String> {
        let uri: http::Uri = url
            .parse()
            .map_err(|e| format!("--notify-url {url:?}: {e}"))?;
        if uri.scheme_str() != Some("http") || uri.authority().is_none() {
            return Err(format!(
                "--notify-url {url:?}: want an absolute http:// URL"
            ));
        }
        Ok(url.to_owned())
    }

    /// Opens the outbox in the ledger's database (creating its table) and
    /// starts its relay; `db` is the `--db` path or `postgres://` URL.
    pub async fn start(
        url: String,
        db: &str,
        postgres: bool,
    ) -> Result<Notifier, Box<dyn std::error::Error>> {
        let outbox = if postgres {
            open_postgres(db).await?
        } else {
            Outbox::sqlite(db).await?
        };
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        outbox
            .relay(HttpSink::new(client))
            .backoff(Duration::from_millis(100), MAX_BACKOFF)
            .max_attempts(None)
            .answer_timeout(ANSWER_TIMEOUT)
            .lease(LEASE)
            .poll_interval(Duration::from_millis(100))
            .spawn();
        Ok(Notifier { url })
    }

    #[cfg(feature = "postgres")]
    async fn open_postgres(url: &str) -> Result<Outbox, Box<dyn std::error::Error>> {
        let store = tower_idempotency::PostgresStore::open(url).await?;
        Ok(Outbox::postgres(&store).await?)
    }

    #[cfg(not(feature = "postgres"))]
    async fn open_postgres(_: &str) -> Result<Outbox, Box<dyn std::error::Error>> {
        Err("this build has no PostgreSQL store: build with `--features postgres`".into())
    }

    impl Notifier {
        /// The notification of the credit whose response is `credit`.
        fn message(&self, claimed: &ClaimedKey, credit: &Json) -> Result<Message, LedgerError> {
            #[derive(serde::Deserialize, serde::Serialize)]
            struct Notice {
                credit_id: i64,
                account_id: i64,
                amount: i64,
            }
            let database = |e: Box<dyn std::error::Error + Send + Sync>| LedgerError::Database(e);
            let notice: Notice =
                serde_json::from_str(&credit.0).map_err(|e| database(Box::new(e)))?;
            let body = serde_json::to_vec(&notice).map_err(|e| database(Box::new(e)))?;
            Message::new(claimed, 0, self.url.clone(), "application/json", body)
                .map_err(|e| database(Box::new(e)))
        }
    }

    /// Runs a credit inside the request's idempotency transaction and, with
    /// `--notify-url`, enqueues its notification in the same transaction.
    pub async fn write_credit(
        state: &AppState,
        tx: Tx,
        op: Op,
        claimed: Option<ClaimedKey>,
    ) -> Result<Json, ApiError> {
        let Some(notifier) = state.notify.clone() else {
            return crate::write(state, tx, op).await;
        };
        let no_tx = || {
            ApiError::Ledger(LedgerError::Database(
                "no idempotency transaction for this request".into(),
            ))
        };
        let claimed = claimed.ok_or_else(no_tx)?;
        match tx {
            Tx::Sqlite(tx) => {
                let sql_error = |e: tower_idempotency::store::TransactionError| {
                    LedgerError::Database(Box::new(e))
                };
                Ok(tx
                    .run(move |tx| {
                        let json = match op.on_sqlite(tx) {
                            Ok(json) => json,
                            Err(e) => return Ok(Err(e)),
                        };
                        let message = match notifier.message(&claimed, &json) {
                            Ok(message) => message,
                            Err(e) => return Ok(Err(e)),
                        };
                        outbox::sqlite::enqueue(tx, &message)?;
                        Ok(Ok(json))
                    })
                    .await
                    .map_err(sql_error)??)
            }
            #[cfg(feature = "postgres")]
            Tx::Postgres(tx) => {
                let client = tx
                    .client()
                    .await
                    .map_err(|e| LedgerError::Database(Box::new(e)))?;
                let json = op.on_postgres(&*client).await?;
                let message = notifier.message(&claimed, &json)?;
                outbox::postgres::enqueue(&*client, &message)
                    .await
                    .map_err(|e| LedgerError::Database(Box::new(e)))?;
                Ok(json)
            }
            Tx::None => Err(no_tx()),
            // parse_args refuses --notify-url with the sqlx and MySQL drivers.
            #[allow(unreachable_patterns)]
            _ => Err(ApiError::Ledger(LedgerError::Database(
                "--notify-url works with the default drivers only".into(),
            ))),
        }
    }
}

/// A build without the `outbox` feature: `--notify-url` is refused.
#[cfg(not(feature = "outbox"))]
mod disabled {
    use tower_idempotency::key::ClaimedKey;

    use crate::db::{Json, Op};
    use crate::{ApiError, AppState, Tx};

    #[derive(Clone)]
    pub enum Notifier {}

    pub fn parse_url(_: &str) -> Result<String, String> {
        Err("--notify-url needs a build with `--features outbox`".into())
    }

    pub async fn start(
        _: String,
        _: &str,
        _: bool,
    ) -> Result<Notifier, Box<dyn std::error::Error>> {
        Err("--notify-url needs a build with `--features outbox`".into())
    }

    pub async fn write_credit(
        state: &AppState,
        tx: Tx,
        op: Op,
        _: Option<ClaimedKey>,
    ) -> Result<Json, ApiError> {
        if let Some(never) = &state.notify {
            match *never {}
        }
        crate::write(state, tx, op).await
    }
}
