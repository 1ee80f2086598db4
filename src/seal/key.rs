//! [`SealingKey`]: one key and its id, from bytes or from a file.

use std::path::{Path, PathBuf};

use chacha20poly1305::KeyInit;
use chacha20poly1305::XChaCha20Poly1305;
use zeroize::Zeroizing;

use crate::fingerprint::Hasher;

/// The length of a key, in bytes.
pub const KEY_LEN: usize = 32;

/// One 32-byte key and its id. `Debug` shows the id only; the key's bytes
/// are zeroed on drop.
#[derive(Clone)]
pub struct SealingKey {
    pub(super) id: u32,
    // Holds the key; zeroes it on drop (`ZeroizeOnDrop`).
    pub(super) cipher: XChaCha20Poly1305,
}

impl std::fmt::Debug for SealingKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SealingKey")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl SealingKey {
    /// The key `bytes` with the id `id`, which the records it seals name.
    /// Ids are the caller's choice; within one [`Keyring`](super::Keyring) each is unique.
    pub fn new(id: u32, bytes: [u8; KEY_LEN]) -> Self {
        let bytes = Zeroizing::new(bytes);
        SealingKey {
            id,
            cipher: XChaCha20Poly1305::new((&*bytes).into()),
        }
    }

    /// The key in the file at `path`, which holds exactly 32 bytes (raw, not
    /// hex or base64: e.g. `head -c 32 /dev/urandom > records.key`). Its id
    /// is derived from the key (the first 4 bytes of a SHA-256 over a domain
    /// string and the key), so every process that reads the same file names
    /// it alike, wherever the file lies.
    ///
    /// # Errors
    ///
    /// [`SealingKeyError::Read`] if the file cannot be read, [`SealingKeyError::Length`] if
    /// it does not hold exactly 32 bytes (the error gives the length found).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, SealingKeyError> {
        let path = path.as_ref();
        let bytes =
            Zeroizing::new(std::fs::read(path).map_err(|source| SealingKeyError::Read {
                path: path.to_owned(),
                source,
            })?);
        let mut key = Zeroizing::new([0u8; KEY_LEN]);
        if bytes.len() != KEY_LEN {
            return Err(SealingKeyError::Length {
                path: path.to_owned(),
                len: bytes.len(),
            });
        }
        key.copy_from_slice(&bytes);
        let mut hasher = Hasher::new("tower-idempotency/seal/key-id/v1");
        hasher.part(key.as_ref());
        let digest = hasher.finish().0;
        let id = u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]);
        Ok(SealingKey::new(id, *key))
    }

    /// The id the records this key seals carry.
    pub fn id(&self) -> u32 {
        self.id
    }
}

/// A [`SealingKey`] could not be read, or a [`Keyring`](super::Keyring) made.
#[derive(Debug)]
#[non_exhaustive]
pub enum SealingKeyError {
    /// The key file could not be read.
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The key file does not hold exactly 32 bytes.
    Length {
        /// The file.
        path: PathBuf,
        /// How many bytes it holds.
        len: usize,
    },
    /// A keyring needs at least one key.
    NoKeys,
    /// Two keys of a keyring have this id.
    DuplicateId(u32),
}

impl std::fmt::Display for SealingKeyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SealingKeyError::Read { path, source } => {
                write!(f, "cannot read the key file {}: {source}", path.display())
            }
            SealingKeyError::Length { path, len } => write!(
                f,
                "the key file {} holds {len} bytes; a key file holds exactly {KEY_LEN} random bytes",
                path.display()
            ),
            SealingKeyError::NoKeys => f.write_str("a keyring needs at least one key"),
            SealingKeyError::DuplicateId(id) => write!(f, "two keys have the id {id}"),
        }
    }
}

impl std::error::Error for SealingKeyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SealingKeyError::Read { source, .. } => Some(source),
            _ => None,
        }
    }
}
