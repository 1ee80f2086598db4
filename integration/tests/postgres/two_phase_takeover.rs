//! Transactional mode in two phases, at the store: a lease taken over while
//! the first holder's transaction is still open. The first holder's commit
//! is fenced (rolled back, nothing stored), never gives the key back from
//! under the new holder, and the new holder's response is the one
//! replayed. On `PostgresStore`, `SqlxPostgresStore` and `MySqlStore`: the
//! new holder is a second handle on the same table whose clock runs two
//! minutes ahead, so the first holder's one-minute lease has ended for it.
//! Needs PostgreSQL and MySQL/MariaDB (`TOWER_IDEMPOTENCY_POSTGRES_URL`,
//! `TOWER_IDEMPOTENCY_MYSQL_URL`, or the local `test` databases).

use std::time::Duration;

use axum::http::{HeaderMap, StatusCode};
use bytes::Bytes;
use tower_idempotency::response::StoredResponse;
use tower_idempotency::store::{
    Claim, ClaimRequest, Clock, Completion, FencingToken, RecordId, Refusal, Store,
    TransactionClaim, TransactionalStore,
};

fn pg_url() -> String {
    crate::common::services::postgres_url()
}

fn mysql_url() -> String {
    crate::common::services::mysql_url()
}

/// A clock `0` ms ahead of the server's.
struct Ahead(i64);

impl Clock for Ahead {
    fn now_ms(&self) -> i64 {
        self.0
    }
}

const AHEAD: i64 = 120_000;

fn claim(key: &str) -> ClaimRequest {
    ClaimRequest::new(
        RecordId::new("s", key),
        tower_idempotency::fingerprint::Fingerprint([7; 32]),
        FencingToken::random(),
    )
    .with_lease(Duration::from_secs(60))
    .with_ttl(Duration::from_secs(3600))
}

fn response(body: &'static str) -> StoredResponse {
    StoredResponse::capture(
        StatusCode::CREATED,
        &HeaderMap::new(),
        Bytes::from_static(body.as_bytes()),
        None,
    )
}

/// `first` claims in a transaction; `later` (two minutes ahead) takes the
/// key over in a transaction of its own. Then the two commit in the order
/// `first_commits_first` says.
async fn take_over<S: TransactionalStore + Store>(
    first: &S,
    later: &S,
    key: &str,
    first_commits_first: bool,
) {
    let TransactionClaim::Acquired {
        transaction: a,
        taken_over: false,
    } = first.claim_in_transaction(claim(key)).await.unwrap()
    else {
        panic!("{key}: the first claim is acquired");
    };
    let TransactionClaim::Acquired {
        transaction: b,
        taken_over: true,
    } = later.claim_in_transaction(claim(key)).await.unwrap()
    else {
        panic!("{key}: the later handle takes the ended lease over");
    };
    let commit_a = async {
        let fenced = first.commit(&a, response("from A")).await;
        assert!(
            fenced.is_err(),
            "{key}: A's commit after the take-over is fenced: {fenced:?}"
        );
        // A's fenced commit gave nothing back from under B.
        match later.claim(claim(key)).await.unwrap() {
            Claim::Refused(Refusal::InFlight { .. }) if first_commits_first => {}
            Claim::Refused(Refusal::Completed(r)) if !first_commits_first => {
                assert_eq!(r, response("from B"), "{key}: B's answer is kept");
            }
            other => panic!("{key}: after A's fenced commit: {other:?}"),
        }
    };
    let commit_b = async {
        assert_eq!(
            later.commit(&b, response("from B")).await.unwrap(),
            Completion::Stored,
            "{key}: B commits"
        );
    };
    if first_commits_first {
        commit_a.await;
        commit_b.await;
    } else {
        commit_b.await;
        commit_a.await;
    }
    for store in [later.claim(claim(key)), first.claim(claim(key))] {
        assert_eq!(
            store.await.unwrap(),
            Claim::Refused(Refusal::Completed(response("from B"))),
            "{key}: B's answer is replayed, never A's"
        );
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_fenced_commit_never_replays_nor_releases() {
    use tower_idempotency_postgres::PostgresStore;
    let table = format!("idem_brk_{:016x}", FencingToken::random().0);
    let first = PostgresStore::builder(&pg_url())
        .table(table.clone())
        .commit_claims_first(true)
        .open()
        .await
        .unwrap();
    let later = PostgresStore::builder(&pg_url())
        .table(table.clone())
        .commit_claims_first(true)
        .clock_offset(Ahead(AHEAD))
        .open()
        .await
        .unwrap();
    take_over(&first, &later, "a-first", true).await;
    take_over(&first, &later, "b-first", false).await;
    first
        .pool()
        .get()
        .await
        .unwrap()
        .batch_execute(&format!("DROP TABLE {table}"))
        .await
        .unwrap();
}

#[cfg(feature = "sqlx-postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_postgres_a_fenced_commit_never_replays_nor_releases() {
    use tower_idempotency_sqlx::SqlxPostgresStore;
    let pool = sqlx::PgPool::connect(&pg_url()).await.unwrap();
    let table = format!("idem_brk_{:016x}", FencingToken::random().0);
    let first = SqlxPostgresStore::builder(pool.clone())
        .table(table.clone())
        .commit_claims_first(true)
        .open()
        .await
        .unwrap();
    let later = SqlxPostgresStore::builder(pool.clone())
        .table(table.clone())
        .commit_claims_first(true)
        .clock_offset(Ahead(AHEAD))
        .open()
        .await
        .unwrap();
    take_over(&first, &later, "a-first", true).await;
    take_over(&first, &later, "b-first", false).await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(&pool)
        .await
        .unwrap();
}

#[cfg(feature = "mysql")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_a_fenced_commit_never_replays_nor_releases() {
    use tower_idempotency_sqlx::MySqlStore;
    let table = format!("idem_brk_{:016x}", FencingToken::random().0);
    let first = MySqlStore::builder(&mysql_url())
        .table(&table)
        .commit_claims_first(true)
        .open()
        .await
        .unwrap();
    let later = MySqlStore::builder(&mysql_url())
        .table(&table)
        .commit_claims_first(true)
        .clock_offset(Ahead(AHEAD))
        .open()
        .await
        .unwrap();
    take_over(&first, &later, "a-first", true).await;
    take_over(&first, &later, "b-first", false).await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
        .execute(first.pool())
        .await
        .unwrap();
}

