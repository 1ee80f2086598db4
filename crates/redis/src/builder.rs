//! [`RedisStoreBuilder`]: where the store connects (one server or a
//! cluster's seed nodes), over TLS or not, and its key prefix.

use std::sync::Arc;
use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::ClusterClientBuilder;

use super::conn::Conn;
use super::eviction::{self, Eviction};
use super::{
    CLAIM_SCRIPT, COMPLETE_SCRIPT, INSPECT_SCRIPT, PURGE_SCRIPT, RELEASE_SCRIPT, RedisStore,
};
use tower_idempotency::store::kit::feed::Feed;
use tower_idempotency::store::kit::replay_cache::CacheBounds;
use tower_idempotency::store::{Clock, StoreError};

/// Reconnection attempts after the first, while Redis is unreachable.
const RECONNECT_RETRIES: usize = 1;
/// How long one attempt to connect may take.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(1);
/// How long one command may wait for its reply.
const RESPONSE_TIMEOUT: Duration = Duration::from_millis(500);
/// On a cluster: how long one call may take in all, with its redirections
/// (`MOVED`, `ASK`) and retries while a master fails over.
const CLUSTER_CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// On a cluster: retries of one call (after a connection error, `TRYAGAIN`,
/// `CLUSTERDOWN`), waiting 50 to 500 ms before each, within
/// [`CLUSTER_CALL_TIMEOUT`]. Redirections are followed in any case.
const CLUSTER_RETRIES: u32 = 4;
const CLUSTER_MIN_RETRY_WAIT_MS: u64 = 50;
const CLUSTER_MAX_RETRY_WAIT_MS: u64 = 500;

/// Where a store connects.
enum Target {
    Single(String),
    Cluster(Vec<String>),
}

/// Options for [`RedisStore`]; made by [`RedisStore::builder`] (one server)
/// or [`RedisStore::cluster_builder`] (a Redis Cluster).
#[must_use]
pub struct RedisStoreBuilder {
    target: Target,
    prefix: String,
    offset: Option<Arc<dyn Clock>>,
    accept_eviction_risk: bool,
    eviction_interval: Duration,
    replays: CacheBounds,
    #[cfg(feature = "tls")]
    ca: Option<Vec<u8>>,
}

tower_idempotency::store::kit::replay_cache::replay_cache_settings!(RedisStoreBuilder, replays);

impl std::fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the URLs: they may carry a password.
        f.debug_struct("RedisStoreBuilder")
            .field("cluster", &matches!(self.target, Target::Cluster(_)))
            .field("prefix", &self.prefix)
            .field("clock_offset", &self.offset.is_some())
            .field("accept_eviction_risk", &self.accept_eviction_risk)
            .field("eviction_check_interval", &self.eviction_interval)
            .finish_non_exhaustive()
    }
}

impl RedisStoreBuilder {
    pub(super) fn single(url: String) -> Self {
        Self::new(Target::Single(url))
    }

    pub(super) fn cluster(seeds: Vec<String>) -> Self {
        Self::new(Target::Cluster(seeds))
    }

    fn new(target: Target) -> Self {
        RedisStoreBuilder {
            target,
            prefix: "idempotency:".into(),
            offset: None,
            accept_eviction_risk: false,
            eviction_interval: eviction::DEFAULT_INTERVAL,
            replays: CacheBounds::default(),
            #[cfg(feature = "tls")]
            ca: None,
        }
    }

    /// The prefix of every key the store writes (default `"idempotency:"`).
    /// Give each application its own; [`Store::purge_expired`] scans the
    /// keys under it. Not empty, and without `{` or `}` (a hash tag in the
    /// prefix would put every record in one cluster slot);
    /// [`RedisStoreBuilder::open`] fails with [`StoreError::Config`].
    ///
    /// [`Store::purge_expired`]: tower_idempotency::Store::purge_expired
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
    #[cfg(feature = "test-util")]
    pub fn clock_offset(mut self, clock: impl Clock) -> Self {
        self.offset = Some(Arc::new(clock));
        self
    }

