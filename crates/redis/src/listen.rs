//! The store's subscriber: one dedicated pub/sub connection (one server;
//! a Redis Cluster has none, and its waiters poll) that `SUBSCRIBE`s to the
//! store's channel, `{prefix}changes`, and hands each announcement (the
//! `complete` and `release` scripts `PUBLISH` one, on any server) to the
//! store's [`Feed`], which wakes the repeats waiting on that key here.
//! Started by the first waiter that watches; reconnects with backoff
//! (100 ms doubling to 5 s) when its connection drops, and waiters poll
//! quickly meanwhile; ends when the last store handle is dropped.

use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use futures_core::Stream;
use tower_idempotency::store::kit::feed::{Feed, FeedListener};

const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// The channel of the store with `prefix`.
pub(super) fn channel(prefix: &str) -> String {
    format!("{prefix}changes")
}

/// Starts the subscriber of `feed` once, on the current runtime.
pub(super) fn start(feed: &Feed, client: &::redis::Client, channel: &Arc<str>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    if feed.start_once() {
        runtime.spawn(run(feed.listener(), client.clone(), channel.clone()));
    }
}

async fn run(mut feed: FeedListener, client: ::redis::Client, channel: Arc<str>) {
    let mut backoff = BACKOFF_FIRST;
    loop {
        match session(&client, &channel, &mut feed).await {
            Ok(true) => return,
            Ok(false) => backoff = BACKOFF_FIRST,
            Err(e) => tracing::warn!(
                error = %e,
                "the idempotency store's pub/sub connection failed; waiters poll until it is back"
            ),
        }
        feed.set_down();
        let stopped = std::future::poll_fn(|cx| feed.poll_stopped(cx));
        if tokio::time::timeout(backoff, stopped).await.is_ok() {
            return;
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// Subscribes, then delivers messages until the connection ends (`false`)
/// or the store is dropped (`true`).
async fn session(
    client: &::redis::Client,
    channel: &str,
    feed: &mut FeedListener,
) -> Result<bool, ::redis::RedisError> {
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe(channel).await?;
    feed.set_live();
    let mut messages = Box::pin(pubsub.into_on_message());
    Ok(std::future::poll_fn(|cx| {
        if feed.poll_stopped(cx).is_ready() {
            return Poll::Ready(true);
        }
        loop {
            match Pin::new(&mut messages).as_mut().poll_next(cx) {
                Poll::Ready(Some(message)) => {
                    if let Ok(payload) = std::str::from_utf8(message.get_payload_bytes()) {
                        feed.deliver(payload);
                    }
                }
                Poll::Ready(None) => return Poll::Ready(false),
                Poll::Pending => return Poll::Pending,
            }
        }
    })
    .await)
}
