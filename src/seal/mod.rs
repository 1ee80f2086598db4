//! Encryption at rest: stored responses sealed with XChaCha20-Poly1305.
//!
//! # Example
//!
//! ```
//! use axum::{Router, routing::post, http::{Request, StatusCode}, body::Body};
//! use tower::ServiceExt;
//! use tower_idempotency::{IdempotencyLayer, MemoryStore, scope};
//! use tower_idempotency::seal::{Keyring, SealingKey};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! // In production: `SealingKey::from_file("/run/secrets/records.key")?`,
//! // a file of exactly 32 random bytes (`head -c 32 /dev/urandom`).
//! let keyring = Keyring::new([SealingKey::new(1, [7; 32])]).unwrap();
//! let app = Router::new()
//!     .route("/cards", post(|| async { (StatusCode::CREATED, "4111 1111 1111 1111") }))
//!     .route_layer(
//!         IdempotencyLayer::new(MemoryStore::new(), scope::header("x-user"))
//!             .encrypt_at_rest(keyring),
//!     );
//! let save = || Request::post("/cards")
//!     .header("idempotency-key", "\"card-1\"")
//!     .header("x-user", "alice")
//!     .body(Body::empty())
//!     .unwrap();
//! app.clone().oneshot(save()).await.unwrap();
//! // The store holds the card number sealed; the repeat opens and replays it.
//! let again = app.oneshot(save()).await.unwrap();
//! assert_eq!(again.headers()["idempotent-replayed"], "true");
//! # }
//! ```
//!
//! # What is sealed, and what stays in the clear
//!
//! [`IdempotencyLayer::encrypt_at_rest`](crate::IdempotencyLayer::encrypt_at_rest)
//! seals every response it stores, once, in the layer, before the store sees
//! it: so every store (memory, SQLite, PostgreSQL, sqlx, MySQL, Redis) keeps
//! ciphertext without code of its own. Sealed: the header fields, the body and
//! the trailers. In the clear: the status code (a [`StoredResponse`]'s
//! `status`, bound to the ciphertext so that it cannot be changed), and
//! everything a store keeps beside the response: the scope, the key, the
//! fingerprint (a SHA-256 of the request, not the request), the fencing
//! token, and the lease and TTL deadlines.
//!
//! A sealed record is a [`StoredResponse`] whose body is
//! [`StoredBody::Sealed`] and whose header and trailer lists are empty. The
//! sealed bytes are: a format byte (1), the id of the key that sealed it (a
//! big-endian `u32`), a 24-byte nonce, then the ciphertext of the response's
//! [`StoredResponse::encode`]ing and its 16-byte tag: 45 bytes more than
//! the plain encoding.
//!
//! # The AEAD, and what a sealed record is bound to
//!
//! XChaCha20-Poly1305 (the RustCrypto crate `chacha20poly1305`): keys of 32
//! bytes, and a 24-byte nonce drawn from the operating system's CSPRNG
//! (`getrandom`) for every record. A nonce that long can be drawn at random
//! for as many records as a store will ever hold without the risk of a
//! repeat, so no counter has to be kept across processes; and ChaCha20 is
//! fast without AES hardware.
//!
//! The associated data binds each record to its scope, key and fingerprint,
//! to its status, and to the format byte and key id: each framed by its
//! length, so no two records frame to the same bytes. A sealed response
//! copied onto another key, scope or fingerprint, or with its status edited,
//! does not open.
//!
//! # Keys and rotation
//!
//! A [`Keyring`] holds one or more [`SealingKey`]s, each with an id. The
//! first key seals; every key opens (the sealed bytes name the key that
//! sealed them). To rotate: deploy `[new, old]` everywhere, and drop `old`
//! once the records it sealed have passed their TTL (one day by default).
//! Keys come only from the caller; there is no default key. A key's bytes
//! are never printed by `Debug`, and are zeroed when the key is dropped.
//!
//! # Records that do not open
//!
//! A sealed record that no key of the layer opens (another key, an unknown
//! key id, a changed byte, a record moved to another key, or a sealed record
//! met by a layer without keys) is never replayed, and the handler does not
//! run: the repeat gets the 503 problem
//! [`Rejection::RecordSealed`](crate::problem::Rejection::RecordSealed)
//! (`record-sealed`), which names the cause, where a corrupt record gets
//! `store-unavailable`; the layer logs at ERROR (the key id and the
//! reason, never key material) and counts it
//! (`tower_idempotency_records_unopened_total` with the `metrics` feature).
//!
//! A plain record met by a layer with keys is replayed: a record stored
//! before encryption was turned on keeps its replay until its TTL ends.
//!
//! # Beside the records
//!
//! [`Keyring::seal_bytes`] and [`Keyring::open_bytes`] seal other data with
//! the same keys, bound to a context of the caller's (format byte 2, a
//! domain of its own: sealed bytes never open as a record, nor the
//! reverse). `tower-idempotency-outbox` seals its messages' payloads with
//! them (`Message::seal`, opened by its relay), so that one keyring, and one
//! rotation, covers the records and the messages they commit with.

