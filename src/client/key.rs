//! [`IdempotencyKeyLayer`]: one key per call, made by a [`MakeIdempotencyKey`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{HeaderName, HeaderValue, Request};
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

pub use super::first_sent::FirstSent;

/// The error type of [`IdempotencyKey`]: the inner service's error, or the
/// maker's ([`KeyUnavailable`] for [`RandomKey`]).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Makes the idempotency key of a request that has none.
///
/// [`RandomKey`] is the default. Closures
/// `FnMut(&Request<B>) -> Option<HeaderValue>` implement it too; implement it
/// on your own type for a scheme that can fail.
///
/// The value is sent as returned. A server using this crate accepts an RFC
/// 9651 sf-string (`"..."`) or a bare token of 1 to 255 printable ASCII
/// characters, except bare values that read as another structured type (a
/// date such as `@1659578233`, a byte sequence, a boolean: see
/// [`crate::key`]); the IETF draft's form is the sf-string.
pub trait MakeIdempotencyKey<B> {
    /// The key for `request`. `Ok(None)` sends the request without a key
    /// (for a method that needs none, say); an error fails the call, and
    /// nothing is sent.
    fn make_key(&mut self, request: &Request<B>) -> Result<Option<HeaderValue>, BoxError>;
}

impl<B, F> MakeIdempotencyKey<B> for F
where
    F: FnMut(&Request<B>) -> Option<HeaderValue>,
{
    fn make_key(&mut self, request: &Request<B>) -> Result<Option<HeaderValue>, BoxError> {
        Ok(self(request))
    }
}

/// The default maker: [`new_key`] for every request.
#[derive(Debug, Clone, Copy, Default)]
pub struct RandomKey;

impl<B> MakeIdempotencyKey<B> for RandomKey {
    fn make_key(&mut self, _request: &Request<B>) -> Result<Option<HeaderValue>, BoxError> {
        Ok(Some(new_key()?))
    }
}

/// The operating system's random number generator failed, so no key was
/// made and the request was not sent.
///
/// `getrandom` fails only where the platform has no working source: on
/// Linux it waits, once per boot, until the kernel's pool is seeded, and
/// then does not fail; a sandbox that forbids both the `getrandom` system
/// call and `/dev/urandom` makes it fail. No key is ever made from a weaker
/// source instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyUnavailable(getrandom::Error);

impl fmt::Display for KeyUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "no idempotency key: the operating system's random number generator failed ({})",
            self.0
        )
    }
}

impl std::error::Error for KeyUnavailable {}

/// A new key: 16 bytes (128 bits) from the operating system's CSPRNG
/// (`getrandom`, one call per key), as 32 lowercase hex digits quoted as an
/// RFC 9651 sf-string: 34 bytes, e.g. `"5f0c9e0a2b7d41c38e1f6a9d0b4c2e77"`.
///
/// No key says anything about another: each is a fresh draw, with no
/// process secret or counter behind it.
pub fn new_key() -> Result<HeaderValue, KeyUnavailable> {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut random = [0u8; 16];
    getrandom::fill(&mut random).map_err(KeyUnavailable)?;
    let mut text = [b'"'; 34];
    for (i, byte) in random.iter().enumerate() {
        text[1 + 2 * i] = HEX[usize::from(byte >> 4)];
        text[2 + 2 * i] = HEX[usize::from(byte & 0x0f)];
    }
    // Quotes and hex digits are visible ASCII: always a valid field value.
    HeaderValue::from_bytes(&text).map_err(|_| KeyUnavailable(getrandom::Error::UNEXPECTED))
}

/// Adds an idempotency key to every request that has none.
///
/// # A scheme of your own
///
/// ```
/// use std::convert::Infallible;
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use http::{HeaderValue, Request, Response};
/// use tower::{Service, ServiceBuilder, ServiceExt};
/// use tower_idempotency::client::IdempotencyKeyLayer;
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// // Keys derived from an order number the application already has.
/// let layer = IdempotencyKeyLayer::with_maker(|req: &Request<String>| {
///     let order = req.headers().get("x-order-id")?.to_str().ok()?;
///     HeaderValue::from_str(&format!("\"order-{order}\"")).ok()
/// });
/// let mut client = ServiceBuilder::new().layer(layer).service(tower::service_fn(
///     |req: Request<String>| async move {
///         Ok::<_, Infallible>(Response::new(req.headers()["idempotency-key"].clone()))
///     },
/// ));
/// let request = Request::post("/charges").header("x-order-id", "42").body(String::new()).unwrap();
/// let response = client.ready().await.unwrap().call(request).await.unwrap();
/// assert_eq!(response.body(), "\"order-42\"");
/// # }
/// ```
#[derive(Clone)]
#[must_use]
pub struct IdempotencyKeyLayer<M = RandomKey> {
    header: HeaderName,
    maker: M,
    first_sent: FirstSent,
}

