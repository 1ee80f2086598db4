//! The layer around a plain tower service (no axum): trailers, errors, and
//! bodies split into many frames.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, StreamBody};
use tower::{Layer, Service, ServiceExt, service_fn};
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::{IdempotencyLayer, MemoryStore, RequestBody};

type BoxBody = http_body_util::combinators::UnsyncBoxBody<Bytes, Infallible>;

fn grpc_like(
    runs: Arc<AtomicUsize>,
) -> impl Service<
    Request<RequestBody<Full<Bytes>>>,
    Response = Response<BoxBody>,
    Error = Infallible,
    Future: Send,
> + Clone
+ Send {
    service_fn(move |req: Request<RequestBody<Full<Bytes>>>| {
        let runs = runs.clone();
        async move {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            let echoed = req.into_body().collect().await.unwrap().to_bytes();
            let mut trailers = HeaderMap::new();
            trailers.insert("grpc-status", "0".parse().unwrap());
            trailers.insert("grpc-message", format!("run {n}").parse().unwrap());
            let body = Full::new(echoed).with_trailers(async move { Some(Ok(trailers)) });
            let mut response = Response::new(BodyExt::boxed_unsync(body));
            response
                .headers_mut()
                .insert("content-type", "application/grpc".parse().unwrap());
            Ok::<_, Infallible>(response)
        }
    })
}

fn request(body: &'static [u8]) -> Request<Full<Bytes>> {
    Request::post("/pay.Payments/Charge")
        .header("idempotency-key", "\"c-1\"")
        .body(Full::new(Bytes::from_static(body)))
        .unwrap()
}

#[tokio::test]
async fn trailers_are_replayed() {
    let runs = Arc::new(AtomicUsize::new(0));
    let svc = IdempotencyLayer::new(MemoryStore::new(), GlobalScope).layer(grpc_like(runs.clone()));
    let first = svc
        .clone()
        .oneshot(request(b"\x00\x00\x00\x00\x02hi"))
        .await
        .unwrap();
    let first_headers = first.headers().clone();
    let first = first.into_body().collect().await.unwrap();
    let again = svc
        .clone()
        .oneshot(request(b"\x00\x00\x00\x00\x02hi"))
        .await
        .unwrap();
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(
        again.headers()["content-type"],
        first_headers["content-type"]
    );
    let again = again.into_body().collect().await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let first_trailers = first.trailers().cloned().unwrap();
    assert_eq!(first_trailers["grpc-message"], "run 1");
    assert_eq!(again.trailers(), Some(&first_trailers));
    assert_eq!(again.to_bytes(), first.to_bytes());
}

#[tokio::test]
async fn an_inner_error_releases_the_key() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let store = MemoryStore::new();
    let failing_once = service_fn(move |_req: Request<RequestBody<Full<Bytes>>>| {
        let n = counter.fetch_add(1, Ordering::SeqCst);
        async move {
            if n == 0 {
                Err("connection to the payment provider reset")
            } else {
                Ok(Response::new(Full::new(Bytes::from_static(b"charged"))))
            }
        }
    });
    let svc = IdempotencyLayer::new(store.clone(), GlobalScope).layer(failing_once);
    let err = svc.clone().oneshot(request(b"x")).await.unwrap_err();
    assert_eq!(err, "connection to the payment provider reset");
    assert!(store.is_empty(), "the key was released");
    let retry = svc.clone().oneshot(request(b"x")).await.unwrap();
    assert_eq!(retry.status(), StatusCode::OK);
    assert!(retry.headers().get("idempotent-replayed").is_none());
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// A request body in many small frames fingerprints as the same bytes in
/// one frame, and the inner service receives them exactly.
#[tokio::test]
async fn fingerprint_does_not_depend_on_framing() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    let inner = service_fn(move |req: Request<RequestBody<BoxBody>>| {
        let log = log.clone();
        async move {
            let body = req.into_body().collect().await.unwrap().to_bytes();
            log.lock().unwrap().push(body);
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        }
    });
    let svc = IdempotencyLayer::new(MemoryStore::new(), GlobalScope).layer(inner);
    let payload = b"abcdefghijklmnopqrstuvwxyz".repeat(100);
    let framed = |size: usize| {
        let frames: Vec<Result<_, Infallible>> = payload
            .chunks(size)
            .map(|c| Ok(http_body::Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        let body = BodyExt::boxed_unsync(StreamBody::new(tokio_stream_iter(frames)));
        Request::post("/upload")
            .header("idempotency-key", "u-1")
            .body(body)
            .unwrap()
    };
    let one = svc.clone().oneshot(framed(payload.len())).await.unwrap();
    assert!(one.headers().get("idempotent-replayed").is_none());
    let many = svc.clone().oneshot(framed(7)).await.unwrap();
    assert_eq!(many.headers()["idempotent-replayed"], "true");
    assert_eq!(*seen.lock().unwrap(), vec![Bytes::from(payload.clone())]);
}

/// A `Stream` over a vector, without pulling in a streams crate.
fn tokio_stream_iter<T: Unpin>(items: Vec<T>) -> impl futures_core::Stream<Item = T> + Unpin {
    struct Iter<T>(std::vec::IntoIter<T>);
    impl<T: Unpin> futures_core::Stream for Iter<T> {
        type Item = T;
        fn poll_next(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<T>> {
            std::task::Poll::Ready(self.0.next())
        }
    }
    Iter(items.into_iter())
}

/// tower-http's conventions: the inner service is reachable, borrowed,
/// mutably borrowed, and unwrapped; the service has `new` and `layer`.
#[test]
fn the_inner_service_is_reachable() {
    #[derive(Debug, PartialEq)]
    struct Inner(u32);
    let mut svc = IdempotencyLayer::new(MemoryStore::new(), GlobalScope).layer(Inner(1));
    assert_eq!(svc.get_ref(), &Inner(1));
    svc.get_mut().0 = 2;
    assert_eq!(svc.into_inner(), Inner(2));
    // And made as tower-http's services are: `new`, or `layer` to configure.
    let svc = tower_idempotency::Idempotency::new(Inner(3), MemoryStore::new(), GlobalScope);
    assert_eq!(svc.get_ref(), &Inner(3));
    let layer = tower_idempotency::Idempotency::<Inner, _>::layer(MemoryStore::new(), GlobalScope)
        .require_key(true);
    assert_eq!(layer.layer(Inner(4)).into_inner(), Inner(4));
    // Named by the inner service and the layer that made it.
    let svc: tower_idempotency::Idempotency<Inner, IdempotencyLayer<MemoryStore, GlobalScope>> =
        IdempotencyLayer::new(MemoryStore::new(), GlobalScope).layer(Inner(5));
    assert_eq!(svc.into_inner(), Inner(5));
}
