//! `PostgresStore` over TLS (feature `postgres-tls`) on private clusters that
//! each test starts itself: a CA and a server certificate made here, `ssl =
//! on`, and a `pg_hba.conf` with only `hostssl` lines. Needs PostgreSQL 15's
//! server binaries and root (the clusters run as the `postgres` user); a
//! missing binary fails the test.
//!
//! Ports 15510..=15513 (127.0.0.1).

#![cfg(feature = "postgres-tls")]

use crate::common;
use crate::driver;
use crate::pgcluster;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::routing::post;
use pgcluster::{PgCluster, TestCa};
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::FencingToken;
use tower_idempotency::test_util::{ClockOffset, ManualClock, run, suite};
use tower_idempotency::{IdempotencyLayer, StoreError};
use tower_idempotency_postgres::PostgresStore;

const HBA_TLS_ONLY: &str = "hostssl all all 127.0.0.1/32 trust\n";

/// A cluster that speaks only TLS, with a certificate for `localhost` signed
/// by a CA of its own; `ca.pem` (that CA) and `other-ca.pem` (a CA that
/// signed nothing here) are written beside it.
struct TlsCluster {
    cluster: PgCluster,
    ca: PathBuf,
    other_ca: PathBuf,
}

impl TlsCluster {
    fn start(port: u16) -> TlsCluster {
        let cluster = PgCluster::init(
            port,
            "ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n",
            HBA_TLS_ONLY,
        );
        let ca = TestCa::new("tower-idempotency test CA");
        let (cert, key) = ca.server(&["localhost"]);
        cluster.write_private("server.crt", &cert);
        cluster.write_private("server.key", &key);
        let ca_path = cluster.dir().join("ca.pem");
        std::fs::write(&ca_path, &ca.cert_pem).unwrap();
        let other_ca = cluster.dir().join("other-ca.pem");
        std::fs::write(&other_ca, TestCa::new("some other CA").cert_pem).unwrap();
        cluster.start();
        TlsCluster {
            cluster,
            ca: ca_path,
            other_ca,
        }
    }

    /// A URL naming the host `host` (reached at 127.0.0.1 whatever the
    /// name) with `params` after it.
    fn url(&self, host: &str, params: &str) -> String {
        format!(
            "postgres://postgres@{host}:{}/postgres?hostaddr=127.0.0.1&{params}",
            self.cluster.port
        )
    }
}

fn table() -> String {
    format!("idem_tls_{:016x}", FencingToken::random().0)
}

