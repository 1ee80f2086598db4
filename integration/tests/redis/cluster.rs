//! `RedisStore` on a Redis Cluster of its own: the store contract suite, the
//! spread of records over every master, `ASK` and `MOVED` while a slot
//! moves, and a master's failover. Each cluster is private `redis-server`
//! processes on loopback ports 15600-15625 (`tests/common/rediscluster.rs`),
//! killed when the test ends; without `redis-server` the tests fail.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tower_idempotency::store::{Claim, FencingToken, Inspect, RecordId, Refusal, Store};
use tower_idempotency::test_util::{
    ClockOffset, ManualClock, claim_of, counts, response, store_suite,
};
use tower_idempotency::{StoreError, StoredResponse};
use tower_idempotency_redis::RedisStore;

use crate::rediscluster;
use rediscluster::{RedisCluster, cli, wait_until};

static SHARED: Mutex<Weak<RedisCluster>> = Mutex::new(Weak::new());

/// The shared 3-master cluster (ports 15600-15602) while any test holds it.
fn shared() -> Arc<RedisCluster> {
    RedisCluster::shared(&SHARED, 15600)
}

fn unique_prefix(what: &str) -> String {
    format!("ti-cluster:{what}:{:016x}:", FencingToken::random().0)
}

async fn cluster(clock: ManualClock) -> (RedisStore, Arc<RedisCluster>) {
    let nodes = tokio::task::spawn_blocking(shared).await.unwrap();
    let test = std::thread::current().name().unwrap_or("suite").to_owned();
    let store = RedisStore::cluster_builder(nodes.urls())
        .prefix(unique_prefix(&test))
        .clock_offset(ClockOffset(clock))
        .open()
        .await
        .unwrap();
    assert!(store.is_cluster());
    (store, nodes)
}

store_suite!(cluster_store, cluster, inspect);

/// The names of the keys under `prefix` on the node at `port`.
fn keys_on(port: u16, prefix: &str) -> BTreeSet<String> {
    cli(port, &["--scan", "--pattern", &format!("{prefix}*")])
        .expect("redis-cli --scan")
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The record's key name (see `RedisStore`'s docs).
fn record_name(prefix: &str, scope: &str, key: &str) -> String {
    format!("{prefix}{{{}:{scope}:{key}}}", scope.len())
}

/// 300 records land on all three masters, each on exactly one; the walk of
/// `counts` and `purge_expired` finds every one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_spread_over_every_master() {
    let clock = ManualClock::new(tower_idempotency::test_util::START_MS);
    let (store, nodes) = cluster(clock.clone()).await;
    let prefix = store.prefix().to_owned();
    let mut names = BTreeSet::new();
    for i in 0..300 {
        let key = format!("k{i}");
        let claim =
            claim_of("alice", &key, 1, FencingToken::random()).with_ttl(Duration::from_secs(60));
        assert_eq!(
            store.claim(claim).await.unwrap(),
            Claim::Acquired { taken_over: false }
        );
        names.insert(record_name(&prefix, "alice", &key));
    }
    let masters = nodes.masters();
    assert_eq!(masters.len(), 3);
    let mut union = BTreeSet::new();
    let mut per_node = Vec::new();
    for &port in &masters {
        let here = keys_on(port, &prefix);
        per_node.push(here.len());
        assert!(!here.is_empty(), "no record on the master at {port}");
        assert!(union.is_disjoint(&here), "a record on two masters");
        union.extend(here);
    }
    assert_eq!(union, names, "per master: {per_node:?}");
    assert_eq!(store.counts().await.unwrap(), counts(300, 0, 0, 0));
    // Past the TTL, the walk purges every record on every master (the
    // test's offset runs ahead of the servers' clocks, which have not
    // expired the keys themselves).
    clock.advance(Duration::from_secs(61));
    assert_eq!(store.counts().await.unwrap(), counts(0, 0, 0, 300));
    assert_eq!(store.purge_expired().await.unwrap(), 300);
    for &port in &masters {
        assert_eq!(keys_on(port, &prefix).len(), 0);
    }
}

