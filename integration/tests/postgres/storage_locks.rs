//! A claim inside the handler's transaction (one phase) bounds its lock
//! waits, so that a repeat of a key held by another server's open
//! transaction is answered 409 soon. The bound must not turn the table's
//! own brief locks into a 409 for a key nobody holds: here another session
//! holds the table's `SHARE` lock (what `CREATE INDEX` takes; it blocks
//! inserts, not reads) for 50 ms while a new key is claimed. The claim
//! waits it out and is acquired, on `PostgresStore` and
//! `SqlxPostgresStore`; at the old 1 ms bound it was refused as in flight.

use std::time::Duration;

use tower_idempotency::store::{
    Claim, ClaimRequest, FencingToken, Refusal, Store, TransactionClaim, TransactionalStore,
};
use tower_idempotency::test_util::{claim_of, response};

fn pg_url() -> String {
    crate::common::services::postgres_url()
}

fn claim(key: &str) -> ClaimRequest {
    claim_of("s", key, 7, FencingToken::random())
}

/// Claims a new key while another session holds `table`'s `SHARE` lock
/// for 50 ms: acquired, committed, then replayed. Drops `table` after.
async fn a_new_key_waits_out_a_brief_table_lock<S: TransactionalStore + Store>(
    store: &S,
    table: &str,
) {
    // A first key, so that the claim's statements are prepared (preparing
    // an INSERT takes the table's lock outside any bound).
    let TransactionClaim::Acquired { transaction, .. } =
        store.claim_in_transaction(claim("first")).await.unwrap()
    else {
        panic!("the first key is acquired");
    };
    store
        .commit(&transaction, response(b"credited"))
        .await
        .unwrap();
    let (locker, connection) = tokio_postgres::connect(&pg_url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    locker
        .batch_execute(&format!("BEGIN; LOCK TABLE {table} IN SHARE MODE"))
        .await
        .unwrap();
    // The lock is held before the claim is sent; it is let go 50 ms on.
    let release = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        locker.batch_execute("COMMIT").await.unwrap();
    };
    let (claimed, ()) = tokio::join!(store.claim_in_transaction(claim("new")), release);
    let transaction = match claimed.unwrap() {
        TransactionClaim::Acquired {
            transaction,
            taken_over: false,
        } => transaction,
        TransactionClaim::Acquired { .. } => panic!("a new key was taken over"),
        TransactionClaim::Refused(refused) => {
            panic!("a new key refused while only the table's SHARE lock was held: {refused:?}")
        }
    };
    store
        .commit(&transaction, response(b"credited"))
        .await
        .unwrap();
    assert_eq!(
        store.claim(claim("new")).await.unwrap(),
        Claim::Refused(Refusal::Completed(response(b"credited")))
    );
    locker
        .batch_execute(&format!("DROP TABLE {table}"))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store() {
    use tower_idempotency_postgres::PostgresStore;
    let table = format!("idem_lck_{:016x}", FencingToken::random().0);
    let store = PostgresStore::builder(&pg_url())
        .table(table.clone())
        .open()
        .await
        .unwrap();
    a_new_key_waits_out_a_brief_table_lock(&store, &table).await;
}

#[cfg(feature = "sqlx-postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_postgres_store() {
    use tower_idempotency_sqlx::SqlxPostgresStore;
    let table = format!("idem_lck_{:016x}", FencingToken::random().0);
    let pool = sqlx::PgPool::connect(&pg_url()).await.unwrap();
    let store = SqlxPostgresStore::builder(pool)
        .table(table.clone())
        .open()
        .await
        .unwrap();
    a_new_key_waits_out_a_brief_table_lock(&store, &table).await;
}
