use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Router, routing::post};
use sqlx::PgPool;
use tower_idempotency::policy::DoNotStore;
use tower_idempotency::{IdempotencyLayer, scope};
use tower_idempotency_sqlx::{SqlxPostgresError, SqlxPostgresStore, SqlxPostgresTransaction};

// POST /credits, the amount as the body. The transaction extractor comes first,
// the body last (axum's rule: the extractor that reads the body is the last one).
async fn credit(tx: SqlxPostgresTransaction, body: String) -> Result<Response, SqlxPostgresError> {
    let Ok(amount) = body.trim().parse::<i64>() else {
        // Nothing happened: DoNotStore gives the key back for the corrected request.
        let refusal = (
            StatusCode::BAD_REQUEST,
            Extension(DoNotStore),
            "amount: an integer\n",
        );
        return Ok(refusal.into_response());
    };
    // The transaction that holds the idempotency record: the credit, the record
    // and the stored response commit together once this handler answers.
    let mut conn = tx.connection().await?;
    let balance: i64 = sqlx::query_scalar(
        "UPDATE accounts SET balance = balance + $1 WHERE id = 1 RETURNING balance",
    )
    .bind(amount)
    .fetch_one(&mut *conn)
    .await?; // a failed statement answers 500 (logged) and nothing commits
    Ok(format!("balance {balance}\n").into_response())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt::init(); // the layer reports its errors (and 500s' causes) here
    let pool = PgPool::connect(&std::env::var("DATABASE_URL")?).await?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL);
         INSERT INTO accounts (id, balance) VALUES (1, 0) ON CONFLICT (id) DO NOTHING",
    )
    .execute(&pool)
    .await?;
    let store = SqlxPostgresStore::from_pool(pool).await?; // creates its table, idempotency_records
    // Keys belong to the caller your gateway names in `x-user-id` (see the quick start).
    let layer = IdempotencyLayer::new(store, scope::header("x-user-id"))
        .require_key(true)
        .transactional();
    let app = Router::new()
        .route("/credits", post(credit))
        .route_layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
    println!("listening on http://127.0.0.1:8080");
    axum::serve(listener, app).await?;
    Ok(())
}
