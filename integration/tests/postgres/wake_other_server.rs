//! Repeats waiting on another server are woken by the store: two layers
//! ("servers", each with its own waiters) over two store handles (their own
//! connections) to one PostgreSQL database or one Redis. PostgreSQL with
//! `PostgresStore` and, with the feature `sqlx-postgres`,
//! `SqlxPostgresStore` (each alone, and one waking the other on a shared
//! table). The first request
//! is held at a gate on server A; repeats on server B meet the key in
//! flight and wait; the gate opens. Server B polls only once a minute while
//! its store's signal is live, so every repeat answered within seconds,
//! after exactly one more claim, was woken by the store's announcement
//! (`NOTIFY`, `PUBLISH`), not by polling.

#![cfg(all(feature = "postgres", feature = "redis"))]

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::routing::post;
use common::waiting::{credit, post_key, replayed, server};
use common::{Harness, eventually, serve};
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::{Claim, FencingToken, RecordId, Refusal, Store, TransactionalStore};
use tower_idempotency::test_util::WatchClaims;
use tower_idempotency_postgres::PostgresStore;
use tower_idempotency_redis::RedisStore;

const REPEATS: usize = 3;

/// Server B's claims: all of them, and those answered "in flight".
#[derive(Clone, Default)]
struct Claims {
    all: Arc<AtomicUsize>,
    in_flight: Arc<AtomicUsize>,
}

impl Claims {
    fn counted<St: Store>(&self, store: St) -> impl Store {
        let claims = self.clone();
        WatchClaims::new(store, move |claim: &Claim| {
            claims.all.fetch_add(1, Ordering::SeqCst);
            if let Claim::Refused(Refusal::InFlight { .. }) = claim {
                claims.in_flight.fetch_add(1, Ordering::SeqCst);
            }
        })
    }
}

/// Starts server B's listener and waits until it is subscribed, so that
/// the repeats below trust the signal from their first wait on.
async fn listening<St: Store>(store: &St) {
    let watch = store
        .watch(&RecordId::new("warm-up", "k"))
        .expect("the store has a signal");
    eventually(Duration::from_secs(20), || watch.live().is_some()).await;
}

/// The first request on A, held; `REPEATS` on B, waiting; the gate opens.
/// `fail`: the first answers 500 and gives its key back, so one waiter runs
/// and the others replay it.
async fn woken_by_the_store<A: Store, B: Store>(a: A, b: B, fail: bool) {
    let h = Harness::default();
    let claims = Claims::default();
    let b = claims.counted(b);
    listening(&b).await;
    let addr_a = server(IdempotencyLayer::new(a, GlobalScope), &h).await;
    let addr_b = server(
        IdempotencyLayer::new(b, GlobalScope)
            .wait_in_flight(Duration::from_secs(120))
            .signalled_poll_interval(Duration::from_secs(60))
            .lease(Duration::from_secs(120)),
        &h,
    )
    .await;
    let mut entered = h.watch();
    let extra: &[(&str, &[u8])] = if fail {
        &[("x-gate", b"g"), ("x-fail", b"1")]
    } else {
        &[("x-gate", b"g")]
    };
    let extra: Vec<(&'static str, &'static [u8])> = extra.to_vec();
    let first = tokio::spawn(async move { post_key(addr_a, &extra).await });
    assert_eq!(entered.recv().await.as_deref(), Some("g"));
    let waiting: Vec<_> = (0..REPEATS)
        .map(|_| tokio::spawn(async move { post_key(addr_b, &[]).await }))
        .collect();
    // Each repeat claimed twice (its claim, and the waiter's first), in flight.
    eventually(Duration::from_secs(20), || {
        claims.in_flight.load(Ordering::SeqCst) >= 2 * REPEATS
    })
    .await;
    let opened = tokio::time::Instant::now();
    h.open("g");
    let first = first.await.unwrap();
    assert_eq!(first.status, if fail { 500 } else { 201 });
    let mut answers = Vec::new();
    for repeat in waiting {
        let repeat = repeat.await.unwrap();
        answers.push((repeat.status, replayed(&repeat), repeat.body));
    }
    // Woken, not polled: the next poll was a minute away.
    assert!(
        opened.elapsed() < Duration::from_secs(10),
        "{:?}",
        opened.elapsed()
    );
    answers.sort();
    if fail {
        // One waiter ran (run 2); the others waited for it and replay it.
        assert_eq!(h.runs(), 2);
        let mut expected = vec![(201, true, b"run 2".to_vec()); REPEATS - 1];
        expected.insert(0, (201, false, b"run 2".to_vec()));
        assert_eq!(answers, expected);
    } else {
        assert_eq!(h.runs(), 1);
        assert_eq!(answers, vec![(201, true, b"run 1".to_vec()); REPEATS]);
        // Two claims each while in flight, then one after the announcement.
        assert_eq!(claims.all.load(Ordering::SeqCst), 3 * REPEATS);
        assert_eq!(claims.in_flight.load(Ordering::SeqCst), 2 * REPEATS);
    }
}

