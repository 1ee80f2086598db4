//! [`Message`]: one outgoing message and its stable downstream key.

use sha2::{Digest, Sha256};

use tower_idempotency::key::ClaimedKey;
use tower_idempotency::seal::{Keyring, SealError};

/// The longest message key accepted, in bytes: what an `IdempotencyLayer`
/// downstream accepts (1..=255 characters, see [`tower_idempotency::key`]).
pub const MAX_KEY_LEN: usize = 255;

/// The largest payload accepted by [`Message::new`] and
/// [`Message::with_key`], in bytes (1 MiB). Messages are rows: keep them small
/// and put bulk data where the receiver can fetch it.
pub const MAX_PAYLOAD: usize = 1024 * 1024;

/// One message to deliver after the handler's transaction commits: its
/// stable idempotency key, its destination (for [`crate::HttpSink`], the
/// URL it is POSTed to), its content type and its payload bytes.
///
/// Enqueue it inside the request's transaction: `sqlite::enqueue`
/// (`SqliteStore`), `postgres::enqueue` (`PostgresStore`), `mysql::enqueue`
/// (`MySqlStore`), or `sqlx::enqueue` on the connection of any sqlx store's
/// transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub(crate) key: String,
    pub(crate) destination: String,
    pub(crate) content_type: String,
    pub(crate) payload: Vec<u8>,
}

/// Why a [`Message`] could not be built.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MessageError {
    /// The key given to [`Message::with_key`] is empty, longer than
    /// [`MAX_KEY_LEN`] bytes, or has a character outside printable ASCII
    /// (`0x20..=0x7e`), which an RFC 9651 sf-string cannot carry.
    InvalidKey,
    /// The payload is larger than [`MAX_PAYLOAD`] bytes.
    PayloadTooLarge(usize),
    /// The destination is empty, longer than 2048 bytes or has a NUL
    /// character, or the content type is empty or longer than 255 bytes or
    /// not visible ASCII.
    InvalidField(&'static str),
}

impl std::fmt::Display for MessageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MessageError::InvalidKey => {
                f.write_str("an outbox message key must be 1..=255 printable ASCII characters")
            }
            MessageError::PayloadTooLarge(n) => {
                write!(
                    f,
                    "an outbox payload of {n} bytes exceeds {MAX_PAYLOAD} bytes"
                )
            }
            MessageError::InvalidField(name) => write!(f, "invalid outbox message {name}"),
        }
    }
}

impl std::error::Error for MessageError {}

