//! Parsing and validating the idempotency key.
//!
//! # Example
//!
//! ```
//! use http::HeaderMap;
//! use tower_idempotency::key::{parse_key, KeyError};
//!
//! let mut headers = HeaderMap::new();
//! headers.insert("idempotency-key", "\"8e03978e-40d5\"".parse().unwrap());
//! assert_eq!(parse_key(&headers, "idempotency-key").unwrap().as_deref(), Some("8e03978e-40d5"));
//!
//! // The bare form that Stripe's examples send is the same key.
//! headers.insert("idempotency-key", "8e03978e-40d5".parse().unwrap());
//! assert_eq!(parse_key(&headers, "idempotency-key").unwrap().as_deref(), Some("8e03978e-40d5"));
//!
//! headers.insert("idempotency-key", "\"a\", \"b\"".parse().unwrap());
//! assert_eq!(parse_key(&headers, "idempotency-key"), Err(KeyError::List));
//! ```
//!
//! # The rules
//!
//! The IETF draft `draft-ietf-httpapi-idempotency-key-header` defines the field
//! as an Item Structured Field whose value is a String (RFC 9651 §3.3.3, which
//! obsoletes RFC 8941), so the standard form is quoted: `"abc"`, with `\"` and
//! `\\` as the only escapes. Many clients, Stripe's own examples among them,
//! send the key unquoted; that bare form is accepted too and names the same
//! key.
//!
//! A key is 1 to [`MAX_KEY_LEN`] characters of printable ASCII (`0x20..=0x7E`;
//! a space only inside the quoted form). Stripe documents the same 255-character
//! limit. Everything else is a [`KeyError`], which the layer answers with 400
//! before the store is touched.
//!
//! # Bare values that are another structured type
//!
//! A bare value is read as the key it spells, except where every structured
//! field parser would read it as a bare item of another type than String.
//! Those are refused with [`KeyError::NotAString`], since the draft requires a
//! String and the client (or the library that serialised the field) meant
//! something else. Each type of RFC 9651 §3.3, and why:
//!
//! | bare value | RFC 9651 | here | why |
//! |---|---|---|---|
//! | `8e03978e-40d5`, `ch_1`, `abc` | Token, §3.3.4 | a key | Stripe's examples and many clients send keys this way |
//! | `123`, `-7`, `1.5` | Integer §3.3.1, Decimal §3.3.2 | a key | numeric ids (a database row, an order number) are real keys; refusing them would break clients that work today |
//! | `@1659578233` | Date, §3.3.7 | [`NotAString`](KeyError::NotAString) | a timestamp sent as a Date is not a key; no known client sends keys starting with `@` |
//! | `%"caf%c3%a9"` | Display String, §3.3.8 | [`NotAString`](KeyError::NotAString) | Unicode text is no key (keys are printable ASCII); it could never be a bare key anyway (`"`) |
//! | `:aGVsbG8=:` | Byte Sequence, §3.3.5 | [`NotAString`](KeyError::NotAString) | bytes, not a String; no known client sends keys wrapped in colons |
//! | `?1`, `?0` | Boolean, §3.3.6 | [`NotAString`](KeyError::NotAString) | a flag, not a key; one bit cannot be unique |
//!
//! The refused shapes are exact: `@` followed by an sf-integer (an optional
//! `-` and 1 to 15 digits), `%"` at the start, `:` base64 characters `:`, and
//! `?0` or `?1`. A bare `@abc` or `?yes` is no structured value at all and
//! stays a key. Quoted, each of them is a String and a key like any other:
//! `"@1659578233"` is the key `@1659578233`.

use std::fmt;
use std::sync::Arc;

use http::HeaderMap;
use http::header::AsHeaderName;

pub use crate::renew::NotConfirmed;
use crate::renew::{Confirmer, LeaseSignal};

/// The longest key accepted, in characters (Stripe's documented limit).
pub const MAX_KEY_LEN: usize = 255;

