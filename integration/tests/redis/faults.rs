//! `RedisStore` fails closed and recovers: a corrupt record, and a server
//! stopped and started again (without persistence its records are then
//! gone). Each fault is injected while the layer serves real HTTP, with a
//! handler that counts its runs:
//!
//! * every request the sick store cannot decide is answered with the 503
//!   `store-unavailable` problem and `Retry-After: 1`, and runs nothing;
//! * nothing is ever replayed while the store is sick;
//! * once the fault is gone, the SAME key runs exactly once and its repeat
//!   is replayed byte for byte, without restarting the app.
//!
//! Runs on the shared server (`TOWER_IDEMPOTENCY_REDIS_URL`) and, for the
//! restart, on a private `redis-server` (on the `PATH`) the test starts and
//! stops itself. A missing server fails.

#![cfg(feature = "redis")]

use crate::common;

use std::time::Duration;

use common::charge::{assert_ran, assert_replay_of, assert_unavailable, request, serve_separate};
use common::{Harness, free_port};
use tower_idempotency::problem::types;
use tower_idempotency::store::{FencingToken, Store};
use tower_idempotency_redis::RedisStore;

fn url() -> String {
    crate::common::services::redis_url()
}

fn prefix(what: &str) -> String {
    format!(
        "tower-idempotency-faults:{what}:{:016x}:",
        FencingToken::random().0
    )
}

/// A completed record whose `response` field is garbage: 503, no replay,
/// no second run; a garbage `fingerprint` field: 422. Repaired, it
/// replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_corrupt_record() {
    let prefix = prefix("corrupt");
    let store = RedisStore::builder(url())
        .prefix(prefix.clone())
        .open()
        .await
        .unwrap_or_else(|e| panic!("Redis at {} is required: {e}", url()));
    let h = Harness::default();
    let addr = serve_separate(store, &h).await;
    let first = request(addr, "k", &[]).await;
    assert_ran(&first, 1);
    let client = ::redis::Client::open(url()).unwrap();
    let mut raw = client.get_multiplexed_async_connection().await.unwrap();
    // `{prefix}{{scope length}:{scope}:{key}}`, see RedisStore's docs.
    let record = format!("{prefix}{{5:alice:k}}");
    for (field, garbage, status, problem) in [
        (
            "response",
            &b"\x00garbage"[..],
            503,
            types::STORE_UNAVAILABLE,
        ),
        ("fingerprint", &b"\x01"[..], 422, types::MISMATCH),
    ] {
        let good: Vec<u8> = ::redis::cmd("HGET")
            .arg(&record)
            .arg(field)
            .query_async(&mut raw)
            .await
            .unwrap();
        let set = |value: Vec<u8>| {
            let mut raw = raw.clone();
            let record = record.clone();
            async move {
                let added: i64 = ::redis::cmd("HSET")
                    .arg(&record)
                    .arg(field)
                    .arg(value)
                    .query_async(&mut raw)
                    .await
                    .unwrap();
                assert_eq!(added, 0, "the field existed");
            }
        };
        set(garbage.to_vec()).await;
        for _ in 0..2 {
            let r = request(addr, "k", &[]).await;
            assert_eq!(r.assert_problem(status), problem, "{field}: {r:?}");
            assert_eq!(r.header("idempotent-replayed"), None);
        }
        set(good).await;
        assert_replay_of(&request(addr, "k", &[]).await, &first);
    }
    assert_eq!(h.runs(), 1);
    let _: i64 = ::redis::cmd("DEL")
        .arg(&record)
        .query_async(&mut raw)
        .await
        .unwrap();
}

/// A Redis server of the test's own, without persistence, on a free port.
struct PrivateRedis {
    port: u16,
    child: Option<std::process::Child>,
}

impl PrivateRedis {
    fn new() -> PrivateRedis {
        PrivateRedis {
            port: free_port(),
            child: None,
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts the server and waits until it answers `PING`.
    async fn start(&mut self) {
        let port = self.port.to_string();
        let child = std::process::Command::new("redis-server")
            .args(["--port", &port, "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server is required");
        self.child = Some(child);
        let client = ::redis::Client::open(self.url()).unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
                let pong: Result<String, _> = ::redis::cmd("PING").query_async(&mut conn).await;
                if pong.is_ok() {
                    return;
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "redis-server did not start"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL: every record, kept in memory only, is gone.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The server goes down: 503 on every request, also the repeat of a
/// completed key; nothing runs. Back up, the same store (its
/// ConnectionManager) reconnects: the pending key runs once and replays.
/// A server without persistence lost its records: the completed key is
/// new to it and runs a second time, as RedisStore's "Durability" docs
/// say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_server_restarted() {
    let mut redis = PrivateRedis::new();
    redis.start().await;
    let store = RedisStore::builder(redis.url())
        .prefix(prefix("restart"))
        .open()
        .await
        .unwrap();
    let h = Harness::default();
    let addr = serve_separate(store.clone(), &h).await;
    let done = request(addr, "done", &[]).await;
    assert_ran(&done, 1);

    redis.kill();
    for key in ["done", "k", "k"] {
        assert_unavailable(&request(addr, key, &[]).await);
    }
    assert_eq!(h.runs(), 1);

    redis.start().await;
    // The ConnectionManager reconnects on the call after a failed one:
    // the first store call may still see the old connection's error.
    let mut failed = 0;
    while let Err(e) = store.purge_expired().await {
        failed += 1;
        assert!(failed < 3, "no reconnection: {e}");
    }
    let first = request(addr, "k", &[]).await;
    assert_ran(&first, 2);
    assert_replay_of(&request(addr, "k", &[]).await, &first);
    // The completed record was lost with the server's memory.
    let again = request(addr, "done", &[]).await;
    assert_ran(&again, 3);
    assert_replay_of(&request(addr, "done", &[]).await, &again);
    assert_eq!(h.runs(), 3);
}
