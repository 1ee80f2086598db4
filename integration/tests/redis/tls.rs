//! `RedisStore` over TLS (`rediss://`, feature `redis-tls`) to a private
//! `redis-server --tls-port 15640 --port 0` whose CA and certificate (for
//! `localhost` and 127.0.0.1) the test makes with the `openssl` CLI. The
//! store suite runs over it; a wrong CA, no CA (the system's roots), a host
//! the certificate does not name, and a plain `redis://` URL with a CA are
//! refused with errors that name the cause. Without `redis-server` or
//! `openssl` the tests fail.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use tower_idempotency::StoreError;
use tower_idempotency::store::{Claim, FencingToken, RecordId, Refusal, Store};
use tower_idempotency::test_util::{ClockOffset, ManualClock, claim_of, response, store_suite};
use tower_idempotency_redis::RedisStore;

const PORT: u16 = 15640;

/// The TLS server and the PEM files it was made with.
struct TlsRedis {
    server: Child,
    ca: Vec<u8>,
    other_ca: Vec<u8>,
    _dir: tempfile::TempDir,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("openssl is required on the PATH: {e}"));
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A self-signed CA `name.crt`/`name.key` (P-256).
fn make_ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            &format!("/CN={name}"),
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.crt"),
        ],
    );
}

impl TlsRedis {
    fn start() -> TlsRedis {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        make_ca(d, "ca");
        make_ca(d, "other-ca");
        openssl(
            d,
            &[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-subj",
                "/CN=localhost",
                "-keyout",
                "server.key",
                "-out",
                "server.csr",
            ],
        );
        std::fs::write(
            d.join("server.ext"),
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n\
             keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n",
        )
        .unwrap();
        openssl(
            d,
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "1",
                "-extfile",
                "server.ext",
                "-out",
                "server.crt",
            ],
        );
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", PORT)).is_ok() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "port {PORT} stays in use (a leftover redis-server?)"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let server = Command::new("redis-server")
            .current_dir(d)
            .args(["--port", "0", "--tls-port", &PORT.to_string()])
            // 127.0.0.2 too: a loopback address the certificate does not name.
            .args(["--bind", "127.0.0.1", "127.0.0.2"])
            .args([
                "--tls-cert-file",
                "server.crt",
                "--tls-key-file",
                "server.key",
            ])
            .args(["--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "no"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("redis-server is required on the PATH: {e}"));
        while std::net::TcpStream::connect(("127.0.0.1", PORT)).is_err() {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "redis-server --tls-port {PORT} did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        TlsRedis {
            server,
            ca: std::fs::read(d.join("ca.crt")).unwrap(),
            other_ca: std::fs::read(d.join("other-ca.crt")).unwrap(),
            _dir: dir,
        }
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
    }
}

static SHARED: Mutex<Weak<TlsRedis>> = Mutex::new(Weak::new());

/// The server, started by the first test that needs it and stopped after
/// the last.
async fn server() -> Arc<TlsRedis> {
    tokio::task::spawn_blocking(|| {
        let mut held = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(server) = held.upgrade() {
            return server;
        }
        let server = Arc::new(TlsRedis::start());
        *held = Arc::downgrade(&server);
        server
    })
    .await
    .unwrap()
}

fn url(host: &str) -> String {
    format!("rediss://{host}:{PORT}")
}

fn unique_prefix(what: &str) -> String {
    format!("ti-tls:{what}:{:016x}:", FencingToken::random().0)
}

async fn tls(clock: ManualClock) -> (RedisStore, Arc<TlsRedis>) {
    let server = server().await;
    let test = std::thread::current().name().unwrap_or("suite").to_owned();
    let store = RedisStore::builder(url("localhost"))
        .ca_certificate(server.ca.clone())
        .prefix(unique_prefix(&test))
        .clock_offset(ClockOffset(clock))
        .open()
        .await
        .unwrap();
    (store, server)
}

store_suite!(tls_store, tls, inspect);

/// By host name and by IP address (both in the certificate), a record is
/// claimed, completed and replayed over TLS.
#[tokio::test]
async fn rediss_with_the_ca_round_trips() {
    let server = server().await;
    for host in ["localhost", "127.0.0.1"] {
        let store = RedisStore::builder(url(host))
            .ca_certificate(server.ca.clone())
            .prefix(unique_prefix("round_trip"))
            .open()
            .await
            .unwrap_or_else(|e| panic!("{host}: {e}"));
        let token = FencingToken::random();
        assert_eq!(
            store.claim(claim_of("s", "k", 1, token)).await.unwrap(),
            Claim::Acquired { taken_over: false }
        );
        store
            .complete(RecordId::new("s", "k"), token, response(b"over tls"))
            .await
            .unwrap();
        assert_eq!(
            store
                .claim(claim_of("s", "k", 1, FencingToken::random()))
                .await
                .unwrap(),
            Claim::Refused(Refusal::Completed(response(b"over tls")))
        );
    }
}

fn unavailable_naming(err: StoreError, cause: &str) {
    match &err {
        StoreError::Unavailable(_) => assert!(err.to_string().contains(cause), "{err}"),
        other => panic!("expected Unavailable naming {cause}, got {other:?}"),
    }
}

/// A certificate that does not chain to the given CA (or, with no CA, to
/// the system's roots), or that does not name the host, fails `open`.
#[tokio::test]
async fn untrusted_certificates_fail_with_the_cause() {
    let server = server().await;
    let err = RedisStore::builder(url("localhost"))
        .ca_certificate(server.other_ca.clone())
        .open()
        .await
        .unwrap_err();
    unavailable_naming(err, "UnknownIssuer");
    let err = RedisStore::open(url("localhost")).await.unwrap_err();
    unavailable_naming(err, "UnknownIssuer");
    let err = RedisStore::builder(url("127.0.0.2"))
        .ca_certificate(server.ca.clone())
        .open()
        .await
        .unwrap_err();
    unavailable_naming(err, "certificate not valid for name \"127.0.0.2\"");
}

/// A CA with a plain `redis://` URL, or a CA that is no PEM certificate, is
/// a configuration error.
#[tokio::test]
async fn a_ca_needs_rediss_and_a_certificate() {
    let server = server().await;
    let err = RedisStore::builder(format!("redis://127.0.0.1:{PORT}"))
        .ca_certificate(server.ca.clone())
        .open()
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Config(_)), "{err:?}");
    let err = RedisStore::cluster_builder([url("localhost"), format!("redis://127.0.0.1:{PORT}")])
        .ca_certificate(server.ca.clone())
        .open()
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Config(_)), "{err:?}");
    let err = RedisStore::builder(url("localhost"))
        .ca_certificate(b"not a certificate".to_vec())
        .open()
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Config(_)), "{err:?}");
}
