//! HTTP over the simulated network: a client that opens one connection per
//! request (the clients' retries and the outbox's `HttpSink` use it), and
//! the downstream that receives the outbox's notifications.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use ::http::{Request, Response, StatusCode};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;

/// A response read to its end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub replayed: bool,
    pub retry_after: Option<u64>,
    pub body: Bytes,
}

/// Sends `request` to its URI's host on port 80 over a new connection.
pub async fn send(request: Request<Full<Bytes>>) -> Result<Answer, String> {
    let host = request.uri().host().ok_or("no host")?.to_owned();
    let stream = turmoil::net::TcpStream::connect((host.as_str(), 80))
        .await
        .map_err(|e| e.to_string())?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(connection);
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok());
    let replayed = header("idempotent-replayed") == Some("true");
    let retry_after = header("retry-after").and_then(|v| v.parse().ok());
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok(Answer {
        status,
        replayed,
        retry_after,
        body,
    })
}

/// [`send`] as the Tower HTTP client `HttpSink` takes.
#[derive(Clone)]
pub struct SimClient;

impl tower::Service<Request<Full<Bytes>>> for SimClient {
    type Response = Response<Full<Bytes>>;
    type Error = String;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, String>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), String>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Full<Bytes>>) -> Self::Future {
        Box::pin(async move {
            let answer = send(request).await?;
            let mut response = Response::new(Full::new(answer.body));
            *response.status_mut() =
                StatusCode::from_u16(answer.status).map_err(|e| e.to_string())?;
            Ok(response)
        })
    }
}

/// How the downstream answers a delivery, drawn by the fault schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mood {
    Fine,
    /// 503 without acting.
    Failing,
    /// Acts, then answers after longer than the relay waits.
    Late,
}

/// What the downstream saw: every delivery it acted on, by key.
#[derive(Default)]
pub struct Downstream {
    pub mood: Option<Mood>,
    /// key -> the payloads it acted on (one per delivery).
    pub acted: BTreeMap<String, Vec<Bytes>>,
    /// Deliveries refused while failing.
    pub refused: u64,
}

/// The downstream host: acts on each `POST` unless failing.
pub async fn downstream(state: Arc<Mutex<Downstream>>) -> turmoil::Result {
    let listener = turmoil::net::TcpListener::bind(("0.0.0.0", 80)).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        let state = state.clone();
        let service = hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
            let state = state.clone();
            async move {
                let key = request
                    .headers()
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .trim_matches('"')
                    .to_owned();
                let body = request.into_body().collect().await.map(|b| b.to_bytes());
                let mood = state.lock().unwrap().mood.unwrap_or(Mood::Fine);
                let status = match (mood, body) {
                    (Mood::Failing, _) | (_, Err(_)) => {
                        state.lock().unwrap().refused += 1;
                        StatusCode::SERVICE_UNAVAILABLE
                    }
                    (mood, Ok(body)) => {
                        state
                            .lock()
                            .unwrap()
                            .acted
                            .entry(key)
                            .or_default()
                            .push(body);
                        if mood == Mood::Late {
                            tokio::time::sleep(Duration::from_secs(3)).await;
                        }
                        StatusCode::OK
                    }
                };
                let mut response = Response::new(Full::new(Bytes::new()));
                *response.status_mut() = status;
                Ok::<_, Infallible>(response)
            }
        });
        tokio::spawn(async move {
            let connection = hyper::server::conn::http1::Builder::new();
            let _ = connection
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
