//! `RedisStore` refuses a Redis that may evict its records (issue 21, item
//! 1): `maxmemory-policy` is read on every node when the store opens and
//! again on a timer. Each test starts private `redis-server` processes on
//! free loopback ports (and a cluster on 15660-15662), never touching the
//! shared server's configuration; they are killed when the test ends.
//! Without `redis-server` (and `redis-cli` for the cluster) the tests fail.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tower_idempotency::StoreError;
use tower_idempotency::store::{Claim, FencingToken, RecordId, Refusal, Store};
use tower_idempotency::test_util::{claim_of, response};
use tower_idempotency_redis::RedisStore;

use crate::rediscluster;

/// Every policy but `noeviction` (Redis 7).
const EVICTING: [&str; 7] = [
    "volatile-lru",
    "allkeys-lru",
    "volatile-lfu",
    "allkeys-lfu",
    "volatile-random",
    "allkeys-random",
    "volatile-ttl",
];

/// How long a private server may take to answer, or a polled condition to
/// hold.
const DEADLINE: Duration = Duration::from_secs(15);

/// A private `redis-server` on a free loopback port, killed on drop.
struct PrivateRedis {
    port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl PrivateRedis {
    /// Starts one with `args` added (say `--maxmemory-policy allkeys-lru`),
    /// no persistence; waits until it answers `PING`.
    fn start(args: &[&str]) -> PrivateRedis {
        for _ in 0..5 {
            // A port the OS just handed out; another process may take it
            // before redis-server binds it, and then the server exits and
            // the next attempt picks another.
            let port = TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let dir = tempfile::tempdir().unwrap();
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
                .arg("--dir")
                .arg(dir.path())
                .args(args)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("redis-server is required on the PATH: {e}"));
            let mut server = PrivateRedis {
                port,
                child,
                _dir: dir,
            };
            let start = Instant::now();
            loop {
                if server.child.try_wait().unwrap().is_some() {
                    break;
                }
                if ping(port) {
                    return server;
                }
                assert!(
                    start.elapsed() < DEADLINE,
                    "redis-server on {port} did not answer PING"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        panic!("redis-server {args:?} exited 5 times before answering");
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn node(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// A connection of the test's own.
    async fn raw(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether a Redis on `port` answers `PING` (a plain RESP exchange, so a
/// renamed `CONFIG` or `INFO` does not matter).
fn ping(port: u16) -> bool {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    let mut reply = [0u8; 7];
    stream.write_all(b"PING\r\n").is_ok()
        && stream.read_exact(&mut reply).is_ok()
        && &reply == b"+PONG\r\n"
}

async fn query<T: redis::FromRedisValue>(
    conn: &mut redis::aio::MultiplexedConnection,
    args: &[&str],
) -> T {
    let mut cmd = redis::cmd(args[0]);
    for arg in &args[1..] {
        cmd.arg(*arg);
    }
    cmd.query_async(conn)
        .await
        .unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

async fn set_policy(conn: &mut redis::aio::MultiplexedConnection, policy: &str) {
    let ok: String = query(conn, &["CONFIG", "SET", "maxmemory-policy", policy]).await;
    assert_eq!(ok, "OK");
}

/// `field` of an `INFO` section, as a number.
async fn info_number(
    conn: &mut redis::aio::MultiplexedConnection,
    section: &str,
    field: &str,
) -> u64 {
    let info: String = query(conn, &["INFO", section]).await;
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .unwrap_or_else(|| panic!("INFO {section} has no {field}"))
        .trim()
        .parse()
        .unwrap()
}

fn config_message(result: Result<RedisStore, StoreError>) -> String {
    match result {
        Err(e @ StoreError::Config(_)) => e.to_string(),
        Err(other) => panic!("expected StoreError::Config, got {other:?}"),
        Ok(store) => panic!("the store opened: {store:?}"),
    }
}

/// A claim of alice's `key` is acquired afresh: its handler would run.
async fn assert_acquired(store: &RedisStore, key: &str) {
    let claim = claim_of("alice", key, 1, FencingToken::random());
    assert_eq!(
        store.claim(claim).await.unwrap(),
        Claim::Acquired { taken_over: false }
    );
}

/// `message` starts with `head`, holds every one of `parts`, and not `absent`.
fn assert_message(message: &str, head: &str, parts: &[&str], absent: &str) {
    assert!(message.starts_with(head), "{message}");
    for part in parts {
        assert!(message.contains(part), "{part}: {message}");
    }
    assert!(!message.contains(absent), "{absent}: {message}");
}

/// The WARN lines written while the guard lives (this thread only: the
/// tests run on current-thread runtimes).
#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Logs {
    type Writer = Logs;
    fn make_writer(&'a self) -> Logs {
        self.clone()
    }
}

impl Logs {
    fn capture() -> (Logs, tracing::subscriber::DefaultGuard) {
        let logs = Logs::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(logs.clone())
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .finish();
        (logs, tracing::subscriber::set_default(subscriber))
    }

    fn warnings(&self) -> Vec<String> {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .lines()
            .filter(|l| l.contains(" WARN "))
            .map(str::to_owned)
            .collect()
    }
}

/// Every evicting policy is refused, the error naming the node, the policy
/// and the fix; the shared server is never asked.
#[tokio::test]
async fn every_evicting_policy_is_refused_naming_node_policy_and_fix() {
    let server = PrivateRedis::start(&["--maxmemory-policy", "volatile-lru"]);
    let mut raw = server.raw().await;
    for policy in EVICTING {
        set_policy(&mut raw, policy).await;
        let message = config_message(RedisStore::open(server.url()).await);
        let head = format!(
            "idempotency store misconfigured: Redis at {} has maxmemory-policy {policy}. ",
            server.node()
        );
        let fixes = [
            "`CONFIG SET maxmemory-policy noeviction`",
            "`maxmemory-policy noeviction` in redis.conf",
            "on ElastiCache (whose default is volatile-lru), in the cluster's parameter group",
            "RedisStoreBuilder::accept_eviction_risk(true)",
        ];
        assert_message(&message, &head, &fixes, "CONFIG is unavailable");
    }
    // Refusing wrote nothing: the scripts are loaded, no key exists.
    assert_eq!(query::<u64>(&mut raw, &["DBSIZE"]).await, 0);
}

/// The server's own `--maxmemory-policy allkeys-lru`, as a test given in the
/// brief: refused, and the same server opens once it is `noeviction`.
#[tokio::test]
async fn allkeys_lru_is_refused_and_noeviction_starts() {
    let server = PrivateRedis::start(&["--maxmemory-policy", "allkeys-lru"]);
    let message = config_message(RedisStore::open(server.url()).await);
    assert!(
        message.contains(&format!(
            "Redis at {} has maxmemory-policy allkeys-lru.",
            server.node()
        )),
        "{message}"
    );
    set_policy(&mut server.raw().await, "noeviction").await;
    let store = RedisStore::open(server.url()).await.unwrap();
    let check = store.last_eviction_check().expect("checked at open");
    assert!(check.is_safe());
    assert_eq!(check.nodes.len(), 1);
    let node = &check.nodes[0];
    assert_eq!(node.node, server.node());
    assert_eq!(node.policy.as_deref(), Some("noeviction"));
    assert_eq!(node.policy_error, None);
    assert_eq!(node.evicted_keys, Some(0));
    assert_eq!(check.evicted_keys(), 0);
    // And it serves.
    assert_acquired(&store, "k").await;
}

/// A default `redis-server` (noeviction) starts with no WARN.
#[tokio::test]
async fn the_default_policy_starts_silently() {
    let (logs, _guard) = Logs::capture();
    let server = PrivateRedis::start(&[]);
    let store = RedisStore::open(server.url()).await.unwrap();
    assert!(store.last_eviction_check().unwrap().is_safe());
    assert_eq!(logs.warnings(), Vec::<String>::new());
}

/// `CONFIG` renamed away: the policy is read from `INFO memory`, so an
/// evicting one is still refused and `noeviction` still starts.
#[tokio::test]
async fn without_config_the_policy_comes_from_info() {
    let evicting = PrivateRedis::start(&[
        "--maxmemory-policy",
        "volatile-lru",
        "--rename-command",
        "CONFIG",
        "",
    ]);
    let message = config_message(RedisStore::open(evicting.url()).await);
    assert!(
        message.starts_with(&format!(
            "idempotency store misconfigured: Redis at {} has maxmemory-policy volatile-lru. ",
            evicting.node()
        )),
        "{message}"
    );
    let safe = PrivateRedis::start(&["--rename-command", "CONFIG", ""]);
    let store = RedisStore::open(safe.url()).await.unwrap();
    let node = &store.last_eviction_check().unwrap().nodes[0];
    assert_eq!(node.policy.as_deref(), Some("noeviction"));
    assert_eq!(node.policy_error, None);
}

/// `CONFIG` and `INFO` both renamed away (as on a locked-down managed
/// service): refused with "CONFIG is unavailable"; with
/// `accept_eviction_risk(true)` the store starts and logs exactly one WARN,
/// and a re-check logs no other.
#[tokio::test]
async fn config_unavailable_is_refused_unless_the_risk_is_accepted() {
    let server = PrivateRedis::start(&[
        "--rename-command",
        "CONFIG",
        "",
        "--rename-command",
        "INFO",
        "",
    ]);
    let message = config_message(RedisStore::open(server.url()).await);
    let head = format!(
        "idempotency store misconfigured: cannot read maxmemory-policy of Redis at {} (CONFIG is unavailable: CONFIG GET maxmemory-policy: ",
        server.node()
    );
    let parts = [
        "unknown command",
        "; INFO memory: ",
        "rename or disable CONFIG",
        "+config|get",
        "RedisStoreBuilder::accept_eviction_risk(true)",
    ];
    assert_message(&message, &head, &parts, "has maxmemory-policy");

    let (logs, _guard) = Logs::capture();
    let store = RedisStore::builder(server.url())
        .accept_eviction_risk(true)
        .open()
        .await
        .unwrap();
    let check = store.last_eviction_check().unwrap();
    assert!(!check.is_safe());
    let node = &check.nodes[0];
    assert_eq!(node.policy, None);
    assert!(
        node.policy_error
            .as_deref()
            .unwrap()
            .starts_with("CONFIG is unavailable: "),
        "{node:?}"
    );
    assert_eq!(node.evicted_keys, None);
    let warnings = logs.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:#?}");
    assert!(
        warnings[0].contains("maxmemory-policy cannot be read"),
        "{}",
        warnings[0]
    );
    // Unchanged at the next check: no second WARN.
    assert_eq!(
        store.check_eviction_policy().await.unwrap().nodes,
        check.nodes
    );
    assert_eq!(logs.warnings().len(), 1);
    assert_acquired(&store, "k").await;
}

/// An ACL user without `+config` and `+info` gets the same refusal, with
/// the server's `NOPERM` quoted.
#[tokio::test]
async fn an_acl_user_without_config_is_told_so() {
    let server = PrivateRedis::start(&[]);
    let mut raw = server.raw().await;
    let ok: String = query(
        &mut raw,
        &[
            "ACL", "SETUSER", "app", "on", ">secret", "~*", "+@all", "-config", "-info",
        ],
    )
    .await;
    assert_eq!(ok, "OK");
    let url = format!("redis://app:secret@127.0.0.1:{}", server.port);
    let message = config_message(RedisStore::open(url.clone()).await);
    assert!(message.contains("CONFIG is unavailable"), "{message}");
    for refused in ["'config|get' command", "'info' command"] {
        assert!(
            message.contains(&format!("no permissions to run the {refused}")),
            "{message}"
        );
    }
    assert!(
        !message.contains("secret"),
        "the password leaked: {message}"
    );
    let store = RedisStore::builder(url)
        .accept_eviction_risk(true)
        .open()
        .await
        .unwrap();
    assert_eq!(store.last_eviction_check().unwrap().nodes[0].policy, None);
}

/// A policy changed at run time is seen by the next check: one WARN, the
/// last check kept, and (feature `metrics`) the gauges; back to
/// `noeviction`, the check is safe again.
#[tokio::test]
async fn a_recheck_sees_a_policy_changed_at_run_time() {
    let server = PrivateRedis::start(&[]);
    let mut raw = server.raw().await;
    let (logs, _guard) = Logs::capture();
    #[cfg(feature = "metrics")]
    let gauges = gauges::Recorded::default();
    #[cfg(feature = "metrics")]
    let _metrics = metrics::set_default_local_recorder(&gauges);
    let store = RedisStore::builder(server.url())
        .eviction_check_interval(Duration::ZERO)
        .open()
        .await
        .unwrap();
    let unsafe_gauge = format!(
        "tower_idempotency_redis_eviction_unsafe{{node={}}}",
        server.node()
    );
    let evicted_gauge = format!(
        "tower_idempotency_redis_evicted_keys{{node={}}}",
        server.node()
    );
    #[cfg(feature = "metrics")]
    assert_eq!(gauges.get(&unsafe_gauge), Some(0.0));
    let opened = store.last_eviction_check().unwrap();

    set_policy(&mut raw, "allkeys-lfu").await;
    let check = store.check_eviction_policy().await.unwrap();
    assert!(!check.is_safe());
    assert_eq!(check.nodes[0].policy.as_deref(), Some("allkeys-lfu"));
    assert!(check.checked_at >= opened.checked_at);
    assert_eq!(store.last_eviction_check(), Some(check));
    #[cfg(feature = "metrics")]
    {
        assert_eq!(gauges.get(&unsafe_gauge), Some(1.0));
        assert_eq!(gauges.get(&evicted_gauge), Some(0.0));
    }
    let warnings = logs.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:#?}");
    assert!(
        warnings[0].contains("maxmemory-policy allkeys-lfu"),
        "{}",
        warnings[0]
    );
    assert!(warnings[0].contains(&server.node()), "{}", warnings[0]);
    // The same policy again: no new WARN.
    store.check_eviction_policy().await.unwrap();
    assert_eq!(logs.warnings().len(), 1);
    // Back to noeviction.
    set_policy(&mut raw, "noeviction").await;
    assert!(store.check_eviction_policy().await.unwrap().is_safe());
    assert!(store.last_eviction_check().unwrap().is_safe());
    #[cfg(feature = "metrics")]
    assert_eq!(gauges.get(&unsafe_gauge), Some(0.0));
    assert_eq!(logs.warnings().len(), 1);
    let _ = (unsafe_gauge, evicted_gauge);
}

/// The bug itself, with the risk accepted: under `volatile-lru` (the
/// issue's setup: a cache's keys without expiry share the server), the
/// record is the only key with an expiry, so it is the first evicted; a
/// retry is then acquired again, and would run its handler a second time.
/// The next check counts the eviction and logs it. Without
/// `accept_eviction_risk`, the same server is refused.
#[tokio::test]
async fn under_volatile_lru_a_completed_record_is_evicted_and_a_retry_runs_again() {
    let server = PrivateRedis::start(&["--maxmemory-policy", "volatile-lru"]);
    let mut raw = server.raw().await;
    let message = config_message(RedisStore::open(server.url()).await);
    assert!(
        message.contains("has maxmemory-policy volatile-lru"),
        "{message}"
    );

    let (logs, _guard) = Logs::capture();
    let store = RedisStore::builder(server.url())
        .prefix("evict:")
        .accept_eviction_risk(true)
        .open()
        .await
        .unwrap();
    assert_eq!(logs.warnings().len(), 1, "one WARN at start-up");
    let token = FencingToken::random();
    assert_eq!(
        store
            .claim(claim_of("alice", "credit-1", 1, token))
            .await
            .unwrap(),
        Claim::Acquired { taken_over: false }
    );
    store
        .complete(
            RecordId::new("alice", "credit-1"),
            token,
            response(b"credit 1"),
        )
        .await
        .unwrap();
    match store
        .claim(claim_of("alice", "credit-1", 1, FencingToken::random()))
        .await
        .unwrap()
    {
        Claim::Refused(Refusal::Completed(stored)) => assert_eq!(stored, response(b"credit 1")),
        other => panic!("expected a replay, got {other:?}"),
    }
    // 1 MB above what the server uses now; then a cache writes 10 KB keys
    // without expiry until the record (the only volatile key) is evicted.
    let used = info_number(&mut raw, "memory", "used_memory").await;
    let max = (used + (1 << 20)).to_string();
    let ok: String = query(&mut raw, &["CONFIG", "SET", "maxmemory", &max]).await;
    assert_eq!(ok, "OK");
    let record = "evict:{5:alice:credit-1}";
    let value = "x".repeat(10 * 1024);
    let mut written = 0;
    while query::<u64>(&mut raw, &["EXISTS", record]).await == 1 {
        assert!(
            written < 1000,
            "10 MB written and the record is still there"
        );
        // The write that makes Redis evict the record may itself be
        // refused (OOM): the record alone does not free 10 KB.
        let set: redis::RedisResult<()> = redis::cmd("SET")
            .arg(format!("cache:{written}"))
            .arg(&value)
            .query_async(&mut raw)
            .await;
        if let Err(e) = set {
            assert_eq!(e.code(), Some("OOM"), "{e}");
        }
        written += 1;
    }
    assert_eq!(info_number(&mut raw, "stats", "evicted_keys").await, 1);
    // The cache shrinks again (no volatile key is left to evict, so every
    // write would be refused with OOM until then).
    let ok: String = query(&mut raw, &["CONFIG", "SET", "maxmemory", "0"]).await;
    assert_eq!(ok, "OK");
    // The retry is acquired afresh: the handler would run again.
    assert_acquired(&store, "credit-1").await;
    let check = store.check_eviction_policy().await.unwrap();
    assert_eq!(check.evicted_keys(), 1);
    let warnings = logs.warnings();
    assert_eq!(warnings.len(), 2, "{warnings:#?}");
    assert!(warnings[1].contains("evicted_keys=1"), "{}", warnings[1]);
}

/// Waits (within [`DEADLINE`]) until the server has `clients` connections.
async fn wait_for_clients(raw: &mut redis::aio::MultiplexedConnection, clients: u64) {
    let start = Instant::now();
    while info_number(raw, "clients", "connected_clients").await != clients {
        assert!(
            start.elapsed() < DEADLINE,
            "the store's connection outlived its last handle (a leaked timer?)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The timer re-checks by itself (interval 1 s: polled until it has, within
/// a deadline), and stops with the store's last handle: the store's
/// connection then closes, which it could not while a task held it. With an
/// interval of an hour, the task is stopped at once, not at its next tick.
#[tokio::test]
async fn the_timer_rechecks_and_stops_with_the_last_handle() {
    let server = PrivateRedis::start(&[]);
    let mut raw = server.raw().await;
    let alone = info_number(&mut raw, "clients", "connected_clients").await;
    assert_eq!(alone, 1);
    let store = RedisStore::builder(server.url())
        .eviction_check_interval(Duration::from_secs(1))
        .open()
        .await
        .unwrap();
    let clone = store.clone();
    assert!(info_number(&mut raw, "clients", "connected_clients").await > alone);
    set_policy(&mut raw, "volatile-ttl").await;
    let start = Instant::now();
    while clone.last_eviction_check().unwrap().nodes[0]
        .policy
        .as_deref()
        != Some("volatile-ttl")
    {
        assert!(start.elapsed() < DEADLINE, "the timer never re-checked");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(store);
    drop(clone);
    wait_for_clients(&mut raw, alone).await;

    set_policy(&mut raw, "noeviction").await;
    let store = RedisStore::builder(server.url())
        .eviction_check_interval(Duration::from_secs(3600))
        .open()
        .await
        .unwrap();
    let clone = store.clone();
    assert!(info_number(&mut raw, "clients", "connected_clients").await > alone);
    drop(clone);
    drop(store);
    wait_for_clients(&mut raw, alone).await;
}

/// On a cluster every master is read: one master with an evicting policy
/// refuses the store, naming that node only; a policy changed on one master
/// at run time is seen by the next check.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_master_with_an_evicting_policy_is_refused() {
    use rediscluster::{RedisCluster, cli};
    let nodes = tokio::task::spawn_blocking(|| RedisCluster::start(15660, 3, 0))
        .await
        .unwrap();
    let masters = nodes.masters();
    assert_eq!(masters.len(), 3);
    let set = |port: u16, policy: &str| {
        let reply = cli(port, &["CONFIG", "SET", "maxmemory-policy", policy]).unwrap();
        assert_eq!(reply.trim(), "OK");
    };
    set(masters[1], "allkeys-lru");
    let message = config_message(RedisStore::cluster(nodes.urls()).await);
    assert!(
        message.starts_with(&format!(
            "idempotency store misconfigured: Redis at 127.0.0.1:{} has maxmemory-policy allkeys-lru. ",
            masters[1]
        )),
        "{message}"
    );
    for other in [masters[0], masters[2]] {
        assert!(!message.contains(&other.to_string()), "{message}");
    }
    set(masters[1], "noeviction");
    let store = RedisStore::cluster_builder(nodes.urls())
        .eviction_check_interval(Duration::ZERO)
        .open()
        .await
        .unwrap();
    let check = store.last_eviction_check().unwrap();
    let mut read: Vec<String> = check.nodes.iter().map(|n| n.node.clone()).collect();
    read.sort();
    let mut expected: Vec<String> = masters.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    expected.sort();
    assert_eq!(read, expected);
    assert!(check.is_safe());
    set(masters[2], "volatile-lfu");
    let check = store.check_eviction_policy().await.unwrap();
    let unsafe_nodes: Vec<(&str, Option<&str>)> = check
        .nodes
        .iter()
        .filter(|n| !n.is_safe())
        .map(|n| (n.node.as_str(), n.policy.as_deref()))
        .collect();
    let third = format!("127.0.0.1:{}", masters[2]);
    assert_eq!(unsafe_nodes, vec![(third.as_str(), Some("volatile-lfu"))]);
}

#[cfg(feature = "metrics")]
mod gauges {
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};

    use metrics::{
        Counter, Gauge, GaugeFn, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
    };

    /// Each gauge's last value, by `name{label=value}`.
    #[derive(Clone, Default)]
    pub(crate) struct Recorded(Arc<Mutex<BTreeMap<String, f64>>>);

    impl Recorded {
        pub(crate) fn get(&self, name: &str) -> Option<f64> {
            self.0.lock().unwrap().get(name).copied()
        }
    }

    /// One gauge: its name and where its value goes.
    struct Cell(String, Recorded);

    impl Cell {
        fn update(&self, change: impl FnOnce(&mut f64)) {
            change(self.1.0.lock().unwrap().entry(self.0.clone()).or_default());
        }
    }

    impl GaugeFn for Cell {
        fn increment(&self, value: f64) {
            self.update(|v| *v += value);
        }
        fn decrement(&self, value: f64) {
            self.update(|v| *v -= value);
        }
        fn set(&self, value: f64) {
            self.update(|v| *v = value);
        }
    }

    impl Recorder for Recorded {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
            Counter::noop()
        }
        fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
            let labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            let name = format!("{}{{{}}}", key.name(), labels.join(","));
            Gauge::from_arc(Arc::new(Cell(name, self.clone())))
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }
}
