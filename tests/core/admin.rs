//! The operators' router (`admin` feature) over real HTTP: exact JSON for
//! each endpoint, 400 for a bad `limit`, 503 when the store fails.

#![cfg(feature = "admin")]

use crate::common;

use std::time::Duration;

use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::store::{ClaimRequest, FencingToken, RecordId, Store};
use tower_idempotency::test_util::ManualClock;
use tower_idempotency::{MemoryStore, SqliteStore, StoredResponse, admin};

const START_MS: i64 = 1_800_000_000_000;
const LEASE: Duration = Duration::from_secs(60);
const TTL: Duration = Duration::from_secs(3600);

async fn claim<S: Store>(store: &S, scope: &str, key: &str, fp: u8, ttl: Duration) -> FencingToken {
    let token = FencingToken::random();
    store
        .claim(
            ClaimRequest::new(RecordId::new(scope, key), Fingerprint([fp; 32]), token)
                .with_lease(LEASE)
                .with_ttl(ttl),
        )
        .await
        .unwrap();
    token
}

async fn get(addr: std::net::SocketAddr, path: &str) -> common::Raw {
    common::send(addr, "GET", path, &[], b"").await
}

fn assert_json(raw: &common::Raw, status: u16, content_type: &str, body: &str) {
    assert_eq!(raw.status, status, "{raw:?}");
    assert_eq!(
        raw.header_str("content-type"),
        Some(content_type),
        "{raw:?}"
    );
    assert_eq!(String::from_utf8_lossy(&raw.body), body);
}

/// Two stuck records (one claimed 10 s before the other), one in flight, one
/// completed and one past its TTL: the counts, the list and the purge.
#[tokio::test]
async fn stuck_counts_and_purge() {
    let clock = ManualClock::new(START_MS);
    let store = MemoryStore::with_clock(clock.clone());
    claim(&store, "alice", "k-1", 0xab, TTL).await;
    claim(&store, "bob", "short", 3, Duration::from_secs(30)).await;
    clock.advance(Duration::from_secs(10));
    claim(&store, "bob \"the\" builder", "k/2", 1, TTL).await;
    let token = claim(&store, "carol", "k-3", 2, TTL).await;
    let stored = StoredResponse::capture(
        http::StatusCode::CREATED,
        &http::HeaderMap::new(),
        bytes::Bytes::from_static(b"ok"),
        None,
    );
    store
        .complete(RecordId::new("carol", "k-3"), token, stored)
        .await
        .unwrap();
    // t0 + 75 s: alice's lease ended 15 s ago, bob's 5 s ago.
    clock.advance(Duration::from_secs(65));
    claim(&store, "dave", "k-4", 4, TTL).await;
    let addr = common::serve(admin::router(store.clone())).await;

    assert_json(
        &get(addr, "/records/counts").await,
        200,
        "application/json",
        r#"{"in_flight":1,"stuck":2,"completed":1,"expired":1}"#,
    );
    let alice = format!(
        r#"{{"scope":"alice","key":"k-1","fingerprint":"{}","lease_ended_ms_ago":15000,"ttl_remaining_ms":3525000}}"#,
        "ab".repeat(32)
    );
    let bob = format!(
        r#"{{"scope":"bob \"the\" builder","key":"k/2","fingerprint":"{}","lease_ended_ms_ago":5000,"ttl_remaining_ms":3535000}}"#,
        "01".repeat(32)
    );
    assert_json(
        &get(addr, "/records/stuck").await,
        200,
        "application/json",
        &format!("[{alice},{bob}]"),
    );
    assert_json(
        &get(addr, "/records/stuck?limit=1").await,
        200,
        "application/json",
        &format!("[{alice}]"),
    );
    assert_json(
        &get(addr, "/records/stuck?limit=1000").await,
        200,
        "application/json",
        &format!("[{alice},{bob}]"),
    );

    let purge = common::send(addr, "POST", "/records/purge", &[], b"").await;
    assert_json(&purge, 200, "application/json", r#"{"purged":1}"#);
    assert_eq!(store.len(), 4);
    let purge = common::send(addr, "POST", "/records/purge", &[], b"").await;
    assert_json(&purge, 200, "application/json", r#"{"purged":0}"#);
    assert_json(
        &get(addr, "/records/counts").await,
        200,
        "application/json",
        r#"{"in_flight":1,"stuck":2,"completed":1,"expired":0}"#,
    );
    // Purging changes state: GET is not allowed.
    assert_eq!(get(addr, "/records/purge").await.status, 405);
    assert_eq!(store.len(), 4);
}

#[tokio::test]
async fn an_empty_store_answers_empty() {
    let addr = common::serve(admin::router(MemoryStore::new())).await;
    assert_json(
        &get(addr, "/records/stuck").await,
        200,
        "application/json",
        "[]",
    );
    assert_json(
        &get(addr, "/records/counts").await,
        200,
        "application/json",
        r#"{"in_flight":0,"stuck":0,"completed":0,"expired":0}"#,
    );
}

#[tokio::test]
async fn a_bad_limit_is_a_400_problem() {
    let addr = common::serve(admin::router(MemoryStore::new())).await;
    let problem = |detail: &str| {
        format!(
            r#"{{"type":"about:blank","title":"Bad Request","status":400,"detail":"{detail}"}}"#
        )
    };
    let range = problem("limit must be an integer in 1..=1000");
    for query in [
        "limit=0",
        "limit=1001",
        "limit=-1",
        "limit=ten",
        "limit=",
        "limit=1%2E5",
    ] {
        let raw = get(addr, &format!("/records/stuck?{query}")).await;
        assert_json(&raw, 400, "application/problem+json", &range);
    }
    assert_json(
        &get(addr, "/records/stuck?limit=1&limit=2").await,
        400,
        "application/problem+json",
        &problem("limit must be given at most once"),
    );
    assert_json(
        &get(addr, "/records/stuck?limt=5").await,
        400,
        "application/problem+json",
        &problem(r#"unknown query parameter \"limt\"; only limit is accepted"#),
    );
}

/// A store that cannot answer (here: its table is gone) is a 503 problem on
/// every endpoint, never an empty answer.
#[tokio::test]
async fn a_failing_store_is_a_503_problem() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("records.sqlite3");
    let store = SqliteStore::open(&path).await.unwrap();
    tower_idempotency::rusqlite::Connection::open(&path)
        .unwrap()
        .execute_batch("DROP TABLE idempotency_records")
        .unwrap();
    let addr = common::serve(admin::router(store)).await;
    let body = r#"{"type":"https://docs.rs/tower-idempotency/latest/tower_idempotency/problem/#store-unavailable","title":"Idempotency store unavailable","status":503,"detail":"the idempotency store is busy or unreachable and did not answer in time; the request was not processed; retry with the same key"}"#;
    for (method, path) in [
        ("GET", "/records/stuck"),
        ("GET", "/records/counts"),
        ("POST", "/records/purge"),
    ] {
        let raw = common::send(addr, method, path, &[], b"").await;
        assert_json(&raw, 503, "application/problem+json", body);
        assert_eq!(raw.header_str("retry-after"), Some("1"), "{path}");
    }
}
