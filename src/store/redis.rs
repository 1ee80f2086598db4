//! Records in Redis, for a fleet of app servers that share one Redis (the
//! `redis` cargo feature). The docs, with an example, are on [`RedisStore`].

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::{Script, Value};

use super::{
    Claim, ClaimRequest, Clock, Completion, FencingToken, Inspect, RecordCounts, RecordSummary,
    Store, StoreError, duration_ms,
};
use crate::fingerprint::Fingerprint;
use crate::response::StoredResponse;

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
const PRELUDE: &str = r"
if redis.replicate_commands then redis.replicate_commands() end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
end
local function int(n)
  return string.format('%d', n)
end
";

/// `KEYS[1]` the record; `ARGV`: offset, fingerprint, token, lease ms, TTL ms.
/// The table in the module docs of [`super`], in order.
const CLAIM: &str = r"
local key = KEYS[1]
local now = now_ms()
local function acquire(taken_over)
  redis.call('DEL', key)
  redis.call('HSET', key,
    'fingerprint', ARGV[2],
    'token', ARGV[3],
    'state', 'in_flight',
    'lease_until', int(now + tonumber(ARGV[4])),
    'expires_at', int(now + tonumber(ARGV[5])))
  redis.call('PEXPIRE', key, ARGV[5])
  return {'acquired', taken_over}
end
local kind = redis.call('TYPE', key)['ok']
if kind == 'none' then
  return acquire(0)
end
if kind ~= 'hash' then
  return {'corrupt', 'the key holds a ' .. kind .. ', not a hash'}
end
local r = redis.call('HMGET', key, 'fingerprint', 'state', 'lease_until', 'expires_at')
local expires_at = tonumber(r[4])
if not expires_at then
  return {'corrupt', 'expires_at is missing or not a number'}
end
if expires_at <= now then
  return acquire(0)
end
if type(r[1]) ~= 'string' then
  return {'corrupt', 'the fingerprint is missing'}
end
if r[1] ~= ARGV[2] then
  return {'mismatch'}
end
if r[2] == 'completed' then
  local response = redis.call('HGET', key, 'response')
  if type(response) ~= 'string' then
    return {'corrupt', 'a completed record without a response'}
  end
  return {'completed', response}
end
if r[2] ~= 'in_flight' then
  return {'corrupt', 'the state is neither in_flight nor completed'}
end
local lease_until = tonumber(r[3])
if not lease_until then
  return {'corrupt', 'lease_until is missing or not a number'}
end
if lease_until > now then
  return {'in_flight', lease_until - now}
end
return acquire(1)
";

/// `KEYS[1]` the record; `ARGV`: offset, token, response. 1 stored, 0 fenced.
/// A record past its TTL counts as gone: nothing is written.
const COMPLETE: &str = r"
local key = KEYS[1]
if redis.call('TYPE', key)['ok'] ~= 'hash' then
  return 0
end
local r = redis.call('HMGET', key, 'token', 'state', 'expires_at')
if r[1] ~= ARGV[2] or r[2] ~= 'in_flight' then
  return 0
end
local remaining = (tonumber(r[3]) or 0) - now_ms()
if remaining <= 0 then
  return 0
end
redis.call('HSET', key, 'state', 'completed', 'response', ARGV[3])
redis.call('PEXPIRE', key, int(remaining))
return 1
";

/// `KEYS[1]` the record; `ARGV`: offset (unused), token. 1 deleted, 0 not.
const RELEASE: &str = r"
local key = KEYS[1]
if redis.call('TYPE', key)['ok'] ~= 'hash' then
  return 0
end
local r = redis.call('HMGET', key, 'token', 'state')
if r[1] == ARGV[2] and r[2] == 'in_flight' then
  redis.call('DEL', key)
  return 1
end
return 0
";

/// `KEYS` records found by `SCAN`; `ARGV`: offset. Deletes the records (hashes
/// with a known state) whose `expires_at` has passed; returns how many.
const PURGE: &str = r"
local now = now_ms()
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('TYPE', key)['ok'] == 'hash' then
    local r = redis.call('HMGET', key, 'state', 'expires_at')
    local expires_at = tonumber(r[2])
    if (r[1] == 'in_flight' or r[1] == 'completed') and expires_at and expires_at <= now then
      redis.call('DEL', key)
      n = n + 1
    end
  end