impl<M> fmt::Debug for IdempotencyKeyLayer<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyKeyLayer")
            .field("header", &self.header)
            .finish_non_exhaustive()
    }
}

impl Default for IdempotencyKeyLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl IdempotencyKeyLayer {
    /// Random keys ([`RandomKey`]) in `Idempotency-Key`.
    pub fn new() -> Self {
        IdempotencyKeyLayer::with_maker(RandomKey)
    }
}

impl<M> IdempotencyKeyLayer<M> {
    /// Keys from `maker` (a [`MakeIdempotencyKey`], e.g. a closure) in
    /// `Idempotency-Key`.
    pub fn with_maker(maker: M) -> Self {
        IdempotencyKeyLayer {
            header: HeaderName::from_static("idempotency-key"),
            maker,
            first_sent: FirstSent::default(),
        }
    }

    /// Keys in another field.
    pub fn header_name(mut self, name: HeaderName) -> Self {
        self.header = name;
        self
    }

    /// Whether a call whose key this layer makes also gets
    /// `Repeatability-First-Sent` (default `true`; see
    /// [`FirstSent`]).
    pub fn send_first_sent(mut self, send: bool) -> Self {
        self.first_sent.send = send;
        self
    }

    /// The clock of `Repeatability-First-Sent` (default: the system clock).
    pub fn clock(mut self, clock: impl crate::store::Clock) -> Self {
        self.first_sent.clock = std::sync::Arc::new(clock);
        self
    }
}

impl<S, M: Clone> Layer<S> for IdempotencyKeyLayer<M> {
    type Service = IdempotencyKey<S, M>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyKey {
            inner,
            header: self.header.clone(),
            maker: self.maker.clone(),
            first_sent: self.first_sent.clone(),
        }
    }
}

/// The service made by [`IdempotencyKeyLayer`].
#[derive(Clone)]
pub struct IdempotencyKey<S, M = RandomKey> {
    inner: S,
    header: HeaderName,
    maker: M,
    first_sent: FirstSent,
}

impl<S: fmt::Debug, M> fmt::Debug for IdempotencyKey<S, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyKey")
            .field("inner", &self.inner)
            .field("header", &self.header)
            .finish_non_exhaustive()
    }
}

impl<S, M, B> Service<Request<B>> for IdempotencyKey<S, M>
where
    S: Service<Request<B>>,
    S::Error: Into<BoxError>,
    M: MakeIdempotencyKey<B>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut req: Request<B>) -> Self::Future {
        if !req.headers().contains_key(&self.header) {
            match self.maker.make_key(&req) {
                Ok(Some(key)) => {
                    req.headers_mut().insert(self.header.clone(), key);
                    self.first_sent.stamp(req.headers_mut());
                }
                Ok(None) => {}
                Err(error) => {
                    let state = State::Failed { error: Some(error) };
                    return ResponseFuture { state };
                }
            }
        }
        let future = self.inner.call(req);
        ResponseFuture {
            state: State::Called { future },
        }
    }
}

pin_project! {
    /// The future of [`IdempotencyKey`]: the inner service's, or the maker's error.
    pub struct ResponseFuture<F> {
        #[pin]
        state: State<F>,
    }
}

