//! Redis's `maxmemory-policy`: read on every node when the store opens (an
//! evicting policy refuses to start), and again on a timer, with each
//! node's `evicted_keys`. See "Eviction" in [`RedisStore`]'s docs.

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime};

use ::redis::{ErrorKind, RedisError, ServerErrorKind, Value};
use tokio::task::AbortHandle;

use super::RedisStore;
use super::conn::{Conn, Node, nodes, on_node};
use tower_idempotency::StoreError;

/// The one policy under which Redis never deletes a record before its TTL.
pub(super) const SAFE_POLICY: &str = "noeviction";

/// The timer's period unless [`super::RedisStoreBuilder::eviction_check_interval`]
/// sets another.
pub(super) const DEFAULT_INTERVAL: Duration = Duration::from_secs(60);

/// The shortest period the timer runs at.
pub(super) const MIN_INTERVAL: Duration = Duration::from_secs(1);

/// How long one check (every node) may take on the timer before it is given
/// up until the next tick.
const CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// One reading of every node's eviction settings: what
/// [`RedisStore::check_eviction_policy`] returns and
/// [`RedisStore::last_eviction_check`] keeps.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct EvictionCheck {
    /// Each node read: the one server, or every master of a cluster (as
    /// `CLUSTER SLOTS` names them at the check).
    pub nodes: Vec<NodeEviction>,
    /// When the check was made, by this process's clock.
    pub checked_at: SystemTime,
}

impl EvictionCheck {
    /// Whether every node's policy was read and is `noeviction`.
    pub fn is_safe(&self) -> bool {
        self.nodes.iter().all(NodeEviction::is_safe)
    }

    /// The sum of the nodes' `evicted_keys` (nodes whose `INFO stats` could
    /// not be read count 0). Each node counts since its own start, across
    /// every key it holds, not only the store's.
    pub fn evicted_keys(&self) -> u64 {
        self.nodes
            .iter()
            .filter_map(|n| n.evicted_keys)
            .fold(0, u64::saturating_add)
    }
}

/// One node's eviction settings, as one check read them.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NodeEviction {
    /// The node's address, `host:port` (never a password).
    pub node: String,
    /// Its `maxmemory-policy` (`CONFIG GET maxmemory-policy`, or
    /// `maxmemory_policy` of `INFO memory` where `CONFIG` is refused);
    /// `None` when neither could be read.
    pub policy: Option<String>,
    /// Why the policy could not be read (the servers' error replies);
    /// `None` when it was.
    pub policy_error: Option<String>,
    /// Its `evicted_keys` (`INFO stats`): keys it has evicted since it
    /// started; `None` when `INFO` was refused.
    pub evicted_keys: Option<u64>,
}

impl NodeEviction {
    /// Whether the node's policy was read and is `noeviction`.
    pub fn is_safe(&self) -> bool {
        self.policy.as_deref() == Some(SAFE_POLICY)
    }
}

/// What the store's handles share: the last check, and the timer task,
/// which is stopped when the last handle drops this.
pub(super) struct Eviction {
    /// The one server's address; unused on a cluster.
    single: Arc<str>,
    last: Mutex<Option<EvictionCheck>>,
    timer: Mutex<Option<AbortHandle>>,
}

impl Drop for Eviction {
    fn drop(&mut self) {
        let timer = self.timer.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(timer) = timer.take() {
            timer.abort();
        }
    }
}

impl Eviction {
    pub(super) fn new(single: String) -> Arc<Eviction> {
        Arc::new(Eviction {
            single: single.into(),
            last: Mutex::new(None),
            timer: Mutex::new(None),
        })
    }

    /// Reads every node now, without recording it.
    pub(super) async fn read(&self, conn: &Conn) -> Result<EvictionCheck, StoreError> {
        read(conn, &self.single).await
    }

    /// Keeps `check` as the last one, sets the metrics, and logs a WARN for
    /// each node that is not safe and was not already unsafe in the same
    /// way at the last check, or that evicted keys since.
    pub(super) fn record(&self, check: &EvictionCheck) {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        for node in &check.nodes {
            let before = last
                .as_ref()
                .and_then(|l| l.nodes.iter().find(|n| n.node == node.node));
            warn_if_news(before, node);
            #[cfg(feature = "metrics")]
            gauges(&node.node, node.is_safe(), node.evicted_keys);
        }
        *last = Some(check.clone());
    }

