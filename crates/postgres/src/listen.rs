//! The store's listener: one dedicated connection that `LISTEN`s on the
//! kit's channel and hands each announcement (a completion or release on
//! any server, `complete_notify` / `release_notify`) to the store's
//! [`Feed`], which wakes the repeats waiting on that key here. Started by
//! the first waiter that watches; the kit's [`Feed::start`] connects it
//! again with backoff (100 ms doubling to 5 s) when its connection drops,
//! and waiters poll quickly meanwhile; ends when the last store handle is
//! dropped.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio_postgres::{AsyncMessage, Client, Connection};
use tower_idempotency::store::kit::feed::{Ended, Feed, FeedListener, Subscriber};
use tower_idempotency::store::kit::pg_sql::NOTIFY_CHANNEL;

use super::connect::Target;
#[cfg(feature = "tls")]
use super::sslmode::SslMode;

/// Starts the listener of `feed` once, on the current runtime.
pub(super) fn start(feed: &Feed, target: &Arc<Target>) {
    feed.start(|| Listen(target.clone()));
}

/// The listener's connection: the store's own target.
struct Listen(Arc<Target>);

impl Subscriber for Listen {
    type Error = tokio_postgres::Error;
    const CONNECTION: &'static str = "LISTEN";

    async fn session(&mut self, feed: &mut FeedListener) -> Result<Ended, tokio_postgres::Error> {
        let target = &self.0;
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
                Poll::Ready(None) => return Poll::Ready(Ok(Ended::Closed)),
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
