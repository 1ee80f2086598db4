//! Micro-benchmarks of the layer's parts (BENCHMARKS.md).
//!
//! ```text
//! cargo bench --bench micro                                   # memory and SQLite stores
//! cargo bench --bench micro --features postgres,redis         # also PostgreSQL and Redis
//! cargo bench --bench micro -- key/                           # one group (a criterion filter)
//! cargo bench --bench micro -- "sqlite hand-offs"             # the writer's round trips
//! ```
//!
//! PostgreSQL and Redis are read from `TOWER_IDEMPOTENCY_POSTGRES_URL`
//! (default `postgres://postgres@127.0.0.1:5432/test`) and
//! `TOWER_IDEMPOTENCY_REDIS_URL` (default `redis://127.0.0.1:6379`); a
//! server that cannot be reached fails the run.

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use http::header::{CONTENT_TYPE, HeaderName};
use http::{HeaderMap, HeaderValue, Request, StatusCode};
use tower_idempotency::fingerprint::{
    DefaultFingerprinter, Fingerprint, Fingerprinter, JsonFingerprinter,
};
use tower_idempotency::key::parse_value;
use tower_idempotency::store::{
    Claim, ClaimRequest, Completion, FencingToken, RecordId, Refusal, SqliteTransaction, Store,
    Synchronous, TransactionClaim, TransactionalStore,
};
use tower_idempotency::{MemoryStore, SqliteStore, StoredBody, StoredResponse};

const UUID_KEY: &str = "8e03978e-40d5-43e8-bc93-6894a57f9324";

fn key_parsing(c: &mut Criterion) {
    let quoted = format!("\"{UUID_KEY}\"");
    let mut group = c.benchmark_group("key");
    assert_eq!(parse_value(quoted.as_bytes()).as_deref(), Ok(UUID_KEY));
    assert_eq!(parse_value(UUID_KEY.as_bytes()).as_deref(), Ok(UUID_KEY));
    group.bench_function("sf-string (quoted uuid)", |b| {
        b.iter(|| parse_value(black_box(quoted.as_bytes())))
    });
    group.bench_function("token (bare uuid)", |b| {
        b.iter(|| parse_value(black_box(UUID_KEY.as_bytes())))
    });
    group.finish();
}

