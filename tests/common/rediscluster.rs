//! A private Redis Cluster on loopback ports: `redis-server` processes with
//! `--cluster-enabled yes`, joined by `redis-cli --cluster create`, killed
//! on drop. A missing `redis-server` or `redis-cli`, or a port in use, fails
//! the test (never a skip).

#![allow(dead_code, unreachable_pub)]

use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

/// How long the cluster may take to start, or to fail over.
pub const CLUSTER_DEADLINE: Duration = Duration::from_secs(30);

/// Every node's cluster bus timeout (ms): how long a master may be silent
/// before the others count it as failed and promote its replica.
pub const NODE_TIMEOUT_MS: u64 = 1000;

pub struct RedisCluster {
    pub ports: Vec<u16>,
    nodes: Vec<Option<Child>>,
    _dir: tempfile::TempDir,
}

impl RedisCluster {
    /// `masters` masters with `replicas` replicas each, on the ports from
    /// `base` up; waits until every node reports `cluster_state:ok`.
    pub fn start(base: u16, masters: u16, replicas: u16) -> RedisCluster {
        let dir = tempfile::tempdir().unwrap();
        let count = masters * (1 + replicas);
        let ports: Vec<u16> = (base..base + count).collect();
        let mut cluster = RedisCluster {
            ports: ports.clone(),
            nodes: Vec::new(),
            _dir: dir,
        };
        for &port in &ports {
            // A cluster of the same test binary that is just stopping frees
            // its ports within moments; a leftover server never does.
            // The node's cluster bus listens on port + 10000.
            for used in [port, port + 10000] {
                wait_until(
                    &format!("port {used} is free (a leftover redis-server?)"),
                    || std::net::TcpStream::connect(("127.0.0.1", used)).is_err(),
                );
            }
            let conf = cluster._dir.path().join(format!("nodes-{port}.conf"));
            let child = Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--cluster-enabled", "yes", "--cluster-config-file"])
                .arg(&conf)
                .args(["--cluster-node-timeout", &NODE_TIMEOUT_MS.to_string()])
                .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
                .arg("--dir")
                .arg(cluster._dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("redis-server is required on the PATH: {e}"));
            cluster.nodes.push(Some(child));
        }
        for &port in &ports {
            wait_until(&format!("redis-server on port {port} answers"), || {
                cli(port, &["PING"]).is_some_and(|r| r.trim() == "PONG")
            });
        }
        let addrs: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        // `redis-cli --cluster create` waits for the nodes to agree with no
        // limit of its own: `timeout` gives it one (exit status 124).
        let out = Command::new("timeout")
            .arg(CLUSTER_DEADLINE.as_secs().to_string())
            .args(["redis-cli", "--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .unwrap_or_else(|e| panic!("timeout and redis-cli are required on the PATH: {e}"));
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed or ran past {CLUSTER_DEADLINE:?} ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        for &port in &ports {
            wait_until(&format!("node {port} reports cluster_state:ok"), || {
                cluster_ok(port)
            });
        }
        if replicas > 0 {
            // Every master has its replicas attached and in sync.
            for &port in &ports {
                wait_until(
                    &format!("node {port} has its replicas in sync"),
                    || match cli(port, &["INFO", "replication"]) {
                        Some(info) if info.contains("role:master") => {
                            info.contains(&format!("connected_slaves:{replicas}"))
                                && !info.contains("state=wait_bgsave")
                        }
                        Some(info) => info.contains("master_link_status:up"),
                        None => false,
                    },
                );
            }
        }
        cluster
    }

    /// A shared cluster of 3 masters on the ports from `base` up, started
    /// by the first caller and stopped when the last handle drops.
    pub fn shared(slot: &'static Mutex<Weak<RedisCluster>>, base: u16) -> Arc<RedisCluster> {
        let mut held = slot.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(cluster) = held.upgrade() {
            return cluster;
        }
        let cluster = Arc::new(RedisCluster::start(base, 3, 0));
        *held = Arc::downgrade(&cluster);
        cluster
    }

    /// Every node's URL: the seeds of a store.
    pub fn urls(&self) -> Vec<String> {
        self.ports
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    /// The ports of the nodes that are masters now.
    pub fn masters(&self) -> Vec<u16> {
        self.live_ports()
            .into_iter()
            .filter(|&p| cli(p, &["ROLE"]).is_some_and(|r| r.starts_with("master")))
            .collect()
    }

    /// The ports whose process is still running.
    pub fn live_ports(&self) -> Vec<u16> {
        self.ports
            .iter()
            .zip(&self.nodes)
            .filter(|(_, n)| n.is_some())
            .map(|(p, _)| *p)
            .collect()
    }

    /// Kills the node on `port` (SIGKILL) and waits for the process to end.
    pub fn kill(&mut self, port: u16) {
        let i = self.ports.iter().position(|&p| p == port).unwrap();
        if let Some(mut child) = self.nodes[i].take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    /// Waits until every live node reports `cluster_state:ok`.
    pub fn wait_ok(&self) {
        for port in self.live_ports() {
            wait_until(&format!("node {port} reports cluster_state:ok"), || {
                cluster_ok(port)
            });
        }
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for child in self.nodes.iter_mut().flatten() {
            let _ = child.kill();
        }
        for child in self.nodes.iter_mut().flatten() {
            let _ = child.wait();
        }
    }
}

/// How long one `redis-cli` call may take: a node that accepts but never
/// answers (stopped, or still loading) counts as not answering.
const CLI_DEADLINE: Duration = Duration::from_secs(5);

/// `redis-cli -p port args...`'s output; `None` when it fails or runs past
/// [`CLI_DEADLINE`].
pub fn cli(port: u16, args: &[&str]) -> Option<String> {
    let out = Command::new("timeout")
        .arg(CLI_DEADLINE.as_secs().to_string())
        .arg("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stderr(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("timeout and redis-cli are required on the PATH: {e}"));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    (out.status.success() && !text.starts_with("Could not connect")).then_some(text)
}

fn cluster_ok(port: u16) -> bool {
    cli(port, &["CLUSTER", "INFO"]).is_some_and(|info| info.contains("cluster_state:ok"))
}

/// Polls `ready` every 50 ms until it holds; panics after [`CLUSTER_DEADLINE`].
pub fn wait_until(what: &str, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(
            start.elapsed() < CLUSTER_DEADLINE,
            "timed out after {CLUSTER_DEADLINE:?} waiting until {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
