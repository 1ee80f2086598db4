//! The ledger's `--admin-listen`: the operators' router on a second
//! listener, over the ledger's own store. A credit whose server is killed
//! mid-request shows up as stuck once its lease ends, and its retry takes it
//! over. Needs the ledger built with `--features admin` (the whole
//! `cargo test --all-features` builds it).

#![cfg(feature = "admin")]

use crate::driver;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use driver::request;

/// A ledger process with its two addresses; killed when dropped.
struct Ledger {
    child: Child,
    public: SocketAddr,
    admin: SocketAddr,
}

impl Ledger {
    fn start(db: &Path) -> Ledger {
        let mut child = Command::new(driver::ledger_beside_tests())
            .arg("--db")
            .arg(db)
            .args([
                "--mode",
                "separate",
                "--lease-secs",
                "1",
                "--fault-injection",
            ])
            .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the ledger");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut addr = |prefix: &str| -> SocketAddr {
            let line = lines.next().expect("a line").expect("stdout");
            line.strip_prefix(prefix)
                .unwrap_or_else(|| panic!("expected {prefix:?}, got {line:?}"))
                .parse()
                .unwrap()
        };
        let public = addr("listening on http://");
        let admin = addr("admin router on http://");
        Ledger {
            child,
            public,
            admin,
        }
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn admin(ledger: &Ledger, method: &str, path: &str) -> (u16, String) {
    let answer = request(ledger.admin, method, path, &[], "").expect("the admin router answers");
    (answer.status, answer.body)
}

/// Asks `path` until it answers `want`, for at most 10 s: for states the
/// ledger reaches in its own time (a request inside its handler, a lease of
/// the server's real clock ending).
fn until(ledger: &Ledger, path: &str, want: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = admin(ledger, "GET", path);
        assert_eq!(status, 200, "{body}");
        if want(&body) {
            return body;
        }
        assert!(
            Instant::now() < deadline,
            "{path} never matched; last {body}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

const CREDIT_KEY: &str = "\"credit-7\"";

fn credit(public: SocketAddr, pause: &str) -> Option<driver::Answer> {
    request(
        public,
        "POST",
        "/accounts/1/credits",
        &[
            ("authorization", "Bearer alice"),
            ("idempotency-key", CREDIT_KEY),
            ("x-ledger-pause-after-effect-ms", pause),
        ],
        r#"{"amount":5}"#,
    )
}

#[test]
fn a_crashed_credit_is_stuck_until_its_retry() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("ledger.sqlite3");
    let mut ledger = Ledger::start(&db);
    let created = request(
        ledger.public,
        "POST",
        "/accounts",
        &[
            ("authorization", "Bearer alice"),
            ("idempotency-key", "\"a-1\""),
        ],
        r#"{"name":"alice"}"#,
    )
    .unwrap();
    assert_eq!(created.status, 201, "{}", created.body);
    assert_eq!(
        admin(&ledger, "GET", "/records/counts"),
        (
            200,
            r#"{"in_flight":0,"stuck":0,"completed":1,"expired":0}"#.into()
        )
    );
    // The credit is written, then the handler pauses; the server dies there.
    let public = ledger.public;
    let held = std::thread::spawn(move || credit(public, "30000"));
    until(&ledger, "/records/counts", |b| {
        b == r#"{"in_flight":1,"stuck":0,"completed":1,"expired":0}"#
    });
    drop(ledger);
    assert!(held.join().unwrap().is_none(), "the killed server answered");
    ledger = Ledger::start(&db);
    // Its lease (1 s) ends by the server's clock: stuck.
    let body = until(&ledger, "/records/stuck", |b| b != "[]");
    let stuck: serde_json::Value = serde_json::from_str(&body).unwrap();
    let record = &stuck.as_array().unwrap()[..];
    assert_eq!(record.len(), 1, "{body}");
    // The ledger scopes by a hash of the bearer token, never the token.
    let digest = <sha2::Sha256 as sha2::Digest>::digest(b"alice");
    let tag: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(record[0]["scope"], format!("bearer:{tag}"));
    assert_eq!(record[0]["key"], "credit-7");
    assert_eq!(record[0]["fingerprint"].as_str().unwrap().len(), 64);
    let ago = record[0]["lease_ended_ms_ago"].as_u64().unwrap();
    let left = record[0]["ttl_remaining_ms"].as_u64().unwrap();
    // Default TTL 24 h, lease 1 s: the two add up to the difference.
    assert_eq!(ago + left, 86_400_000 - 1_000, "{body}");
    assert_eq!(
        admin(&ledger, "GET", "/records/counts"),
        (
            200,
            r#"{"in_flight":0,"stuck":1,"completed":1,"expired":0}"#.into()
        )
    );
    assert_eq!(
        admin(&ledger, "POST", "/records/purge"),
        (200, r#"{"purged":0}"#.into())
    );
    // The retry takes it over and completes it (separate mode: the credit
    // that committed before the crash is applied again, as documented).
    let retried = credit(ledger.public, "0").unwrap();
    assert_eq!(retried.status, 201, "{}", retried.body);
    assert_eq!(admin(&ledger, "GET", "/records/stuck"), (200, "[]".into()));
    assert_eq!(
        admin(&ledger, "GET", "/records/counts"),
        (
            200,
            r#"{"in_flight":0,"stuck":0,"completed":2,"expired":0}"#.into()
        )
    );
    // The public listener does not serve the admin routes.
    let public = request(ledger.public, "GET", "/records/counts", &[], "").unwrap();
    assert_eq!(public.status, 404);
}
