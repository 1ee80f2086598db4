#![doc = include_str!("../README.md")]
// Source map (for contributors; docs/architecture.md maps every file):
// `lib.rs` holds `RedisStore` and its `Store` methods; `builder.rs` where
// it connects; `conn.rs` one server or a cluster; `eviction.rs` the
// `maxmemory-policy` guard; `inspect.rs` `Inspect`; `listen.rs` the
// pub/sub connection that wakes waiting repeats. Each Lua script is a
// `.lua` file beside them, loaded with `include_str!`.
#![deny(unsafe_code, unreachable_pub)]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use ::redis::{Script, Value};

use tower_idempotency::StoredResponse;
use tower_idempotency::store::kit::feed::{Feed, change_key, change_payload};
use tower_idempotency::store::{
    Claim, ClaimRequest, Clock, Completion, FencingToken, RecordId, Store, StoreError, Watch,
    duration_ms,
};

mod builder;
mod conn;
mod eviction;
mod inspect;
mod listen;
mod reply;

pub use builder::RedisStoreBuilder;
use conn::{Conn, Walk};
use eviction::Eviction;
pub use eviction::{EvictionCheck, NodeEviction};
use reply::{Claimed, int, parse_claim, parse_flag, text, unexpected};
use tower_idempotency::store::kit::claim::{answer_cached, answer_completed};
use tower_idempotency::store::kit::replay_cache::{ReplayCache, offset_instant};

/// The largest lease, TTL or clock offset (ms) a script is given: about
/// 35,000 years. A Unix time plus an offset plus a TTL stays below 2^52, so
/// Lua's doubles hold every sum exactly, and `PEXPIRE` accepts it.
const MAX_MS: i64 = 1 << 50;

/// Keys per `SCAN` step and per purge script.
const SCAN_COUNT: usize = 500;

/// Shared by every script: the server's time in ms plus the offset in
/// `ARGV[1]`, and whole numbers written as integers (never `1.8e+12`).
const PRELUDE: &str = include_str!("prelude.lua");

/// `KEYS[1]` the record; `ARGV`: offset, fingerprint, token, lease ms, TTL ms.
/// The table in the module docs of `tower_idempotency::store`, in order.
const CLAIM: &str = include_str!("claim.lua");

/// `KEYS[1]` the record; `ARGV`: offset, token, response. 1 stored, 0 fenced.
/// A record past its TTL counts as gone: nothing is written.
const COMPLETE: &str = include_str!("complete.lua");