/// Seeds, prefixes and unreachable clusters are checked when the store opens.
#[tokio::test]
async fn cluster_config_errors() {
    let err = RedisStore::cluster(Vec::<String>::new()).await.unwrap_err();
    assert!(matches!(err, StoreError::Config(_)), "{err:?}");
    let err = RedisStore::cluster(["not a url"]).await.unwrap_err();
    assert!(matches!(err, StoreError::Config(_)), "{err:?}");
    let err = RedisStore::cluster_builder(["redis://127.0.0.1:15699"])
        .prefix("{app}:")
        .open()
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Config(_)), "{err:?}");
    // Nothing listens on 15699.
    let err = RedisStore::cluster(["redis://127.0.0.1:15699"])
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
}

/// `CLUSTER MYID` of the node at `port`.
fn node_id(port: u16) -> String {
    cli(port, &["CLUSTER", "MYID"]).unwrap().trim().to_owned()
}

fn ok(port: u16, args: &[&str]) {
    let reply = cli(port, args).unwrap();
    assert_eq!(reply.trim(), "OK", "{args:?} on {port}");
}

async fn replay_body(store: &RedisStore, scope: &str, key: &str, fp: u8) -> StoredResponse {
    match store
        .claim(claim_of(scope, key, fp, FencingToken::random()))
        .await
        .unwrap()
    {
        Claim::Refused(Refusal::Completed(stored)) => stored,
        other => panic!("{key}: expected a replay, got {other:?}"),
    }
}

/// A slot moves from one master to another while the store runs: a record
/// already moved is reached through `ASK`, a new record in the migrating
/// slot is created on the new master through `ASK`, and once the move is
/// final the store's stale slot map is corrected by `MOVED`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ask_and_moved_are_followed_while_a_slot_moves() {
    let nodes = tokio::task::spawn_blocking(|| RedisCluster::start(15610, 3, 0))
        .await
        .unwrap();
    let store = RedisStore::cluster_builder(nodes.urls())
        .prefix(unique_prefix("moving"))
        .open()
        .await
        .unwrap();
    let prefix = store.prefix().to_owned();
    let token = FencingToken::random();
    store
        .claim(claim_of("alice", "first", 1, token))
        .await
        .unwrap();
    store
        .complete(RecordId::new("alice", "first"), token, response(b"first"))
        .await
        .unwrap();
    let first = record_name(&prefix, "alice", "first");
    let slot = cli(nodes.ports[0], &["CLUSTER", "KEYSLOT", &first]).unwrap();
    let slot = slot.trim().to_owned();
    // A second key in the same slot.
    let second = (0..)
        .map(|i| format!("second-{i}"))
        .find(|k| {
            let tag = format!("5:alice:{k}");
            redis::cluster_routing::Slot::for_key(&tag)
                == redis::cluster_routing::Slot::for_key("5:alice:first")
        })
        .unwrap();
    let masters = nodes.masters();
    let from = *masters
        .iter()
        .find(|&&p| keys_on(p, &prefix).contains(&first))
        .expect("a master holds the record");
    let to = *masters.iter().find(|&&p| p != from).unwrap();
    let (from_id, to_id) = (node_id(from), node_id(to));
    ok(to, &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id]);
    ok(from, &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id]);
    // Still on the old master.
    assert_eq!(
        replay_body(&store, "alice", "first", 1).await,
        response(b"first")
    );
    ok(
        from,
        &[
            "MIGRATE",
            "127.0.0.1",
            &to.to_string(),
            "",
            "0",
            "5000",
            "KEYS",
            &first,
        ],
    );
    assert!(!keys_on(from, &prefix).contains(&first));
    // Moved: the old master answers ASK.
    assert_eq!(
        replay_body(&store, "alice", "first", 1).await,
        response(b"first")
    );
    // New in the migrating slot: created on the new master, through ASK.
    let token = FencingToken::random();
    assert_eq!(
        store
            .claim(claim_of("alice", &second, 2, token))
            .await
            .unwrap(),
        Claim::Acquired { taken_over: false }
    );
    store
        .complete(RecordId::new("alice", &second), token, response(b"second"))
        .await
        .unwrap();
    for port in [to, from] {
        ok(port, &["CLUSTER", "SETSLOT", &slot, "NODE", &to_id]);
    }
    for &port in &masters {
        if port != to && port != from {
            ok(port, &["CLUSTER", "SETSLOT", &slot, "NODE", &to_id]);
        }
    }
    // The final move: the store's slot map is stale until MOVED.
    assert_eq!(
        replay_body(&store, "alice", "first", 1).await,
        response(b"first")
    );
    assert_eq!(
        replay_body(&store, "alice", &second, 2).await,
        response(b"second")
    );
    let count = |port| cli(port, &["CLUSTER", "COUNTKEYSINSLOT", &slot]).unwrap();
    assert_eq!(count(to).trim(), "2");
    assert_eq!(count(from).trim(), "0");
    assert_eq!(store.counts().await.unwrap(), counts(0, 0, 2, 0));
}