use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use chacha20poly1305::XNonce;
use chacha20poly1305::aead::{Aead, Payload};
use zeroize::Zeroizing;

use crate::fingerprint::Fingerprint;
use crate::response::{StoredBody, StoredResponse};
use crate::store::RecordId;

mod key;
pub use key::{KEY_LEN, SealingKey, SealingKeyError};

const FORMAT: u8 = 1;
/// The format byte of [`Keyring::seal_bytes`].
const BYTES_FORMAT: u8 = 2;
const NONCE_LEN: usize = 24;
const TAG_LEN: usize = 16;
const HEADER_LEN: usize = 1 + 4 + NONCE_LEN;

/// The keys of a layer: the first seals, every one opens. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Keyring {
    keys: Arc<[SealingKey]>,
}

impl Keyring {
    /// A keyring of `keys`, the first of which seals.
    ///
    /// # Errors
    ///
    /// [`SealingKeyError::NoKeys`] for none, [`SealingKeyError::DuplicateId`] if two keys
    /// share an id.
    pub fn new(keys: impl IntoIterator<Item = SealingKey>) -> Result<Self, SealingKeyError> {
        let keys: Arc<[SealingKey]> = keys.into_iter().collect();
        if keys.is_empty() {
            return Err(SealingKeyError::NoKeys);
        }
        for (i, key) in keys.iter().enumerate() {
            if keys[..i].iter().any(|k| k.id == key.id) {
                return Err(SealingKeyError::DuplicateId(key.id));
            }
        }
        Ok(Keyring { keys })
    }

    /// The id of the key that seals.
    pub fn sealing_id(&self) -> u32 {
        self.keys[0].id
    }

    /// Seals `response`, the record of `id` for a request with `fingerprint`:
    /// the result keeps the status, and holds the rest as
    /// [`StoredBody::Sealed`].
    ///
    /// # Errors
    ///
    /// [`SealError`] only if the operating system's random number generator
    /// fails.
    pub fn seal(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        response: &StoredResponse,
    ) -> Result<StoredResponse, SealError> {
        let plaintext = Zeroizing::new(response.encode());
        let aad = |head: &[u8]| associated_data(id, fingerprint, response.status, head);
        let sealed = self.encrypt(FORMAT, aad, &plaintext)?;
        Ok(StoredResponse {
            status: response.status,
            headers: Vec::new(),
            body: StoredBody::Sealed(sealed),
            trailers: None,
        })
    }

    /// Seals `plaintext` bound to `context` (each part framed by its
    /// length; a copy under another context does not open): for data kept
    /// beside the records, such as `tower-idempotency-outbox`'s payloads.
    /// The sealed bytes: a format byte (2), the sealing key's id (a
    /// big-endian `u32`), a 24-byte nonce, the ciphertext and its 16-byte
    /// tag: 45 bytes more than `plaintext`.
    ///
    /// # Errors
    ///
    /// [`SealError`] only if the operating system's random number generator
    /// fails.
    pub fn seal_bytes(&self, context: &[&[u8]], plaintext: &[u8]) -> Result<Bytes, SealError> {
        self.encrypt(BYTES_FORMAT, |head| bytes_aad(context, head), plaintext)
    }

