//! The ledger's refusals, over real HTTP, in both modes on SQLite: an `{id}`
//! that is not a decimal integer, whatever its bytes, is an unknown account
//! (404 problem+json, never axum's `400 text/plain`), and a refusal given
//! before any effect is not stored: its retry is answered afresh, never
//! replayed, and the corrected request runs with the same key. A body sent
//! with a `Content-Encoding` is refused 415.

use crate::driver;

use driver::{Answer, Ledger, request};

const NO_SUCH_ACCOUNT: &str =
    r#"{"detail":"no such account","status":404,"title":"Not Found","type":"about:blank"}"#;

fn post(ledger: &Ledger, path: &str, key: &str, body: &str) -> Answer {
    request(ledger.addr, "POST", path, &[("idempotency-key", key)], body)
        .expect("the ledger answers")
}

fn balance(ledger: &Ledger, id: &str) -> String {
    request(ledger.addr, "GET", &format!("/accounts/{id}"), &[], "")
        .expect("the ledger answers")
        .body
}

fn refusals_in(mode: &str) {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::start(
        &driver::ledger_beside_tests(),
        &dir.path().join("ledger.sqlite3"),
        mode,
        5,
    );
    let account = post(&ledger, "/accounts", r#""a""#, r#"{"name":"a"}"#);
    assert_eq!(account.status, 201, "{}", account.body);

    // Not UTF-8, not decimal, out of i64's range: each names no account.
    for id in ["%FF", "%C3%28", "abc", "1.5", "99999999999999999999"] {
        let got = request(ledger.addr, "GET", &format!("/accounts/{id}"), &[], "").unwrap();
        assert_eq!(
            (got.status, got.body.as_str()),
            (404, NO_SUCH_ACCOUNT),
            "GET {id}"
        );
        for attempt in 0..2 {
            let got = post(
                &ledger,
                &format!("/accounts/{id}/credits"),
                &format!("\"{id}\""),
                r#"{"amount":5}"#,
            );
            assert_eq!(
                (got.status, got.replayed, got.body.as_str()),
                (404, false, NO_SUCH_ACCOUNT),
                "POST credit to {id}, attempt {attempt}"
            );
        }
    }

    // A body with a Content-Encoding the ledger does not decode: 415
    // problem+json, not stored (issue 36, item 6; it was 400 "invalid JSON").
    let path = "/accounts/1/credits";
    for _ in 0..2 {
        let headers = [
            ("idempotency-key", r#""c-1""#),
            ("content-encoding", "gzip"),
        ];
        let refused = request(ledger.addr, "POST", path, &headers, r#"{"amount":5}"#).unwrap();
        assert_eq!(
            (refused.status, refused.replayed),
            (415, false),
            "{}",
            refused.body
        );
        assert!(refused.body.contains(r#""status":415"#), "{}", refused.body);
    }

    // A malformed body, then the corrected body with the same key: it runs once.
    for _ in 0..2 {
        let refused = post(&ledger, path, r#""c-1""#, r#"{"amount":"five"}"#);
        assert_eq!(
            (refused.status, refused.replayed),
            (400, false),
            "{}",
            refused.body
        );
        assert!(
            refused.body.contains(r#""type":"about:blank""#),
            "{}",
            refused.body
        );
    }
    let out_of_range = post(&ledger, path, r#""c-1""#, r#"{"amount":0}"#);
    assert_eq!((out_of_range.status, out_of_range.replayed), (400, false));
    let fixed = post(&ledger, path, r#""c-1""#, r#"{"amount":5}"#);
    assert_eq!(
        (fixed.status, fixed.replayed),
        (201, false),
        "{}",
        fixed.body
    );
    let again = post(&ledger, path, r#""c-1""#, r#"{"amount":5}"#);
    assert_eq!(
        (again.status, again.replayed, &again.body),
        (201, true, &fixed.body)
    );
    assert_eq!(balance(&ledger, "1"), r#"{"id":1,"name":"a","balance":5}"#);
}

#[test]
fn refusals_transactional() {
    refusals_in("transactional");
}

#[test]
fn refusals_separate() {
    refusals_in("separate");
}

/// `--relay-db` names the same kind of server as `--db`, and only with
/// `--notify-url`: otherwise the ledger exits with status 2 and says why,
/// before it opens anything. (The cases with `--notify-url` or a
/// `postgres://` `--db` need the builds that have them; the ledger here is
/// built with this package's features.)
#[test]
fn relay_db_is_refused_where_it_cannot_work() {
    let notify = ["--notify-url", "http://127.0.0.1:1/n"];
    let relay = ["--relay-db", "mysql://root@127.0.0.1:2/test"];
    let mut cases: Vec<(Vec<&str>, &str)> = vec![(
        [&["--db", "ledger.sqlite3"][..], &relay].concat(),
        "error: --relay-db needs --notify-url: it is where the relay works",
    )];
    if cfg!(feature = "outbox") {
        cases.push((
            [&["--db", "ledger.sqlite3"][..], &notify, &relay].concat(),
            "error: --relay-db mysql://root@127.0.0.1:2/test: want a URL of the same kind as --db ledger.sqlite3 (postgres:// or mysql://)",
        ));
    }
    if cfg!(all(feature = "outbox", feature = "postgres")) {
        let db = ["--db", "postgresql://postgres@127.0.0.1:1/test"];
        cases.push((
            [&db[..], &notify, &relay].concat(),
            "error: --relay-db mysql://root@127.0.0.1:2/test: want a URL of the same kind as --db postgresql://postgres@127.0.0.1:1/test (postgres:// or mysql://)",
        ));
    }
    for (args, said) in cases {
        let out = std::process::Command::new(driver::ledger_beside_tests())
            .args(&args)
            .output()
            .expect("the ledger runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            (out.status.code(), stderr.lines().next()),
            (Some(2), Some(said)),
            "{args:?}"
        );
    }
}
