//! What is kept of a completed request and what the application hears of
//! it: records sealed at rest ([`crate::seal`]), a namespace for the keys,
//! and the hooks on replays and events ([`crate::hooks`]).

use std::sync::Arc;

use http::HeaderMap;

use super::IdempotencyLayer;
use crate::hooks::{Event, check_namespace};
use crate::seal::Keyring;

impl<St, Sc, F, P, M> IdempotencyLayer<St, Sc, F, P, M> {
    /// Seals every stored response with `keyring`'s first key, and opens
    /// stored responses with any of its keys (off by default): header
    /// fields, body and trailers are kept encrypted (XChaCha20-Poly1305),
    /// bound to their scope, key and fingerprint; the status stays in the
    /// clear. Works with every store. A sealed record that no key opens is
    /// never replayed (503); a plain record, stored before this was turned
    /// on, is still replayed. See [`crate::seal`].
    pub fn encrypt_at_rest(mut self, keyring: Keyring) -> Self {
        self.config.settings.keyring = Some(keyring);
        self
    }

    /// Keeps this layer's keys apart from every other layer's in a shared
    /// store: the same key under two namespaces is two records (off by
    /// default). Use one per service or route group that shares a store
    /// (Powertools calls it a key prefix). The stored key is the namespace,
    /// a unit separator (U+001F, which no key holds) and the client's key;
    /// the handler's [`ClaimedKey`](crate::key::ClaimedKey) and the events
    /// still name the client's key. Changing a namespace orphans the keys
    /// stored under the old one until their TTL ends.
    ///
    /// # Panics
    ///
    /// When `namespace` is not 1 to [`MAX_NAMESPACE_LEN`](crate::hooks::MAX_NAMESPACE_LEN) printable ASCII
    /// characters: a configuration error, found when the layer is built.
    pub fn namespace(mut self, namespace: &str) -> Self {
        if let Err(why) = check_namespace(namespace) {
            panic!("IdempotencyLayer::namespace({namespace:?}): {why}");
        }
        self.config.settings.hooks.namespace = Some(namespace.into());
        self
    }

    /// Calls `hook` on every replay before it goes out, with the
    /// [`Event`] (`EventKind::Replayed`, its scope and key) and the replay's
    /// header fields, which it may add to or change: a `Cache-Status`, say.
    /// It does not see first responses or rejections (see
    /// [`on_event`](Self::on_event)). See [`crate::hooks`].
    pub fn on_replay<H>(mut self, hook: H) -> Self
    where
        H: Fn(&Event<'_>, &mut HeaderMap) + Send + Sync + 'static,
    {
        self.config.settings.hooks.on_replay = Some(Arc::new(hook));
        self
    }

    /// Calls `hook` with every [`Event`]: a replay, a rejection (400, 401,
    /// 409, 410, 412, 413, 422, 503, with its problem type), a takeover, a
    /// lost lease. For audit logs and metrics of your own, without parsing
    /// logs. See [`crate::hooks`].
    pub fn on_event<H>(mut self, hook: H) -> Self
    where
        H: Fn(&Event<'_>) + Send + Sync + 'static,
    {
        self.config.settings.hooks.on_event = Some(Arc::new(hook));
        self
    }
}
