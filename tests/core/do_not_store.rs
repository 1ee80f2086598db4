//! `policy::DoNotStore`: a handler's "nothing happened" releases the key, so
//! the corrected request runs with the same key; without it, the refusal is
//! stored and replayed.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::policy::DoNotStore;
use tower_idempotency::scope::GlobalScope;
use tower_idempotency::store::{Inspect, MemoryStore, SqliteStore, SqliteTransaction};

type Runs = Arc<AtomicUsize>;

/// Counts the run; a body that is not a number is refused with 422, marked
/// `DoNotStore` when `marked`.
fn answer(runs: &Runs, body: &str, marked: bool) -> Response {
    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
    match body.parse::<u64>() {
        Ok(amount) => (StatusCode::CREATED, format!("run {n}: charged {amount}")).into_response(),
        Err(_) if marked => (
            StatusCode::UNPROCESSABLE_ENTITY,
            Extension(DoNotStore),
            format!("run {n}: amount must be a number"),
        )
            .into_response(),
        Err(_) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            format!("run {n}: amount must be a number"),
        )
            .into_response(),
    }
}

async fn marked(State(runs): State<Runs>, body: String) -> Response {
    answer(&runs, &body, true)
}

async fn unmarked(State(runs): State<Runs>, body: String) -> Response {
    answer(&runs, &body, false)
}

fn charge(path: &str, body: &'static str) -> Request {
    Request::post(path)
        .header("idempotency-key", "k-1")
        .body(Body::from(body))
        .unwrap()
}

/// Status, whether replayed, body.
async fn call(app: &Router, request: Request) -> (u16, bool, String) {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status().as_u16();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, replayed, String::from_utf8(body.to_vec()).unwrap())
}

fn app(store: MemoryStore, runs: &Runs) -> Router {
    Router::new()
        .route("/marked", post(marked))
        .route("/unmarked", post(unmarked))
        .route_layer(IdempotencyLayer::new(store, GlobalScope))
        .with_state(runs.clone())
}

