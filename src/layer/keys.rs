//! Where the key comes from, and how long a retry may count on it: the
//! body as a key source ([`crate::key_source`]) and the
//! `Repeatability-First-Sent` guard ([`crate::first_sent`]).

use std::sync::Arc;

use http::HeaderName;

use super::IdempotencyLayer;

impl<St, Sc, F, P, M> IdempotencyLayer<St, Sc, F, P, M> {
    /// Reads the key from the JSON body at `pointer` (RFC 6901, e.g. `/id`)
    /// instead of a header: a string, or an integer in decimal. See
    /// [`crate::key_source`] for what changes (the body is read before the
    /// key is known) and an example; a body that is not JSON is answered
    /// with the 400 `invalid-key` problem.
    ///
    /// # Panics
    ///
    /// When `pointer` is neither empty nor starts with `/`.
    pub fn key_from_json(self, pointer: impl Into<String>) -> Self {
        self.key_from(crate::key_source::json_pointer(pointer))
    }

    /// Reads the key with `f`, a function of the request head and its
    /// buffered body, instead of a header. `Ok(None)` is no key (400
    /// `missing-key`, or a pass-through with `require_key(false)`); an error
    /// is the 400 `invalid-key` problem; a key is checked with
    /// [`check_key`](crate::key_source::check_key).
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, key::KeyError, scope::GlobalScope};
    ///
    /// // The key is the first line of a text body.
    /// let layer = IdempotencyLayer::new(MemoryStore::new(), GlobalScope).key_from_fn(
    ///     |_head, body| -> Result<Option<String>, KeyError> {
    ///         let text = std::str::from_utf8(body).map_err(|_| KeyError::NotPrintableAscii)?;
    ///         Ok(text.lines().next().map(str::to_owned))
    ///     },
    /// );
    /// # let _ = layer;
    /// ```
    pub fn key_from_fn<Fun>(self, f: Fun) -> Self
    where
        Fun: Fn(&http::request::Parts, &[u8]) -> Result<Option<String>, crate::key::KeyError>
            + Send
            + Sync
            + 'static,
    {
        self.key_from(crate::key_source::from_fn(f))
    }

    /// Reads the key with `source` instead of a header (see
    /// [`crate::key_source`]).
    pub fn key_from<K: crate::key_source::KeySource>(mut self, source: K) -> Self {
        self.config.settings.key_source = Some(Arc::new(source));
        self
    }

    /// Refuses, with 412 [`Rejection::ExpiredRetry`](crate::problem::Rejection::ExpiredRetry) and without running the
    /// handler, a request whose `Repeatability-First-Sent` is older than the
    /// [`ttl`](Self::ttl) when its claim finds no live record: a retry whose
    /// record may have expired (off by default). Requests without the field
    /// are not guarded; a malformed field, or one more than a minute ahead of
    /// the layer's [`clock`](Self::clock), is a 400. See
    /// [`crate::first_sent`] for the rules and an example.
    pub fn refuse_expired_retries(mut self) -> Self {
        self.config.settings.refuse_expired = true;
        self
    }

    /// Sends the [`ttl`](Self::ttl) in whole seconds in the field `name` on
    /// first responses and replays (not on the layer's rejections, nor on
    /// answers that are not stored). No field name is standard;
    /// [`crate::first_sent::IDEMPOTENCY_TTL`] (`Idempotency-TTL`) is the
    /// one proposed for the IETF draft (see [`crate::first_sent`]).
    pub fn advertise_retention(mut self, name: HeaderName) -> Self {
        self.config.settings.retention_header = Some(name);
        self
    }

    /// The clock that judges `Repeatability-First-Sent` times (default: the
    /// system clock). Tests pass the `test_util::ManualClock` their store
    /// runs on.
    pub fn clock(mut self, clock: impl crate::store::Clock) -> Self {
        self.config.settings.clock = Arc::new(clock);
        self
    }
}
