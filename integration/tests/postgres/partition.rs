//! A network partition between one app server and PostgreSQL, mid-request,
//! in separate mode: two ledger processes on one private cluster, ledger A
//! through a TCP proxy that, when cut, stops forwarding without closing
//! anything (the bytes wait, as they would in a partition), and heals later
//! (the held bytes then arrive).
//!
//! A claims the keys, then the proxy is cut before A's credits reach the
//! database. Retries on ledger B answer 409 until A's lease ends, then take
//! the keys over and credit each once, within the lease plus 5 s of the cut.
//! After the heal, A's late release of each record carries its old fencing
//! token and changes nothing: the records stay B's, and replay B's answers
//! byte for byte from either server. A abandoned its credit transaction
//! (half the lease, then its connection closed), so it never commits later:
//! exactly one credit per key.
//!
//! The same in transactional mode, where the fencing is inside A's commit.
//!
//! Needs PostgreSQL 15's server binaries, root, and the ledger example built
//! with the same features. Ports 15530..=15533 (clusters and proxies).

#![cfg(feature = "postgres")]

use crate::driver;
use crate::pgcluster;

use std::path::Path;
use std::time::{Duration, Instant};

use driver::{Ledger, request, request_within};
use pgcluster::{PgCluster, wait_until};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const LEASE_SECS: u64 = 3;
const KEYS: usize = 4;

/// A TCP proxy on 127.0.0.1:`port` to 127.0.0.1:`upstream`. `cut` makes
/// every connection, old and new, hold what it reads instead of passing it
/// on; `heal` passes on what was held, and everything after.
struct Proxy {
    forwarding: watch::Sender<bool>,
    _runtime: tokio::runtime::Runtime,
}

impl Proxy {
    fn start(port: u16, upstream: u16) -> Proxy {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (forwarding, watch) = watch::channel(true);
        let listener = runtime
            .block_on(TcpListener::bind(("127.0.0.1", port)))
            .unwrap_or_else(|e| panic!("proxy port {port}: {e}"));
        runtime.spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let watch = watch.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                        return;
                    };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(pipe(cr, sw, watch.clone()), pipe(sr, cw, watch));
                });
            }
        });
        Proxy {
            forwarding,
            _runtime: runtime,
        }
    }

    fn cut(&self) {
        self.forwarding.send_replace(false);
    }

    fn heal(&self) {
        self.forwarding.send_replace(true);
    }
}