/// `KEYS[1]` the record; `ARGV`: offset (unused), token. 1 deleted, 0 not.
const RELEASE: &str = include_str!("release.lua");
const RENEW: &str = include_str!("renew.lua");

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
static RENEW_SCRIPT: LazyLock<Script> = LazyLock::new(|| script(RENEW));
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
/// use tower_idempotency::IdempotencyLayer;
/// use tower_idempotency_redis::RedisStore;
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
/// Each record is one hash at `{prefix}{{{scope length}:{scope}:{key}}}`,
/// e.g. `idempotency:{5:alice:k-1}` (the scope's length in bytes first, so
/// `("a:b", "c")` and `("a", "b:c")` never share a key; the braces are a
/// Redis Cluster hash tag, see below) with the fields `fingerprint` (32 bytes), `token` (decimal),
/// `state` (`in_flight` or `completed`), `lease_until` and `expires_at` (Unix
/// milliseconds) and, once completed, `response` (the bytes of
/// [`StoredResponse::encode`]). A record past its TTL counts as absent:
/// a claim starts it afresh, and [`Store::complete`] writes nothing and
/// answers [`Completion::Fenced`].
///
/// # Separate mode only
///
/// [`RedisStore`] does not implement [`TransactionalStore`](tower_idempotency::store::TransactionalStore), so
/// [`IdempotencyLayer::transactional`](tower_idempotency::IdempotencyLayer::transactional) does not accept it. Transactional
/// mode commits the handler's own writes together with the record, in one
/// database transaction; the handler's data does not live in Redis, and no
/// Redis transaction can include another database's writes. In
/// [`mode::Separate`](tower_idempotency::mode::Separate), a process that dies between the handler's
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
/// [`spawn_purge_task`](tower_idempotency::store::spawn_purge_task) is not needed. Lookups check `expires_at`
/// themselves and never rely on the native expiry. (A test's
/// `RedisStoreBuilder::clock_offset` (feature `test-util`) is added to the server's time.) If the
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
/// # Eviction: `maxmemory-policy noeviction` only
///
/// Every record has an expiry (its TTL), so under any `maxmemory-policy`
/// but `noeviction` (`volatile-lru` and the other `volatile-*` policies
/// included) a Redis that reaches `maxmemory` may delete a record before its
/// TTL, say when a cache shares the server, and a retry of that request
/// then runs its handler again, with nothing logged. ElastiCache's default
/// is `volatile-lru`. So [`RedisStoreBuilder::open`] reads the policy on
/// the server, or on every master of a cluster (`CONFIG GET
/// maxmemory-policy`; where `CONFIG` is refused, `maxmemory_policy` from
/// `INFO memory`), and fails with [`StoreError::Config`] unless each is
/// `noeviction`: the message names the node, its policy and the fix
/// (`CONFIG SET maxmemory-policy noeviction` and the same line in
/// redis.conf; on ElastiCache, the parameter group). A server that refuses
/// both commands (a managed service without `CONFIG`, an ACL user without
/// `+config|get` and `+info`) is refused too, with a message that says
/// `CONFIG is unavailable`; [`RedisStoreBuilder::accept_eviction_risk`]
/// starts anyway, with a WARN at start-up.
///
/// A policy can change at run time, and a failover can promote a replica
/// configured otherwise, so a timer
/// ([`RedisStoreBuilder::eviction_check_interval`], every 60 s by default)
/// reads every master's policy and `INFO stats` `evicted_keys` again: a
/// WARN when a node's policy turns evicting or it has evicted keys since,
/// the gauges `tower_idempotency_redis_eviction_unsafe` and
/// `tower_idempotency_redis_evicted_keys` (feature `metrics`, see
/// the gauges of the [crate docs](crate)), and [`RedisStore::last_eviction_check`]. It never
/// stops the store: requests go on being served. Replicas are not read;
/// a promoted one is, at the next check.
///
/// # Redis Cluster
///
/// [`RedisStore::cluster`] (or [`RedisStore::cluster_builder`]) takes seed
/// URLs and learns the rest of the cluster from them. Each script touches
/// one record, one key; the key's hash tag (the braces around scope and key)
/// means any key derived from the record's name shares its slot, and a
/// prefix may hold no braces, so records spread over every master by their
/// scope and key. `MOVED` and `ASK` redirections (resharding) are followed,
/// and a call that meets a failed master retries (at most 4 times, 50 to
/// 500 ms apart, 2 s in all) while the cluster promotes a replica and the
/// client re-reads the slot map; past that it fails with
/// [`StoreError::Unavailable`] (503), and the next call tries again.
/// Leases are judged by the clock of the master that holds the record, so
/// the masters' clocks should agree (NTP) to well within a lease.
///
/// Redis replicates asynchronously: a master may acknowledge a claim or a
/// completion and fail before a replica has it, and the promoted replica
/// then has an older record or none, with the consequences under
/// "Durability" (a completed record lost runs its handler again). `WAIT`
/// narrows that window but does not close it (a replica that received the
/// write is not necessarily the one promoted); the store does not call it.
///
/// [`Store::purge_expired`] and [`Inspect`](tower_idempotency::store::Inspect) walk
/// every master with `SCAN` (the masters as `CLUSTER SLOTS` names them when
/// the walk starts), judging each slot's keys in one script call. During a
/// resharding or a failover a walk may miss or repeat a record, or fail
/// with [`StoreError::Unavailable`]; run it again.
///
/// # TLS
///
/// `rediss://` URLs need the `tls` feature (rustls). The server's
/// certificate must chain to the system's roots, or to the CA given to
/// `RedisStoreBuilder::ca_certificate` (feature `tls`), and name the URL's host; an
/// untrusted certificate fails [`RedisStoreBuilder::open`] with
/// [`StoreError::Unavailable`] naming rustls's reason (`UnknownIssuer`,
/// `certificate not valid for name`, ...).
///
/// # Connections and errors
///
/// One multiplexed connection per store (per master on a cluster; cloning a
/// store shares them), through [`::redis::aio::ConnectionManager`] (or the
/// `redis` crate's cluster connection), which reconnects by itself. A call
/// that Redis does not answer fails with [`StoreError::Unavailable`], which
/// the layer answers with 503: an error reply, no reply within 500 ms, or no
/// connection (while Redis is unreachable, a call makes one more connection
/// attempt of at most 1 s and fails; the next call tries again). A call that
/// timed out may still have run on the server: a claim then leaves the key
/// in flight until its lease ends.
///
/// A record that cannot be decoded (say, a key under the prefix that another
/// program wrote) fails the claim with [`StoreError::Corrupt`]: give the
/// store a prefix of its own. Sentinel discovery is not supported: a URL
/// names one server, or seeds name a cluster.
#[derive(Clone)]
pub struct RedisStore {
    conn: Conn,
    prefix: Arc<str>,
    offset: Option<Arc<dyn Clock>>,
    /// The last eviction check and the timer, shared by every clone.
    eviction: Arc<Eviction>,
    /// The channel that `complete` and `release` announce on.
    channel: Arc<str>,
    /// Completed records cached for replays (`replay_cache`; see
    /// `store::kit::replay_cache`).
    replays: Arc<ReplayCache>,
    /// The feed that wakes waiting repeats, and the client its subscriber
    /// connects with (one server; `None` on a cluster: waiters poll).
    feed: Option<(Feed, ::redis::Client)>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the URL: it may carry a password.
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("clock_offset", &self.offset.is_some())
            .finish_non_exhaustive()
    }
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

    /// Options (key prefix, CA, test time offset) for one server at `url`.
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder::single(url.into())
    }

    /// Connects to a Redis Cluster through `seeds` (one or more of its
    /// nodes' URLs, `redis://` or `rediss://`, all with the same password,
    /// database and scheme) with the default options. The store learns the
    /// other nodes from the seeds (`CLUSTER SLOTS`), so one reachable seed
    /// is enough; a managed service's one configuration endpoint is a seed.
    ///
    /// # Errors
    ///
    /// As [`RedisStoreBuilder::open`].
    pub async fn cluster<S: Into<String>>(
        seeds: impl IntoIterator<Item = S>,
    ) -> Result<Self, StoreError> {
        Self::cluster_builder(seeds).open().await
    }

    /// Options (key prefix, CA, test time offset) for a Redis Cluster
    /// reached through `seeds`, as [`RedisStore::cluster`].
    pub fn cluster_builder<S: Into<String>>(
        seeds: impl IntoIterator<Item = S>,
    ) -> RedisStoreBuilder {
        RedisStoreBuilder::cluster(seeds.into_iter().map(Into::into).collect())
    }

    /// Whether the store talks to a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.conn, Conn::Cluster(_))
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

