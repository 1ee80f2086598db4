//! How long after a first request's completion a repeat waiting on another
//! server answers (issue 22: waiters on other servers are woken by the
//! store). Two "servers" in one process: two axum routers, each with its own
//! layer (so its own waiters) over its own store handle (its own
//! connections) to one PostgreSQL database or one Redis.
//!
//! ```text
//! cargo run --release -p integration --example wake --all-features -- [--runs 200]
//! ```
//!
//! Each run: the first request of a fresh key runs on server A and is held
//! in its handler; a repeat on server B meets the key in flight and waits;
//! after a delay spread over 0-299 ms (so that polling is met at every
//! phase of its backoff) the handler answers. Measured: from the moment A's
//! client has its response to the moment B's client has the replay
//! (negative when B answers first: A's completion is committed before A's
//! response leaves the layer). Prints p50, p99 and max per store: PostgreSQL
//! without the signal (polling 5 ms doubling to 100 ms), PostgreSQL with
//! `NOTIFY` (`PostgresStore`, and `SqlxPostgresStore` with the feature
//! `sqlx-postgres`), Redis with `PUBLISH`. URLs from `TOWER_IDEMPOTENCY_POSTGRES_URL`
//! and `TOWER_IDEMPOTENCY_REDIS_URL` (defaults: the local services).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::routing::post;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tower::ServiceExt;
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::{Claim, FencingToken, Refusal, Store};
use tower_idempotency::test_util::WatchClaims;
use tower_idempotency_postgres::PostgresStore;
use tower_idempotency_redis::RedisStore;

#[derive(Clone)]
struct Gate {
    entered: Arc<AtomicUsize>,
    open: Arc<Semaphore>,
}

async fn credit(State(gate): State<Gate>, headers: HeaderMap) -> (StatusCode, &'static str) {
    if headers.contains_key("x-gate") {
        gate.entered.fetch_add(1, Ordering::SeqCst);
        gate.open.acquire().await.unwrap().forget();
    }
    (StatusCode::CREATED, "done")
}

fn request(key: &str, gated: bool) -> Request<Body> {
    let mut builder = Request::post("/credit").header("idempotency-key", format!("\"{key}\""));
    if gated {
        builder = builder.header("x-gate", "1");
    }
    builder.body(Body::from("{}")).unwrap()
}

async fn until(mut condition: impl FnMut() -> bool) {
    while !condition() {
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
}

/// Signed microseconds from the first's answer to the waiter's, per run.
async fn measure<St: Store>(a: St, b: St, runs: usize) -> Vec<i64> {
    let gate = Gate {
        entered: Arc::default(),
        open: Arc::new(Semaphore::new(0)),
    };
    let in_flight = Arc::new(AtomicUsize::new(0));
    let seen = in_flight.clone();
    let b = WatchClaims::new(b, move |claim: &Claim| {
        if let Claim::Refused(Refusal::InFlight { .. }) = claim {
            seen.fetch_add(1, Ordering::SeqCst);
        }
    });
    let server_a = Router::new()
        .route("/credit", post(credit))
        .route_layer(IdempotencyLayer::new(a, GlobalScope))
        .with_state(gate.clone());
    let server_b = Router::new()
        .route("/credit", post(credit))
        .route_layer(IdempotencyLayer::new(b, GlobalScope).wait_in_flight(Duration::from_secs(10)))
        .with_state(gate.clone());
    let run_id = FencingToken::random().0;
    let mut out = Vec::with_capacity(runs);
    for i in 0..runs {
        let key = format!("wake-{run_id:x}-{i}");
        let entered = gate.entered.load(Ordering::SeqCst);
        let first = tokio::spawn(server_a.clone().oneshot(request(&key, true)));
        until(|| gate.entered.load(Ordering::SeqCst) > entered).await;
        let claims = in_flight.load(Ordering::SeqCst);
        let repeat = tokio::spawn(server_b.clone().oneshot(request(&key, false)));
        // The repeat's claim and its waiter's first claim met the key in flight.
        until(|| in_flight.load(Ordering::SeqCst) >= claims + 2).await;
        tokio::time::sleep(Duration::from_millis((i as u64 * 7919) % 300)).await;
        gate.open.add_permits(1);
        let first = async {
            let response = first.await.unwrap().unwrap();
            assert_eq!(response.status(), StatusCode::CREATED);
            Instant::now()
        };
        let repeat = async {
            let response = repeat.await.unwrap().unwrap();
            assert_eq!(response.status(), StatusCode::CREATED);
            assert_eq!(response.headers()["idempotent-replayed"], "true");
            Instant::now()
        };
        let (t_first, t_repeat) = tokio::join!(first, repeat);
        out.push(if t_repeat >= t_first {
            (t_repeat - t_first).as_micros() as i64
        } else {
            -((t_first - t_repeat).as_micros() as i64)
        });
    }
    out
}

fn report(name: &str, mut us: Vec<i64>) {
    us.sort_unstable();
    let at = |q: f64| us[((us.len() as f64 * q).ceil() as usize).clamp(1, us.len()) - 1];
    let ms = |v: i64| v as f64 / 1000.0;
    println!(
        "{name:<34} runs {:>4}  p50 {:>7.2} ms  p99 {:>7.2} ms  max {:>7.2} ms",
        us.len(),
        ms(at(0.50)),
        ms(at(0.99)),
        ms(*us.last().unwrap())
    );
}

#[tokio::main]
async fn main() {
    let mut runs = 200;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--runs" => runs = args.next().and_then(|n| n.parse().ok()).expect("--runs N"),
            other => panic!("unknown argument {other}"),
        }
    }
    let pg = std::env::var("TOWER_IDEMPOTENCY_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let redis = std::env::var("TOWER_IDEMPOTENCY_REDIS_URL")
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let table = format!("wake_bench_{:08x}", FencingToken::random().0 >> 32);
    let postgres = |notify: bool| {
        PostgresStore::builder(&pg)
            .table(table.clone())
            .notify_waiters(notify)
            .open()
    };
    let (a, b) = (
        postgres(false).await.unwrap(),
        postgres(false).await.unwrap(),
    );
    report("postgres, polling (no NOTIFY)", measure(a, b, runs).await);
    let (a, b) = (postgres(true).await.unwrap(), postgres(true).await.unwrap());
    report("postgres, LISTEN/NOTIFY", measure(a, b, runs).await);
    #[cfg(feature = "sqlx-postgres")]
    {
        use tower_idempotency_sqlx::SqlxPostgresStore;
        let sqlx_postgres = || async {
            let pool = sqlx::PgPool::connect(&pg).await.unwrap();
            SqlxPostgresStore::builder(pool)
                .table(table.clone())
                .notify_waiters(true)
                .open()
                .await
                .unwrap()
        };
        let (a, b) = (sqlx_postgres().await, sqlx_postgres().await);
        report(
            "sqlx postgres, PgListener/NOTIFY",
            measure(a, b, runs).await,
        );
    }
    let prefix = format!(
        "tower-idempotency-wake-bench:{:016x}:",
        FencingToken::random().0
    );
    let redis_store = || {
        RedisStore::builder(redis.clone())
            .prefix(prefix.clone())
            .open()
    };
    let (a, b) = (redis_store().await.unwrap(), redis_store().await.unwrap());
    report("redis, pub/sub", measure(a, b, runs).await);
}