    /// Opens what [`Keyring::seal_bytes`] sealed under `context`, with the
    /// key its bytes name.
    ///
    /// # Errors
    ///
    /// [`OpenError`] if no key of this keyring opens it under `context`.
    pub fn open_bytes(&self, context: &[&[u8]], sealed: &[u8]) -> Result<Vec<u8>, OpenError> {
        decrypt(self, BYTES_FORMAT, sealed, |head| bytes_aad(context, head))
    }

    /// `FORMAT`, the sealing key's id, a fresh nonce, then `plaintext`
    /// encrypted with the associated data `aad` gives for those 5 first
    /// bytes.
    fn encrypt(
        &self,
        format: u8,
        aad: impl FnOnce(&[u8]) -> Vec<u8>,
        plaintext: &[u8],
    ) -> Result<Bytes, SealError> {
        let key = &self.keys[0];
        let mut nonce = [0u8; NONCE_LEN];
        getrandom::fill(&mut nonce).map_err(|_| SealError(()))?;
        let mut sealed = BytesMut::with_capacity(HEADER_LEN + TAG_LEN + plaintext.len());
        sealed.put_u8(format);
        sealed.put_u32(key.id);
        sealed.put_slice(&nonce);
        let aad = aad(&sealed[..5]);
        let payload = Payload {
            msg: plaintext,
            aad: &aad,
        };
        // Fails only for a message longer than the cipher allows (256 GiB).
        let ciphertext = key
            .cipher
            .encrypt(&XNonce::from(nonce), payload)
            .map_err(|_| SealError(()))?;
        sealed.put_slice(&ciphertext);
        Ok(sealed.freeze())
    }

    /// Opens `stored`, the record of `id` for a request with `fingerprint`;
    /// a plain record (one not [`StoredBody::Sealed`]) is returned as it is.
    ///
    /// # Errors
    ///
    /// [`OpenError`] if no key of this keyring opens it.
    pub fn open(
        &self,
        id: &RecordId,
        fingerprint: &Fingerprint,
        stored: StoredResponse,
    ) -> Result<StoredResponse, OpenError> {
        open(Some(self), id, fingerprint, stored)
    }
}

/// What the layer seals one request's record with: its keyring, and what
/// the record is bound to.
pub(crate) struct Sealer {
    pub(crate) keyring: Keyring,
    pub(crate) id: RecordId,
    pub(crate) fingerprint: Fingerprint,
}

impl Sealer {
    pub(crate) fn seal(&self, response: &StoredResponse) -> Result<StoredResponse, SealError> {
        self.keyring.seal(&self.id, &self.fingerprint, response)
    }
}

/// Opens `stored` with `keyring`, if any: see [`Keyring::open`]. Without a
/// keyring, a sealed record is [`OpenError::NoKeys`].
pub(crate) fn open(
    keyring: Option<&Keyring>,
    id: &RecordId,
    fingerprint: &Fingerprint,
    stored: StoredResponse,
) -> Result<StoredResponse, OpenError> {
    let StoredBody::Sealed(sealed) = &stored.body else {
        return Ok(stored);
    };
    let keyring = keyring.ok_or(OpenError::NoKeys)?;
    if !stored.headers.is_empty() || stored.trailers.is_some() {
        return Err(OpenError::Malformed);
    }
    let aad = |head: &[u8]| associated_data(id, fingerprint, stored.status, head);
    let plaintext = Zeroizing::new(decrypt(keyring, FORMAT, sealed, aad)?);
    match StoredResponse::decode(&plaintext) {
        Ok(inner) if inner.status == stored.status && !inner.body.is_sealed() => Ok(inner),
        _ => Err(OpenError::Malformed),
    }
}