/// Why a key field was rejected. Each answers 400 (IETF draft §2.7).
/// `#[non_exhaustive]`: more reasons may come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyError {
    /// The request carried the field more than once.
    Repeated,
    /// The value is empty (`""`, or nothing at all).
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] characters.
    TooLong,
    /// A byte outside printable ASCII: a control character or non-ASCII.
    NotPrintableAscii,
    /// A quoted value that is not a valid RFC 9651 sf-string: unterminated,
    /// or a backslash before anything but `"` or `\`.
    MalformedString,
    /// More than one member (an sf-list such as `"a", "b"`).
    List,
    /// Parameters after the string (`"a";p=1`): the draft defines none.
    Parameters,
    /// An unquoted value holding a character a bare key cannot carry
    /// (space, `"`, `\`, `,` or `;`): quote it.
    MalformedToken,
    /// The key is read from the body's JSON
    /// ([`crate::key_source::json_pointer`]) and the body is not JSON.
    BodyNotJson,
    /// The value where a key source looks is neither a string nor an
    /// integer (a boolean, a fraction, an object, an array).
    UnsupportedType,
    /// A bare field value that structured fields read as another type than
    /// String: a Date (`@1659578233`, RFC 9651 §3.3.7), a Display String
    /// (`%"caf%c3%a9"`, §3.3.8), a Byte Sequence (`:aGVsbG8=:`, §3.3.5) or a
    /// Boolean (`?1`, §3.3.6). Bare tokens, integers and decimals stay keys
    /// (see [the module](self)).
    NotAString,
}

impl KeyError {
    /// A sentence for the `detail` of the 400 problem. It never echoes the key.
    pub fn describe(self) -> &'static str {
        match self {
            KeyError::Repeated => "the idempotency key field appears more than once",
            KeyError::Empty => "the idempotency key is empty",
            KeyError::TooLong => "the idempotency key is longer than 255 characters",
            KeyError::NotPrintableAscii => {
                "the idempotency key holds a byte outside printable ASCII"
            }
            KeyError::MalformedString => {
                "the idempotency key is not a valid structured-field string (RFC 9651 section 3.3.3)"
            }
            KeyError::List => "the idempotency key field holds a list; it must be one string",
            KeyError::Parameters => {
                "the idempotency key field carries parameters; none are defined"
            }
            KeyError::MalformedToken => {
                "an unquoted idempotency key may not contain spaces, quotes, backslashes, commas or semicolons; quote it as an sf-string"
            }
            KeyError::BodyNotJson => {
                "this endpoint reads the idempotency key from the JSON body, and the body is not JSON"
            }
            KeyError::UnsupportedType => {
                "the idempotency key in the body is neither a string nor an integer"
            }
            KeyError::NotAString => {
                "the idempotency key field holds a structured-field date, display string, byte sequence or boolean (RFC 9651 section 3.3), not a string; send the key as an sf-string"
            }
        }
    }
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}

impl std::error::Error for KeyError {}

/// Reads the key field `name` from `headers`.
///
/// Returns `Ok(None)` when the field is absent, `Ok(Some(key))` with the
/// unescaped key, or the [`KeyError`] that makes it invalid.
pub fn parse_key<K: AsHeaderName>(
    headers: &HeaderMap,
    name: K,
) -> Result<Option<String>, KeyError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    parse_value(value.as_bytes()).map(Some)
}

