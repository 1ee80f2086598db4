//! The load generator: `connections` hyper 1 HTTP/1.1 clients, each on its own
//! keep-alive connection, sending one request at a time (closed loop) for a
//! warm-up and then a measuring window.
//!
//! A request counts when it was sent after the warm-up ended and its response
//! body was read in full before the window closed. Its latency (send to last
//! body byte, microseconds) goes into an HDR histogram with 3 significant
//! digits. Every response is checked by the scenario; a response that fails
//! its check is counted as an error, and the first error's text is kept.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Builds request number `seq` of connection `conn`.
pub type MakeRequest = Arc<dyn Fn(usize, u64) -> Request<Full<Bytes>> + Send + Sync>;

/// Checks one response (head and full body); `Err` names what was wrong.
pub type Check = Arc<dyn Fn(&Response<()>, &Bytes) -> Result<(), String> + Send + Sync>;

/// How long and how wide.
#[derive(Clone, Copy, Debug)]
pub struct LoadConfig {
    pub connections: usize,
    pub warmup: Duration,
    pub window: Duration,
}

/// What one run measured.
#[derive(Debug)]
pub struct LoadResult {
    /// Requests counted in the window.
    pub requests: u64,
    /// Every request whose response passed its check, warm-up included
    /// (the handler's effects must match this count exactly).
    pub answered: u64,
    pub rps: f64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
    pub errors: u64,
    pub first_error: Option<String>,
}

/// One HTTP/1.1 keep-alive connection to `addr`.
pub async fn connect(addr: SocketAddr) -> hyper::client::conn::http1::SendRequest<Full<Bytes>> {
    let stream = TcpStream::connect(addr)
        .await
        .expect("connect to the server");
    stream.set_nodelay(true).expect("TCP_NODELAY");
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("HTTP/1.1 handshake");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    sender
}

/// Sends one request on `sender` and reads the whole response.
pub async fn send(
    sender: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    request: Request<Full<Bytes>>,
) -> Result<(Response<()>, Bytes), String> {
    sender.ready().await.map_err(|e| e.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    let (parts, body) = response.into_parts();
    let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok((Response::from_parts(parts, ()), body))
}

/// Runs the load against `addr`. Call from inside the load generator's runtime.
pub async fn run(
    addr: SocketAddr,
    config: LoadConfig,
    make: MakeRequest,
    check: Check,
) -> LoadResult {
    let start = Instant::now();
    let measure_from = start + config.warmup;
    let end = measure_from + config.window;
    let answered = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..config.connections)
        .map(|conn| {
            let (make, check, answered) = (make.clone(), check.clone(), answered.clone());
            tokio::spawn(async move {
                let mut sender = connect(addr).await;
                let mut histogram =
                    Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds");
                let (mut errors, mut first_error) = (0u64, None);
                let mut seq = 0u64;
                while Instant::now() < end {
                    let request = make(conn, seq);
                    seq += 1;
                    let sent = Instant::now();
                    let outcome = send(&mut sender, request).await;
                    let done = Instant::now();
                    let verdict = match &outcome {
                        Ok((head, body)) => check(head, body),
                        Err(e) => Err(format!("transport: {e}")),
                    };
                    if let Err(e) = verdict {
                        errors += 1;
                        first_error.get_or_insert(e);
                        if outcome.is_err() {
                            sender = connect(addr).await;
                        }
                        continue;
                    }
                    answered.fetch_add(1, Ordering::Relaxed);
                    if sent >= measure_from && done <= end {
                        let micros = done.duration_since(sent).as_micros() as u64;
                        histogram.saturating_record(micros.max(1));
                    }
                }
                (histogram, errors, first_error)
            })
        })
        .collect();
    let mut total = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("histogram bounds");
    let (mut errors, mut first_error) = (0, None);
    for task in tasks {
        let (histogram, e, first) = task.await.expect("a load task panicked");
        total.add(histogram).expect("same bounds");
        errors += e;
        if first_error.is_none() {
            first_error = first;
        }
    }
    let requests = total.len();
    LoadResult {
        requests,
        answered: answered.load(Ordering::Relaxed),
        rps: requests as f64 / config.window.as_secs_f64(),
        p50_us: total.value_at_quantile(0.50),
        p99_us: total.value_at_quantile(0.99),
        max_us: total.max(),
        errors,
        first_error,
    }
}