/// Opens `sealed` (of `format`) with the key of `keyring` it names, under
/// the associated data `aad` gives for its 5 first bytes.
fn decrypt(
    keyring: &Keyring,
    format: u8,
    sealed: &[u8],
    aad: impl FnOnce(&[u8]) -> Vec<u8>,
) -> Result<Vec<u8>, OpenError> {
    if sealed.len() < HEADER_LEN + TAG_LEN || sealed[0] != format {
        return Err(OpenError::Malformed);
    }
    let key_id = u32::from_be_bytes([sealed[1], sealed[2], sealed[3], sealed[4]]);
    let key = keyring
        .keys
        .iter()
        .find(|k| k.id == key_id)
        .ok_or(OpenError::UnknownKey(key_id))?;
    let aad = aad(&sealed[..5]);
    let payload = Payload {
        msg: &sealed[HEADER_LEN..],
        aad: &aad,
    };
    let nonce =
        XNonce::try_from(&sealed[5..HEADER_LEN]).map_err(|_| OpenError::Rejected(key_id))?;
    key.cipher
        .decrypt(&nonce, payload)
        .map_err(|_| OpenError::Rejected(key_id))
}

/// What bytes sealed by [`Keyring::seal_bytes`] are bound to: a domain
/// string of their own (so no sealed record opens as sealed bytes, nor the
/// reverse), the caller's context parts and the format byte and key id,
/// each preceded by its length (u64, big-endian).
fn bytes_aad(context: &[&[u8]], head: &[u8]) -> Vec<u8> {
    let parts: Vec<&[u8]> = context.iter().copied().chain([head]).collect();
    framed(b"tower-idempotency/seal/bytes/v1", &parts)
}

/// `domain`, then each part preceded by its length (u64, big-endian).
fn framed(domain: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    let mut aad = Vec::with_capacity(64 + parts.iter().map(|p| 8 + p.len()).sum::<usize>());
    aad.extend_from_slice(domain);
    for part in parts {
        aad.extend_from_slice(&(part.len() as u64).to_be_bytes());
        aad.extend_from_slice(part);
    }
    aad
}

/// What a sealed record is bound to: a domain string, then the scope, the
/// key, the fingerprint, the status and the sealed bytes' format byte and
/// key id, each preceded by its length (u64, big-endian).
fn associated_data(
    id: &RecordId,
    fingerprint: &Fingerprint,
    status: http::StatusCode,
    head: &[u8],
) -> Vec<u8> {
    let status = status.as_u16().to_be_bytes();
    let parts: [&[u8]; 5] = [
        id.scope().as_bytes(),
        id.key().as_bytes(),
        &fingerprint.0,
        &status,
        head,
    ];
    framed(b"tower-idempotency/seal/v1", &parts)
}

/// The operating system's random number generator failed: nothing was
/// sealed.
#[derive(Debug)]
pub struct SealError(());

impl std::fmt::Display for SealError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("no nonce from the OS random number generator; the response was not sealed")
    }
}

impl std::error::Error for SealError {}

/// Why a sealed record did not open. Never replayed: the layer answers 503.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OpenError {
    /// The record is sealed, and the layer has no keys.
    NoKeys,
    /// No key of the keyring has the id the record names.
    UnknownKey(u32),
    /// The key with this id did not open it: another key with the same id,
    /// a changed byte, or a record moved to another scope, key or
    /// fingerprint.
    Rejected(u32),
    /// The sealed bytes are not in the format this version writes.
    Malformed,
}

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            OpenError::NoKeys => f.write_str("the record is sealed and the layer has no keys"),
            OpenError::UnknownKey(id) => write!(
                f,
                "the record is sealed with key {id}, which no configured key has"
            ),
            OpenError::Rejected(id) => write!(
                f,
                "key {id} did not open the record: another key, a changed byte, or a record of another request"
            ),
            OpenError::Malformed => f.write_str("the sealed record is malformed"),
        }
    }
}

impl std::error::Error for OpenError {}

#[cfg(test)]
mod tests;
