//! Records in Redis, for a fleet of app servers that share one Redis (the
//! `redis` cargo feature). The docs, with an example, are on [`RedisStore`].
//!
//! Each Lua script is a `.lua` file beside this one, loaded with
//! `include_str!`; `inspect.rs` holds [`Inspect`](crate::store::Inspect).

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::{Script, Value};

use super::{
    Claim, ClaimRequest, Clock, Completion, FencingToken, RecordId, Refusal, Store, StoreError,
    duration_ms,
};
use crate::response::StoredResponse;

mod inspect;

/// The largest lease, TTL or clock offset (ms) a script is given: about
/// 35,000 years. A Unix time plus an offset plus a TTL stays below 2^52, so
/// Lua's doubles hold every sum exactly, and `PEXPIRE` accepts it.
const MAX_MS: i64 = 1 << 50;

/// Reconnection attempts after the first, while Redis is unreachable.
const RECONNECT_RETRIES: usize = 1;
/// How long one attempt to connect may take.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(1);
/// How long one command may wait for its reply.
const RESPONSE_TIMEOUT: Duration = Duration::from_millis(500);

/// Keys per `SCAN` step and per purge script.
const SCAN_COUNT: usize = 500;

/// Shared by every script: the server's time in ms plus the offset in
/// `ARGV[1]`, and whole numbers written as integers (never `1.8e+12`).
const PRELUDE: &str = include_str!("prelude.lua");

/// `KEYS[1]` the record; `ARGV`: offset, fingerprint, token, lease ms, TTL ms.
/// The table in the module docs of [`super`], in order.
const CLAIM: &str = include_str!("claim.lua");

/// `KEYS[1]` the record; `ARGV`: offset, token, response. 1 stored, 0 fenced.
/// A record past its TTL counts as gone: nothing is written.
const COMPLETE: &str = include_str!("complete.lua");

/// `KEYS[1]` the record; `ARGV`: offset (unused), token. 1 deleted, 0 not.
const RELEASE: &str = include_str!("release.lua");

/// `KEYS` records found by `SCAN`; `ARGV`: offset. Deletes the records (hashes
/// with a known state) whose `expires_at` has passed; returns how many.
const PURGE: &str = include_str!("purge.lua");

/// `KEYS` records found by `SCAN`; `ARGV`: offset, `1` to list the stuck
/// records. Judges each record (hashes with a known state) as the claim
/// would, at one reading of the server's clock. Returns `{'ok', now,
/// in_flight, stuck, completed, expired, {{key, fingerprint, lease_until,
/// expires_at}, ...}}`, or `{'corrupt', why}`.
const INSPECT: &str = include_str!("inspect.lua");

static CLAIM_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(CLAIM));
static COMPLETE_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(COMPLETE));
static RELEASE_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(RELEASE));
static PURGE_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(PURGE));
static INSPECT_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(INSPECT));

fn script(body: &str) -> Script {
    Script::new(&format!("{PRELUDE}{body}"))
}