    /// Whether [`RedisStoreBuilder::open`] starts even when a node's
    /// `maxmemory-policy` is not `noeviction`, or cannot be read (default
    /// `false`: it refuses with [`StoreError::Config`]). With `true`, the
    /// USER TAKES THE RISK that Redis evicts a record, and that a retry of
    /// its request then runs the handler a second time, silently; the store
    /// logs a WARN at start-up for each such node, and the timer of
    /// [`RedisStoreBuilder::eviction_check_interval`] keeps checking.
    ///
    /// Why the rule: every record has an expiry (its TTL), so under any
    /// policy but `noeviction`, `volatile-*` included, Redis may delete a
    /// record before its TTL when it reaches `maxmemory`, for example when a
    /// cache shares the server. ElastiCache's default is `volatile-lru`.
    ///
    /// Meant for a server that refuses `CONFIG GET` and `INFO` (a managed
    /// service that renames or disables `CONFIG`, an ACL user without
    /// `+config|get` or `+info`) whose policy the user has checked to be
    /// `noeviction` by other means, such as the provider's console.
    pub fn accept_eviction_risk(mut self, accept: bool) -> Self {
        self.accept_eviction_risk = accept;
        self
    }

    /// How often the store reads `maxmemory-policy` and `INFO
    /// stats` `evicted_keys` on every node again (default 60 s; below 1 s
    /// counts as 1 s; [`Duration::ZERO`] turns the timer off), since a
    /// policy can be changed at run time. Each check is
    /// [`RedisStore::check_eviction_policy`]: a WARN log for a node whose
    /// policy evicts, the gauges of the [crate docs](crate) (feature
    /// `metrics`), and [`RedisStore::last_eviction_check`]. The timer is one
    /// tokio task per opened store, stopped when the store's last clone is
    /// dropped; a check that takes over 10 s is abandoned until the next.
    pub fn eviction_check_interval(mut self, interval: Duration) -> Self {
        self.eviction_interval = interval;
        self
    }

