//! A ledger that starts beside a running one while a credit holds its
//! transaction open (a rolling deploy under load). The newcomer finds its
//! tables current and runs no DDL: an `ALTER TABLE` or `CREATE INDEX`, even
//! one that changes nothing, waits for every open transaction on `credits`
//! (PostgreSQL's table lock, MySQL's metadata lock), and every statement on
//! the table then queues behind it. So the newcomer serves while the credit
//! is still open. Each test has a database of its own.

use std::path::Path;

use crate::driver::{self, Ledger, create_account, request, request_past_409, until_in_flight};

/// Ledger A holds a credit's transaction open for 10 s after its effect;
/// ledger B starts on the same database meanwhile and creates an account
/// before A's credit commits. Then A's credit answers 201, applied once.
fn a_ledger_starts_beside_an_open_credit(url: &str, extra: &[&str]) {
    let binary = driver::ledger_beside_tests();
    let a = Ledger::start_with(&binary, Path::new(url), "transactional", 0, extra);
    let caller = ("authorization", "Bearer startup");
    let account = create_account(&a, caller, "startup-a");
    let path = format!("/accounts/{account}/credits");
    let body = r#"{"amount":5}"#;
    let held = {
        let (addr, path) = (a.addr, path.clone());
        std::thread::spawn(move || {
            let headers = [
                ("idempotency-key", "held"),
                caller,
                ("x-ledger-pause-after-effect-ms", "10000"),
            ];
            // Past a probe of `until_in_flight` that took the key first.
            request_past_409(addr, "POST", &path, &headers, body)
        })
    };
    until_in_flight(a.addr, &path, &[("idempotency-key", "held"), caller], body);
    open_writes(url);

    let b = Ledger::start_with(&binary, Path::new(url), "transactional", 0, extra);
    create_account(&b, caller, "startup-b");
    assert!(
        !held.is_finished(),
        "ledger B served only once A's credit had committed"
    );
    let held = held.join().unwrap().expect("A answers");
    assert_eq!(held.status, 201, "{}", held.body);
    let got = request(b.addr, "GET", &format!("/accounts/{account}"), &[], "").unwrap();
    let json: serde_json::Value = serde_json::from_str(&got.body).unwrap();
    assert_eq!(json["balance"], 5, "{}", got.body);
}

/// Waits (bounded) until a transaction on `url`'s server has written
/// `credits` (the held credit's effect), so B starts while it is open.
fn open_writes(url: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !credits_written(url) {
        assert!(
            std::time::Instant::now() < deadline,
            "the held credit never wrote"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Whether an open transaction holds a write lock on `credits`.
fn credits_written(url: &str) -> bool {
    #[cfg(feature = "mysql")]
    if url.starts_with("mysql:") {
        use tower_idempotency_sqlx::sqlx;
        return crate::block_on(async {
            let pool = sqlx::MySqlPool::connect(url).await.unwrap();
            // The claim, the account's update and the credit's insert.
            let rows: Option<u64> = sqlx::query_scalar(
                "SELECT MAX(trx_rows_modified) FROM information_schema.INNODB_TRX",
            )
            .fetch_one(&pool)
            .await
            .unwrap();
            rows.unwrap_or(0) >= 3
        });
    }
    crate::block_on(async {
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        client
            .query_one(
                "SELECT count(*) > 0 FROM pg_locks WHERE relation = to_regclass('credits') \
                 AND mode = 'RowExclusiveLock' AND granted",
                &[],
            )
            .await
            .unwrap()
            .get(0)
    })
}

#[test]
fn postgres() {
    a_ledger_starts_beside_an_open_credit(
        &crate::fresh_postgres_database("ledger_startup_pg"),
        &[],
    );
}

#[cfg(feature = "sqlx-postgres")]
#[test]
fn sqlx_postgres() {
    a_ledger_starts_beside_an_open_credit(
        &crate::fresh_postgres_database("ledger_startup_sqlx"),
        &["--db-driver", "sqlx"],
    );
}

#[cfg(feature = "mysql")]
#[test]
fn mysql() {
    a_ledger_starts_beside_an_open_credit(
        &crate::fresh_mysql_database("ledger_startup_mysql"),
        &[],
    );
}
