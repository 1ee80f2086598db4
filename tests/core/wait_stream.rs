//! `wait_in_flight` and streamed responses: a waiter that ends up running
//! its request (the first gave its key back) has a lease of its own from
//! its own claim, so its streamed response gets the whole of it to end in
//! and is recorded, as any first response's is. The store's clock is manual
//! (no lease ends in the store); the streaming deadline runs on Tokio's.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http_body::Frame;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::test_util::{ManualClock, START_MS};
use tower_idempotency::{IdempotencyLayer, MemoryStore};

/// `a`, then `b` 50 ms later: a body the layer must stream.
struct Slow {
    sleep: Pin<Box<tokio::time::Sleep>>,
    sent: u8,
}

impl http_body::Body for Slow {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.sent {
            0 => {
                self.sent = 1;
                Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"a")))))
            }
            1 => {
                std::task::ready!(self.sleep.as_mut().poll(cx));
                self.sent = 2;
                Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"b")))))
            }
            _ => Poll::Ready(None),
        }
    }
}

async fn handler(runs: Arc<AtomicUsize>, headers: HeaderMap) -> Response {
    runs.fetch_add(1, Ordering::SeqCst);
    if headers.contains_key("x-fail") {
        // Longer than the lease's streaming window; the store's lease holds
        // (its clock is manual), then the key is given back.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    }
    let body = Slow {
        sleep: Box::pin(tokio::time::sleep(Duration::from_millis(50))),
        sent: 0,
    };
    (StatusCode::CREATED, Body::new(body)).into_response()
}

fn request(fail: bool) -> Request<Body> {
    let mut request = Request::post("/stream").header("idempotency-key", "\"k\"");
    if fail {
        request = request.header("x-fail", "1");
    }
    request.body(Body::empty()).unwrap()
}

async fn call(app: Router, fail: bool) -> (StatusCode, bool, Bytes) {
    let response = app.oneshot(request(fail)).await.unwrap();
    let status = response.status();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, replayed, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_runs_records_its_stream_for_the_next_repeat() {
    let clock = ManualClock::new(START_MS);
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let app = Router::new()
        .route(
            "/stream",
            post(move |headers: HeaderMap| handler(counter.clone(), headers)),
        )
        .route_layer(
            IdempotencyLayer::new(MemoryStore::with_clock(clock), GlobalScope)
                .lease(Duration::from_secs(1))
                .wait_in_flight(Duration::from_secs(10)),
        );
    let first = tokio::spawn(call(app.clone(), true));
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Meets the key in flight, waits ~1.45 s, then claims it and runs.
    let waiter = call(app.clone(), false).await;
    assert_eq!(
        first.await.unwrap(),
        (StatusCode::INTERNAL_SERVER_ERROR, false, Bytes::new())
    );
    assert_eq!(waiter, (StatusCode::CREATED, false, Bytes::from("ab")));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    // Its stream ended 50 ms into a lease of 1 s: the next repeat replays it.
    let repeat = call(app, false).await;
    assert_eq!(repeat, (StatusCode::CREATED, true, Bytes::from("ab")));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}