    /// The certificate authority (PEM: one or more `BEGIN CERTIFICATE`
    /// blocks) that a `rediss://` server's certificate must chain to,
    /// instead of the system's roots. The server's certificate must also
    /// name the URL's host (a DNS name, or an IP address for an IP URL; on a
    /// cluster, the addresses the nodes announce). Every URL must then be
    /// `rediss://`, or [`RedisStoreBuilder::open`] fails with
    /// [`StoreError::Config`]; a PEM without a certificate fails the same
    /// way. Feature `tls`.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn ca_certificate(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca = Some(pem.into());
        self
    }

    /// Connects, and loads the scripts (so a server without Lua scripting
    /// fails here, not on the first request). On a cluster, connects to a
    /// seed, reads the slot map, and loads the scripts on every master.
    /// Then reads `maxmemory-policy` on the server, or on every master
    /// (`CONFIG GET maxmemory-policy`, or `INFO memory` where `CONFIG` is
    /// refused), and refuses to start unless each is `noeviction` (see
    /// [`RedisStoreBuilder::accept_eviction_risk`]); then starts the timer of
    /// [`RedisStoreBuilder::eviction_check_interval`].
    ///
    /// # Errors
    ///
    /// [`StoreError::Config`] when a URL is not a Redis URL (or `rediss://`
    /// without the `tls` feature), a cluster has no seed or seeds that
    /// disagree (password, database, TLS), the prefix is empty or holds `{`
    /// or `}`, or a CA is not a PEM certificate; [`StoreError::Unavailable`]
    /// when no server (or seed) can be reached, its TLS certificate is not
    /// trusted (the message names the cause, e.g. `UnknownIssuer` or
    /// `certificate not valid for name`), or it refuses the scripts.
    ///
    /// [`StoreError::Config`] also when a node's `maxmemory-policy` is not
    /// `noeviction` (the message names the node, the policy and the fix:
    /// `CONFIG SET maxmemory-policy noeviction`, redis.conf, or on
    /// ElastiCache the parameter group), or when neither `CONFIG GET` nor
    /// `INFO` tells it (the message says `CONFIG is unavailable` and quotes
    /// the servers' replies), unless
    /// [`RedisStoreBuilder::accept_eviction_risk`] is `true`.
    pub async fn open(self) -> Result<RedisStore, StoreError> {
        // 1. Refuse what cannot work, before any connection.
        self.check()?;
        // 2. Connect to the server, or to the cluster through its seeds.
        let Connected {
            mut conn,
            single,
            subscriber,
        } = self.connect().await?;
        // 3. Load the scripts (on a cluster, on every master).
        load_scripts(&mut conn).await?;
        // 4. Refuse a node that may evict records, unless the risk is
        //    accepted, and keep checking.
        let eviction = self.watch_eviction(single, &conn).await?;
        Ok(RedisStore {
            conn,
            channel: super::listen::channel(&self.prefix).into(),
            prefix: self.prefix.into(),
            offset: self.offset,
            replays: self.replays.open(),
            eviction,
            feed: subscriber.map(|client| {
                (
                    Feed::new(tower_idempotency::store::kit::feed::DEFAULT_MAX_WATCHED_KEYS),
                    client,
                )
            }),
        })
    }

    /// Step 1 of [`RedisStoreBuilder::open`]: the prefix is usable (not
    /// empty, no hash tag), and the URLs' TLS can be set up (with the `tls`
    /// feature, `check_tls`; without it, no URL may ask for TLS).
    fn check(&self) -> Result<(), StoreError> {
        if self.prefix.is_empty() {
            return Err(StoreError::config(
                "the Redis key prefix is empty: purging and inspecting would scan every key of the database",
            ));
        }
        if self.prefix.contains(['{', '}']) {
            return Err(StoreError::config(
                "the Redis key prefix holds '{' or '}': on a cluster, every record would hash to one slot",
            ));
        }
        #[cfg(feature = "tls")]
        self.check_tls()?;
        #[cfg(not(feature = "tls"))]
        if self.urls().iter().any(|url| is_tls(url)) {
            return Err(StoreError::config(
                "a rediss:// URL needs TLS: enable the `tls` feature of tower-idempotency-redis",
            ));
        }
        Ok(())
    }

    /// Step 2 of [`RedisStoreBuilder::open`]: connects to the one server
    /// (through a connection manager that reconnects), or to a cluster
    /// through its seeds.
    async fn connect(&self) -> Result<Connected, StoreError> {
        match &self.target {
            Target::Single(url) => {
                let client = self.single_client(url)?;
                let single = client.get_connection_info().addr().to_string();
                let subscriber = Some(client.clone());
                let conn = Conn::Single(
                    ConnectionManager::new_with_config(client, connection_config())
                        .await
                        .map_err(|e| connect_error(&e))?,
                );
                Ok(Connected {
                    conn,
                    single,
                    subscriber,
                })
            }
            Target::Cluster(seeds) => {
                let client = self.cluster_client(seeds)?;
                let conn = Conn::Cluster(
                    client
                        .get_async_connection()
                        .await
                        .map_err(|e| connect_error(&e))?,
                );
                Ok(Connected {
                    conn,
                    single: String::new(),
                    subscriber: None,
                })
            }
        }
    }

    /// The one server's client, trusting the CA given (feature `tls`)
    /// instead of the system's roots.
    fn single_client(&self, url: &str) -> Result<::redis::Client, StoreError> {
        #[cfg(feature = "tls")]
        let client = match self.ca.clone() {
            Some(pem) => ::redis::Client::build_with_tls(
                url,
                ::redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(pem),
                },
            ),
            None => ::redis::Client::open(url),
        };
        #[cfg(not(feature = "tls"))]
        let client = ::redis::Client::open(url);
        client.map_err(StoreError::config)
    }

    /// The cluster's client: its seeds, its timeouts and retries, and the
    /// CA given (feature `tls`).
    fn cluster_client(
        &self,
        seeds: &[String],
    ) -> Result<::redis::cluster::ClusterClient, StoreError> {
        if seeds.is_empty() {
            return Err(StoreError::config(
                "a Redis Cluster needs at least one seed URL",
            ));
        }
        let builder = ClusterClientBuilder::new(seeds.iter().map(String::as_str))
            .connection_timeout(CONNECTION_TIMEOUT)
            .response_timeout(RESPONSE_TIMEOUT)
            .overall_response_timeout(Some(CLUSTER_CALL_TIMEOUT))
            .retries(CLUSTER_RETRIES)
            .min_retry_wait(CLUSTER_MIN_RETRY_WAIT_MS)
            .max_retry_wait(CLUSTER_MAX_RETRY_WAIT_MS);
        #[cfg(feature = "tls")]
        let builder = match self.ca.clone() {
            Some(pem) => builder.certs(::redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(pem),
            }),
            None => builder,
        };
        builder.build().map_err(StoreError::config)
    }

    /// Step 4 of [`RedisStoreBuilder::open`]: reads every node's
    /// `maxmemory-policy`, refuses one that may evict unless
    /// [`RedisStoreBuilder::accept_eviction_risk`] (then logs a WARN for
    /// it), and starts the timer of
    /// [`RedisStoreBuilder::eviction_check_interval`].
    async fn watch_eviction(
        &self,
        single: String,
        conn: &Conn,
    ) -> Result<Arc<Eviction>, StoreError> {
        let eviction = Eviction::new(single);
        let check = eviction.read(conn).await?;
        if !check.is_safe() && !self.accept_eviction_risk {
            return Err(eviction::refusal(&check));
        }
        // With the risk accepted, a WARN for each node that is not safe.
        eviction.record(&check);
        if !self.eviction_interval.is_zero() {
            Eviction::start_timer(&eviction, conn.clone(), self.eviction_interval);
        }
        Ok(eviction)
    }

    /// Every URL is `rediss://` when a CA is given, and a TLS URL has a
    /// crypto provider to use.
    #[cfg(feature = "tls")]
    fn check_tls(&self) -> Result<(), StoreError> {
        let urls = self.urls();
        let tls = |url: &&str| is_tls(url);
        if let Some(pem) = &self.ca {
            if !urls.iter().all(tls) {
                return Err(StoreError::config(
                    "a CA certificate was given, but not every Redis URL is rediss://",
                ));
            }
            use rustls::pki_types::{CertificateDer, pem::PemObject};
            let certificates = CertificateDer::pem_slice_iter(pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| {
                    StoreError::config(format!("the Redis CA certificate is not PEM: {e}"))
                })?;
            if certificates.is_empty() {
                return Err(StoreError::config(
                    "the Redis CA certificate holds no BEGIN CERTIFICATE block",
                ));
            }
        }
        if urls.iter().any(tls) {
            // The `redis` crate builds its rustls config with the process's
            // default provider; when a build enables more than one, none is
            // chosen by itself. This installs ring's unless one is set.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        Ok(())
    }
}

