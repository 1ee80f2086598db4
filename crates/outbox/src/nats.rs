//! [`NatsSink`]: the outbox's NATS JetStream sink (feature `nats`).
//!
//! ```no_run
//! use tower_idempotency_outbox::{Outbox, nats::NatsSink};
//!
//! # async fn run(outbox: Outbox) -> Result<(), Box<dyn std::error::Error>> {
//! let client = async_nats::connect("nats://127.0.0.1:4222").await?;
//! let jetstream = async_nats::jetstream::new(client);
//! // Each message is published to the subject named by its destination,
//! // with `Nats-Msg-Id: <its key>`.
//! outbox.relay(NatsSink::new(jetstream)).spawn();
//! # Ok(()) }
//! ```
//!
//! # What an answer means
//!
//! Each attempt publishes the message with the header `Nats-Msg-Id` set to
//! its stable key (and `Content-Type` to its content type), and waits for
//! the stream's publish acknowledgement:
//!
//! * An ack: [`Outcome::Delivered`]. An ack flagged `duplicate` (the
//!   stream already holds a message with this `Nats-Msg-Id`, because an
//!   earlier attempt was stored but its ack, or the relay's record of it,
//!   was lost) is [`Outcome::Delivered`] too: the stream holds the message
//!   once.
//! * No ack within the relay's answer timeout (or the JetStream context's
//!   own timeout, 5 s by default), a broken connection, or any other
//!   failed publish: [`Outcome::Retry`].
//! * No stream listening on the subject (`no responders`):
//!   [`Outcome::Retry`], not a dead letter, because a stream may be
//!   created, or a clustered stream's leader elected, after the message was
//!   enqueued. [`Relay::max_attempts`](crate::Relay::max_attempts) still
//!   ends it as a dead letter, which an operator can requeue once the
//!   stream exists.
//! * A subject that can never be published to (empty, or with whitespace,
//!   an empty token or a wildcard token `*` or `>`): [`Outcome::Reject`].
//!
//! # How far JetStream de-duplicates
//!
//! A stream drops a message whose `Nats-Msg-Id` it has seen **within its
//! `duplicate_window`** (2 minutes unless the stream is configured
//! otherwise). So a re-send within that window, which is what a relay
//! crash between publish and record or a lost ack produces (the lease, 15 s
//! by default, plus the backoff), leaves exactly one message in the stream.
//! A re-send after the window (a relay down for longer than it, a dead
//! letter requeued later) is stored again. Consumers that must apply each
//! message once regardless keep the `Nats-Msg-Id` of what they applied
//! (for as long as re-sends can happen) and skip a message whose key they
//! have: the key is the same on every attempt. Make the window at least
//! the lease plus [`Relay::backoff`](crate::Relay::backoff)'s maximum if
//! the stream alone should de-duplicate relay re-sends.
//!
//! JetStream de-duplication: <https://docs.nats.io/using-nats/developer/develop_jetstream/model_deep_dive#message-deduplication>.

use std::future::Future;
use std::pin::Pin;

use async_nats::HeaderMap;
use async_nats::jetstream::context::{Context, PublishError, PublishErrorKind};
use async_nats::jetstream::publish::PublishAck;

use super::sink::{Delivery, Outcome, Sink};

/// Where a [`NatsSink`] publishes.
#[derive(Debug, Clone)]
enum Subject {
    /// The message's destination.
    Destination,
    /// One subject for every message.
    Fixed(String),
}

/// Publishes each message to a JetStream stream and waits for its
/// acknowledgement; see the [module docs](self) for what each answer means
/// and how far the stream de-duplicates.
#[derive(Debug, Clone)]
pub struct NatsSink {
    jetstream: Context,
    subject: Subject,
}

impl NatsSink {
    /// Publishes each message to the subject named by its destination
    /// (e.g. `Message::new(&claimed, 0, "orders.created", ...)`).
    pub fn new(jetstream: Context) -> NatsSink {
        NatsSink {
            jetstream,
            subject: Subject::Destination,
        }
    }

    /// Publishes every message to `subject`, whatever its destination.
    pub fn with_subject(jetstream: Context, subject: impl Into<String>) -> NatsSink {
        NatsSink {
            jetstream,
            subject: Subject::Fixed(subject.into()),
        }
    }

    /// The subject `d` goes to.
    fn subject_of<'a>(&'a self, d: &'a Delivery) -> &'a str {
        match &self.subject {
            Subject::Destination => &d.destination,
            Subject::Fixed(s) => s,
        }
    }
}

/// Whether `subject` can be published to: non-empty, no whitespace or
/// control characters, no empty token (`a..b`, a leading or trailing `.`),
/// no wildcard token (`*`, `>`), as the NATS protocol requires of a publish
/// subject.
pub fn valid_subject(subject: &str) -> bool {
    !subject.is_empty()
        && !subject.chars().any(|c| c.is_whitespace() || c.is_control())
        && subject
            .split('.')
            .all(|t| !t.is_empty() && t != "*" && t != ">")
}

/// What a publish's answer means for the message (see the [module
/// docs](self)).
pub fn classify(answer: Result<PublishAck, PublishError>) -> Outcome {
    match answer {
        Ok(_) => Outcome::Delivered,
        Err(e) => match e.kind() {
            PublishErrorKind::StreamNotFound => {
                Outcome::Retry(format!("no JetStream stream for the subject: {e}"))
            }
            // Set only by expectations this sink never sends: such a
            // message could never be stored.
            PublishErrorKind::WrongLastMessageId | PublishErrorKind::WrongLastSequence => {
                Outcome::Reject(format!("JetStream refused the message: {e}"))
            }
            _ => Outcome::Retry(format!("JetStream publish failed: {e}")),
        },
    }
}

impl Sink for NatsSink {
    fn deliver(&self, delivery: Delivery) -> Pin<Box<dyn Future<Output = Outcome> + Send + '_>> {
        Box::pin(async move {
            let subject = self.subject_of(&delivery).to_owned();
            if !valid_subject(&subject) {
                return Outcome::Reject(format!("invalid NATS subject {subject:?}"));
            }
            let mut headers = HeaderMap::new();
            headers.insert(async_nats::header::NATS_MESSAGE_ID, delivery.key.as_str());
            headers.insert("Content-Type", delivery.content_type.as_str());
            let ack = match self
                .jetstream
                .publish_with_headers(subject, headers, delivery.payload.clone())
                .await
            {
                Ok(ack) => ack,
                Err(e) => return classify(Err(e)),
            };
            classify(ack.await)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_are_checked() {
        for ok in ["orders", "orders.created", "a.b-c.d_e", "outbox2_x.1"] {
            assert!(valid_subject(ok), "{ok}");
        }
        for bad in [
            "", "a b", "a..b", ".a", "a.", "a.*", ">", "a.>.b", "a\tb", "a\nb",
        ] {
            assert!(!valid_subject(bad), "{bad:?}");
        }
    }

    #[test]
    fn answers_are_classified() {
        let e = |k| Err(PublishError::new(k));
        assert!(matches!(
            classify(e(PublishErrorKind::StreamNotFound)),
            Outcome::Retry(_)
        ));
        assert!(matches!(
            classify(e(PublishErrorKind::TimedOut)),
            Outcome::Retry(_)
        ));
        assert!(matches!(
            classify(e(PublishErrorKind::BrokenPipe)),
            Outcome::Retry(_)
        ));
        assert!(matches!(
            classify(e(PublishErrorKind::WrongLastMessageId)),
            Outcome::Reject(_)
        ));
    }
}