/// Parses one field value: an RFC 9651 sf-string or a bare key.
pub fn parse_value(raw: &[u8]) -> Result<String, KeyError> {
    // A tab is optional whitespace around the value (RFC 9110 §5.5), not key material.
    if raw
        .iter()
        .any(|b| !(0x20..=0x7e).contains(b) && *b != b'\t')
    {
        return Err(KeyError::NotPrintableAscii);
    }
    // RFC 9651 §4.2: leading and trailing spaces are discarded.
    let value = trim(raw);
    let key = match value.first() {
        None => return Err(KeyError::Empty),
        Some(b'"') => parse_sf_string(value)?,
        Some(_) => parse_bare(value)?,
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    Ok(key)
}

fn trim(mut raw: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = raw {
        raw = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = raw {
        raw = rest;
    }
    raw
}

/// RFC 9651 §4.2.5, followed by the end-of-item checks of §4.2.
fn parse_sf_string(value: &[u8]) -> Result<String, KeyError> {
    let mut key = String::new();
    let mut bytes = value[1..].iter();
    loop {
        match bytes.next() {
            None => return Err(KeyError::MalformedString),
            Some(b'\\') => match bytes.next() {
                Some(&c @ (b'"' | b'\\')) => key.push(char::from(c)),
                _ => return Err(KeyError::MalformedString),
            },
            Some(b'"') => break,
            Some(b'\t') => return Err(KeyError::NotPrintableAscii),
            Some(&c) => key.push(char::from(c)),
        }
    }
    match trim(bytes.as_slice()).first() {
        None => Ok(key),
        Some(b',') => Err(KeyError::List),
        Some(b';') => Err(KeyError::Parameters),
        Some(_) => Err(KeyError::MalformedString),
    }
}

fn parse_bare(value: &[u8]) -> Result<String, KeyError> {
    if is_other_bare_item(value) {
        return Err(KeyError::NotAString);
    }
    if value.contains(&b',') {
        return Err(KeyError::List);
    }
    if value
        .iter()
        .any(|b| matches!(b, b' ' | b'\t' | b'"' | b'\\' | b';'))
    {
        return Err(KeyError::MalformedToken);
    }
    // Every byte is printable ASCII here, so this cannot fail.
    String::from_utf8(value.to_vec()).map_err(|_| KeyError::NotPrintableAscii)
}

/// Whether a bare `value` is a structured field bare item that is neither a
/// String nor one of the types kept as keys (Token, Integer, Decimal): see
/// the table in the module's docs.
fn is_other_bare_item(value: &[u8]) -> bool {
    match value {
        // Date (RFC 9651 §3.3.7): "@" sf-integer, sf-integer = ["-"] 1*15DIGIT.
        [b'@', rest @ ..] => {
            let digits = rest.strip_prefix(b"-").unwrap_or(rest);
            (1..=15).contains(&digits.len()) && digits.iter().all(u8::is_ascii_digit)
        }
        // Display String (§3.3.8): it opens with `%"`.
        [b'%', b'"', ..] => true,
        // Byte Sequence (§3.3.5): ":" base64 ":".
        [b':', inner @ .., b':'] => inner
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'=')),
        // Boolean (§3.3.6).
        [b'?', b'0' | b'1'] => true,
        _ => false,
    }
}

/// The idempotency key of the request the handler is serving, and the scope
/// it belongs to: what the layer claimed. The layer inserts it into the
/// request's extensions before the inner service runs, so a handler that
/// forwards the key (to a payment provider, say) does not parse the header
/// again. With the `axum` feature it is an extractor: `ClaimedKey` answers a
/// request without one with a 500 problem (the route is not behind the layer,
/// or its key is optional); `Option<ClaimedKey>` is `None` for requests that
/// passed through without a key.
///
/// ```
/// use tower_idempotency::key::ClaimedKey;
///
/// async fn charge(claimed: ClaimedKey) -> String {
///     // E.g. the provider's own Idempotency-Key, derived from ours.
///     format!("{}/{}", claimed.scope(), claimed.key())
/// }
/// ```
#[derive(Debug, Clone)]
pub struct ClaimedKey {
    key: String,
    scope: String,
    namespace: Option<Arc<str>>,
    lease: Arc<LeaseSignal>,
    taken_over: bool,
    confirmer: Option<Arc<Confirmer>>,
}

/// Two claimed keys are equal when their keys, scopes and namespaces are.
impl PartialEq for ClaimedKey {
    fn eq(&self, other: &Self) -> bool {
        (&self.key, &self.scope, &self.namespace) == (&other.key, &other.scope, &other.namespace)
    }
}

impl Eq for ClaimedKey {}

impl ClaimedKey {
    pub(crate) fn new(key: String, scope: String) -> Self {
        ClaimedKey {
            key,
            scope,
            namespace: None,
            lease: Arc::default(),
            taken_over: false,
            confirmer: None,
        }
    }

    /// The claim as the store made it: whether it took over a record whose
    /// lease had ended, and how to confirm it.
    pub(crate) fn claimed(&mut self, taken_over: bool, confirmer: Confirmer) {
        self.taken_over = taken_over;
        self.confirmer = Some(Arc::new(confirmer));
    }

    /// Whether this request took its key over from an earlier request whose
    /// lease had ended unfinished (it crashed, was cut off, or its handler
    /// said [`OutcomeUnknown`](crate::policy::OutcomeUnknown)). That request's
    /// effect may have happened: a handler whose effect is not atomic with
    /// the record (separate mode) should look for it (by the key it stored
    /// with the effect) before making it again.
    pub fn taken_over(&self) -> bool {
        self.taken_over
    }