    pub(super) fn last(&self) -> Option<EvictionCheck> {
        self.last.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Starts the timer: every `interval`, reads and records every node,
    /// until the last handle of `this` is dropped.
    pub(super) fn start_timer(this: &Arc<Eviction>, conn: Conn, interval: Duration) {
        let interval = interval.max(MIN_INTERVAL);
        let weak: Weak<Eviction> = Arc::downgrade(this);
        let single = Arc::clone(&this.single);
        let task = tokio::spawn(async move {
            let start = tokio::time::Instant::now() + interval;
            let mut ticker = tokio::time::interval_at(start, interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                if weak.strong_count() == 0 {
                    return;
                }
                let result = tokio::time::timeout(CHECK_TIMEOUT, read(&conn, &single)).await;
                let Some(eviction) = weak.upgrade() else {
                    return;
                };
                match result {
                    Ok(Ok(check)) => eviction.record(&check),
                    Ok(Err(e)) => {
                        tracing::debug!(error = %e, "could not re-check Redis's maxmemory-policy");
                    }
                    Err(_) => tracing::debug!(
                        "re-checking Redis's maxmemory-policy took over {CHECK_TIMEOUT:?}"
                    ),
                }
            }
        });
        *this.timer.lock().unwrap_or_else(|e| e.into_inner()) = Some(task.abort_handle());
    }
}

/// A node's check as the gauges `tower_idempotency_redis_eviction_unsafe` and
/// `tower_idempotency_redis_evicted_keys` (when `INFO stats` told it).
#[cfg(feature = "metrics")]
fn gauges(node: &str, safe: bool, evicted_keys: Option<u64>) {
    metrics::gauge!("tower_idempotency_redis_eviction_unsafe", "node" => node.to_owned())
        .set(if safe { 0.0 } else { 1.0 });
    if let Some(evicted) = evicted_keys {
        // A gauge holds an f64: exact up to 2^53 keys.
        #[allow(clippy::cast_precision_loss)]
        metrics::gauge!("tower_idempotency_redis_evicted_keys", "node" => node.to_owned())
            .set(evicted as f64);
    }
}

/// A WARN for `node` unless the previous check saw it in the same state.
fn warn_if_news(before: Option<&NodeEviction>, node: &NodeEviction) {
    if node.is_safe() {
        if before.is_some_and(|b| !b.is_safe()) {
            tracing::info!(
                node = %node.node,
                "Redis's maxmemory-policy is noeviction again: records are no longer evicted"
            );
        }
        return;
    }
    let same_policy = before.is_some_and(|b| b.policy == node.policy);
    let evicted_more = match (before.and_then(|b| b.evicted_keys), node.evicted_keys) {
        (Some(was), Some(now)) => now > was,
        _ => false,
    };
    if same_policy && !evicted_more {
        return;
    }
    match &node.policy {
        Some(policy) => tracing::warn!(
            node = %node.node,
            maxmemory_policy = %policy,
            evicted_keys = node.evicted_keys,
            "Redis may evict idempotency records (maxmemory-policy {policy}), and a retry of an evicted \
             record runs its handler again; set maxmemory-policy noeviction"
        ),
        None => tracing::warn!(
            node = %node.node,
            evicted_keys = node.evicted_keys,
            "Redis's maxmemory-policy cannot be read ({}): the store cannot tell whether Redis \
             evicts idempotency records; make sure it is noeviction",
            node.policy_error.as_deref().unwrap_or("no reply")
        ),
    }
}

/// Reads the policy and `evicted_keys` of every node: `single` names the
/// one server; a cluster's masters are named by `CLUSTER SLOTS`.
async fn read(conn: &Conn, single: &str) -> Result<EvictionCheck, StoreError> {
    let mut conn = conn.clone();
    let mut read = Vec::new();
    for node in nodes(&mut conn).await? {
        let name = match &node {
            Some((host, port)) => format!("{host}:{port}"),
            None => single.to_owned(),
        };
        read.push(read_node(&mut conn, node.as_ref(), name).await?);
    }
    Ok(EvictionCheck {
        nodes: read,
        checked_at: SystemTime::now(),
    })
}

async fn read_node(
    conn: &mut Conn,
    node: Option<&Node>,
    name: String,
) -> Result<NodeEviction, StoreError> {
    let mut config = ::redis::cmd("CONFIG");
    config.arg("GET").arg("maxmemory-policy");
    let from_config = match refusable(on_node(conn, node, config).await)? {
        Ok(reply) => config_value(&reply)
            .ok_or_else(|| "CONFIG GET maxmemory-policy: no such parameter".to_owned()),
        Err(refused) => Err(format!(
            "CONFIG is unavailable: CONFIG GET maxmemory-policy: {refused}"
        )),
    };
    // Where CONFIG fails, INFO memory may still tell it.
    let (policy, policy_error) = match from_config {
        Ok(policy) => (Some(policy), None),
        Err(why) => match refusable(on_node(conn, node, info("memory")).await)? {
            Ok(reply) => match info_field(&reply, "maxmemory_policy") {
                Some(policy) => (Some(policy.to_owned()), None),
                None => (
                    None,
                    Some(format!("{why}; INFO memory has no maxmemory_policy")),
                ),
            },
            Err(refused) => (None, Some(format!("{why}; INFO memory: {refused}"))),
        },
    };
    let evicted_keys = match refusable(on_node(conn, node, info("stats")).await)? {
        Ok(reply) => info_field(&reply, "evicted_keys").and_then(|n| n.parse().ok()),
        Err(_) => None,
    };
    Ok(NodeEviction {
        node: name,
        policy,
        policy_error,
        evicted_keys,
    })
}

fn info(section: &str) -> ::redis::Cmd {
    let mut cmd = ::redis::cmd("INFO");
    cmd.arg(section);
    cmd
}

/// A server's error reply to one command (`ERR unknown command`, `NOPERM`):
/// `Ok(Err(reply))`. No answer at all (I/O, a timeout, a cluster in
/// failover) is [`StoreError::Unavailable`].
fn refusable(reply: Result<Value, RedisError>) -> Result<Result<Value, String>, StoreError> {
    match reply {
        Ok(value) => Ok(Ok(value)),
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::Extension
                    | ErrorKind::Server(ServerErrorKind::ResponseError | ServerErrorKind::NoPerm)
            ) =>
        {
            Ok(Err(e.to_string()))
        }
        Err(e) => Err(StoreError::unavailable(format!(
            "cannot read Redis's maxmemory-policy: {e}"
        ))),
    }
}