end
return n
";

/// `KEYS` records found by `SCAN`; `ARGV`: offset, `1` to list the stuck
/// records. Judges each record (hashes with a known state) as the claim
/// would, at one reading of the server's clock. Returns `{'ok', now,
/// in_flight, stuck, completed, expired, {{key, fingerprint, lease_until,
/// expires_at}, ...}}`, or `{'corrupt', why}`.
const INSPECT: &str = r"
local now = now_ms()
local list = ARGV[2] == '1'
local counts = {0, 0, 0, 0}
local stuck = {}
for _, key in ipairs(KEYS) do
  if redis.call('TYPE', key)['ok'] == 'hash' then
    local r = redis.call('HMGET', key, 'state', 'lease_until', 'expires_at', 'fingerprint')
    local expires_at = tonumber(r[3])
    if (r[1] == 'in_flight' or r[1] == 'completed') and expires_at then
      if expires_at <= now then
        counts[4] = counts[4] + 1
      elseif r[1] == 'completed' then
        counts[3] = counts[3] + 1
      else
        local lease_until = tonumber(r[2])
        if not lease_until then
          return {'corrupt', 'lease_until is missing or not a number'}
        end
        if lease_until > now then
          counts[1] = counts[1] + 1
        else
          counts[2] = counts[2] + 1
          if list then
            table.insert(stuck, {key, r[4] or '', int(lease_until), int(expires_at)})
          end
        end
      end
    end
  end
