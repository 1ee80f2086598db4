//! The store's listener (`notify_waiters`): one connection, outside the
//! application's pool, on which sqlx's [`PgListener`] `LISTEN`s on the
//! kit's channel and hands each announcement (a completion or release on
//! any server, `complete_notify` / `release_notify`, from this store or
//! `PostgresStore`) to the store's [`Feed`], which wakes the repeats
//! waiting on that key here. Started by the first waiter that watches; the
//! kit's [`Feed::start`] connects it again with backoff (100 ms doubling to
//! 5 s) when its connection drops, and waiters poll quickly meanwhile; ends
//! when the last store handle is dropped.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tower_idempotency::store::kit::feed::{Ended, Feed, FeedListener, Subscriber};
use tower_idempotency::store::kit::pg_sql::NOTIFY_CHANNEL;

/// Starts the listener of `feed` once, on the current runtime, connecting
/// as `pool` does.
pub(super) fn start(feed: &Feed, pool: &PgPool) {
    feed.start(|| Listen {
        options: pool.connect_options(),
        acquire_timeout: pool.options().get_acquire_timeout(),
    });
}

/// How the listener connects: the application pool's connect options and
/// acquire timeout.
struct Listen {
    options: Arc<PgConnectOptions>,
    acquire_timeout: Duration,
}

impl Subscriber for Listen {
    type Error = sqlx::Error;
    const CONNECTION: &'static str = "LISTEN";

    /// Connects, `LISTEN`s, then delivers notifications until the
    /// connection is lost or the store is dropped. Each session has a pool
    /// of its own, of one connection (a [`PgListener`] is made from a
    /// pool), so the listener never takes one of the application's
    /// connections, and a lost connection is never handed out again.
    async fn session(&mut self, feed: &mut FeedListener) -> Result<Ended, sqlx::Error> {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .max_lifetime(None)
            .idle_timeout(None)
            .acquire_timeout(self.acquire_timeout)
            .connect_lazy_with(PgConnectOptions::clone(&self.options));
        let mut listener = PgListener::connect_with(&pool).await?;
        // A lost connection ends the session (the feed goes down, waiters
        // poll quickly) instead of being replaced without a word.
        listener.eager_reconnect(false);
        listener.ignore_pool_close_event(true);
        listener.listen(NOTIFY_CHANNEL).await?;
        feed.set_live();
        loop {
            let received = {
                let mut next = pin!(listener.try_recv());
                std::future::poll_fn(|cx| {
                    if feed.poll_stopped(cx).is_ready() {
                        return Poll::Ready(None);
                    }
                    next.as_mut().poll(cx).map(Some)
                })
                .await
            };
            match received {
                None => return Ok(Ended::Stopped),
                Some(Ok(Some(notification))) => feed.deliver(notification.payload()),
                Some(Ok(None)) => return Ok(Ended::Closed),
                Some(Err(e)) => return Err(e),
            }
        }
    }
}