    /// Confirms, right before an effect, that this request still holds its
    /// key, and returns how long it surely holds it from now: finish the
    /// effect within that time, or confirm again.
    ///
    /// In separate mode it costs nothing while the store has confirmed the
    /// claim for at least half a lease more (its first lease, counted from
    /// before the claim was sent, or a renewal's): a request shorter than
    /// half its lease never pays for it. Past that it is one store round
    /// trip: a renewal of the lease fenced by the request's fencing token
    /// (one lease, never past the max hold; the same write as
    /// the layer's renewals while the request runs, see
    /// [`IdempotencyLayer::max_hold`](crate::IdempotencyLayer::max_hold)).
    /// It closes the window in which a paused holder (a stopped process, a
    /// long GC pause, a partition) resumes after another request took its key
    /// over and makes the effect a second time: such a holder gets
    /// [`NotConfirmed::Lost`]. What remains is a pause between the
    /// confirmation and the effect longer than the duration returned.
    ///
    /// In transactional mode the effect commits with the record, so the
    /// commit is the fence: it answers at once with the hold left.
    ///
    /// # Errors
    ///
    /// [`NotConfirmed::Lost`] when the key is no longer this request's
    /// (then [`ClaimedKey::lease_lost`] resolves too);
    /// [`NotConfirmed::Store`] when the store did not answer.
    pub async fn confirm(&self) -> Result<std::time::Duration, NotConfirmed> {
        match &self.confirmer {
            Some(confirmer) => confirmer.confirm().await,
            // Only a key the layer has not claimed yet has none.
            None => Err(NotConfirmed::Lost),
        }
    }

    /// The same claim under the layer's namespace, if it has one.
    pub(crate) fn in_namespace(mut self, namespace: Option<Arc<str>>) -> Self {
        self.namespace = namespace;
        self
    }

    pub(crate) fn lease_signal(&self) -> Arc<LeaseSignal> {
        self.lease.clone()
    }

    /// Resolves if this request's lease is lost while it runs (see
    /// [`IdempotencyLayer::max_hold`](crate::IdempotencyLayer::max_hold)):
    /// a renewal found the key taken over, or none was confirmed before the
    /// lease ended, or the max hold passed. Another request may then run
    /// the same operation: a handler with a long effect can race this
    /// against its work and stop. Never resolves without renewal.
    pub async fn lease_lost(&self) {
        self.lease.lost().await;
    }

    /// Whether [`ClaimedKey::lease_lost`] has resolved.
    pub fn is_lease_lost(&self) -> bool {
        self.lease.is_lost()
    }

    /// The parsed key, unquoted (what [`parse_key`] returns).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The scope the key belongs to (see [`crate::scope`]; `""` for
    /// [`GlobalScope`](crate::scope::GlobalScope)).
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The layer's [`namespace`](crate::IdempotencyLayer::namespace), if
    /// it has one: the same key and scope under two namespaces are two
    /// claims (two records, two runs), so whatever a handler derives from
    /// its claim to keep runs apart (the outbox's message keys) must take
    /// the namespace in too.
    pub fn namespace(&self) -> Option<&str> {
        self.namespace.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &[u8]) -> Result<String, KeyError> {
        parse_value(raw)
    }

    #[test]
    fn quoted_and_bare_forms_are_one_key() {
        assert_eq!(parse(b"\"abc-123\"").unwrap(), "abc-123");
        assert_eq!(parse(b"abc-123").unwrap(), "abc-123");
        assert_eq!(parse(b"  \"abc\"  ").unwrap(), "abc");
    }

