//! The store's subscriber: one dedicated pub/sub connection (one server;
//! a Redis Cluster has none, and its waiters poll) that `SUBSCRIBE`s to the
//! store's channel, `{prefix}changes`, and hands each announcement (the
//! `complete` and `release` scripts `PUBLISH` one, on any server) to the
//! store's [`Feed`], which wakes the repeats waiting on that key here.
//! Started by the first waiter that watches; the kit's [`Feed::start`]
//! connects it again with backoff (100 ms doubling to 5 s) when its
//! connection drops, and waiters poll quickly meanwhile; ends when the last
//! store handle is dropped.

use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use futures_core::Stream;
use tower_idempotency::store::kit::feed::{Ended, Feed, FeedListener, Subscriber};

/// The channel of the store with `prefix`.
pub(super) fn channel(prefix: &str) -> String {
    format!("{prefix}changes")
}

/// Starts the subscriber of `feed` once, on the current runtime.
pub(super) fn start(feed: &Feed, client: &::redis::Client, channel: &Arc<str>) {
    feed.start(|| Subscribe {
        client: client.clone(),
        channel: channel.clone(),
    });
}

/// The subscriber's connection: the store's server and channel.
struct Subscribe {
    client: ::redis::Client,
    channel: Arc<str>,
}

impl Subscriber for Subscribe {
    type Error = ::redis::RedisError;
    const CONNECTION: &'static str = "pub/sub";

    /// Subscribes, then delivers messages until the connection ends or the
    /// store is dropped.
    async fn session(&mut self, feed: &mut FeedListener) -> Result<Ended, ::redis::RedisError> {
        let mut pubsub = self.client.get_async_pubsub().await?;
        pubsub.subscribe(&*self.channel).await?;
        feed.set_live();
        let mut messages = Box::pin(pubsub.into_on_message());
        Ok(std::future::poll_fn(|cx| {
            if feed.poll_stopped(cx).is_ready() {
                return Poll::Ready(Ended::Stopped);
            }
            loop {
                match Pin::new(&mut messages).as_mut().poll_next(cx) {
                    Poll::Ready(Some(message)) => {
                        if let Ok(payload) = std::str::from_utf8(message.get_payload_bytes()) {
                            feed.deliver(payload);
                        }
                    }
                    Poll::Ready(None) => return Poll::Ready(Ended::Closed),
                    Poll::Pending => return Poll::Pending,
                }
            }
        })
        .await)
    }
}