/// The stable key of message `index` of the request that claimed `claimed`:
/// `"obx1-"` and 64 hex digits of SHA-256 over a fixed label, the scope, the
/// key (each framed by its length in 8 bytes, big-endian) and `index` (4
/// bytes, big-endian). Under a layer's namespace
/// ([`ClaimedKey::namespace`]), the key is framed as the store keeps it:
/// the namespace, U+001F, then the key.
///
/// The same (scope, key, index) gives the same key in every process and
/// after every restart, so a request that is rolled back and retried
/// enqueues its messages under the same keys; different scopes, keys or
/// indexes give different keys (SHA-256's collision resistance). The key
/// says nothing readable about the request: the hash cannot be reversed,
/// though whoever knows a request's scope and key can recompute it.
pub fn message_key(claimed: &ClaimedKey, index: u32) -> String {
    let mut h = Sha256::new();
    h.update(b"tower-idempotency outbox message key v1");
    // Under a layer's namespace the key is framed as the store keeps it,
    // the namespace, U+001F and the key: the same key under two namespaces
    // is two runs, and a key (printable ASCII) never holds U+001F, so no
    // namespaced key frames as a plain one. Without a namespace the key is
    // framed as before.
    let key = match claimed.namespace() {
        Some(namespace) => format!("{namespace}\u{1f}{}", claimed.key()),
        None => claimed.key().to_owned(),
    };
    for part in [claimed.scope().as_bytes(), key.as_bytes()] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    h.update(index.to_be_bytes());
    let digest = h.finalize();
    let mut out = String::with_capacity(5 + 64);
    out.push_str("obx1-");
    for b in digest {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

fn check_fields(destination: &str, content_type: &str, payload: &[u8]) -> Result<(), MessageError> {
    // A NUL fits no PostgreSQL `TEXT` (and no URL nor subject).
    if destination.is_empty() || destination.len() > 2048 || destination.contains('\0') {
        return Err(MessageError::InvalidField("destination"));
    }
    if content_type.is_empty()
        || content_type.len() > 255
        || !content_type.bytes().all(|b| (0x20..=0x7e).contains(&b))
    {
        return Err(MessageError::InvalidField("content type"));
    }
    if payload.len() > MAX_PAYLOAD {
        return Err(MessageError::PayloadTooLarge(payload.len()));
    }
    // Reserved for sealed payloads: a plain one never reads as sealed.
    if payload.starts_with(SEALED) {
        return Err(MessageError::InvalidField("payload"));
    }
    Ok(())
}

/// What a sealed payload starts with ([`Message::seal`]); a plain payload
/// may not.
pub(crate) const SEALED: &[u8] = b"\0tower-idempotency-outbox/sealed\0";

/// What a sealed payload is bound to: the message's key, destination and
/// content type.
fn seal_context(message: &Message) -> [&[u8]; 4] {
    [
        b"tower-idempotency-outbox",
        message.key.as_bytes(),
        message.destination.as_bytes(),
        message.content_type.as_bytes(),
    ]
}

/// Opens the payload of `message` if it is sealed ([`Message::seal`]) with
/// a key of `keyring`; a plain payload is left as it is.
pub(crate) fn open(message: &mut Message, keyring: Option<&Keyring>) -> Result<(), String> {
    let Some(sealed) = message.payload.strip_prefix(SEALED) else {
        return Ok(());
    };
    let keyring = keyring.ok_or("the payload is sealed, and this relay has no keys")?;
    let opened = keyring
        .open_bytes(&seal_context(message), sealed)
        .map_err(|e| format!("the sealed payload does not open: {e}"))?;
    message.payload = opened;
    Ok(())
}

impl Message {
    /// Message `index` (0, 1, ... in the order the handler enqueues them) of
    /// the request whose claimed key is `claimed`, keyed by
    /// [`message_key`].
    ///
    /// # Errors
    ///
    /// [`MessageError`] for a payload over [`MAX_PAYLOAD`] bytes, an empty or
    /// over-long destination or one with a NUL character, or a content type
    /// that is not 1..=255 visible ASCII characters.
    pub fn new(
        claimed: &ClaimedKey,
        index: u32,
        destination: impl Into<String>,
        content_type: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Result<Message, MessageError> {
        Message::with_key(
            message_key(claimed, index),
            destination,
            content_type,
            payload,
        )
    }

    /// A message under a key of the caller's choosing (for a handler that
    /// has no [`ClaimedKey`], e.g. one that derives keys from its own rows).
    /// The key must be stable across retries for the receiver to
    /// de-duplicate.
    ///
    /// # Errors
    ///
    /// As [`Message::new`], and [`MessageError::InvalidKey`] for a key that
    /// is empty, over [`MAX_KEY_LEN`] bytes or not printable ASCII.
    pub fn with_key(
        key: impl Into<String>,
        destination: impl Into<String>,
        content_type: impl Into<String>,
        payload: impl Into<Vec<u8>>,
    ) -> Result<Message, MessageError> {
        let key = key.into();
        if key.is_empty()
            || key.len() > MAX_KEY_LEN
            || !key.bytes().all(|b| (0x20..=0x7e).contains(&b))
        {
            return Err(MessageError::InvalidKey);
        }
        let (destination, content_type, payload) =
            (destination.into(), content_type.into(), payload.into());
        check_fields(&destination, &content_type, &payload)?;
        Ok(Message {
            key,
            destination,
            content_type,
            payload,
        })
    }

    /// The same message with its payload sealed at rest by `keyring`'s first
    /// key (XChaCha20-Poly1305, see [`tower_idempotency::seal`]), bound to
    /// its key, destination and content type: what the outbox table keeps
    /// of the payload is ciphertext. A relay given the keyring
    /// ([`Relay::keyring`](crate::Relay::keyring)) opens it before it
    /// delivers; the sink, and the receiver, get the plain payload. The key,
    /// the destination and the content type stay in the clear. Use the
    /// keyring of the layer's
    /// [`encrypt_at_rest`](tower_idempotency::IdempotencyLayer::encrypt_at_rest),
    /// so that one rotation covers records and messages.
    ///
    /// # Errors
    ///
    /// [`SealError`] only if the operating system's random number generator
    /// fails.
    pub fn seal(mut self, keyring: &Keyring) -> Result<Message, SealError> {
        let sealed = keyring.seal_bytes(&seal_context(&self), &self.payload)?;
        let mut payload = Vec::with_capacity(SEALED.len() + sealed.len());
        payload.extend_from_slice(SEALED);
        payload.extend_from_slice(&sealed);
        self.payload = payload;
        Ok(self)
    }

    /// Whether the payload is sealed ([`Message::seal`]).
    pub fn is_sealed(&self) -> bool {
        self.payload.starts_with(SEALED)
    }

    /// The message's idempotency key, as the receiver gets it (unquoted).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Where it goes (for [`crate::HttpSink`], the URL).
    pub fn destination(&self) -> &str {
        &self.destination
    }

    /// Its media type, e.g. `application/json`.
    pub fn content_type(&self) -> &str {
        &self.content_type
    }

    /// Its bytes, delivered unchanged on every attempt (sealed, once
    /// [`Message::seal`]ed: the relay opens them).
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower_idempotency::test_util::claimed_key;

    #[test]
    fn a_sealed_payload_opens_only_with_its_keys_and_fields() {
        use tower_idempotency::seal::{Keyring, SealingKey};
        let ring = Keyring::new([SealingKey::new(1, [5; 32])]).unwrap();
        let plain = Message::with_key("k", "http://x/", "application/json", b"{\"n\":42}".to_vec())
            .unwrap();
        let sealed = plain.clone().seal(&ring).unwrap();
        assert!(sealed.is_sealed() && !plain.is_sealed());
        assert!(!sealed.payload().windows(6).any(|w| w == b"\"n\":42"));
        let mut opened = sealed.clone();
        open(&mut opened, Some(&ring)).unwrap();
        assert_eq!(opened, plain);
        // No keys, other keys, another key or destination: not opened.
        assert!(open(&mut sealed.clone(), None).is_err());
        let other = Keyring::new([SealingKey::new(2, [5; 32])]).unwrap();
        assert!(open(&mut sealed.clone(), Some(&other)).is_err());
        let mut moved = sealed.clone();
        moved.key = "k2".into();
        assert!(open(&mut moved, Some(&ring)).is_err());
        moved = sealed;
        moved.destination = "http://y/".into();
        assert!(open(&mut moved, Some(&ring)).is_err());
        // A plain payload is left as it is; one that looks sealed is refused.
        let mut same = plain.clone();
        open(&mut same, None).unwrap();
        assert_eq!(same, plain);
        let mut fake = SEALED.to_vec();
        fake.push(1);
        assert_eq!(
            Message::with_key("k", "http://x/", "text/plain", fake),
            Err(MessageError::InvalidField("payload"))
        );
    }

    #[test]
    fn keys_are_stable_and_distinct() {
        let a = claimed_key("k1", "alice");
        let k = message_key(&a, 0);
        assert_eq!(k, message_key(&claimed_key("k1", "alice"), 0));
        assert_eq!(k.len(), 69);
        assert!(k.starts_with("obx1-"));
        assert_ne!(k, message_key(&a, 1));
        assert_ne!(k, message_key(&claimed_key("k1", "bob"), 0));
        // Framing: moving a byte between scope and key changes the key.
        assert_ne!(
            message_key(&claimed_key("ab", "c"), 0),
            message_key(&claimed_key("b", "ca"), 0)
        );
    }

    #[test]
    fn bad_fields_are_refused() {
        let ok = |k: &str| Message::with_key(k, "http://x/", "application/json", b"{}".to_vec());
        assert_eq!(ok(""), Err(MessageError::InvalidKey));
        assert_eq!(ok("a\"\n"), Err(MessageError::InvalidKey));
        assert_eq!(ok(&"a".repeat(256)), Err(MessageError::InvalidKey));
        assert!(ok(&"a".repeat(255)).is_ok());
        assert_eq!(
            Message::with_key("k", "", "application/json", vec![]),
            Err(MessageError::InvalidField("destination"))
        );
        assert_eq!(
            Message::with_key("k", "d", "a\u{7f}", vec![]),
            Err(MessageError::InvalidField("content type"))
        );
        assert_eq!(
            Message::with_key("k", "d", "t", vec![0; MAX_PAYLOAD + 1]),
            Err(MessageError::PayloadTooLarge(MAX_PAYLOAD + 1))
        );
    }
}