end
return {'ok', int(now), counts[1], counts[2], counts[3], counts[4], stuck}
";

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
/// let layer = IdempotencyLayer::new(store, |parts: &http::request::Parts| {
///     parts.headers.get("x-user").and_then(|v| v.to_str().ok()).unwrap_or("anonymous").to_owned()
/// });
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
/// [`RedisStoreBuilder::time_offset`] is added to the server's time.)
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
    /// keys under it.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// For tests of leases and TTLs only: `clock`'s reading, in milliseconds,
    /// is ADDED to the Redis server's time in every script, so a test moves
    /// time on without sleeping (e.g. a clock reading
    /// [`super::ManualClock`]'s time minus its start). The server's own clock
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
    /// [`StoreError::Unavailable`] when the URL is not a Redis URL, or the
    /// server cannot be reached or refuses the scripts.
    pub async fn open(self) -> Result<RedisStore, StoreError> {
        let client = ::redis::Client::open(self.url).map_err(StoreError::unavailable)?;
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
        Some(b"mismatch") => Ok(Claim::Mismatch),
        Some(b"completed") => match text(items.get(1)) {
            Some(blob) => StoredResponse::decode(blob)
                .map(Claim::Completed)
                .map_err(|e| StoreError::Corrupt(e.to_string())),
            None => Err(unexpected("claim", &reply)),
        },
        Some(b"in_flight") => match int(items.get(1)).and_then(|ms| u64::try_from(ms).ok()) {
            Some(ms) => Ok(Claim::InFlight {
                lease_remaining: Duration::from_millis(ms),
            }),
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
        scope: String,
        key: String,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
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

    async fn release(
        &self,
        scope: String,
        key: String,
        token: FencingToken,
    ) -> Result<bool, StoreError> {
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

/// A stuck record as the inspect script lists it.
struct StuckEntry {
    scope: String,
    key: String,
    fingerprint: Fingerprint,
    lease_until: i64,
    expires_at: i64,
}

/// One batch's answer from the inspect script.
struct Inspected {
    counts: RecordCounts,
    stuck: Vec<StuckEntry>,
    /// The server's time (ms, with the test offset) when it was judged; for
    /// a whole walk, the last page's.
    now: i64,
}

/// A decimal reply field (the scripts write whole numbers as strings).
fn decimal(v: Option<&Value>) -> Option<i64> {
    std::str::from_utf8(text(v)?).ok()?.parse().ok()
}

/// The inspect script's reply; record names are parsed with `prefix`.
fn parse_inspect(prefix: &str, reply: Value) -> Result<Inspected, StoreError> {
    // Not the reply itself: it names records (scopes and keys).
    let bad = || StoreError::unavailable("unexpected reply from the inspect script");
    let Value::Array(items) = &reply else {
        return Err(bad());
    };
    match text(items.first()) {
        Some(b"ok") => {}
        Some(b"corrupt") => {
            return Err(StoreError::Corrupt(
                text(items.get(1))
                    .map(|why| String::from_utf8_lossy(why).into_owned())
                    .unwrap_or_default(),
            ));
        }
        _ => return Err(bad()),
    }
    let now = decimal(items.get(1)).ok_or_else(bad)?;
    let count = |i: usize| {
        int(items.get(i))
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(bad)
    };
    let counts = RecordCounts {
        in_flight: count(2)?,
        stuck: count(3)?,
        completed: count(4)?,
        expired: count(5)?,
    };
    let Some(Value::Array(listed)) = items.get(6) else {
        return Err(bad());
    };
    let stuck = listed
        .iter()
        .map(|entry| {
            let Value::Array(fields) = entry else {
                return Err(bad());
            };
            let name = text(fields.first()).ok_or_else(bad)?;
            // Not the name: it holds a scope and a key, which logs never show.
            let corrupt = |why: &str| StoreError::Corrupt(why.to_owned());
            let (scope, key) = parse_record_key(prefix, name).ok_or_else(|| {
                corrupt("a stuck record's name is not prefix, scope length, ':', scope, ':', key")
            })?;
            let fingerprint = text(fields.get(1))
                .and_then(|f| <[u8; 32]>::try_from(f).ok())
                .ok_or_else(|| corrupt("a stuck record's fingerprint is not 32 bytes"))?;
            Ok(StuckEntry {
                scope,
                key,
                fingerprint: Fingerprint(fingerprint),
                lease_until: decimal(fields.get(2)).ok_or_else(bad)?,
                expires_at: decimal(fields.get(3)).ok_or_else(bad)?,
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(Inspected { counts, stuck, now })
}

/// `(scope, key)` from a record's name, `{prefix}{scope length}:{scope}:{key}`.
fn parse_record_key(prefix: &str, name: &[u8]) -> Option<(String, String)> {
    let rest = name.strip_prefix(prefix.as_bytes())?;
    let colon = rest.iter().position(|b| *b == b':')?;
    let len: usize = std::str::from_utf8(&rest[..colon]).ok()?.parse().ok()?;
    let rest = &rest[colon + 1..];
    let scope = rest.get(..len)?;
    let key = rest.get(len..)?.strip_prefix(b":")?;
    Some((
        String::from_utf8(scope.to_vec()).ok()?,
        String::from_utf8(key.to_vec()).ok()?,
    ))
}

impl RedisStore {
    /// Runs the inspect script over every key under the prefix, one `SCAN`
    /// page at a time. `SCAN` may return a key twice; each is judged once.
    /// With `list`, keeps the `limit` stuck records with the oldest lease end.
    async fn inspect(&self, list: Option<usize>) -> Result<Inspected, StoreError> {
        let mut conn = self.conn.clone();
        let pattern = scan_pattern(&self.prefix);
        let mut seen = std::collections::HashSet::new();
        let mut total = Inspected {
            counts: RecordCounts::default(),
            stuck: Vec::new(),
            now: i64::MIN,
        };
        let order = |a: &StuckEntry, b: &StuckEntry| {
            (a.lease_until, &a.scope, &a.key).cmp(&(b.lease_until, &b.scope, &b.key))
        };
        let mut cursor: u64 = 0;
        loop {
            let (next, keys) = scan_page(&mut conn, &pattern, cursor).await?;
            let fresh: Vec<Vec<u8>> = keys
                .into_iter()
                .filter(|k| seen.insert(k.clone()))
                .collect();
            if !fresh.is_empty() {
                let reply: Value = INSPECT_SCRIPT
                    .key(&fresh)
                    .arg(self.offset_ms())
                    .arg(if list.is_some() { "1" } else { "0" })
                    .invoke_async(&mut conn)
                    .await
                    .map_err(StoreError::unavailable)?;
                let batch = parse_inspect(&self.prefix, reply)?;
                total.now = total.now.max(batch.now);
                let counts = &mut total.counts;
                counts.in_flight += batch.counts.in_flight;
                counts.stuck += batch.counts.stuck;
                counts.completed += batch.counts.completed;
                counts.expired += batch.counts.expired;
                if let Some(limit) = list {
                    total.stuck.extend(batch.stuck);
                    if total.stuck.len() > limit.saturating_mul(2).max(SCAN_COUNT) {
                        total.stuck.sort_by(order);
                        total.stuck.truncate(limit);
                    }
                }
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
        if let Some(limit) = list {
            total.stuck.sort_by(order);
            total.stuck.truncate(limit);
        }
        Ok(total)
    }
}

/// Walks every key under the prefix with `SCAN` (as
/// [`Store::purge_expired`] does), judging each page in one script at one
/// reading of the Redis server's clock. So an answer is not one snapshot:
/// records written or deleted during the walk may or may not be counted, and
/// pages are judged some milliseconds apart (the figures of
/// [`RecordSummary`] are all taken at the last page's reading, so they
/// agree with the order of the list). The walk keeps the names it has
/// seen in memory (`SCAN` may return a key twice), so it costs memory in
/// proportion to the records. Records past their TTL usually vanish by
/// Redis's own expiry before any purge, so [`RecordCounts::expired`] is
/// rarely above 0 here.
impl Inspect for RedisStore {
    async fn stuck(&self, limit: usize) -> Result<Vec<RecordSummary>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let inspected = self.inspect(Some(limit)).await?;
        Ok(inspected
            .stuck
            .into_iter()
            .map(|e| {
                RecordSummary::new(
                    e.scope,
                    e.key,
                    e.fingerprint,
                    e.lease_until,
                    e.expires_at,
                    inspected.now,
                )
            })
            .collect())
    }

    async fn counts(&self) -> Result<RecordCounts, StoreError> {
        Ok(self.inspect(None).await?.counts)
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
    fn record_names_parse_back_to_scope_and_key() {
        for (scope, key) in [
            ("alice", "k-1"),
            ("a:b", "c"),
            ("a", "b:c"),
            ("", ""),
            ("é", ":"),
        ] {
            let name = record_key("p:", scope, key);
            assert_eq!(
                parse_record_key("p:", name.as_bytes()),
                Some((scope.to_owned(), key.to_owned())),
                "{name}"
            );
        }
        for name in [
            "q:5:alice:k",
            "p:x:alice:k",
            "p:9:alice:k",
            "p:5:alicek",
            "p:5",
        ] {
            assert_eq!(parse_record_key("p:", name.as_bytes()), None, "{name}");
        }
    }

    #[test]
    fn odd_inspect_replies_are_errors_that_name_no_record() {
        let bulk = |b: &[u8]| Value::BulkString(b.to_vec());
        let reply = |stuck: Vec<Value>| {
            Value::Array(vec![
                bulk(b"ok"),
                bulk(b"1800000000000"),
                Value::Int(0),
                Value::Int(1),
                Value::Int(0),
                Value::Int(0),
                Value::Array(stuck),
            ])
        };
        let entry = |name: &[u8], fingerprint: &[u8]| {
            Value::Array(vec![
                bulk(name),
                bulk(fingerprint),
                bulk(b"1799999999000"),
                bulk(b"1800000003600"),
            ])
        };
        let ok = parse_inspect("p:", reply(vec![entry(b"p:5:alice:k-1", &[9; 32])])).unwrap();
        assert_eq!(ok.now, 1_800_000_000_000);
        assert_eq!(ok.counts.stuck, 1);
        assert_eq!(
            (ok.stuck[0].scope.as_str(), ok.stuck[0].key.as_str()),
            ("alice", "k-1")
        );
        for odd in [
            Value::Nil,
            Value::Array(vec![bulk(b"p:5:alice:secret-key")]),
            reply(vec![entry(b"p:5:alice", &[9; 32])]),
            reply(vec![entry(b"p:5:alice:secret-key", &[9; 31])]),
            reply(vec![Value::Array(vec![bulk(b"p:5:alice:secret-key")])]),
        ] {
            let Err(e) = parse_inspect("p:", odd) else {
                panic!("accepted an odd reply");
            };
            assert!(!e.to_string().contains("alice"), "{e}");
        }
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