/// Records in Redis, for a fleet of app servers that share one Redis: one
/// hash per record, each operation one Lua script, time from the Redis server.
///
/// # Example
///
/// ```no_run
/// use tower_idempotency::{IdempotencyLayer, store::RedisStore};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RedisStore::builder("redis://127.0.0.1:6379")
///     .prefix("shop:idempotency:")
///     .open()
///     .await?;
/// // Separate mode (the default): the only mode Redis offers.
/// // Keys belong to the caller your gateway names in `x-user` (a request
/// // without it gets 401: never a shared fallback scope).
/// let user = http::HeaderName::from_static("x-user");
/// let layer = IdempotencyLayer::new(store, tower_idempotency::scope::header(user));
/// # Ok(()) }
/// ```
///
/// # How it decides
///
/// [`Store::claim`], [`Store::complete`] and [`Store::release`] are each ONE
/// Lua script (`EVALSHA`, loaded again by itself after a Redis restart). Redis
/// runs a script to its end before it runs any other command, so a claim
/// reads and writes the record with nothing in between: of many concurrent
/// claims on one key, from one process or many, exactly one is acquired.
///
/// Each record is one hash at `{prefix}{scope length}:{scope}:{key}` (the
/// scope's length in bytes first, so `("a:b", "c")` and `("a", "b:c")` never
/// share a key) with the fields `fingerprint` (32 bytes), `token` (decimal),
/// `state` (`in_flight` or `completed`), `lease_until` and `expires_at` (Unix
/// milliseconds) and, once completed, `response` (the bytes of
/// [`StoredResponse::encode`]). A record past its TTL counts as absent:
/// a claim starts it afresh, and [`Store::complete`] writes nothing and
/// answers [`Completion::Fenced`].
///
/// # Separate mode only
///
/// [`RedisStore`] does not implement [`super::TransactionalStore`], so
/// [`crate::IdempotencyLayer::transactional`] does not accept it. Transactional
/// mode commits the handler's own writes together with the record, in one
/// database transaction; the handler's data does not live in Redis, and no
/// Redis transaction can include another database's writes. In
/// [`crate::mode::Separate`], a process that dies between the handler's
/// effect and [`Store::complete`] leaves the key in flight; when its lease
/// ends, a retry runs the handler again.
///
/// # Time
///
/// Leases and TTLs are judged by the Redis server's clock (`TIME`, read
/// inside each script), never by an app server's: app servers whose clocks
/// disagree still agree on who holds a key. Each write also sets the key's
/// native expiry (`PEXPIRE`) to the record's TTL, so Redis deletes records by
/// itself; [`Store::purge_expired`] (a `SCAN` over the prefix) only sweeps a
/// record whose `expires_at` has passed before Redis removed it, and a
/// [`super::spawn_purge_task`] is not needed. Lookups check `expires_at`
/// themselves and never rely on the native expiry. (A test's
/// [`RedisStoreBuilder::time_offset`] is added to the server's time.) If the
/// server's clock steps back, a record whose `lease_until` is then further
/// ahead than the claiming request's lease counts as over, as on every
/// store (see [`ClaimRequest::lease`]).
///
/// # Durability
///
/// A record is as durable as the Redis server's persistence settings make
/// it, and they decide whether a completed record survives a Redis restart:
/// with `appendonly yes` and `appendfsync always`, an acknowledged write is
/// on disk; with `appendfsync everysec`, about the last second may be lost;
/// with RDB snapshots only, everything since the last snapshot; with no
/// persistence (common for a cache), every record. A failover to a replica
/// may also lose the last writes (replication is asynchronous). A lost
/// completed record means a retry runs the handler again; a lost in-flight
/// record lets a concurrent retry run it a second time. Where that matters,
/// use a Redis with `appendfsync always` and no failover, or the SQLite
/// store.
///
/// # Connections and errors
///
/// One multiplexed connection per store (cloning a store shares it), through
/// [`::redis::aio::ConnectionManager`], which reconnects by itself. A call
/// that Redis does not answer fails with [`StoreError::Unavailable`], which
/// the layer answers with 503: an error reply, no reply within 500 ms, or no
/// connection (while Redis is unreachable, a call makes one more connection
/// attempt of at most 1 s and fails; the next call tries again). A call that
/// timed out may still have run on the server: a claim then leaves the key
/// in flight until its lease ends.
///
/// A record that cannot be decoded (say, a key under the prefix that another
/// program wrote) fails the claim with [`StoreError::Corrupt`]: give the
/// store a prefix of its own. The store talks to the one server its URL
/// names: neither Redis Cluster nor Sentinel discovery is supported.
#[derive(Clone)]
pub struct RedisStore {
    conn: ConnectionManager,
    prefix: Arc<str>,
    offset: Option<Arc<dyn Clock>>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the URL: it may carry a password.
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("time_offset", &self.offset.is_some())
            .finish_non_exhaustive()
    }
}

/// Options for [`RedisStore`]; made by [`RedisStore::builder`].
#[must_use]
pub struct RedisStoreBuilder {
    url: String,
    prefix: String,
    offset: Option<Arc<dyn Clock>>,
}

impl std::fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStoreBuilder")
            .field("prefix", &self.prefix)
            .field("time_offset", &self.offset.is_some())
            .finish_non_exhaustive()
    }
}

impl RedisStoreBuilder {
    /// The prefix of every key the store writes (default `"idempotency:"`).
    /// Give each application its own; [`Store::purge_expired`] scans the
    /// keys under it. Not empty ([`RedisStoreBuilder::open`] fails with
    /// [`StoreError::Config`]).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// For tests of leases and TTLs only: `clock`'s reading, in milliseconds,
    /// is ADDED to the Redis server's time in every script, so a test moves
    /// time on without sleeping (e.g. a clock reading
    /// `test_util::ManualClock`'s time minus its start). The server's own clock
    /// still runs underneath. Production leaves it unset: the server's time
    /// alone judges leases and TTLs.
    pub fn time_offset(mut self, clock: impl Clock) -> Self {
        self.offset = Some(Arc::new(clock));
        self
    }