/// A JSON object of about `len` bytes: fields in a fixed, unsorted order.
fn json_body(len: usize) -> Bytes {
    let mut text = String::from(r#"{"currency":"EUR","amount":500,"account":"acct-1","items":["#);
    let mut i = 0;
    while text.len() + 40 < len {
        if i > 0 {
            text.push(',');
        }
        text.push_str(&format!(r#"{{"sku":"sku-{i:05}","qty":{}}}"#, i % 7 + 1));
        i += 1;
    }
    text.push_str("]}");
    Bytes::from(text)
}

fn fingerprinting(c: &mut Criterion) {
    let (parts, ()) = Request::post("/payments?source=bench")
        .header(CONTENT_TYPE, "application/json")
        .body(())
        .expect("a request")
        .into_parts();
    let mut group = c.benchmark_group("fingerprint");
    for size in [1024usize, 64 * 1024] {
        let body = Bytes::from(vec![b'x'; size]);
        group.throughput(Throughput::Bytes(size as u64));
        let default = DefaultFingerprinter::new();
        group.bench_function(format!("default {} KiB", size / 1024), |b| {
            b.iter(|| default.fingerprint(black_box(&parts), black_box(&body)))
        });
    }
    let json = json_body(1024);
    assert!((1000..=1024).contains(&json.len()), "{} bytes", json.len());
    let fingerprinter = JsonFingerprinter::new();
    // Key order and spacing do not change the JSON fingerprint.
    let reordered: serde_json::Value = serde_json::from_slice(&json).expect("JSON");
    let pretty = Bytes::from(serde_json::to_vec_pretty(&reordered).expect("JSON"));
    assert_eq!(
        fingerprinter.fingerprint(&parts, &json).expect("JSON"),
        fingerprinter.fingerprint(&parts, &pretty).expect("JSON")
    );
    group.throughput(Throughput::Bytes(json.len() as u64));
    group.bench_function("json 1 KiB", |b| {
        b.iter(|| fingerprinter.fingerprint(black_box(&parts), black_box(&json)))
    });
    group.finish();
}

fn response_headers() -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert("location", HeaderValue::from_static("/payments/pay_0001"));
    headers.insert(
        HeaderName::from_static("x-request-id"),
        HeaderValue::from_static("req-8e03978e"),
    );
    headers
}

fn responses(c: &mut Criterion) {
    let headers = response_headers();
    let marker = HeaderName::from_static("idempotent-replayed");
    let mut group = c.benchmark_group("response");
    for (name, size) in [("200 B", 200usize), ("64 KiB", 64 * 1024)] {
        let body = Bytes::from(vec![b'r'; size]);
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_function(format!("capture {name}"), |b| {
            b.iter(|| {
                StoredResponse::capture(
                    StatusCode::CREATED,
                    black_box(&headers),
                    black_box(body.clone()),
                    None,
                )
            })
        });
        let stored = StoredResponse::capture(StatusCode::CREATED, &headers, body.clone(), None);
        let encoded = stored.encode();
        assert_eq!(StoredResponse::decode(&encoded).expect("decodes"), stored);
        group.bench_function(format!("encode {name}"), |b| {
            b.iter(|| black_box(&stored).encode())
        });
        group.bench_function(format!("decode {name}"), |b| {
            b.iter(|| StoredResponse::decode(black_box(&encoded)))
        });
        let replay = stored.replay(&marker);
        assert_eq!(replay.body(), &body);
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(replay.headers()["content-length"], size.to_string());
        group.bench_function(format!("replay {name}"), |b| {
            b.iter(|| black_box(&stored).replay(&marker))
        });
    }
    group.finish();
}

static NEXT_KEY: AtomicU64 = AtomicU64::new(0);

/// One new key's life: claim (acquired), complete (stored), claim again
/// (completed, with the stored response).
async fn round_trip<S: Store>(store: &S, response: &StoredResponse) {
    let key = format!("micro-{}", NEXT_KEY.fetch_add(1, Ordering::Relaxed));
    let id = RecordId::new("bench", key);
    let request = |token| {
        ClaimRequest::new(id.clone(), Fingerprint([7; 32]), token)
            .with_lease(Duration::from_secs(60))
            .with_ttl(Duration::from_secs(600))
    };
    let token = FencingToken::random();
    let claim = store.claim(request(token)).await.expect("claim");
    assert_eq!(claim, Claim::Acquired { taken_over: false });
    let completion = store
        .complete(id.clone(), token, response.clone())
        .await
        .expect("complete");
    assert_eq!(completion, Completion::Stored);
    match store
        .claim(request(FencingToken::random()))
        .await
        .expect("claim")
    {
        Claim::Refused(Refusal::Completed(stored)) => assert_eq!(stored.body, response.body),
        other => panic!("expected the completed record, got {other:?}"),
    }
}

fn stores(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let response = StoredResponse {
        status: StatusCode::CREATED,
        headers: vec![(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        body: StoredBody::Complete(Bytes::from_static(
            br#"{"id":"pay_0001","amount":500,"currency":"EUR","status":"succeeded"}"#,
        )),
        trailers: None,
    };
    let mut group = c.benchmark_group("store round trip");
    // Every iteration records a new key, beyond the default capacity.
    let memory = MemoryStore::with_max_records(usize::MAX);
    group.bench_function("memory", |b| {
        b.iter(|| rt.block_on(round_trip(&memory, &response)))
    });
    let dir = tempfile::tempdir().expect("a temporary directory");
    for (name, synchronous) in [("normal", Synchronous::Normal), ("full", Synchronous::Full)] {
        let path = dir.path().join(format!("micro-{name}.sqlite3"));
        let store = rt
            .block_on(SqliteStore::builder(&path).synchronous(synchronous).open())
            .expect("open SQLite");
        group.bench_function(format!("sqlite {name}"), |b| {
            b.iter(|| rt.block_on(round_trip(&store, &response)))
        });
    }
    #[cfg(feature = "postgres")]
    {
        let url = std::env::var("TOWER_IDEMPOTENCY_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
        let table = format!("bench_micro_{}", std::process::id());
        let store = rt
            .block_on(
                tower_idempotency_postgres::PostgresStore::builder(&url)
                    .table(table.clone())
                    .open(),
            )
            .unwrap_or_else(|e| panic!("PostgreSQL at {url}: {e}"));
        group.bench_function("postgres", |b| {
            b.iter(|| rt.block_on(round_trip(&store, &response)))
        });
        rt.block_on(async {
            let client = store.pool().get().await.expect("a connection");
            client
                .batch_execute(&format!("DROP TABLE {table}"))
                .await
                .expect("drop the bench table");
        });
    }
    #[cfg(feature = "redis")]
    {
        let url = std::env::var("TOWER_IDEMPOTENCY_REDIS_URL")
            .unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let store = rt
            .block_on(
                tower_idempotency_redis::RedisStore::builder(url.clone())
                    .prefix(format!("bench-micro-{}:", std::process::id()))
                    .open(),
            )
            .unwrap_or_else(|e| panic!("Redis at {url}: {e}"));
        group.bench_function("redis", |b| {
            b.iter(|| rt.block_on(round_trip(&store, &response)))
        });
    }
    group.finish();
}

/// A new key claimed in a transaction on the SQLite writer.
async fn claim_in_transaction(store: &SqliteStore) -> SqliteTransaction {
    let key = format!("hand-off-{}", NEXT_KEY.fetch_add(1, Ordering::Relaxed));
    let request = ClaimRequest::new(
        RecordId::new("bench", key),
        Fingerprint([7; 32]),
        FencingToken::random(),
    )
    .with_lease(Duration::from_secs(60))
    .with_ttl(Duration::from_secs(600));
    match store.claim_in_transaction(request).await.expect("claim") {
        TransactionClaim::Acquired { transaction, .. } => transaction,
        TransactionClaim::Refused(refusal) => panic!("a new key was refused: {refusal:?}"),
    }
}

/// What a transactional request pays in hand-offs to `SqliteStore`'s writer
/// thread, one request at a time, from a task on a runtime worker (as the
/// layer runs): the claim and the commit (with its fsync at `FULL`), the
/// same with one empty `SqliteTransaction::run` between them, and an empty
/// `run` alone (one round trip to the writer and back, no SQL, no sync).
fn sqlite_hand_offs(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::tempdir().expect("a temporary directory");
    let store = rt
        .block_on(SqliteStore::builder(dir.path().join("hand-offs.sqlite3")).open())
        .expect("open SQLite");
    let response = StoredResponse {
        status: StatusCode::CREATED,
        headers: Vec::new(),
        body: StoredBody::Complete(Bytes::from_static(b"{}")),
        trailers: None,
    };
    // `iters` requests in one task on the worker, timed there: each a new
    // claim, `runs` empty runs and the commit; or, without `claims`, `runs`
    // empty runs on one transaction held throughout.
    let timed = |iters: u64, runs: u64, claims: bool| {
        let store = store.clone();
        let response = response.clone();
        rt.block_on(async move {
            tokio::spawn(async move {
                let held = if claims {
                    None
                } else {
                    Some(claim_in_transaction(&store).await)
                };
                let start = Instant::now();
                for _ in 0..iters {
                    let transaction = match &held {
                        Some(transaction) => transaction.clone(),
                        None => claim_in_transaction(&store).await,
                    };
                    for _ in 0..runs {
                        transaction.run(|_| Ok(())).await.expect("run");
                    }
                    if claims {
                        let completion = store.commit(&transaction, response.clone()).await;
                        assert_eq!(completion.expect("commit"), Completion::Stored);
                    }
                }
                let elapsed = start.elapsed();
                if let Some(transaction) = held {
                    store.rollback(&transaction);
                }
                elapsed
            })
            .await
            .expect("the timed task")
        })
    };
    let mut group = c.benchmark_group("sqlite hand-offs");
    group.bench_function("claim, commit", |b| {
        b.iter_custom(|iters| timed(iters, 0, true))
    });
    group.bench_function("claim, an empty run, commit", |b| {
        b.iter_custom(|iters| timed(iters, 1, true))
    });
    group.bench_function("an empty run", |b| {
        b.iter_custom(|iters| timed(iters, 1, false))
    });
    group.finish();
}

criterion_group!(
    benches,
    key_parsing,
    fingerprinting,
    responses,
    stores,
    sqlite_hand_offs
);
criterion_main!(benches);