/// A fenced commit rolls back the handler's own writes, not only the
/// record, with and without `notify_waiters` (each has its completion
/// statement); and a transaction that a failed statement of the handler
/// aborted commits nothing and gives the key back. The handler's effect is
/// a row in a table of its own: afterwards only the new holder's row is
/// there.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_fenced_or_failed_commit_keeps_no_write_of_its_handler() {
    use tower_idempotency_postgres::{PostgresStore, PostgresTransaction};
    let acquired = |claim: TransactionClaim<PostgresTransaction>, taken_over: bool| match claim {
        TransactionClaim::Acquired {
            transaction,
            taken_over: t,
        } if t == taken_over => transaction,
        other => panic!("expected a claim (taken over: {taken_over}): {other:?}"),
    };
    for notify in [false, true] {
        let table = format!("idem_brk_{:016x}", FencingToken::random().0);
        let effects = format!("{table}_effects");
        let open = |ahead| {
            PostgresStore::builder(&pg_url())
                .table(table.clone())
                .commit_claims_first(true)
                .notify_waiters(notify)
                .clock_offset(Ahead(ahead))
                .open()
        };
        let (first, later) = (open(0).await.unwrap(), open(AHEAD).await.unwrap());
        let admin = first.pool().get().await.unwrap();
        admin
            .batch_execute(&format!("CREATE TABLE {effects} (effect TEXT PRIMARY KEY)"))
            .await
            .unwrap();
        let insert = format!("INSERT INTO {effects} VALUES ($1)");
        let write = async |tx: &PostgresTransaction, effect: &str| {
            let client = tx.client().await.unwrap();
            client.execute(insert.as_str(), &[&effect]).await.unwrap();
        };

        // A writes; B takes the key over; A's commit is fenced.
        let a = acquired(first.claim_in_transaction(claim("k")).await.unwrap(), false);
        write(&a, "from A").await;
        let b = acquired(later.claim_in_transaction(claim("k")).await.unwrap(), true);
        let fenced = first.commit(&a, response("from A")).await.unwrap_err();
        assert!(
            fenced
                .to_string()
                .contains("another request took the key over"),
            "notify {notify}: {fenced}"
        );
        write(&b, "from B").await;
        assert_eq!(
            later.commit(&b, response("from B")).await.unwrap(),
            Completion::Stored
        );

        // C writes, then one of its statements fails: nothing commits and
        // the key is free at once.
        let c = acquired(
            first.claim_in_transaction(claim("failed")).await.unwrap(),
            false,
        );
        write(&c, "from C").await;
        let failed = c.client().await.unwrap().execute("SELECT 1 / 0", &[]).await;
        assert!(failed.is_err(), "division by zero fails");
        assert!(first.commit(&c, response("from C")).await.is_err());
        assert_eq!(
            first.claim(claim("failed")).await.unwrap(),
            Claim::Acquired { taken_over: false },
            "notify {notify}: the failed request's key was given back"
        );

        let effects_left: Vec<String> = admin
            .query(
                &format!("SELECT effect FROM {effects} ORDER BY effect"),
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|row| row.get(0))
            .collect();
        assert_eq!(effects_left, ["from B"], "notify {notify}");
        assert_eq!(
            later.claim(claim("k")).await.unwrap(),
            Claim::Refused(Refusal::Completed(response("from B"))),
            "notify {notify}: B's answer is replayed"
        );
        admin
            .batch_execute(&format!("DROP TABLE {table}, {effects}"))
            .await
            .unwrap();
    }
}
