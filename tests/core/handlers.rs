//! What handlers and their apps get from the layer: scopes that refuse, and
//! the order of the layer against authentication, the claimed key, errors
//! that answer as problems.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, StatusCode, request::Parts};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::StoreError;
use tower_idempotency::key::ClaimedKey;
use tower_idempotency::store::{
    Inspect, MemoryStore, RecordCounts, SqliteStore, SqliteTransaction, TransactionError,
};
use tower_idempotency::{IdempotencyLayer, scope};

/// The principal the authentication middleware inserts.
#[derive(Clone)]
struct User(String);

impl fmt::Display for User {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// `Authorization: Bearer <name>` becomes the principal `User(name)`;
/// anything else is answered 401 by the middleware itself.
async fn authenticate(mut request: Request, next: Next) -> Response {
    let user = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok()?.strip_prefix("Bearer "))
        .map(|name| User(name.to_owned()));
    match user {
        Some(user) => {
            request.extensions_mut().insert(user);
            next.run(request).await
        }
        None => {
            let mut response = Response::new(Body::from("who are you?"));
            *response.status_mut() = StatusCode::UNAUTHORIZED;
            response
        }
    }
}

/// A handler that counts its runs and answers with its caller's secret.
fn statement(runs: Arc<AtomicUsize>) -> Router {
    Router::new().route(
        "/statements",
        post(move |request: Request| async move {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            let user = request
                .extensions()
                .get::<User>()
                .map_or("nobody".to_owned(), |u| u.0.clone());
            (StatusCode::CREATED, format!("run {n}: {user}'s balance"))
        }),
    )
}

fn post_as(user: &str, key: &str) -> Request {
    Request::post("/statements")
        .header("authorization", format!("Bearer {user}"))
        .header("idempotency-key", key)
        .body(Body::from("month=11"))
        .unwrap()
}

async fn call(app: &Router, request: Request) -> (StatusCode, Option<String>, Bytes) {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, replayed, body)
}

const UNAUTHENTICATED: &str = concat!(
    r#"{"type":"https://docs.rs/tower-idempotency/latest/tower_idempotency/problem/#unauthenticated","#,
    r#""title":"Authentication required","status":401,"#,
    r#""detail":"this request has an idempotency key but no authenticated principal to scope it to; the request was not processed"}"#
);

fn nothing_recorded() -> RecordCounts {
    RecordCounts::default()
}

/// A request body that records whether anyone read it.
struct Watched(Arc<AtomicUsize>);

impl http_body::Body for Watched {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Poll::Ready(None)
    }
}

#[tokio::test]
async fn a_request_without_a_principal_gets_401_before_its_body_or_the_store() {
    let store = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let app = statement(runs.clone()).route_layer(IdempotencyLayer::new(
        store.clone(),
        scope::extension::<User>(),
    ));
    let reads = Arc::new(AtomicUsize::new(0));
    let request = Request::post("/statements")
        .header("idempotency-key", "k-1")
        .body(Body::new(Watched(reads.clone())))
        .unwrap();
    let response = app.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, UNAUTHENTICATED);
    assert_eq!(reads.load(Ordering::SeqCst), 0, "the body was not read");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(store.counts().await.unwrap(), nothing_recorded());
}