    #[test]
    fn escapes_are_unescaped() {
        assert_eq!(parse(br#""a\"b\\c""#).unwrap(), r#"a"b\c"#);
        assert_eq!(parse(b"\"with space\"").unwrap(), "with space");
    }

    #[test]
    fn length_limits() {
        assert_eq!(parse(&[b'a'; 255]).unwrap().len(), 255);
        assert_eq!(parse(&[b'a'; 256]), Err(KeyError::TooLong));
        let mut quoted = vec![b'"'];
        quoted.extend([b'a'; 256]);
        quoted.push(b'"');
        assert_eq!(parse(&quoted), Err(KeyError::TooLong));
        // An escape counts as the one character it stands for.
        let mut escaped = vec![b'"'];
        for _ in 0..255 {
            escaped.extend(br"\\");
        }
        escaped.push(b'"');
        assert_eq!(parse(&escaped).unwrap().len(), 255);
    }

    #[test]
    fn rejections() {
        assert_eq!(parse(b""), Err(KeyError::Empty));
        assert_eq!(parse(b"   "), Err(KeyError::Empty));
        assert_eq!(parse(b"\"\""), Err(KeyError::Empty));
        assert_eq!(parse(b"k\xff\xfe"), Err(KeyError::NotPrintableAscii));
        assert_eq!(parse(b"k\x01x"), Err(KeyError::NotPrintableAscii));
        assert_eq!(parse(b"\"k\x7fx\""), Err(KeyError::NotPrintableAscii));
        assert_eq!(parse(b"\"abc"), Err(KeyError::MalformedString));
        assert_eq!(parse(br#""a\x""#), Err(KeyError::MalformedString));
        assert_eq!(parse(br#""abc"def"#), Err(KeyError::MalformedString));
        assert_eq!(parse(br#""a", "b""#), Err(KeyError::List));
        assert_eq!(parse(b"a, b"), Err(KeyError::List));
        assert_eq!(parse(br#""a";p=1"#), Err(KeyError::Parameters));
        assert_eq!(parse(b"a b"), Err(KeyError::MalformedToken));
        assert_eq!(parse(b"a\"b"), Err(KeyError::MalformedToken));
        assert_eq!(parse(b"\"a\tb\""), Err(KeyError::NotPrintableAscii));
    }

    #[test]
    fn bare_items_of_other_types_are_refused() {
        // RFC 9651 §3.3.7 (Date), §3.3.8 (Display String), §3.3.5 (Byte
        // Sequence), §3.3.6 (Boolean).
        for raw in [
            &b"@1659578233"[..],
            b"@-1659578233",
            b"@0",
            b"@123456789012345",
            b"  @1659578233\t",
            br#"%"caf%c3%a9""#,
            br#"%"""#,
            br#"%"a"#,
            b":aGVsbG8=:",
            b"::",
            b":YQ==:",
            b"?1",
            b"?0",
        ] {
            assert_eq!(parse(raw), Err(KeyError::NotAString), "{raw:?}");
        }
    }

    #[test]
    fn bare_keys_that_clients_send_are_kept() {
        // Tokens (Stripe's examples), integers and decimals (numeric ids).
        for raw in [
            "8e03978e-40d5",
            "8e03978e-40d5-43e8-bc93-6894a57f9324",
            "ch_1NirD82eZvKYlo2CIvbtLWuY",
            "123",
            "-7",
            "1.5",
            "18446744073709551615",
            "k:v",
            "a=b",
        ] {
            assert_eq!(parse(raw.as_bytes()), Ok(raw.to_owned()));
        }
        // Near misses of the refused shapes are no structured value: keys.
        for raw in [
            "@abc",
            "@",
            "@-",
            "@1234567890123456",
            "@12a",
            "a@1",
            "%41",
            "%",
            "?2",
            "?10",
            "?",
            ":",
            ":abc",
            "abc:",
            ":a.b:",
            ":a-b:",
        ] {
            assert_eq!(parse(raw.as_bytes()), Ok(raw.to_owned()), "{raw}");
        }
        // Quoted, every refused shape is a String, hence a key.
        assert_eq!(parse(br#""@1659578233""#).unwrap(), "@1659578233");
        assert_eq!(parse(br#""?1""#).unwrap(), "?1");
        assert_eq!(parse(br#"":aGVsbG8=:""#).unwrap(), ":aGVsbG8=:");
        assert_eq!(parse(br#""%\"caf\"""#).unwrap(), r#"%"caf""#);
    }

    #[test]
    fn not_a_string_describes_without_the_key() {
        let text = KeyError::NotAString.describe();
        assert_eq!(
            text,
            "the idempotency key field holds a structured-field date, display string, \
             byte sequence or boolean (RFC 9651 section 3.3), not a string; send the key \
             as an sf-string"
        );
        assert_eq!(KeyError::NotAString.to_string(), text);
    }

    #[test]
    fn repeated_field_is_rejected() {
        let mut headers = HeaderMap::new();
        headers.append("idempotency-key", "one".parse().unwrap());
        headers.append("idempotency-key", "two".parse().unwrap());
        assert_eq!(
            parse_key(&headers, "idempotency-key"),
            Err(KeyError::Repeated)
        );
        assert_eq!(parse_key(&HeaderMap::new(), "idempotency-key"), Ok(None));
    }
}