pin_project! {
    #[project = StateProjection]
    enum State<F> {
        // The request went to the inner service.
        Called { #[pin] future: F },
        // The maker failed; the request was not sent.
        Failed { error: Option<BoxError> },
    }
}

impl<F, T, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProjection::Called { future } => future.poll(cx).map_err(Into::into),
            // Polled again after it returned the error: a caller bug; it never
            // finishes again.
            StateProjection::Failed { error } => {
                error.take().map_or(Poll::Pending, |e| Poll::Ready(Err(e)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;
    use std::sync::{Arc, Mutex};
    use tower::ServiceExt;

    #[test]
    fn keys_are_34_byte_sf_strings_of_32_lowercase_hex_digits() {
        for _ in 0..1000 {
            let key = new_key().unwrap();
            let bytes = key.as_bytes();
            assert_eq!(bytes.len(), 34);
            assert_eq!((bytes[0], bytes[33]), (b'"', b'"'));
            assert!(
                bytes[1..33]
                    .iter()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
            );
            let parsed = crate::key::parse_value(bytes).unwrap();
            assert_eq!(parsed.len(), 32);
            assert_eq!(parsed.as_bytes(), &bytes[1..33]);
        }
    }

    #[test]
    fn keys_are_distinct_over_many_draws() {
        let keys: std::collections::HashSet<HeaderValue> =
            (0..100_000).map(|_| new_key().unwrap()).collect();
        assert_eq!(keys.len(), 100_000);
    }

    /// The key fields the recorder's service got, in order.
    type Seen = Arc<Mutex<Vec<Option<HeaderValue>>>>;

    /// An inner service that records the key field of every request it gets.
    fn recorder() -> (
        Seen,
        impl Service<Request<()>, Response = (), Error = Infallible> + Clone,
    ) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let service = tower::service_fn(move |req: Request<()>| {
            log.lock()
                .unwrap()
                .push(req.headers().get("idempotency-key").cloned());
            async { Ok::<_, Infallible>(()) }
        });
        (seen, service)
    }

    #[tokio::test]
    async fn the_layer_sends_the_custom_makers_key() {
        let (seen, inner) = recorder();
        let mut calls = 0u32;
        let layer = IdempotencyKeyLayer::with_maker(move |_: &Request<()>| {
            calls += 1;
            Some(HeaderValue::from_str(&format!("\"mine-{calls}\"")).unwrap())
        });
        let mut client = layer.layer(inner);
        for _ in 0..2 {
            client
                .ready()
                .await
                .unwrap()
                .call(Request::new(()))
                .await
                .unwrap();
        }
        let mut given = Request::new(());
        given
            .headers_mut()
            .insert("idempotency-key", HeaderValue::from_static("\"given\""));
        client.ready().await.unwrap().call(given).await.unwrap();
        assert_eq!(
            *seen.lock().unwrap(),
            [
                Some(HeaderValue::from_static("\"mine-1\"")),
                Some(HeaderValue::from_static("\"mine-2\"")),
                Some(HeaderValue::from_static("\"given\"")),
            ]
        );
    }

    #[tokio::test]
    async fn a_maker_may_send_a_request_without_a_key() {
        let (seen, inner) = recorder();
        let client = IdempotencyKeyLayer::with_maker(|_: &Request<()>| None).layer(inner);
        client.oneshot(Request::new(())).await.unwrap();
        assert_eq!(*seen.lock().unwrap(), [None]);
    }

    #[derive(Clone)]
    struct Failing;

    impl MakeIdempotencyKey<()> for Failing {
        fn make_key(&mut self, _: &Request<()>) -> Result<Option<HeaderValue>, BoxError> {
            Err(KeyUnavailable(getrandom::Error::UNSUPPORTED).into())
        }
    }

    #[tokio::test]
    async fn a_failing_maker_fails_the_call_and_sends_nothing() {
        let (seen, inner) = recorder();
        let client = IdempotencyKeyLayer::with_maker(Failing).layer(inner);
        let error = client.oneshot(Request::new(())).await.unwrap_err();
        let error = error.downcast::<KeyUnavailable>().unwrap();
        assert_eq!(*error, KeyUnavailable(getrandom::Error::UNSUPPORTED));
        assert!(error.to_string().starts_with(
            "no idempotency key: the operating system's random number generator failed"
        ));
        assert_eq!(seen.lock().unwrap().len(), 0, "nothing was sent");
    }

    #[tokio::test]
    async fn the_default_layer_sends_a_random_key_per_call() {
        let (seen, inner) = recorder();
        let mut client = IdempotencyKeyLayer::new()
            .header_name(HeaderName::from_static("idempotency-key"))
            .layer(inner);
        for _ in 0..2 {
            client
                .ready()
                .await
                .unwrap()
                .call(Request::new(()))
                .await
                .unwrap();
        }
        let seen = seen.lock().unwrap();
        let keys: Vec<&HeaderValue> = seen.iter().map(|k| k.as_ref().unwrap()).collect();
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[0].len(), 34);
        assert_eq!(keys[1].len(), 34);
        assert_ne!(keys[0], keys[1]);
    }
}
