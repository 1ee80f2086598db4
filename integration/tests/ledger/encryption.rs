//! The ledger's `--encryption-key-file`, over real HTTP: a credit's repeat is
//! replayed byte for byte, no stored row (nor the SQLite file) holds the
//! plaintext of a response body, and a ledger restarted with only another key
//! never replays the record: the repeat gets the 503 problem and the balance
//! shows exactly one credit. Rotation (`[new, old]`) replays it again. On
//! SQLite in both modes; on PostgreSQL with `--features postgres` and a
//! server (`TOWER_IDEMPOTENCY_POSTGRES_URL`, or the local `test` database).

use crate::driver;

#[cfg(feature = "postgres")]
use crate::common;

use std::path::{Path, PathBuf};

use driver::{Answer, Ledger, request};

fn post(ledger: &Ledger, path: &str, key: &str, body: &str) -> Answer {
    request(ledger.addr, "POST", path, &[("idempotency-key", key)], body)
        .expect("the ledger answers")
}

/// A key file of 32 random bytes.
fn key_file(dir: &Path, name: &str) -> PathBuf {
    let mut key = [0u8; 32];
    getrandom::fill(&mut key).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, key).unwrap();
    path
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

/// One database's scenario. `tag` makes the keys unique in a shared
/// database; `stored` reads every byte the store wrote (its rows, and the
/// file where there is one).
fn scenario(db: &Path, mode: &str, tag: &str, stored: impl Fn() -> Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let (old, new) = (
        key_file(dir.path(), "old.key"),
        key_file(dir.path(), "new.key"),
    );
    let start = |keys: &[&PathBuf]| {
        let mut args = Vec::new();
        for key in keys {
            args.push("--encryption-key-file");
            args.push(key.to_str().unwrap());
        }
        Ledger::start_with(&driver::ledger_beside_tests(), db, mode, 5, &args)
    };
    let mut ledger = start(&[&old]);
    let name = format!(r#"{{"name":"sealed {tag}"}}"#);
    let account = post(&ledger, "/accounts", &format!("account-{tag}"), &name);
    assert_eq!(account.status, 201, "{}", account.body);
    let id = account
        .body
        .split(['{', ':', ','])
        .nth(2)
        .unwrap()
        .to_owned();
    let path = format!("/accounts/{id}/credits");
    let credit_key = format!("credit-{tag}");
    let first = post(&ledger, &path, &credit_key, r#"{"amount":12345}"#);
    assert_eq!(
        (first.status, first.replayed),
        (201, false),
        "{}",
        first.body
    );
    assert!(
        first.body.contains(r#""amount":12345,"balance":12345"#),
        "{}",
        first.body
    );
    let again = post(&ledger, &path, &credit_key, r#"{"amount":12345}"#);
    assert_eq!((again.status, again.replayed), (201, true));
    assert_eq!(again.body, first.body, "the replay is byte-identical");

    let bytes = stored();
    assert!(!bytes.is_empty());
    for plaintext in [
        first.body.as_str(),
        r#""amount":12345"#,
        account.body.as_str(),
    ] {
        assert!(!contains(&bytes, plaintext), "the store holds {plaintext}");
    }

    // Only another key: never replayed, never applied again.
    ledger.kill();
    let ledger = start(&[&new]);
    for _ in 0..2 {
        let refused = post(&ledger, &path, &credit_key, r#"{"amount":12345}"#);
        assert_eq!(
            (refused.status, refused.replayed),
            (503, false),
            "{}",
            refused.body
        );
        assert!(refused.body.contains("record-sealed"), "{}", refused.body);
        assert!(!refused.body.contains("12345"));
    }
    let balance = request(ledger.addr, "GET", &format!("/accounts/{id}"), &[], "").unwrap();
    assert_eq!(
        balance.body,
        format!(r#"{{"id":{id},"name":"sealed {tag}","balance":12345}}"#)
    );
    drop(ledger);

    // Rotation: the new key first, the old one still opens.
    let ledger = start(&[&new, &old]);
    let rotated = post(&ledger, &path, &credit_key, r#"{"amount":12345}"#);
    assert_eq!((rotated.status, rotated.replayed), (201, true));
    assert_eq!(rotated.body, first.body);
}

fn on_sqlite(mode: &str) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("ledger.sqlite3");
    let file = db.clone();
    scenario(&db, mode, mode, move || {
        // The database file, its write-ahead log, and every stored response.
        let mut bytes = Vec::new();
        for suffix in ["", "-wal"] {
            let name = format!("{}{suffix}", file.display());
            bytes.extend(std::fs::read(name).unwrap_or_default());
        }
        let conn = rusqlite::Connection::open(&file).unwrap();
        let mut rows = conn
            .prepare("SELECT response FROM idempotency_records WHERE response IS NOT NULL")
            .unwrap();
        let responses = rows.query_map([], |r| r.get::<_, Vec<u8>>(0)).unwrap();
        let mut count = 0;
        for response in responses {
            bytes.extend(response.unwrap());
            count += 1;
        }
        assert_eq!(count, 2, "the account's record and the credit's");
        bytes
    });
}

#[test]
fn sealed_records_on_sqlite_transactional() {
    on_sqlite("transactional");
}

#[test]
fn sealed_records_on_sqlite_separate() {
    on_sqlite("separate");
}

#[cfg(feature = "postgres")]
#[test]
fn sealed_records_on_postgres() {
    let url = common::services::postgres_url();
    let mut nonce = [0u8; 8];
    getrandom::fill(&mut nonce).unwrap();
    let tag: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
    let keys = [format!("account-{tag}"), format!("credit-{tag}")];
    let rows_url = url.clone();
    scenario(Path::new(&url), "transactional", &tag, move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let (client, connection) = tokio_postgres::connect(&rows_url, tokio_postgres::NoTls)
                .await
                .unwrap();
            tokio::spawn(connection);
            let rows = client
                .query(
                    "SELECT response FROM idempotency_records WHERE key = ANY($1)",
                    &[&keys.to_vec()],
                )
                .await
                .unwrap();
            assert_eq!(rows.len(), 2);
            rows.iter()
                .flat_map(|row| row.get::<_, Vec<u8>>(0))
                .collect()
        })
    });
}

#[test]
fn a_key_file_of_another_length_stops_the_ledger() {
    let dir = tempfile::tempdir().unwrap();
    let short = dir.path().join("short.key");
    std::fs::write(&short, [7u8; 31]).unwrap();
    let output = std::process::Command::new(driver::ledger_beside_tests())
        .arg("--db")
        .arg(dir.path().join("ledger.sqlite3"))
        .args(["--listen", "127.0.0.1:0", "--encryption-key-file"])
        .arg(&short)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--encryption-key-file"), "{stderr}");
    assert!(stderr.contains("holds 31 bytes"), "{stderr}");
    assert!(stderr.contains("exactly 32 random bytes"), "{stderr}");
    assert!(output.stdout.is_empty(), "it never listened");
}