impl RedisStoreBuilder {
    /// The one server's URL, or every seed's.
    fn urls(&self) -> Vec<&str> {
        match &self.target {
            Target::Single(url) => vec![url],
            Target::Cluster(seeds) => seeds.iter().map(String::as_str).collect(),
        }
    }
}

/// What step 2 of [`RedisStoreBuilder::open`] connected.
struct Connected {
    conn: Conn,
    /// The one server's address, naming it in the eviction check; empty on
    /// a cluster, whose masters `CLUSTER SLOTS` names.
    single: String,
    /// The one server's client, for the pub/sub feed; none on a cluster.
    subscriber: Option<::redis::Client>,
}

/// Step 3 of [`RedisStoreBuilder::open`]: loads every script, so a server
/// without Lua scripting fails at start-up, not on the first request.
async fn load_scripts(conn: &mut Conn) -> Result<(), StoreError> {
    for script in [
        &CLAIM_SCRIPT,
        &COMPLETE_SCRIPT,
        &RELEASE_SCRIPT,
        &PURGE_SCRIPT,
        &INSPECT_SCRIPT,
    ] {
        // On a cluster `SCRIPT LOAD` goes to every master; a master that
        // lacks a script later (say, a promoted replica) gets it again
        // from the call that finds it missing (`NOSCRIPT`).
        script
            .prepare_invoke()
            .load_async(conn)
            .await
            .map_err(StoreError::unavailable)?;
    }
    Ok(())
}

/// Whether `url` asks for TLS (`rediss://`, in any case).
fn is_tls(url: &str) -> bool {
    url.get(..9)
        .is_some_and(|s| s.eq_ignore_ascii_case("rediss://"))
}

/// An error while connecting, with the cause (for TLS, rustls's reason such
/// as `invalid peer certificate: UnknownIssuer`).
fn connect_error(e: &::redis::RedisError) -> StoreError {
    let mut message = format!("cannot connect to Redis: {e}");
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        let text = cause.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    StoreError::unavailable(message)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Without the feature, a `rediss://` URL is refused before any
    /// connection, naming the feature to enable.
    #[cfg(not(feature = "tls"))]
    #[tokio::test]
    async fn a_tls_url_without_the_tls_feature_names_the_feature() {
        for builder in [
            RedisStore::builder("rediss://127.0.0.1:1"),
            RedisStore::cluster_builder(["redis://127.0.0.1:1", "REDISS://127.0.0.1:2"]),
        ] {
            match builder.open().await {
                Err(StoreError::Config(e)) => assert_eq!(
                    e.to_string(),
                    "a rediss:// URL needs TLS: enable the `tls` feature of tower-idempotency-redis"
                ),
                other => panic!("expected a configuration error, got {other:?}"),
            }
        }
    }

    #[test]
    fn tls_urls_are_told_apart_in_any_case() {
        assert!(is_tls("rediss://h:6380"));
        assert!(is_tls("REDISS://h"));
        assert!(!is_tls("redis://h"));
        assert!(!is_tls("redis"));
    }
}
