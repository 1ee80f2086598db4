//! `--notify-url URL`: every applied credit enqueues, in the transaction that
//! writes it, one notification `POST URL` with the body
//! `{"credit_id":N,"account_id":N,"amount":N}`, which the ledger's outbox
//! relay delivers with a stable `Idempotency-Key` (see the README's
//! "Notifications").
//!
//! The key is message 0 of the credit request
//! (`tower_idempotency_outbox::message_key` over the caller's scope and the
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
    use tower_idempotency::seal::Keyring;
    pub use tower_idempotency_outbox::Message;
    use tower_idempotency_outbox::{HttpSink, Outbox};

    use crate::db::{Json, LedgerError};

    /// Between attempts at most this long (the contract's "at most 2 s").
    const MAX_BACKOFF: Duration = Duration::from_secs(2);
    /// A receiver's `Retry-After` is honoured up to this long.
    const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);
    /// No answer within this long is a failed attempt.
    const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
    /// A relay holds a notification at most this long.
    const LEASE: Duration = Duration::from_secs(15);

    /// Where credits are notified, and the keys that seal the
    /// notifications at rest (`--encryption-key-file`).
    #[derive(Clone)]
    pub struct Notifier {
        url: String,
        keys: Option<Keyring>,
    }

    /// The notification of one credit request.
    pub struct Notify {
        pub notifier: Notifier,
        pub claimed: ClaimedKey,
    }

    /// Checks `--notify-url`: an absolute `http://` URL.
    pub fn parse_url(url: &str) -> Result<String, String> {
        let uri: http::Uri = url.parse().map_err(|e| format!("{e}"))?;
        if uri.scheme_str() != Some("http") || uri.authority().is_none() {
            return Err("want an absolute http:// URL".into());
        }
        Ok(url.to_owned())
    }

    /// Starts the relay of `outbox`, the outbox in the ledger's database;
    /// with `keys`, notifications are sealed at rest and the relay opens
    /// them.
    pub fn start(url: String, outbox: Outbox, keys: Option<Keyring>) -> Notifier {
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let relay = outbox.relay(HttpSink::new(client));
        let relay = match &keys {
            Some(keys) => relay.keyring(keys.clone()),
            None => relay,
        };
        relay
            .backoff(Duration::from_millis(100), MAX_BACKOFF)
            .retry_after_max(MAX_RETRY_AFTER)
            .max_attempts(None)
            .answer_timeout(ANSWER_TIMEOUT)
            .lease(LEASE)
            .poll_interval(Duration::from_millis(100))
            .spawn();
        Notifier { url, keys }
    }

    impl Notify {
        /// The notification of the credit whose response is `credit`.
        pub fn message(&self, credit: &Json) -> Result<Message, LedgerError> {
            #[derive(serde::Deserialize, serde::Serialize)]
            struct Notice {
                credit_id: i64,
                account_id: i64,
                amount: i64,
            }
            let notice: Notice = serde_json::from_str(&credit.0)?;
            let body = serde_json::to_vec(&notice)?;
            let url = self.notifier.url.clone();
            let message = Message::new(&self.claimed, 0, url, "application/json", body)?;
            Ok(match &self.notifier.keys {
                Some(keys) => message.seal(keys)?,
                None => message,
            })
        }
    }
}

/// A build without the `outbox` feature: `--notify-url` is refused.
#[cfg(not(feature = "outbox"))]
mod disabled {
    use tower_idempotency::key::ClaimedKey;

    use crate::db::{Json, LedgerError};

    #[derive(Clone)]
    pub enum Notifier {}

    pub enum Message {}

    pub struct Notify {
        pub notifier: Notifier,
        pub claimed: ClaimedKey,
    }

    pub fn parse_url(_: &str) -> Result<String, String> {
        Err("--notify-url needs a build with `--features outbox`".into())
    }

    impl Notify {
        pub fn message(&self, _: &Json) -> Result<Message, LedgerError> {
            let _ = &self.claimed;
            match self.notifier {}
        }
    }
}