/// The value of `CONFIG GET maxmemory-policy`: `[name, value]` (RESP2) or
/// `{name: value}` (RESP3); `None` for an empty reply (an unknown parameter).
fn config_value(reply: &Value) -> Option<String> {
    let value = match reply {
        Value::Array(items) => items.get(1)?,
        Value::Map(pairs) => &pairs.first()?.1,
        _ => return None,
    };
    ::redis::from_redis_value_ref::<String>(value).ok()
}

/// `field`'s value in an `INFO` reply (`field:value` lines).
fn info_field<'a>(reply: &'a Value, field: &str) -> Option<&'a str> {
    let text = match reply {
        Value::BulkString(bytes) => std::str::from_utf8(bytes).ok()?,
        Value::SimpleString(text) => text,
        Value::VerbatimString { text, .. } => text,
        _ => return None,
    };
    text.lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .map(str::trim)
}

/// The refusal of [`super::RedisStoreBuilder::open`] for a check that is
/// not safe: each unsafe node, its policy or why it is unknown, and the fix.
pub(super) fn refusal(check: &EvictionCheck) -> StoreError {
    let mut message = String::new();
    let mut evicting = false;
    let mut unknown = false;
    for node in check.nodes.iter().filter(|n| !n.is_safe()) {
        if !message.is_empty() {
            message.push_str("; ");
        }
        match &node.policy {
            Some(policy) => {
                evicting = true;
                message.push_str(&format!(
                    "Redis at {} has maxmemory-policy {policy}",
                    node.node
                ));
            }
            None => {
                unknown = true;
                message.push_str(&format!(
                    "cannot read maxmemory-policy of Redis at {} ({})",
                    node.node,
                    node.policy_error.as_deref().unwrap_or("no reply")
                ));
            }
        }
    }
    if evicting {
        message.push_str(
            ". Under any policy but noeviction, Redis may evict idempotency records (every \
             record has an expiry, so the volatile-* policies apply to them too), and a retry of \
             an evicted record runs its handler again. Set it to noeviction: \
             `CONFIG SET maxmemory-policy noeviction` and `maxmemory-policy noeviction` in \
             redis.conf; on ElastiCache (whose default is volatile-lru), in the cluster's \
             parameter group",
        );
    }
    if unknown {
        message.push_str(
            ". Some managed services rename or disable CONFIG, and an ACL user may lack \
             +config|get and +info. Make sure maxmemory-policy is noeviction (the provider's \
             console or parameter group), or grant those commands",
        );
    }
    message.push_str(
        ". To start anyway, taking the risk: RedisStoreBuilder::accept_eviction_risk(true)",
    );
    StoreError::config(message)
}

