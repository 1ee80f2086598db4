//! A TCP proxy to the test's PostgreSQL server that can hold the next new
//! connection until the test lets it through: the stray-cancel tests
//! (`two_phase_stray_cancel`, `sqlx_stray_cancel`) hold the max-hold
//! timer's cancel connection with it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

/// A proxy started by [`Proxy::start`].
pub(crate) struct Proxy {
    /// The server's URL through the proxy.
    pub(crate) url: String,
    /// The next connection accepted is held until `resume`.
    pub(crate) stall_next: Arc<AtomicBool>,
    /// A held connection arrived.
    pub(crate) stalled: Arc<Notify>,
    pub(crate) resume: Arc<Notify>,
    /// The held connection, let through, has ended.
    pub(crate) done: Arc<Notify>,
}

impl Proxy {
    /// A proxy to the server of `common::services::postgres_url()`.
    pub(crate) async fn start() -> Proxy {
        let (upstream, template) = upstream();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let p = Proxy {
            url: format!("postgres://{}", template.replace("{proxy}", &addr)),
            stall_next: Arc::default(),
            stalled: Arc::default(),
            resume: Arc::default(),
            done: Arc::default(),
        };
        let (stall_next, stalled, resume, done) = (
            p.stall_next.clone(),
            p.stalled.clone(),
            p.resume.clone(),
            p.done.clone(),
        );
        tokio::spawn(async move {
            loop {
                let (mut client, _) = listener.accept().await.unwrap();
                let stall = stall_next.swap(false, Ordering::SeqCst);
                let (stalled, resume, done) = (stalled.clone(), resume.clone(), done.clone());
                tokio::spawn(async move {
                    if stall {
                        stalled.notify_one();
                        resume.notified().await;
                    }
                    if let Ok(mut server) = TcpStream::connect(upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                    if stall {
                        done.notify_one();
                    }
                });
            }
        });
        p
    }
}

/// The PostgreSQL server's address in the test's URL (host 127.0.0.1 or
/// localhost, port given or 5432), and the URL with `{proxy}` for its host
/// and port.
fn upstream() -> (SocketAddr, String) {
    let url = crate::common::services::postgres_url();
    let rest = url.split("://").nth(1).unwrap();
    let (auth, rest) = rest.split_once('@').unwrap_or(("", rest));
    let (hostport, db) = rest.split_once('/').unwrap_or((rest, "postgres"));
    let port: u16 = hostport
        .split_once(':')
        .map(|(_, p)| p.parse().unwrap())
        .unwrap_or(5432);
    let auth = if auth.is_empty() {
        String::new()
    } else {
        format!("{auth}@")
    };
    (
        SocketAddr::from(([127, 0, 0, 1], port)),
        format!("{auth}{{proxy}}/{db}"),
    )
}
