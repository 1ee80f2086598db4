//! Helpers shared by the integration tests: a server on a real loopback
//! socket, and a raw HTTP/1.1 client that sees header fields exactly as sent.

#![allow(dead_code, unreachable_pub)]

pub mod charge;
pub mod logs;
pub mod services;
pub mod waiting;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::HeaderMap;
use tokio::sync::{Semaphore, mpsc};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Serves `app` on 127.0.0.1 with a free port; the server lives as long as the runtime.
pub async fn serve(app: axum::Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// A response as it came off the wire.
#[derive(Debug, Clone)]
pub struct Raw {
    pub status: u16,
    /// Header fields in wire order, names lowercased, values as raw bytes.
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
}

impl Raw {
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    pub fn header_str(&self, name: &str) -> Option<&str> {
        self.header(name).and_then(|v| std::str::from_utf8(v).ok())
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some(b"true")
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }

    /// Asserts a problem+json answer with this status, and returns its `type`.
    pub fn assert_problem(&self, status: u16) -> String {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(
            self.header_str("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let doc = self.json();
        assert_eq!(doc["status"], status, "{doc}");
        assert!(
            doc["title"].as_str().is_some_and(|t| !t.is_empty()),
            "{doc}"
        );
        assert!(
            doc["detail"].as_str().is_some_and(|t| !t.is_empty()),
            "{doc}"
        );
        doc["type"].as_str().unwrap().to_owned()
    }

    /// The header fields other than those that differ between any two
    /// responses of the same server (`date`) or that mark a replay.
    pub fn stable_headers(&self) -> Vec<(String, Vec<u8>)> {
        self.headers
            .iter()
            .filter(|(n, _)| n != "date" && n != "idempotent-replayed")
            .cloned()
            .collect()
    }
}

/// One request over a fresh connection (`Connection: close`); `headers` are
/// raw bytes, so tests can send what a well-behaved client library would not.
pub async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &[u8])],
    body: &[u8],
) -> Raw {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(&request_bytes(method, path, headers, body))
        .await
        .unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut buf))
        .await
        .expect("response within 30 s")
        .expect("read response");
    parse_response(&buf)
        .unwrap_or_else(|| panic!("bad response: {:?}", String::from_utf8_lossy(&buf)))
}

pub fn request_bytes(method: &str, path: &str, headers: &[(&str, &[u8])], body: &[u8]) -> Vec<u8> {
    let mut req =
        format!("{method} {path} HTTP/1.1\r\nhost: test\r\nconnection: close\r\n").into_bytes();
    for (name, value) in headers {
        req.extend_from_slice(name.as_bytes());
        req.extend_from_slice(b": ");
        req.extend_from_slice(value);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
    req.extend_from_slice(body);
    req
}

/// Parses a `Connection: close` response with a Content-Length or chunked body.
pub fn parse_response(buf: &[u8]) -> Option<Raw> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = &buf[..end];
    let mut rest = &buf[end + 4..];
    let mut lines = head
        .split(|b| *b == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
    let status_line = std::str::from_utf8(lines.next()?).ok()?;
    let status = status_line.split(' ').nth(1)?.parse().ok()?;
    let mut headers = Vec::new();
    for line in lines {
        let colon = line.iter().position(|b| *b == b':')?;
        let name = std::str::from_utf8(&line[..colon])
            .ok()?
            .to_ascii_lowercase();
        let value = line[colon + 1..].trim_ascii().to_vec();
        headers.push((name, value));
    }
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v.eq_ignore_ascii_case(b"chunked"));
    let body = if chunked {
        let mut body = Vec::new();
        loop {
            let eol = rest.windows(2).position(|w| w == b"\r\n")?;
            let size =
                usize::from_str_radix(std::str::from_utf8(&rest[..eol]).ok()?.trim(), 16).ok()?;
            rest = &rest[eol + 2..];
            if size == 0 {
                break;
            }
            body.extend_from_slice(&rest[..size]);
            rest = &rest[size + 2..];
        }
        body
    } else {
        rest.to_vec()
    };
    Some(Raw {
        status,
        headers,
        body,
    })
}

/// Waits until `condition` holds, checking after each yield to the runtime;
/// panics after `limit`. For effects of spawned tasks (a release from a drop
/// guard) whose completion no future exposes.
pub async fn eventually(limit: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition not met within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// What the handlers share with the test: how often they ran, and gates that
/// hold a request inside the handler until the test opens them.
#[derive(Clone, Default)]
pub struct Harness {
    pub runs: Arc<AtomicUsize>,
    gates: Arc<Mutex<HashMap<String, Arc<Semaphore>>>>,
    entered: Arc<Mutex<Option<mpsc::UnboundedSender<String>>>>,
}

impl Harness {
    pub fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    pub fn gate(&self, name: &str) -> Arc<Semaphore> {
        let mut gates = self.gates.lock().unwrap();
        gates
            .entry(name.to_owned())
            .or_insert_with(|| Arc::new(Semaphore::new(0)))
            .clone()
    }

    pub fn open(&self, name: &str) {
        self.gate(name).add_permits(1);
    }

    /// A receiver told the gate name each time a request reaches a gate.
    pub fn watch(&self) -> mpsc::UnboundedReceiver<String> {
        let (tx, rx) = mpsc::unbounded_channel();
        *self.entered.lock().unwrap() = Some(tx);
        rx
    }

    pub async fn wait_at_gate(&self, headers: &HeaderMap) {
        if let Some(name) = headers.get("x-gate").and_then(|v| v.to_str().ok()) {
            let gate = self.gate(name);
            if let Some(tx) = &*self.entered.lock().unwrap() {
                let _ = tx.send(name.to_owned());
            }
            gate.acquire().await.unwrap().forget();
        }
    }
}

/// Repeats a request while it is answered 409 (its first is still in
/// flight), as a client honouring the answer would, for at most 10 s.
pub async fn until_not_in_flight<T, F, Fut>(mut request: F, status: impl Fn(&T) -> u16) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let answer = request().await;
        if status(&answer) != 409 || tokio::time::Instant::now() >= deadline {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A free TCP port on 127.0.0.1 (bound, read and let go).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs `program` to its end and fails the test, with its output, unless it
/// succeeded.
pub fn run(program: &str, args: &[&str]) {
    let out = std::process::Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program} is required: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