impl RedisStore {
    /// Reads `maxmemory-policy` and `INFO stats` `evicted_keys` on every
    /// node now (the one server, or every master of a cluster), keeps the
    /// result as [`RedisStore::last_eviction_check`], sets the metrics
    /// (feature `metrics`, see the crate docs) and logs a WARN for a
    /// node whose policy evicts (once per change of policy, and again when
    /// it has evicted keys since the last check). The store's timer calls
    /// it every [`RedisStoreBuilder::eviction_check_interval`]; call it to
    /// check at once.
    ///
    /// Returns the check whatever the policy (look at
    /// [`EvictionCheck::is_safe`]); the store keeps running either way.
    ///
    /// # Errors
    ///
    /// [`StoreError::Unavailable`] when a node does not answer. A server
    /// that refuses `CONFIG` and `INFO` is not an error: its policy is
    /// `None`.
    ///
    /// [`RedisStoreBuilder::eviction_check_interval`]: super::RedisStoreBuilder::eviction_check_interval
    pub async fn check_eviction_policy(&self) -> Result<EvictionCheck, StoreError> {
        let check = self.eviction.read(&self.conn).await?;
        self.eviction.record(&check);
        Ok(check)
    }

    /// The last check of the nodes' eviction settings: the one made when
    /// the store opened, or a later one by the timer or
    /// [`RedisStore::check_eviction_policy`].
    pub fn last_eviction_check(&self) -> Option<EvictionCheck> {
        self.eviction.last()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn config_replies_in_resp2_and_resp3() {
        let resp2 = Value::Array(vec![bulk("maxmemory-policy"), bulk("allkeys-lru")]);
        assert_eq!(config_value(&resp2).as_deref(), Some("allkeys-lru"));
        let resp3 = Value::Map(vec![(bulk("maxmemory-policy"), bulk("noeviction"))]);
        assert_eq!(config_value(&resp3).as_deref(), Some("noeviction"));
        assert_eq!(config_value(&Value::Array(vec![])), None);
        assert_eq!(config_value(&Value::Nil), None);
    }

    #[test]
    fn info_fields_are_whole_names() {
        let info = bulk("# Stats\r\nevicted_keys_total:9\r\nevicted_keys:42\r\nexpired_keys:7\r\n");
        assert_eq!(info_field(&info, "evicted_keys"), Some("42"));
        assert_eq!(info_field(&info, "expired_keys"), Some("7"));
        assert_eq!(info_field(&info, "evicted"), None);
        assert_eq!(info_field(&Value::Nil, "evicted_keys"), None);
    }

    fn node(policy: Option<&str>, evicted: Option<u64>) -> NodeEviction {
        NodeEviction {
            node: "127.0.0.1:7000".into(),
            policy: policy.map(str::to_owned),
            policy_error: policy.is_none().then(|| "CONFIG is unavailable".to_owned()),
            evicted_keys: evicted,
        }
    }

    #[test]
    fn the_refusal_names_node_policy_and_fix() {
        let check = EvictionCheck {
            nodes: vec![
                node(Some("noeviction"), Some(0)),
                NodeEviction {
                    node: "10.0.0.2:6379".into(),
                    ..node(Some("volatile-lru"), Some(3))
                },
            ],
            checked_at: SystemTime::UNIX_EPOCH,
        };
        assert!(!check.is_safe());
        assert_eq!(check.evicted_keys(), 3);
        let text = refusal(&check).to_string();
        assert!(
            text.starts_with(
                "idempotency store misconfigured: Redis at 10.0.0.2:6379 has maxmemory-policy volatile-lru. "
            ),
            "{text}"
        );
        assert!(!text.contains("7000"), "{text}");
        for part in [
            "CONFIG SET maxmemory-policy noeviction",
            "redis.conf",
            "ElastiCache",
            "parameter group",
            "accept_eviction_risk(true)",
        ] {
            assert!(text.contains(part), "{part}: {text}");
        }
        let unknown = EvictionCheck {
            nodes: vec![node(None, None)],
            checked_at: SystemTime::UNIX_EPOCH,
        };
        let text = refusal(&unknown).to_string();
        assert!(
            text.starts_with(
                "idempotency store misconfigured: cannot read maxmemory-policy of Redis at 127.0.0.1:7000 (CONFIG is unavailable)"
            ),
            "{text}"
        );
        assert!(!text.contains("CONFIG SET"), "{text}");
    }
}