/// Whether the store's pooled connection is encrypted, by the server's own
/// account (`pg_stat_ssl`).
async fn encrypted(store: &PostgresStore) -> bool {
    let client = store.pool().get().await.unwrap();
    client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// The error of opening `url`, which must fail.
async fn open_error(url: &str) -> StoreError {
    match PostgresStore::builder(url).table(table()).open().await {
        Ok(_) => panic!("{url} must not connect"),
        Err(e) => e,
    }
}

#[test]
fn verify_full_passes_the_store_suite() {
    let tls = TlsCluster::start(15510);
    let url = tls.url(
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={}", tls.ca.display()),
    );
    let make = |url: String| {
        move |clock: ManualClock| async move {
            let store = PostgresStore::builder(&url)
                .table(table())
                .clock_offset(ClockOffset(clock))
                .open()
                .await
                .unwrap_or_else(|e| panic!("verify-full must connect: {e}"));
            assert!(encrypted(&store).await, "the session must be TLS");
            (store, ())
        }
    };
    run(make(url.clone()), suite::new_key_is_acquired);
    run(make(url.clone()), suite::completed_record_is_replayed);
    run(make(url.clone()), suite::mismatch_is_checked_first);
    run(make(url.clone()), suite::in_flight_reports_remaining_lease);
    run(
        make(url.clone()),
        suite::expired_lease_is_taken_over_and_fenced,
    );
    run(make(url.clone()), suite::release_needs_the_token);
    run(make(url.clone()), suite::completed_record_is_final);
    run(make(url.clone()), suite::record_past_ttl_is_new);
    run(make(url.clone()), suite::purge_removes_only_expired);
    run(make(url.clone()), suite::scopes_never_meet);
    run(make(url.clone()), suite::concurrent_claims_have_one_winner);
    run(make(url.clone()), suite::omitted_body_round_trips);
    run(
        make(url.clone()),
        suite::stepped_back_clock_lease_is_taken_over,
    );
    run(
        make(url.clone()),
        suite::counts_sort_every_record_into_one_kind,
    );
    run(make(url), suite::stuck_lists_ended_leases_oldest_first);
}

/// Claim, complete and replay through the layer in transactional mode, over
/// verify-full: the handler runs once, the replay has the same bytes.
#[tokio::test]
async fn verify_full_claims_completes_and_replays_through_the_layer() {
    let tls = TlsCluster::start(15511);
    let url = tls.url(
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={}", tls.ca.display()),
    );
    let store = PostgresStore::builder(&url)
        .table(table())
        .open()
        .await
        .unwrap();
    assert!(encrypted(&store).await);
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let app = Router::new()
        .route(
            "/items",
            post(|| async { format!("run {}", RUNS.fetch_add(1, Ordering::SeqCst) + 1) }),
        )
        .route_layer(IdempotencyLayer::new(store, GlobalScope).transactional());
    let addr = common::serve(app).await;
    let key: &[(&str, &[u8])] = &[("idempotency-key", b"tls-1")];
    let first = common::send(addr, "POST", "/items", key, b"{}").await;
    assert_eq!((first.status, first.replayed()), (200, false), "{first:?}");
    let again = common::send(addr, "POST", "/items", key, b"{}").await;
    assert_eq!((again.status, again.replayed()), (200, true), "{again:?}");
    assert_eq!(again.body, first.body);
    assert_eq!(again.stable_headers(), first.stable_headers());
    assert_eq!(
        (first.body.as_slice(), RUNS.load(Ordering::SeqCst)),
        (&b"run 1"[..], 1)
    );
}

#[tokio::test]
async fn a_wrong_ca_or_host_name_fails_at_start_up_naming_the_cause() {
    let tls = TlsCluster::start(15512);
    let (ca, other) = (tls.ca.display(), tls.other_ca.display());

    // A CA that did not sign the server's certificate.
    for mode in ["verify-full", "verify-ca", "require"] {
        let e =
            open_error(&tls.url("localhost", &format!("sslmode={mode}&sslrootcert={other}"))).await;
        assert!(matches!(e, StoreError::Unavailable(_)), "{e:?}");
        assert!(e.to_string().contains("unknown CA"), "{mode}: {e}");
    }

    // The certificate names `localhost`, not `127.0.0.1`: verify-full
    // refuses, verify-ca (chain only) accepts.
    let e = open_error(&tls.url(
        "127.0.0.1",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    ))
    .await;
    assert!(e.to_string().contains("host name mismatch"), "{e}");
    for params in [
        format!("sslmode=verify-ca&sslrootcert={ca}"),
        // libpq's require: encrypted, the certificate not checked.
        "sslmode=require".to_owned(),
        // prefer (also the default): TLS, since the server offers it.
        "sslmode=prefer".to_owned(),
        String::new(),
    ] {
        let store = PostgresStore::builder(&tls.url("127.0.0.1", &params))
            .table(table())
            .open()
            .await
            .unwrap_or_else(|e| panic!("{params}: {e}"));
        assert!(encrypted(&store).await, "{params}");
    }

    // Plain text against a hostssl-only server: refused by the server.
    let e = open_error(&tls.url("localhost", "sslmode=disable")).await;
    assert!(matches!(e, StoreError::Unavailable(_)), "{e:?}");
    assert!(e.to_string().contains("no encryption"), "{e}");

    // An sslrootcert that cannot be read is a configuration error.
    let missing = Path::new(&tls.cluster.dir().to_path_buf()).join("missing.pem");
    let e = open_error(&tls.url(
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={}", missing.display()),
    ))
    .await;
    assert!(matches!(e, StoreError::Config(_)), "{e:?}");
    assert!(e.to_string().contains("missing.pem"), "{e}");
}

#[tokio::test]
async fn require_against_a_server_without_tls_fails_naming_the_cause() {
    let plain = PgCluster::init(15513, "ssl = off\n", "host all all 127.0.0.1/32 trust\n");
    plain.start();
    let base = "postgres://postgres@localhost:15513/postgres?hostaddr=127.0.0.1";
    let ca = plain.dir().join("ca.pem");
    std::fs::write(&ca, TestCa::new("unused CA").cert_pem).unwrap();
    for mode in ["require", "verify-ca", "verify-full"] {
        let e = open_error(&format!(
            "{base}&sslmode={mode}&sslrootcert={}",
            ca.display()
        ))
        .await;
        assert!(matches!(e, StoreError::Unavailable(_)), "{e:?}");
        assert!(
            e.to_string().contains("the server does not support TLS"),
            "{mode}: {e}"
        );
    }
    // prefer falls back to plain text, as libpq does.
    let store = PostgresStore::builder(&format!("{base}&sslmode=prefer"))
        .table(table())
        .open()
        .await
        .unwrap();
    assert!(!encrypted(&store).await);
}

/// The ledger refuses to start on a URL whose CA is wrong: exit status 1 and
/// the cause on stderr. Needs the ledger built with the same features
/// (`cargo build --example ledger --features postgres-tls`, or the whole
/// `cargo test`).
#[test]
fn the_ledger_exits_non_zero_naming_the_cause() {
    let tls = TlsCluster::start(15514);
    let url = tls.url(
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={}", tls.other_ca.display()),
    );
    let out = std::process::Command::new(driver::ledger_beside_tests())
        .args(["--db", &url, "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("unknown CA"), "{stderr}");
    assert!(out.stdout.is_empty(), "it must not have listened");
}
