//! Store throughput: new keys (claim, then complete) and replays (a claim on
//! a completed key) per second, for every store this build has, measured in
//! one run with the same concurrency.
//!
//! ```text
//! cargo run --release --example store_bench --all-features -- [--ops 2000] [--tasks 8]
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::store::{Claim, ClaimRequest, FencingToken, RecordId, Refusal, Store};
use tower_idempotency::{MemoryStore, SqliteStore, StoredResponse};

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().expect("a number"))
        .unwrap_or(default)
}

fn claim(prefix: &str, n: usize) -> ClaimRequest {
    ClaimRequest::new(
        RecordId::new("bench", format!("{prefix}-{n}")),
        Fingerprint([7; 32]),
        FencingToken::random(),
    )
    .with_lease(Duration::from_secs(60))
    .with_ttl(Duration::from_secs(3600))
}

/// Runs `op(n)` for n in 0..ops from `tasks` tasks; returns operations per second.
async fn rate<S, F, Fut>(store: &S, ops: usize, tasks: usize, op: F) -> f64
where
    S: Store,
    F: Fn(S, usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let next = Arc::new(AtomicUsize::new(0));
    let op = Arc::new(op);
    let start = Instant::now();
    let handles: Vec<_> = (0..tasks)
        .map(|_| {
            let (store, next, op) = (store.clone(), next.clone(), op.clone());
            tokio::spawn(async move {
                loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if n >= ops {
                        return;
                    }
                    op(store.clone(), n).await;
                }
            })
        })
        .collect();
    for h in handles {
        h.await.expect("bench task");
    }
    ops as f64 / start.elapsed().as_secs_f64()
}

async fn bench<S: Store>(name: &str, store: S, ops: usize, tasks: usize) {
    let run = format!("{:016x}", FencingToken::random().0);
    let body = Bytes::from(vec![b'x'; 200]);
    let response = StoredResponse::capture(StatusCode::CREATED, &HeaderMap::new(), body, None);
    let (prefix, stored) = (run.clone(), response.clone());
    let new_keys = rate(&store, ops, tasks, move |store, n| {
        let (request, stored) = (claim(&prefix, n), stored.clone());
        async move {
            let token = request.token;
            let key = request.key.clone();
            assert_eq!(
                store.claim(request).await.unwrap(),
                Claim::Acquired { taken_over: false }
            );
            store
                .complete(RecordId::new("bench", key), token, stored)
                .await
                .unwrap();
        }
    })
    .await;
    let prefix = run.clone();
    let replays = rate(&store, ops, tasks, move |store, n| {
        let request = claim(&prefix, n);
        async move {
            assert!(matches!(
                store.claim(request).await.unwrap(),
                Claim::Refused(Refusal::Completed(_))
            ));
        }
    })
    .await;
    println!("| {name} | {new_keys:.0} | {replays:.0} |");
}

#[tokio::main]
async fn main() {
    let ops = arg("--ops", 2000);
    let tasks = arg("--tasks", 8);
    println!("{ops} operations per column from {tasks} tasks; a 200-byte stored response\n");
    println!("| store | new keys/s (claim + complete) | replays/s |");
    println!("|---|---|---|");
    bench("MemoryStore", MemoryStore::new(), ops, tasks).await;
    let dir = tempfile::tempdir().expect("a temporary directory");
    for (label, sync) in [
        ("FULL", tower_idempotency::store::Synchronous::Full),
        ("NORMAL", tower_idempotency::store::Synchronous::Normal),
    ] {
        let store = SqliteStore::builder(dir.path().join(format!("bench-{label}.sqlite3")))
            .synchronous(sync)
            .open()
            .await
            .expect("open SQLite");
        bench(
            &format!("SqliteStore (synchronous={label})"),
            store,
            ops,
            tasks,
        )
        .await;
    }
    #[cfg(feature = "postgres")]
    {
        let url = std::env::var("TOWER_IDEMPOTENCY_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let table = format!("idem_bench_{:08x}", FencingToken::random().0 as u32);
        let store = tower_idempotency_postgres::PostgresStore::builder(&url)
            .table(table.clone())
            .open()
            .await
            .expect("open PostgreSQL");
        bench("PostgresStore", store.clone(), ops, tasks).await;
        let client = store.pool().get().await.expect("a connection");
        client
            .batch_execute(&format!("DROP TABLE {table}"))
            .await
            .expect("drop the bench table");
    }
    #[cfg(feature = "redis")]
    {
        let url = std::env::var("TOWER_IDEMPOTENCY_REDIS_URL")
            .unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let store = tower_idempotency_redis::RedisStore::builder(url)
            .prefix(format!("bench-{:08x}:", FencingToken::random().0 as u32))
            .open()
            .await
            .expect("open Redis");
        bench("RedisStore", store, ops, tasks).await;
    }
}