/// Every replica's offset has reached its master's: all the writes so far
/// are on the replicas.
fn wait_replicated(nodes: &RedisCluster) {
    for port in nodes.masters() {
        wait_until(&format!("the replicas of {port} caught up"), || {
            let info = cli(port, &["INFO", "replication"]).unwrap_or_default();
            let field = |name: &str| {
                info.lines()
                    .find_map(|l| l.strip_prefix(name))
                    .map(|v| v.trim().to_owned())
            };
            let Some(master) = field("master_repl_offset:") else {
                return false;
            };
            let offsets: Vec<String> = info
                .lines()
                .filter(|l| l.starts_with("slave"))
                .filter_map(|l| l.split(",offset=").nth(1))
                .map(|rest| rest.split(',').next().unwrap_or("").to_owned())
                .collect();
            !offsets.is_empty() && offsets.iter().all(|o| *o == master)
        });
    }
}

/// 3 masters with a replica each. 90 records are completed and replicated;
/// then the master holding the most of them is killed (SIGKILL). Once its
/// replica is promoted, the same store replays every record byte for byte
/// and takes new claims on every slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_over_master_loses_no_replicated_record() {
    let mut nodes = tokio::task::spawn_blocking(|| RedisCluster::start(15620, 3, 1))
        .await
        .unwrap();
    let store = RedisStore::cluster_builder(nodes.urls())
        .prefix(unique_prefix("failover"))
        .open()
        .await
        .unwrap();
    let prefix = store.prefix().to_owned();
    let keys: Vec<&'static str> = (0..90)
        .map(|i| &*Box::leak(format!("k{i}").into_boxed_str()))
        .collect();
    for &key in &keys {
        let token = FencingToken::random();
        store.claim(claim_of("s", key, 1, token)).await.unwrap();
        let body = key.as_bytes();
        store
            .complete(RecordId::new("s", key), token, response(body))
            .await
            .unwrap();
    }
    let nodes_ref = &nodes;
    wait_replicated(nodes_ref);
    let held: HashMap<u16, usize> = nodes
        .masters()
        .into_iter()
        .map(|p| (p, keys_on(p, &prefix).len()))
        .collect();
    assert_eq!(held.values().sum::<usize>(), 90, "{held:?}");
    let (&victim, &lost_master_held) = held.iter().max_by_key(|(_, n)| **n).unwrap();
    assert!(lost_master_held > 0);
    nodes.kill(victim);
    let started = Instant::now();
    wait_until("a replica took over the killed master's slots", || {
        nodes.masters().len() == 3
    });
    nodes.wait_ok();
    // The store's first calls may meet the dead master until its slot map
    // is refreshed; each is retried within a bounded deadline.
    let mut unavailable = 0;
    for &key in &keys {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            match store
                .claim(claim_of("s", key, 1, FencingToken::random()))
                .await
            {
                Ok(Claim::Refused(Refusal::Completed(stored))) => {
                    assert_eq!(stored, response(key.as_bytes()));
                    break;
                }
                Err(StoreError::Unavailable(_)) if Instant::now() < deadline => {
                    unavailable += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                other => panic!("{key}: {other:?}"),
            }
        }
    }
    for i in 0..30 {
        let claim = claim_of("s", &format!("after-{i}"), 1, FencingToken::random());
        assert_eq!(
            store.claim(claim).await.unwrap(),
            Claim::Acquired { taken_over: false }
        );
    }
    assert_eq!(store.counts().await.unwrap(), counts(30, 0, 90, 0));
    eprintln!(
        "failover: {lost_master_held} of 90 records were on the killed master; \
         all 90 replayed {:?} after the kill, {unavailable} calls answered Unavailable first",
        started.elapsed()
    );
}
