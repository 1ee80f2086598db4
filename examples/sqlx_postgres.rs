use axum::{Router, http::HeaderName, routing::post};
use sqlx::PgPool;
use tower_idempotency::store::{SqlxPostgresError, SqlxPostgresTransaction};
use tower_idempotency::{IdempotencyLayer, SqlxPostgresStore, scope};

async fn credit(tx: SqlxPostgresTransaction) -> Result<String, SqlxPostgresError> {
    // The transaction that holds the idempotency record: the credit, the record
    // and the stored response commit together once this handler answers.
    let mut conn = tx.acquire().await?;
    let balance: i64 = sqlx::query_scalar(
        "UPDATE accounts SET balance = balance + 5 WHERE id = 1 RETURNING balance",
    )
    .fetch_one(&mut *conn)
    .await?; // a failed statement answers 500 (logged) and nothing commits
    Ok(format!("balance {balance}\n"))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pool = PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL);
         INSERT INTO accounts (id, balance) VALUES (1, 0) ON CONFLICT (id) DO NOTHING",
    )
    .execute(&pool)
    .await?;
    let store = SqlxPostgresStore::new(pool).await?; // creates its table, idempotency_records
    // Keys belong to the caller your gateway names in `x-user-id` (see the quick start).
    let scope = scope::header(HeaderName::from_static("x-user-id"));
    let layer = IdempotencyLayer::new(store, scope)
        .require_key(true)
        .transactional();
    let app = Router::new()
        .route("/credits", post(credit))
        .route_layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    println!("listening on http://127.0.0.1:3000");
    axum::serve(listener, app).await?;
    Ok(())
}