/// `{prefix}{{{scope length}:{scope}:{key}}}`: the braces around the
/// record's own part are a cluster hash tag, so every key ever derived from
/// a record's name by appending hashes to the record's slot, and no prefix
/// decides the slot (the prefix may hold no braces).
fn record_key(prefix: &str, scope: &str, key: &str) -> String {
    format!("{prefix}{{{}:{scope}:{key}}}", scope.len())
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

impl Store for RedisStore {
    async fn claim(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        // A replay cached by an earlier one needs no script (off unless the
        // builder sets `replay_cache`).
        let sent = offset_instant(self.offset_ms());
        if let Some(claim) = answer_cached(&self.replays, &req, sent) {
            return Ok(claim);
        }
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
        match parse_claim(reply, &req.fingerprint.0)? {
            Claimed::Claim(claim) => Ok(claim),
            Claimed::Completed(row) => answer_completed(row, &req, &self.replays, sent),
        }
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
            .arg(&*self.channel)
            .arg(change_payload(&self.prefix, &scope, &key))
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
            .arg(&*self.channel)
            .arg(change_payload(&self.prefix, &scope, &key))
            .invoke_async(&mut conn)
            .await
            .map_err(StoreError::unavailable)?;
        parse_flag("release", reply)
    }

    /// One server: woken by the `PUBLISH` of any server's completion or
    /// release of `id`; starts the subscriber. A cluster: `None` (polling).
    fn watch(&self, id: &RecordId) -> Option<Watch> {
        let (feed, client) = self.feed.as_ref()?;
        listen::start(feed, client, &self.channel);
        feed.watch(change_key(&self.prefix, id.scope(), id.key()))
    }

    async fn renew(
        &self,
        id: RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let (scope, key) = id.into_parts();
        let mut conn = self.conn.clone();
        let reply: Value = RENEW_SCRIPT
            .key(self.record_key(&scope, &key))
            .arg(self.offset_ms())
            .arg(token.0)
            .arg(clamp_ms(lease))
            .invoke_async(&mut conn)
            .await
            .map_err(StoreError::unavailable)?;
        parse_flag("renew", reply)
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let mut walk = Walk::new(&self.conn, scan_pattern(&self.prefix)).await?;
        let mut purged: u64 = 0;
        while let Some(keys) = walk.next_page().await? {
            let offset = self.offset_ms().to_string().into_bytes();
            for reply in walk.run(&PURGE_SCRIPT, keys, vec![offset]).await? {
                match reply {
                    Value::Int(n) => purged += u64::try_from(n).unwrap_or(0),
                    other => return Err(unexpected("purge", &other)),
                }
            }
        }
        Ok(purged)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scope_length_keeps_scope_and_key_apart() {
        assert_eq!(record_key("p:", "alice", "k-1"), "p:{5:alice:k-1}");
        assert_ne!(record_key("p:", "a:b", "c"), record_key("p:", "a", "b:c"));
        // Bytes, not chars.
        assert_eq!(record_key("", "é", "k"), "{2:é:k}");
    }

    #[test]
    fn glob_characters_in_the_prefix_are_escaped() {
        assert_eq!(scan_pattern("idempotency:"), "idempotency:*");
        assert_eq!(scan_pattern(r"a*b?[c]\"), r"a\*b\?\[c\]\\*");
    }
}