async fn postgres_store(table: &str) -> PostgresStore {
    postgres_store_with(table, false).await
}

async fn postgres_store_with(table: &str, commit_claims_first: bool) -> PostgresStore {
    PostgresStore::builder(&common::services::postgres_url())
        .table(table)
        .notify_waiters(true)
        .commit_claims_first(commit_claims_first)
        .open()
        .await
        .unwrap()
}

async fn postgres_pair() -> (PostgresStore, PostgresStore) {
    let table = postgres_table();
    (postgres_store(&table).await, postgres_store(&table).await)
}

async fn redis_pair() -> (RedisStore, RedisStore) {
    let url = common::services::redis_url();
    let prefix = format!("tower-idempotency-wake:{:016x}:", FencingToken::random().0);
    let open = || {
        RedisStore::builder(url.clone())
            .prefix(prefix.clone())
            .open()
    };
    (open().await.unwrap(), open().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_notify_wakes_waiters_on_another_server() {
    let (a, b) = postgres_pair().await;
    woken_by_the_store(a, b, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_notify_of_a_release_wakes_waiters_on_another_server() {
    let (a, b) = postgres_pair().await;
    woken_by_the_store(a, b, true).await;
}

/// The first request on A in transactional mode, held; one repeat on B,
/// waiting; the gate opens: the announcement leaves with A's commit.
/// Server A's transactional request holds the key; server B's repeat waits
/// for it (`wait_in_flight`) and replays it once A commits. Where A's claim
/// commits first, B's claims meet it in flight and B waits for the
/// announcement (`NOTIFY`); where it lives in A's open transaction (one
/// phase), B's waiting claim waits on the uncommitted row in the database.
async fn woken_at_a_transactional_commit<A: TransactionalStore, B: Store>(a: A, b: B) {
    let h = Harness::default();
    let claims = Claims::default();
    let b = claims.counted(b);
    listening(&b).await;
    let one_phase = !a.claim_commits_first();
    let app = Router::new()
        .route("/credit", post(credit))
        .route_layer(
            IdempotencyLayer::new(a, GlobalScope)
                .require_key(true)
                .transactional(),
        )
        .with_state(h.clone());
    let addr_a = serve(app).await;
    let addr_b = server(
        IdempotencyLayer::new(b, GlobalScope)
            .wait_in_flight(Duration::from_secs(120))
            .signalled_poll_interval(Duration::from_secs(60))
            .lease(Duration::from_secs(120)),
        &h,
    )
    .await;
    let mut entered = h.watch();
    let first = tokio::spawn(async move { post_key(addr_a, &[("x-gate", b"g")]).await });
    assert_eq!(entered.recv().await.as_deref(), Some("g"));
    let repeat = tokio::spawn(async move { post_key(addr_b, &[]).await });
    if one_phase {
        // B's first claim is refused at once (1 ms); its waiting claim then
        // waits on A's uncommitted row.
        eventually(Duration::from_secs(20), || {
            claims.in_flight.load(Ordering::SeqCst) >= 1
        })
        .await;
        waiting_on_a_lock().await;
    } else {
        eventually(Duration::from_secs(20), || {
            claims.in_flight.load(Ordering::SeqCst) >= 2
        })
        .await;
    }
    let opened = tokio::time::Instant::now();
    h.open("g");
    assert_eq!(first.await.unwrap().status, 201);
    let repeat = repeat.await.unwrap();
    assert_eq!(
        (repeat.status, replayed(&repeat), repeat.body.as_slice()),
        (201, true, b"run 1".as_slice())
    );
    assert!(opened.elapsed() < Duration::from_secs(10));
    let (all, in_flight) = if one_phase { (2, 1) } else { (3, 2) };
    assert_eq!(claims.all.load(Ordering::SeqCst), all);
    assert_eq!(claims.in_flight.load(Ordering::SeqCst), in_flight);
    assert_eq!(h.runs(), 1);
}

/// Until a session of this test's database waits on a lock in an
/// `INSERT` (the barrier of a claim waiting on an uncommitted one).
async fn waiting_on_a_lock() {
    let (client, connection) =
        tokio_postgres::connect(&common::services::postgres_url(), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let waiting: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO wake_%'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if waiting > 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no claim waits on a lock"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn postgres_table() -> String {
    format!("wake_{:012x}", FencingToken::random().0 >> 16)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_notify_at_a_transactional_commit_wakes_waiters_on_another_server() {
    let table = postgres_table();
    let a = postgres_store_with(&table, true).await;
    woken_at_a_transactional_commit(a, postgres_store(&table).await).await;
}

/// One phase (the default): the waiting claim on the other server waits
/// on the uncommitted claim in the database, and replays at the commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_a_claim_inside_the_transaction_is_waited_for_on_another_server() {
    let (a, b) = postgres_pair().await;
    woken_at_a_transactional_commit(a, b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_publish_wakes_waiters_on_another_server() {
    let (a, b) = redis_pair().await;
    woken_by_the_store(a, b, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_publish_of_a_release_wakes_waiters_on_another_server() {
    let (a, b) = redis_pair().await;
    woken_by_the_store(a, b, true).await;
}

/// `SqlxPostgresStore` with `notify_waiters(true)`: the same announcements
/// as `PostgresStore`, heard through sqlx's `PgListener`.
#[cfg(feature = "sqlx-postgres")]
mod sqlx_postgres {
    use std::str::FromStr;

    use sqlx::PgPool;
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    use tower_idempotency_sqlx::SqlxPostgresStore;

    use super::*;

    /// A pool of its own (its own connections), its connections named
    /// `application_name` in `pg_stat_activity`.
    async fn pool(application_name: &str) -> PgPool {
        let options = PgConnectOptions::from_str(&common::services::postgres_url())
            .unwrap()
            .application_name(application_name);
        PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await
            .unwrap()
    }

    async fn sqlx_store(table: &str, application_name: &str) -> SqlxPostgresStore {
        sqlx_store_with(table, application_name, false).await
    }

    async fn sqlx_store_with(
        table: &str,
        application_name: &str,
        commit_claims_first: bool,
    ) -> SqlxPostgresStore {
        SqlxPostgresStore::builder(pool(application_name).await)
            .table(table)
            .notify_waiters(true)
            .commit_claims_first(commit_claims_first)
            .open()
            .await
            .unwrap()
    }

    async fn sqlx_pair() -> (SqlxPostgresStore, SqlxPostgresStore) {
        let table = postgres_table();
        (
            sqlx_store(&table, "wake-a").await,
            sqlx_store(&table, "wake-b").await,
        )
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn notify_wakes_waiters_on_another_server() {
        let (a, b) = sqlx_pair().await;
        woken_by_the_store(a, b, false).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn notify_of_a_release_wakes_waiters_on_another_server() {
        let (a, b) = sqlx_pair().await;
        woken_by_the_store(a, b, true).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn notify_at_a_transactional_commit_wakes_waiters_on_another_server() {
        let table = postgres_table();
        let a = sqlx_store_with(&table, "wake-a", true).await;
        woken_at_a_transactional_commit(a, sqlx_store(&table, "wake-b").await).await;
    }

    /// One phase (the default): the waiting claim waits on the uncommitted
    /// claim in the database, and replays at the commit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_claim_inside_the_transaction_is_waited_for_on_another_server() {
        let (a, b) = sqlx_pair().await;
        woken_at_a_transactional_commit(a, b).await;
    }

    /// One table, both PostgreSQL stores: `PostgresStore`'s completion
    /// wakes `SqlxPostgresStore`'s waiters, and the other way round.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn postgres_store_and_sqlx_store_wake_each_other() {
        let table = postgres_table();
        let (a, b) = (
            postgres_store(&table).await,
            sqlx_store(&table, "wake-b").await,
        );
        woken_by_the_store(a, b, false).await;
        let table = postgres_table();
        let (a, b) = (
            sqlx_store(&table, "wake-a").await,
            postgres_store(&table).await,
        );
        woken_at_a_transactional_commit(a, b).await;
    }

    /// The listener's connection is killed: the listener connects again
    /// (a new generation of the feed), and the next completion still wakes
    /// the waiters at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_listener_reconnects_after_its_connection_is_killed() {
        let table = postgres_table();
        let name = format!("wake-listen-{:012x}", FencingToken::random().0 >> 16);
        let a = sqlx_store(&table, "wake-a").await;
        let b = sqlx_store(&table, &name).await;
        let watch = b
            .watch(&RecordId::new("warm-up", "k"))
            .expect("the store has a signal");
        eventually(Duration::from_secs(20), || watch.live().is_some()).await;
        let generation = watch.live().unwrap();
        let admin = pool("wake-admin").await;
        let killed: i64 = sqlx::query_scalar(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
             WHERE application_name = $1 AND query LIKE 'LISTEN%'",
        )
        .bind(&name)
        .fetch_one(&admin)
        .await
        .unwrap();
        assert_eq!(killed, 1, "the one listener of store B");
        eventually(Duration::from_secs(20), || {
            watch.live() == Some(generation + 1)
        })
        .await;
        drop(watch);
        woken_by_the_store(a, b, false).await;
    }
}