#[tokio::test]
async fn a_header_scope_refuses_a_request_without_the_header() {
    let store = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(
        store.clone(),
        scope::header(HeaderName::from_static("x-user-id")),
    );
    let app = statement(runs.clone()).route_layer(layer);
    let (status, _, body) = call(&app, post_as("alice", "k-1")).await;
    assert_eq!(
        (status, &body[..]),
        (StatusCode::UNAUTHORIZED, UNAUTHENTICATED.as_bytes())
    );
    let mut with_header = post_as("alice", "k-1");
    with_header
        .headers_mut()
        .insert("x-user-id", "alice".parse().unwrap());
    let (status, replayed, body) = call(&app, with_header).await;
    assert_eq!(
        (status, replayed, &body[..]),
        (StatusCode::CREATED, None, &b"run 1: nobody's balance"[..])
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn on_rejection_can_add_www_authenticate_to_the_401() {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(MemoryStore::new(), scope::extension::<User>()).on_rejection(
        |rejection| {
            let mut response = rejection.to_problem();
            if rejection.status() == StatusCode::UNAUTHORIZED {
                response
                    .headers_mut()
                    .insert("www-authenticate", "Bearer".parse().unwrap());
            }
            response
        },
    );
    let app = statement(runs.clone()).route_layer(layer);
    let request = Request::post("/statements")
        .header("idempotency-key", "k-1")
        .body(Body::empty())
        .unwrap();
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(response.headers()["www-authenticate"], "Bearer");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn scope_from_fn_needs_no_annotation() {
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::new(
        MemoryStore::new(),
        scope::from_fn(|parts| {
            parts
                .extensions
                .get::<User>()
                .map(|u| format!("user:{}", u.0))
        }),
    );
    let app = statement(runs.clone())
        .route_layer(layer)
        .route_layer(middleware::from_fn(authenticate));
    assert_eq!(
        call(&app, post_as("alice", "k-1")).await.0,
        StatusCode::CREATED
    );
    let (status, replayed, body) = call(&app, post_as("alice", "k-1")).await;
    assert_eq!(
        (status, replayed.as_deref(), &body[..]),
        (
            StatusCode::CREATED,
            Some("true"),
            &b"run 1: alice's balance"[..]
        )
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The right order: idempotency added first (inner), authentication after
/// it (outer, runs first). Each user's key space is their own.
#[tokio::test]
async fn inside_authentication_each_principal_has_its_own_keys() {
    let store = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let app = statement(runs.clone())
        .route_layer(IdempotencyLayer::new(
            store.clone(),
            scope::extension::<User>(),
        ))
        .route_layer(middleware::from_fn(authenticate));
    let alice = call(&app, post_as("alice", "k-1")).await;
    assert_eq!(
        (alice.0, alice.1, &alice.2[..]),
        (StatusCode::CREATED, None, &b"run 1: alice's balance"[..])
    );
    let again = call(&app, post_as("alice", "k-1")).await;
    assert_eq!(
        (again.0, again.1.as_deref(), &again.2[..]),
        (
            StatusCode::CREATED,
            Some("true"),
            &b"run 1: alice's balance"[..]
        )
    );
    let bob = call(&app, post_as("bob", "k-1")).await;
    assert_eq!(
        (bob.0, bob.1, &bob.2[..]),
        (StatusCode::CREATED, None, &b"run 2: bob's balance"[..])
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(store.counts().await.unwrap().completed, 2);
}

/// The wrong order: authentication added first (inner), so it runs AFTER
/// the idempotency layer, whose scope then never sees a principal. Every
/// request with a key gets 401; nothing runs, nothing is stored, and bob
/// can never receive alice's response.
#[tokio::test]
async fn outside_authentication_the_layer_refuses_and_cannot_leak() {
    let store = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let app = statement(runs.clone())
        .route_layer(middleware::from_fn(authenticate))
        .route_layer(IdempotencyLayer::new(
            store.clone(),
            scope::extension::<User>(),
        ));
    for user in ["alice", "bob", "alice"] {
        let (status, replayed, body) = call(&app, post_as(user, "k-1")).await;
        assert_eq!(
            (status, replayed, &body[..]),
            (StatusCode::UNAUTHORIZED, None, UNAUTHENTICATED.as_bytes()),
            "{user}"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(store.counts().await.unwrap(), nothing_recorded());
}

/// Why a scope must refuse rather than fall back: the same wrong order with
/// a scope that falls back to a shared value replays alice's response to bob.
#[tokio::test]
async fn a_fallback_scope_in_the_wrong_order_leaks_which_is_why_scopes_refuse() {
    let runs = Arc::new(AtomicUsize::new(0));
    let fallback = |parts: &Parts| {
        parts
            .extensions
            .get::<User>()
            .map_or_else(|| "anonymous".to_owned(), |u| u.0.clone())
    };
    let app = statement(runs.clone())
        .route_layer(middleware::from_fn(authenticate))
        .route_layer(IdempotencyLayer::new(MemoryStore::new(), fallback));
    let alice = call(&app, post_as("alice", "k-1")).await;
    let bob = call(&app, post_as("bob", "k-1")).await;
    assert_eq!(&alice.2[..], b"run 1: alice's balance");
    assert_eq!(
        (bob.0, bob.1.as_deref(), &bob.2[..]),
        (
            StatusCode::CREATED,
            Some("true"),
            &b"run 1: alice's balance"[..]
        ),
        "bob got alice's response"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Answers with the key and scope the layer claimed, as the handler sees them.
async fn forward(claimed: ClaimedKey) -> String {
    format!("scope={} key={}", claimed.scope(), claimed.key())
}

async fn forward_if_any(claimed: Option<ClaimedKey>) -> String {
    claimed.map_or_else(|| "no key".to_owned(), |c| format!("key={}", c.key()))
}

#[tokio::test]
async fn the_handler_sees_the_claimed_key_and_scope() {
    let app = Router::new()
        .route("/charges", post(forward))
        .route("/optional", post(forward_if_any))
        .route_layer(IdempotencyLayer::new(
            MemoryStore::new(),
            scope::extension::<User>(),
        ))
        .route_layer(middleware::from_fn(authenticate));
    let request = |path: &str, key: Option<&str>| {
        let mut request = Request::post(path).header("authorization", "Bearer alice");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        request.body(Body::empty()).unwrap()
    };
    // The quoted (RFC 9651) form: the handler gets the key unquoted and unescaped.
    let (status, _, body) = call(&app, request("/charges", Some(r#""order \"17\"""#))).await;
    assert_eq!(
        (status, &body[..]),
        (StatusCode::OK, &br#"scope=alice key=order "17""#[..])
    );
    let (status, _, body) = call(&app, request("/optional", Some("ord-18"))).await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"key=ord-18"[..]));
    let (status, _, body) = call(&app, request("/optional", None)).await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"no key"[..]));
}

#[tokio::test]
async fn a_claimed_key_extractor_without_a_key_is_a_500_problem() {
    let app = Router::new()
        .route("/charges", post(forward))
        .route_layer(IdempotencyLayer::new(
            MemoryStore::new(),
            scope::GlobalScope,
        ));
    let request = Request::post("/charges").body(Body::empty()).unwrap();
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json"
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        body,
        concat!(
            r#"{"type":"about:blank","title":"Internal Server Error","status":500,"#,
            r#""detail":"this handler needs the request's idempotency key, and the request has none: put the route behind an IdempotencyLayer with require_key(true), or take Option<ClaimedKey>"}"#
        )
    );
}

#[tokio::test]
async fn a_store_error_answers_as_the_layers_problem() {
    let problem = |e: StoreError| async move {
        let response = e.into_response();
        let status = response.status();
        let retry_after = response
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_owned());
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (
            status.as_u16(),
            retry_after,
            String::from_utf8(body.to_vec()).unwrap(),
        )
    };
    assert_eq!(
        problem(StoreError::unavailable("locked")).await,
        (503, Some("1".into()), STORE_UNAVAILABLE.into())
    );
    assert_eq!(
        problem(StoreError::config("bad table name")).await,
        (
            500,
            None,
            concat!(
                r#"{"type":"https://docs.rs/tower-idempotency/latest/tower_idempotency/problem/#store-misconfigured","#,
                r#""title":"Idempotency store misconfigured","status":500,"#,
                r#""detail":"the idempotency store is misconfigured; the request was not processed"}"#
            )
            .into()
        )
    );
    let full = StoreError::Full {
        capacity: 3,
        retry_after: std::time::Duration::from_secs(4),
    };
    assert_eq!(
        problem(full).await,
        (
            503,
            Some("4".into()),
            concat!(
                r#"{"type":"https://docs.rs/tower-idempotency/latest/tower_idempotency/problem/#store-full","#,
                r#""title":"Idempotency store full","status":503,"#,
                r#""detail":"the idempotency store has no room for a new key; the request was not processed; retry in 4 s"}"#
            )
            .into()
        )
    );
}

const STORE_UNAVAILABLE: &str = concat!(
    r#"{"type":"https://docs.rs/tower-idempotency/latest/tower_idempotency/problem/#store-unavailable","#,
    r#""title":"Idempotency store unavailable","status":503,"#,
    r#""detail":"the idempotency store is busy or unreachable and did not answer in time; the request was not processed; retry with the same key"}"#
);

/// A transactional handler that uses `?` on `run`: `x-bad-sql` makes its
/// statement fail.
async fn credit(
    State(runs): State<Arc<AtomicUsize>>,
    tx: SqliteTransaction,
    headers: HeaderMap,
) -> Result<String, TransactionError> {
    runs.fetch_add(1, Ordering::SeqCst);
    let table = if headers.contains_key("x-bad-sql") {
        "no_such_table"
    } else {
        "accounts"
    };
    let balance: i64 = tx
        .run(move |t| {
            t.execute(
                &format!("UPDATE {table} SET balance = balance + 5 WHERE id = 1"),
                [],
            )?;
            t.query_row("SELECT balance FROM accounts WHERE id = 1", [], |r| {
                r.get(0)
            })
        })
        .await?;
    Ok(format!("balance {balance}"))
}

#[tokio::test]
async fn a_failed_statement_is_a_500_problem_and_gives_the_key_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bank.sqlite3");
    let store = SqliteStore::open(&path).await.unwrap();
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute_batch(
            "CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL);
             INSERT INTO accounts VALUES (1, 100);",
        )
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route("/credits", post(credit))
        .route_layer(IdempotencyLayer::new(store, scope::GlobalScope).transactional())
        .with_state(runs.clone());
    let request = |bad: bool| {
        let mut request = Request::post("/credits").header("idempotency-key", "k-1");
        if bad {
            request = request.header("x-bad-sql", "1");
        }
        request.body(Body::empty()).unwrap()
    };
    let (status, replayed, body) = call(&app, request(true)).await;
    assert_eq!(
        (status, replayed, &body[..]),
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            None,
            &br#"{"type":"about:blank","title":"Internal Server Error","status":500,"detail":"a database statement failed while this request was processed"}"#[..]
        )
    );
    // The 500 was not stored: the same key runs again.
    let (status, replayed, body) = call(&app, request(false)).await;
    assert_eq!(
        (status, replayed, &body[..]),
        (StatusCode::OK, None, &b"balance 105"[..])
    );
    let (status, replayed, body) = call(&app, request(false)).await;
    assert_eq!(
        (status, replayed.as_deref(), &body[..]),
        (StatusCode::OK, Some("true"), &b"balance 105"[..])
    );
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

mod extractor_rejections {
    //! axum's own extractor rejections never poison a key (issue 38, item
    //! 2): `Json<T>` refusing a body (422), a missing content type (415),
    //! a `Path` that does not parse (400) are answered and not stored, with
    //! the default layer, so the corrected request under the same key runs
    //! once and its repeat is the replay. In both modes.

    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::Router;
    use axum::body::Body;
    use axum::extract::{Json, Path, Request, State};
    use axum::http::StatusCode;
    use axum::routing::post;
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    use tower_idempotency::store::{MemoryStore, SqliteStore, SqliteTransaction};
    use tower_idempotency::{IdempotencyLayer, scope::GlobalScope};

    #[derive(serde::Deserialize)]
    struct Payment {
        amount: u32,
    }

    async fn pay(
        State(runs): State<Arc<AtomicUsize>>,
        Path(account): Path<u32>,
        Json(payment): Json<Payment>,
    ) -> (StatusCode, String) {
        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
        (
            StatusCode::CREATED,
            format!("run {n}: {} to {account}", payment.amount),
        )
    }

    async fn pay_in_transaction(
        State(runs): State<Arc<AtomicUsize>>,
        _tx: SqliteTransaction,
        Path(account): Path<u32>,
        Json(payment): Json<Payment>,
    ) -> (StatusCode, String) {
        pay(State(runs), Path(account), Json(payment)).await
    }

    async fn call(app: &Router, path: &str, json: bool, body: &'static str) -> (u16, bool, String) {
        let mut request = Request::post(path).header("idempotency-key", "\"k\"");
        if json {
            request = request.header("content-type", "application/json");
        }
        let response = app
            .clone()
            .oneshot(request.body(Body::from(body)).unwrap())
            .await
            .unwrap();
        let status = response.status().as_u16();
        let replayed = response.headers().contains_key("idempotent-replayed");
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, replayed, String::from_utf8(bytes.to_vec()).unwrap())
    }

    async fn corrected_request_runs_once(app: Router, runs: &AtomicUsize) {
        // Refused by `Json` (a field missing: 422; no content type: 415)
        // and by `Path` (400): each answered by axum, twice, never replayed.
        for _ in 0..2 {
            let missing = call(&app, "/pay/7", true, r#"{"amunt":5}"#).await;
            assert_eq!((missing.0, missing.1), (422, false), "{missing:?}");
            let untyped = call(&app, "/pay/7", false, r#"{"amount":5}"#).await;
            assert_eq!((untyped.0, untyped.1), (415, false), "{untyped:?}");
            let bad_path = call(&app, "/pay/seven", true, r#"{"amount":5}"#).await;
            assert_eq!((bad_path.0, bad_path.1), (400, false), "{bad_path:?}");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 0);
        // The corrected request, same key: it runs, once.
        let paid = call(&app, "/pay/7", true, r#"{"amount":5}"#).await;
        assert_eq!(paid, (201, false, "run 1: 5 to 7".to_owned()));
        let again = call(&app, "/pay/7", true, r#"{"amount":5}"#).await;
        assert_eq!(again, (201, true, "run 1: 5 to 7".to_owned()));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn separate_mode() {
        let runs = Arc::new(AtomicUsize::new(0));
        let app = Router::new()
            .route("/pay/{account}", post(pay))
            .route_layer(IdempotencyLayer::new(MemoryStore::new(), GlobalScope))
            .with_state(runs.clone());
        corrected_request_runs_once(app, &runs).await;
    }

    #[tokio::test]
    async fn transactional_mode() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path().join("app.sqlite3"))
            .await
            .unwrap();
        let runs = Arc::new(AtomicUsize::new(0));
        let layer = IdempotencyLayer::new(store, GlobalScope)
            .require_key(true)
            .transactional();
        let app = Router::new()
            .route("/pay/{account}", post(pay_in_transaction))
            .route_layer(layer)
            .with_state(runs.clone());
        corrected_request_runs_once(app, &runs).await;
    }
}