    /// Connects, and loads the scripts (so a server without Lua scripting
    /// fails here, not on the first request).
    ///
    /// # Errors
    ///
    /// [`StoreError::Config`] when the URL is not a Redis URL or the prefix
    /// is empty; [`StoreError::Unavailable`] when the server cannot be
    /// reached or refuses the scripts.
    pub async fn open(self) -> Result<RedisStore, StoreError> {
        if self.prefix.is_empty() {
            return Err(StoreError::config(
                "the Redis key prefix is empty: purging and inspecting would scan every key of the database",
            ));
        }
        let client = ::redis::Client::open(self.url).map_err(StoreError::config)?;
        let mut conn = ConnectionManager::new_with_config(client, connection_config())
            .await
            .map_err(StoreError::unavailable)?;
        for script in [
            &CLAIM_SCRIPT,
            &COMPLETE_SCRIPT,
            &RELEASE_SCRIPT,
            &PURGE_SCRIPT,
            &INSPECT_SCRIPT,
        ] {
            script
                .prepare_invoke()
                .load_async(&mut conn)
                .await
                .map_err(StoreError::unavailable)?;
        }
        Ok(RedisStore {
            conn,
            prefix: self.prefix.into(),
            offset: self.offset,
        })
    }
}

/// One reconnection attempt per call while Redis is unreachable, so a call
/// fails in about a connection timeout rather than after the `redis` crate's
/// default six attempts with backoff (about 9 s against a refused port, far
/// longer against a silent host); the next call tries again. The connection
/// (1 s) and response (500 ms) timeouts are the `redis` crate's defaults,
/// set here so that its updates do not change them.
fn connection_config() -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_number_of_retries(RECONNECT_RETRIES)
        .set_connection_timeout(Some(CONNECTION_TIMEOUT))
        .set_response_timeout(Some(RESPONSE_TIMEOUT))
}

impl RedisStore {
    /// Connects to `url` (`redis://[:password@]host[:port][/db]`, or
    /// `rediss://` where the `redis` crate has TLS) with the default options
    /// (see [`RedisStoreBuilder`]).
    ///
    /// # Errors
    ///
    /// As [`RedisStoreBuilder::open`].
    pub async fn open(url: impl Into<String>) -> Result<Self, StoreError> {
        Self::builder(url).open().await
    }

    /// Options: key prefix, test time offset.
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder {
            url: url.into(),
            prefix: "idempotency:".into(),
            offset: None,
        }
    }

    /// The prefix of every key the store writes.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn record_key(&self, scope: &str, key: &str) -> String {
        record_key(&self.prefix, scope, key)
    }

    /// The test offset (ms) for `ARGV[1]`; 0 in production.
    fn offset_ms(&self) -> i64 {
        self.offset
            .as_ref()
            .map_or(0, |clock| clock.now_ms().clamp(-MAX_MS, MAX_MS))
    }
}

/// `{prefix}{scope length}:{scope}:{key}`.
fn record_key(prefix: &str, scope: &str, key: &str) -> String {
    format!("{prefix}{}:{scope}:{key}", scope.len())
}

/// One page of `SCAN cursor MATCH pattern COUNT SCAN_COUNT`: the next
/// cursor (0 when the walk is over) and the key names.
async fn scan_page(
    conn: &mut ConnectionManager,
    pattern: &str,
    cursor: u64,
) -> Result<(u64, Vec<Vec<u8>>), StoreError> {
    ::redis::cmd("SCAN")
        .arg(cursor)
        .arg("MATCH")
        .arg(pattern)
        .arg("COUNT")
        .arg(SCAN_COUNT)
        .query_async(conn)
        .await
        .map_err(StoreError::unavailable)
}

/// A `SCAN MATCH` pattern for every key under `prefix`, its glob characters
/// escaped.
fn scan_pattern(prefix: &str) -> String {
    let mut pattern = String::with_capacity(prefix.len() + 1);
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            pattern.push('\\');
        }
        pattern.push(c);
    }
    pattern.push('*');
    pattern
}

fn clamp_ms(d: Duration) -> i64 {
    duration_ms(d).min(MAX_MS)
}

fn unexpected(script: &str, reply: &Value) -> StoreError {
    StoreError::unavailable(format!(
        "unexpected reply from the {script} script: {reply:?}"
    ))
}

fn text(v: Option<&Value>) -> Option<&[u8]> {
    match v {
        Some(Value::BulkString(b)) => Some(b),
        _ => None,
    }
}

fn int(v: Option<&Value>) -> Option<i64> {
    match v {
        Some(Value::Int(n)) => Some(*n),
        _ => None,
    }
}

/// The claim script's reply: `{kind, value}`.
fn parse_claim(reply: Value) -> Result<Claim, StoreError> {
    let Value::Array(items) = &reply else {
        return Err(unexpected("claim", &reply));
    };
    match text(items.first()) {
        Some(b"acquired") => match int(items.get(1)) {
            Some(0) => Ok(Claim::Acquired { taken_over: false }),
            Some(1) => Ok(Claim::Acquired { taken_over: true }),
            _ => Err(unexpected("claim", &reply)),
        },
        Some(b"mismatch") => Ok(Refusal::Mismatch.into()),
        Some(b"completed") => match text(items.get(1)) {
            Some(blob) => StoredResponse::decode(blob)
                .map(|stored| Refusal::Completed(stored).into())
                .map_err(|e| StoreError::Corrupt(e.to_string())),
            None => Err(unexpected("claim", &reply)),
        },
        Some(b"in_flight") => match int(items.get(1)).and_then(|ms| u64::try_from(ms).ok()) {
            Some(ms) => Ok(Refusal::InFlight {
                lease_remaining: Duration::from_millis(ms),
            }
            .into()),
            None => Err(unexpected("claim", &reply)),
        },
        Some(b"corrupt") => Err(StoreError::Corrupt(
            text(items.get(1))
                .map(|why| String::from_utf8_lossy(why).into_owned())
                .unwrap_or_default(),
        )),
        _ => Err(unexpected("claim", &reply)),
    }
}

