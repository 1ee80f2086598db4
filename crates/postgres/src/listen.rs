//! The store's listener: one dedicated connection that `LISTEN`s on the
//! kit's channel and hands each announcement (a completion or release on
//! any server, `complete_notify` / `release_notify`) to the store's
//! [`Feed`], which wakes the repeats waiting on that key here. Started by
//! the first waiter that watches; reconnects with backoff (100 ms doubling
//! to 5 s) when its connection drops, and waiters poll quickly meanwhile;
//! ends when the last store handle is dropped.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio_postgres::{AsyncMessage, Client, Connection};
use tower_idempotency::store::kit::feed::{Feed, FeedListener};
use tower_idempotency::store::kit::pg_sql::NOTIFY_CHANNEL;

use super::connect::Target;
#[cfg(feature = "tls")]
use super::sslmode::SslMode;

const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Starts the listener of `feed` once, on the current runtime.
pub(super) fn start(feed: &Feed, target: &Arc<Target>) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    if feed.start_once() {
        runtime.spawn(run(feed.listener(), target.clone()));
    }
}

async fn run(mut feed: FeedListener, target: Arc<Target>) {
    let mut backoff = BACKOFF_FIRST;
    loop {
        match session(&target, &mut feed).await {
            Ok(Ended::Stopped) => return,
            Ok(Ended::Live) => backoff = BACKOFF_FIRST,
            Ok(Ended::NeverLive) => {}
            Err(e) => tracing::warn!(
                error = %e,
                "the idempotency store's LISTEN connection failed; waiters poll until it is back"
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

/// How a session ended.
enum Ended {
    /// Every store handle is gone.
    Stopped,
    /// The connection closed after it listened.
    Live,
    /// The connection closed before it listened.
    NeverLive,
}

async fn session(target: &Target, feed: &mut FeedListener) -> Result<Ended, tokio_postgres::Error> {
    #[cfg(feature = "tls")]
    if target.mode != SslMode::Disable {
        // `open` built this connector already: it does not fail here.
        if let Ok(connector) = super::tls::connector(target.mode, &target.root_cert) {
            let (client, connection) = target.config.connect(connector).await?;
            return listen(client, connection, feed).await;
        }
    }
    let (client, connection) = target.config.connect(tokio_postgres::NoTls).await?;
    listen(client, connection, feed).await
}

/// Runs `LISTEN`, then delivers notifications until the connection ends or
/// the store is dropped. One task drives both the connection and the
/// client's request, polled by hand.
async fn listen<S, T>(
    client: Client,
    mut connection: Connection<S, T>,
    feed: &mut FeedListener,
) -> Result<Ended, tokio_postgres::Error>
where
    S: AsyncRead + AsyncWrite + Unpin,
    T: AsyncRead + AsyncWrite + Unpin,
{
    let statement = format!("LISTEN {NOTIFY_CHANNEL}");
    let mut subscribe = pin!(client.batch_execute(&statement));
    let mut live = false;
    std::future::poll_fn(|cx| {
        if feed.poll_stopped(cx).is_ready() {
            return Poll::Ready(Ok(Ended::Stopped));
        }
        loop {
            match connection.poll_message(cx) {
                Poll::Ready(Some(Ok(AsyncMessage::Notification(n)))) => feed.deliver(n.payload()),
                Poll::Ready(Some(Ok(_))) => {}
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Err(e)),
                Poll::Ready(None) => {
                    return Poll::Ready(Ok(if live { Ended::Live } else { Ended::NeverLive }));
                }
                Poll::Pending => break,
            }
        }
        if !live {
            match subscribe.as_mut().poll(cx) {
                Poll::Ready(Ok(())) => {
                    live = true;
                    feed.set_live();
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {}
            }
        }
        Poll::Pending
    })
    .await
}
