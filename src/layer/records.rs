//! What is kept of a completed request: sealed at rest
//! ([`crate::seal`]).

use super::IdempotencyLayer;
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
}