/// A script's 0 or 1.
fn parse_flag(script: &str, reply: Value) -> Result<bool, StoreError> {
    match reply {
        Value::Int(0) => Ok(false),
        Value::Int(1) => Ok(true),
        other => Err(unexpected(script, &other)),
    }
}

impl Store for RedisStore {
    async fn claim(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        let mut conn = self.conn.clone();
        let reply: Value = CLAIM_SCRIPT
            .key(self.record_key(&req.scope, &req.key))
            .arg(self.offset_ms())
            .arg(&req.fingerprint.0[..])
            .arg(req.token.0)
            .arg(clamp_ms(req.lease))
            .arg(clamp_ms(req.ttl))
            .invoke_async(&mut conn)
            .await
            .map_err(StoreError::unavailable)?;
        parse_claim(reply)
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        let (scope, key) = id.into_parts();
        let mut conn = self.conn.clone();
        let reply: Value = COMPLETE_SCRIPT
            .key(self.record_key(&scope, &key))
            .arg(self.offset_ms())
            .arg(token.0)
            .arg(response.encode())
            .invoke_async(&mut conn)
            .await
            .map_err(StoreError::unavailable)?;
        Ok(if parse_flag("complete", reply)? {
            Completion::Stored
        } else {
            Completion::Fenced
        })
    }

    async fn release(&self, id: RecordId, token: FencingToken) -> Result<bool, StoreError> {
        let (scope, key) = id.into_parts();
        let mut conn = self.conn.clone();
        let reply: Value = RELEASE_SCRIPT
            .key(self.record_key(&scope, &key))
            .arg(self.offset_ms())
            .arg(token.0)
            .invoke_async(&mut conn)
            .await
            .map_err(StoreError::unavailable)?;
        parse_flag("release", reply)
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let mut conn = self.conn.clone();
        let pattern = scan_pattern(&self.prefix);
        let mut cursor: u64 = 0;
        let mut purged: u64 = 0;
        loop {
            let (next, keys) = scan_page(&mut conn, &pattern, cursor).await?;
            for batch in keys.chunks(SCAN_COUNT) {
                let reply: Value = PURGE_SCRIPT
                    .key(batch)
                    .arg(self.offset_ms())
                    .invoke_async(&mut conn)
                    .await
                    .map_err(StoreError::unavailable)?;
                match reply {
                    Value::Int(n) => purged += u64::try_from(n).unwrap_or(0),
                    other => return Err(unexpected("purge", &other)),
                }
            }
            if next == 0 {
                return Ok(purged);
            }
            cursor = next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scope_length_keeps_scope_and_key_apart() {
        assert_eq!(record_key("p:", "alice", "k-1"), "p:5:alice:k-1");
        assert_ne!(record_key("p:", "a:b", "c"), record_key("p:", "a", "b:c"));
        // Bytes, not chars.
        assert_eq!(record_key("", "é", "k"), "2:é:k");
    }

    #[test]
    fn glob_characters_in_the_prefix_are_escaped() {
        assert_eq!(scan_pattern("idempotency:"), "idempotency:*");
        assert_eq!(scan_pattern(r"a*b?[c]\"), r"a\*b\?\[c\]\\*");
    }

    #[test]
    fn odd_replies_are_errors_not_panics() {
        for reply in [
            Value::Nil,
            Value::Array(vec![]),
            Value::Array(vec![Value::BulkString(b"acquired".to_vec())]),
            Value::Array(vec![
                Value::BulkString(b"in_flight".to_vec()),
                Value::Int(-1),
            ]),
            Value::Array(vec![Value::BulkString(b"completed".to_vec())]),
        ] {
            assert!(matches!(
                parse_claim(reply),
                Err(StoreError::Unavailable(_))
            ));
        }
        let garbage = Value::Array(vec![
            Value::BulkString(b"completed".to_vec()),
            Value::BulkString(b"\x00garbage".to_vec()),
        ]);
        assert!(matches!(parse_claim(garbage), Err(StoreError::Corrupt(_))));
        assert!(parse_flag("release", Value::Int(2)).is_err());
    }
}