#[tokio::test]
async fn a_marked_refusal_is_not_stored_and_the_corrected_request_runs_with_the_same_key() {
    let (store, runs) = (MemoryStore::new(), Runs::default());
    let app = app(store.clone(), &runs);
    let refused = call(&app, charge("/marked", "five")).await;
    assert_eq!(
        refused,
        (422, false, "run 1: amount must be a number".into())
    );
    assert_eq!(store.counts().await.unwrap().completed, 0);
    // The corrected body, same key: a new fingerprint, and no record in the way.
    let fixed = call(&app, charge("/marked", "5")).await;
    assert_eq!(fixed, (201, false, "run 2: charged 5".into()));
    let again = call(&app, charge("/marked", "5")).await;
    assert_eq!(again, (201, true, "run 2: charged 5".into()));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn an_unmarked_refusal_is_stored_replayed_and_binds_the_key() {
    let (store, runs) = (MemoryStore::new(), Runs::default());
    let app = app(store.clone(), &runs);
    let refused = call(&app, charge("/unmarked", "five")).await;
    assert_eq!(
        refused,
        (422, false, "run 1: amount must be a number".into())
    );
    let replayed = call(&app, charge("/unmarked", "five")).await;
    assert_eq!(
        replayed,
        (422, true, "run 1: amount must be a number".into())
    );
    // The corrected body with the same key is another request: 422 mismatch.
    let mismatch = call(&app, charge("/unmarked", "5")).await;
    let problem = concat!(
        r#"{"type":"https://docs.rs/tower-idempotency/latest/tower_idempotency/problem/#mismatch","#,
        r#""title":"Idempotency key reused with a different request","status":422,"#,
        r#""detail":"this idempotency key was first used with a different method, path, query or body; use a new key for a new operation"}"#
    );
    assert_eq!(mismatch, (422, false, problem.into()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(store.counts().await.unwrap().completed, 1);
}

/// Transactional: the marked refusal rolls back what the handler wrote.
#[tokio::test]
async fn a_marked_refusal_rolls_the_transaction_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("app.sqlite3");
    let store = SqliteStore::open(&path).await.unwrap();
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute_batch("CREATE TABLE attempts (body TEXT NOT NULL);")
        .unwrap();
    let runs = Runs::default();
    let handler = |State(runs): State<Runs>, tx: SqliteTransaction, body: String| async move {
        let written = body.clone();
        tx.run(move |t| t.execute("INSERT INTO attempts (body) VALUES (?1)", [written]))
            .await
            .unwrap();
        answer(&runs, &body, true)
    };
    let app = Router::new()
        .route("/marked", post(handler))
        .route_layer(IdempotencyLayer::new(store, GlobalScope).transactional())
        .with_state(runs.clone());
    let attempts = || -> Vec<String> {
        let conn = rusqlite::Connection::open(&path).unwrap();
        let mut rows = conn.prepare("SELECT body FROM attempts").unwrap();
        rows.query_map([], |r| r.get(0))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    };
    let refused = call(&app, charge("/marked", "five")).await;
    assert_eq!(
        refused,
        (422, false, "run 1: amount must be a number".into())
    );
    assert_eq!(attempts(), Vec::<String>::new(), "rolled back");
    let fixed = call(&app, charge("/marked", "5")).await;
    assert_eq!(fixed, (201, false, "run 2: charged 5".into()));
    let again = call(&app, charge("/marked", "5")).await;
    assert_eq!(again, (201, true, "run 2: charged 5".into()));
    assert_eq!(attempts(), vec!["5".to_owned()]);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// `problem::WithProblem`: an axum extractor's rejection (a path segment
/// that is not UTF-8, a body that is not JSON) comes out as problem details
/// with axum's status, is not stored, and leaves the key free for the
/// corrected request.
#[tokio::test]
async fn an_extractor_rejection_wrapped_in_with_problem_is_problem_json_and_not_stored() {
    use axum::extract::Path;
    use tower_idempotency::problem::WithProblem;
    let (store, runs) = (MemoryStore::new(), Runs::default());
    let handler =
        |State(runs): State<Runs>,
         WithProblem(Path(account)): WithProblem<Path<u64>>,
         WithProblem(axum::Json(amount)): WithProblem<axum::Json<u64>>| async move {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            (
                StatusCode::CREATED,
                format!("run {n}: {amount} to {account}"),
            )
        };
    let app = Router::new()
        .route("/accounts/{account}/credits", post(handler))
        .route_layer(IdempotencyLayer::new(store.clone(), GlobalScope))
        .with_state(runs.clone());
    let json = |path: &str, body: &'static str| {
        let mut request = charge(path, body);
        let json = axum::http::HeaderValue::from_static("application/json");
        request.headers_mut().insert("content-type", json);
        request
    };
    let content_type = |request: Request| {
        let app = app.clone();
        async move {
            let response = app.oneshot(request).await.unwrap();
            response.headers()["content-type"]
                .to_str()
                .unwrap()
                .to_owned()
        }
    };

    let bad_path = json("/accounts/%FF/credits", "5");
    assert_eq!(content_type(bad_path).await, "application/problem+json");
    let bad_path = call(&app, json("/accounts/%FF/credits", "5")).await;
    let detail = "Invalid URL: Invalid UTF-8 in `account`";
    let problem = format!(
        r#"{{"type":"about:blank","title":"Bad Request","status":400,"detail":"{detail}"}}"#
    );
    assert_eq!(bad_path, (400, false, problem));

    let bad_body = call(&app, json("/accounts/7/credits", "five")).await;
    assert_eq!((bad_body.0, bad_body.1), (400, false));
    assert!(bad_body.2.starts_with(r#"{"type":"about:blank","title":"Bad Request","status":400,"detail":"Failed to parse the request body as JSON"#), "{}", bad_body.2);
    assert_eq!(store.counts().await.unwrap().completed, 0);

    // The same key, corrected: it runs, once.
    let fixed = call(&app, json("/accounts/7/credits", "5")).await;
    assert_eq!(fixed, (201, false, "run 1: 5 to 7".into()));
    let again = call(&app, json("/accounts/7/credits", "5")).await;
    assert_eq!(again, (201, true, "run 1: 5 to 7".into()));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// An extractor that refuses with a 401, its `WWW-Authenticate`, and a
/// 2,000-byte text.
struct Authenticated;

impl<S: Sync> axum::extract::FromRequestParts<S> for Authenticated {
    type Rejection = Response;

    async fn from_request_parts(
        _: &mut axum::http::request::Parts,
        _: &S,
    ) -> Result<Self, Response> {
        Err((
            StatusCode::UNAUTHORIZED,
            [("www-authenticate", "Bearer realm=\"api\"")],
            "é".repeat(1000),
        )
            .into_response())
    }
}

/// `WithProblem` keeps the rejection's header fields, and cuts a long text
/// at 1 KiB (on a character boundary).
#[tokio::test]
async fn with_problem_keeps_the_rejections_headers_and_cuts_its_text() {
    use tower_idempotency::problem::WithProblem;
    let app = Router::new()
        .route("/", post(|_: WithProblem<Authenticated>| async { "never" }))
        .route_layer(IdempotencyLayer::new(MemoryStore::new(), GlobalScope));
    let response = app.oneshot(charge("/", "")).await.unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        response.headers()["www-authenticate"],
        "Bearer realm=\"api\""
    );
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["detail"].as_str().unwrap(), "é".repeat(512));
}