/// Copies `from` to `to`, each chunk only once forwarding is on.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut forwarding: watch::Receiver<bool>,
) {
    let mut buf = vec![0; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => 0,
            Ok(n) => n,
        };
        if forwarding.wait_for(|on| *on).await.is_err() {
            return;
        }
        if n == 0 {
            let _ = to.shutdown().await;
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[test]
fn a_cut_off_server_never_causes_a_second_credit_in_separate_mode() {
    cut_off_mid_request("separate", 15530);
}

/// Transactional mode: A's claim, credit and completion share one
/// transaction (one phase, `PostgresStore`'s default), so the claim holds
/// the key until the server ends A's idle session
/// (`idle_in_transaction_session_timeout`, the max hold, 60 s, + 1 s): B's
/// retries get 409 until then, not a lease, then credit once. A's
/// statements arriving after the heal cannot commit a second credit.
#[test]
fn a_cut_off_server_never_causes_a_second_credit_in_transactional_mode() {
    cut_off_mid_request("transactional", 15532);
}

/// `port`: the cluster's; the proxy's is the next one.
fn cut_off_mid_request(mode: &str, port: u16) {
    let cluster = PgCluster::init(port, "", "host all all 127.0.0.1/32 trust\n");
    cluster.start();
    let proxy = Proxy::start(port + 1, cluster.port);
    let db = |port: u16| format!("postgres://postgres@127.0.0.1:{port}/postgres");
    let binary = driver::ledger_beside_tests();
    let a = Ledger::start(&binary, Path::new(&db(port + 1)), mode, LEASE_SECS);
    let b = Ledger::start(&binary, Path::new(&db(cluster.port)), mode, LEASE_SECS);

    let created = request(
        b.addr,
        "POST",
        "/accounts",
        &[("idempotency-key", "setup-account")],
        r#"{"name":"partition"}"#,
    )
    .unwrap();
    assert_eq!(created.status, 201, "{}", created.body);
    let account: i64 = serde_json::from_str::<serde_json::Value>(&created.body).unwrap()["id"]
        .as_i64()
        .unwrap();
    let path = format!("/accounts/{account}/credits");
    let amount = |i: usize| 100 * (i as i64 + 1);

    // A claims every key; its handlers wait 1 s before crediting.
    let on_a: Vec<_> = (0..KEYS)
        .map(|i| {
            let (addr, path) = (a.addr, path.clone());
            std::thread::spawn(move || {
                // Answered after the heal: past a minute in transactional
                // mode (the max hold).
                request_within(
                    Duration::from_secs(180),
                    addr,
                    "POST",
                    &path,
                    &[
                        ("idempotency-key", &format!("partition-{i}")),
                        ("x-ledger-delay-ms", "1000"),
                    ],
                    &format!(r#"{{"amount":{}}}"#, amount(i)),
                )
            })
        })
        .collect();
    // Separate mode: A's claims committed. Transactional: A's sessions
    // idle in their transactions, right after the claim.
    let claimed = match mode {
        "separate" => {
            "SELECT count(*) FROM idempotency_records WHERE key LIKE 'partition-%' AND state = 'in_flight'"
        }
        _ => {
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' AND query LIKE '%lock_timeout TO DEFAULT%'"
        }
    };
    wait_until(
        Duration::from_secs(10),
        "A's claims in the database",
        || cluster.psql(claimed) == KEYS.to_string(),
    );
    proxy.cut();
    let cut_at = Instant::now();

    // Retries on B: 409 while A's lease runs, then B takes each key over.
    // The key is free once A's lease ends, or (transactional) once the
    // server ends A's idle session: the default max hold (60 s) + 1 s.
    let free_after = match mode {
        "separate" => LEASE_SECS,
        _ => 61,
    };
    let limit = Duration::from_secs(free_after + 5);
    let mut answers_on_b = Vec::new();
    let mut slowest = Duration::ZERO;
    for i in 0..KEYS {
        let answer = loop {
            let answer = request(
                b.addr,
                "POST",
                &path,
                &[("idempotency-key", &format!("partition-{i}"))],
                &format!(r#"{{"amount":{}}}"#, amount(i)),
            )
            .expect("B answers");
            if answer.status == 201 {
                break answer;
            }
            assert_eq!(answer.status, 409, "{}", answer.body);
            assert!(
                cut_at.elapsed() < limit,
                "key {i}: B's retry did not complete within {free_after} + 5 s of the cut"
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        slowest = slowest.max(cut_at.elapsed());
        assert!(!answer.replayed, "key {i}: B ran it");
        answers_on_b.push(answer.body);
    }
    assert_eq!(
        cluster.psql(&format!(
            "SELECT count(*) || ' ' || sum(amount) FROM credits WHERE account_id = {account}"
        )),
        format!("{KEYS} {}", (0..KEYS).map(amount).sum::<i64>()),
        "one credit per key while A is cut off"
    );

    // Heal: A's held statements and its late release arrive now.
    proxy.heal();
    for (i, handle) in on_a.into_iter().enumerate() {
        let answer = handle.join().unwrap().expect("A answers once healed");
        assert_eq!(
            answer.status, 503,
            "key {i}: A must not have credited: {}",
            answer.body
        );
    }
    // A's late release was fenced: the records are B's, completed.
    assert_eq!(
        cluster.psql(
            "SELECT count(*) FROM idempotency_records WHERE key LIKE 'partition-%' AND state = 'completed'"
        ),
        KEYS.to_string()
    );
    for (i, original) in answers_on_b.iter().enumerate() {
        for server in [&a, &b] {
            let again = request(
                server.addr,
                "POST",
                &path,
                &[("idempotency-key", &format!("partition-{i}"))],
                &format!(r#"{{"amount":{}}}"#, amount(i)),
            )
            .unwrap();
            assert_eq!((again.status, again.replayed), (201, true), "key {i}");
            assert_eq!(&again.body, original, "key {i}: the replay differs");
        }
    }
    // Still exactly one credit per key, now that A is back.
    let per_key = cluster.psql(&format!(
        "SELECT amount || ':' || count(*) FROM credits WHERE account_id = {account} GROUP BY amount ORDER BY amount"
    ));
    let expected: Vec<String> = (0..KEYS).map(|i| format!("{}:1", amount(i))).collect();
    assert_eq!(per_key.lines().collect::<Vec<_>>(), expected);
    eprintln!(
        "partition ({mode} mode): {KEYS} keys, lease {LEASE_SECS} s; every retry on B completed within {:.2} s of the cut; credits per key: {per_key:?}",
        slowest.as_secs_f64()
    );
}
