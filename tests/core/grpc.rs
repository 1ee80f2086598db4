//! The gRPC example (`examples/grpc.rs`) on a real socket, called by a real
//! tonic client over HTTP/2: replays with their trailers, the status mapping
//! of every rejection, the store policy, and a duplicate held in flight by a
//! gate (never a sleep).

#[path = "../../examples/grpc.rs"]
#[allow(dead_code)]
mod example;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use http_body_util::{BodyExt, Full};
use prost::Message;
use tokio::net::TcpListener;
use tonic::Code;
use tonic::metadata::MetadataMap;
use tower::{Layer, ServiceExt, service_fn};
use tower_idempotency::problem::Rejection;
use tower_idempotency::{MemoryStore, RequestBody};

use example::{
    ChargeReply, ChargeRequest, Gate, PaymentsClient, PaymentsLayer, RETRY_PUSHBACK, charge_request,
};

/// The example's server on 127.0.0.1:0, and a client connected to it.
async fn start(
    payments: Arc<example::Payments>,
    layer: PaymentsLayer<MemoryStore>,
) -> (SocketAddr, PaymentsClient) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(example::serve(listener, payments, layer));
    // The listener is bound already: the connection waits in its backlog
    // until the server accepts it.
    let client = PaymentsClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    (addr, client)
}

fn charge(account: &str, amount_cents: i64) -> ChargeRequest {
    ChargeRequest {
        account: account.into(),
        amount_cents,
    }
}

fn with_key(message: ChargeRequest, key: &str) -> tonic::Request<ChargeRequest> {
    charge_request(message, Some(key), Some("alice"))
}

fn get<'a>(metadata: &'a MetadataMap, name: &str) -> Option<&'a str> {
    metadata.get(name).map(|v| v.to_str().unwrap())
}

/// The metadata a response carries apart from what varies per response
/// (`date`) and what a replay adds (`content-length`, the marker).
fn comparable(metadata: &MetadataMap) -> HeaderMap {
    let mut map = metadata.clone().into_headers();
    for name in ["date", "content-length", "idempotent-replayed"] {
        map.remove(name);
    }
    map
}

#[tokio::test]
async fn a_repeat_gets_the_first_reply_and_its_trailers() {
    let payments = Arc::new(example::Payments::new());
    let store = MemoryStore::new();
    let (_, mut client) = start(payments.clone(), example::payments_layer(store.clone())).await;

    let first = client
        .charge(with_key(charge("acct-1", 500), "k-1"))
        .await
        .unwrap();
    assert_eq!(
        *first.get_ref(),
        ChargeReply {
            charge_id: "ch_1".into(),
            account: "acct-1".into(),
            amount_cents: 500,
        }
    );
    assert_eq!(payments.executions(), 1);
    // tonic's client merges the trailers into the metadata: `grpc-status`
    // came in the trailers, after the reply.
    assert_eq!(get(first.metadata(), "grpc-status"), Some("0"));
    assert_eq!(get(first.metadata(), "grpc-message"), None);
    assert_eq!(get(first.metadata(), "idempotent-replayed"), None);
    assert_eq!(store.len(), 1);

    let again = client
        .charge(with_key(charge("acct-1", 500), "k-1"))
        .await
        .unwrap();
    assert_eq!(payments.executions(), 1, "the repeat did not run");
    assert_eq!(again.get_ref(), first.get_ref());
    assert_eq!(
        again.get_ref().encode_to_vec(),
        first.get_ref().encode_to_vec()
    );
    assert_eq!(get(again.metadata(), "idempotent-replayed"), Some("true"));
    assert_eq!(get(again.metadata(), "grpc-status"), Some("0"));
    assert_eq!(get(again.metadata(), "grpc-message"), None);
    assert_eq!(
        get(again.metadata(), "content-type"),
        Some("application/grpc")
    );
    let first_fields = comparable(first.metadata());
    let mut names: Vec<_> = first_fields.keys().map(|n| n.as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["content-type", "grpc-status"]);
    assert_eq!(comparable(again.metadata()), first_fields);

    // Another key is another charge.
    let other = client
        .charge(with_key(charge("acct-1", 500), "k-2"))
        .await
        .unwrap();
    assert_eq!(other.get_ref().charge_id, "ch_2");
    assert_eq!(payments.executions(), 2);
}

#[tokio::test]
async fn the_handlers_own_error_is_stored_and_replayed() {
    let payments = Arc::new(example::Payments::new());
    let (_, mut client) = start(
        payments.clone(),
        example::payments_layer(MemoryStore::new()),
    )
    .await;

    let first = client
        .charge(with_key(charge("acct-1", 0), "k-zero"))
        .await
        .unwrap_err();
    assert_eq!(first.code(), Code::InvalidArgument);
    assert_eq!(first.message(), "amount_cents must be positive");
    assert_eq!(get(first.metadata(), "idempotent-replayed"), None);

    let again = client
        .charge(with_key(charge("acct-1", 0), "k-zero"))
        .await
        .unwrap_err();
    assert_eq!(payments.executions(), 1, "a considered answer is replayed");
    assert_eq!(again.code(), Code::InvalidArgument);
    assert_eq!(again.message(), "amount_cents must be positive");
    assert_eq!(get(again.metadata(), "idempotent-replayed"), Some("true"));
    assert_eq!(comparable(again.metadata()), comparable(first.metadata()));
}

#[tokio::test]
async fn the_same_key_with_another_request_is_failed_precondition() {
    let payments = Arc::new(example::Payments::new());
    let (_, mut client) = start(
        payments.clone(),
        example::payments_layer(MemoryStore::new()),
    )
    .await;

    client
        .charge(with_key(charge("acct-1", 500), "k-1"))
        .await
        .unwrap();
    let changed = client
        .charge(with_key(charge("acct-1", 700), "k-1"))
        .await
        .unwrap_err();
    assert_eq!(changed.code(), Code::FailedPrecondition);
    assert_eq!(changed.message(), Rejection::Mismatch.detail());
    assert_eq!(get(changed.metadata(), "idempotent-replayed"), None);
    assert_eq!(payments.executions(), 1);

    // The key still replays its own request.
    let again = client
        .charge(with_key(charge("acct-1", 500), "k-1"))
        .await
        .unwrap();
    assert_eq!(again.get_ref().charge_id, "ch_1");
}

#[tokio::test]
async fn a_duplicate_in_flight_is_unavailable_with_pushback_then_replays() {
    let gate = Arc::new(Gate::default());
    let payments = Arc::new(example::Payments::gated(gate.clone()));
    let (_, client) = start(
        payments.clone(),
        example::payments_layer(MemoryStore::new()),
    )
    .await;

    let mut first_client = client.clone();
    let first = tokio::spawn(async move {
        first_client
            .charge(with_key(charge("acct-1", 500), "k-1"))
            .await
    });
    // The first charge is inside the handler, holding the key.
    gate.entered.acquire().await.unwrap().forget();
    assert_eq!(payments.executions(), 1);

    let mut client = client;
    let duplicate = client
        .charge(with_key(charge("acct-1", 500), "k-1"))
        .await
        .unwrap_err();
    assert_eq!(duplicate.code(), Code::Unavailable);
    let pushback: u64 = get(duplicate.metadata(), RETRY_PUSHBACK)
        .unwrap()
        .parse()
        .unwrap();
    // Whole seconds of the 60 s lease that are left.
    assert!(pushback.is_multiple_of(1000) && (1000..=60_000).contains(&pushback));
    let secs = pushback / 1000;
    let in_flight = Rejection::InFlight {
        retry_after_secs: secs,
    };
    assert_eq!(duplicate.message(), in_flight.detail());
    assert_eq!(payments.executions(), 1, "the duplicate did not run");

    gate.proceed.add_permits(1);
    let first = first.await.unwrap().unwrap();
    assert_eq!(first.get_ref().charge_id, "ch_1");
    assert_eq!(get(first.metadata(), "idempotent-replayed"), None);

    let retry = client
        .charge(with_key(charge("acct-1", 500), "k-1"))
        .await
        .unwrap();
    assert_eq!(retry.get_ref(), first.get_ref());
    assert_eq!(get(retry.metadata(), "idempotent-replayed"), Some("true"));
    assert_eq!(payments.executions(), 1);
}

#[tokio::test]
async fn unavailable_releases_the_key_so_the_retry_runs_again() {
    let payments = Arc::new(example::Payments::new());
    let store = MemoryStore::new();
    let (_, mut client) = start(payments.clone(), example::payments_layer(store.clone())).await;

    let first = client
        .charge(with_key(charge("unavailable", 500), "k-1"))
        .await
        .unwrap_err();
    assert_eq!(first.code(), Code::Unavailable);
    assert_eq!(
        first.message(),
        "the payment provider is unavailable; nothing was charged"
    );
    assert_eq!(payments.executions(), 1);
    assert!(store.is_empty(), "the key was released");

    let retry = client
        .charge(with_key(charge("unavailable", 500), "k-1"))
        .await
        .unwrap_err();
    assert_eq!(retry.code(), Code::Unavailable);
    assert_eq!(get(retry.metadata(), "idempotent-replayed"), None);
    assert_eq!(payments.executions(), 2, "the retry ran again");
    assert!(store.is_empty());
}

#[tokio::test]
async fn keys_are_required_and_validated() {
    let payments = Arc::new(example::Payments::new());
    let (_, mut client) = start(
        payments.clone(),
        example::payments_layer(MemoryStore::new()),
    )
    .await;

    let missing = client
        .charge(charge_request(charge("acct-1", 500), None, Some("alice")))
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument);
    assert_eq!(missing.message(), Rejection::MissingKey.detail());

    let list = client
        .charge(with_key(charge("acct-1", 500), "\"a\", \"b\""))
        .await
        .unwrap_err();
    assert_eq!(list.code(), Code::InvalidArgument);
    assert_eq!(
        list.message(),
        "the idempotency key field holds a list; it must be one string"
    );
    assert_eq!(payments.executions(), 0);
}

#[tokio::test]
async fn keys_belong_to_their_caller() {
    let payments = Arc::new(example::Payments::new());
    let (_, mut client) = start(
        payments.clone(),
        example::payments_layer(MemoryStore::new()),
    )
    .await;

    let alice = client
        .charge(charge_request(
            charge("acct-1", 500),
            Some("k-1"),
            Some("alice"),
        ))
        .await
        .unwrap();
    let bob = client
        .charge(charge_request(
            charge("acct-1", 500),
            Some("k-1"),
            Some("bob"),
        ))
        .await
        .unwrap();
    let anonymous = client
        .charge(charge_request(charge("acct-1", 500), Some("k-1"), None))
        .await
        .unwrap();
    let ids: Vec<_> = [&alice, &bob, &anonymous]
        .map(|r| r.get_ref().charge_id.clone())
        .into();
    assert_eq!(ids, ["ch_1", "ch_2", "ch_3"]);
    assert_eq!(payments.executions(), 3);
}

#[tokio::test]
async fn a_body_over_the_limit_is_resource_exhausted() {
    let payments = Arc::new(example::Payments::new());
    let layer = example::payments_layer(MemoryStore::new()).max_request_body(16);
    let (_, mut client) = start(payments.clone(), layer).await;

    let large = client
        .charge(with_key(charge(&"a".repeat(64), 500), "k-1"))
        .await
        .unwrap_err();
    assert_eq!(large.code(), Code::ResourceExhausted);
    assert_eq!(
        large.message(),
        Rejection::BodyTooLarge { limit: 16 }.detail()
    );
    assert_eq!(payments.executions(), 0);
}

#[tokio::test]
async fn a_reply_too_large_to_keep_is_already_exists_on_repeat() {
    let payments = Arc::new(example::Payments::new());
    let layer = example::payments_layer(MemoryStore::new()).max_response_body(8);
    let (_, mut client) = start(payments.clone(), layer).await;

    let first = client
        .charge(with_key(charge("acct-1", 500), "k-1"))
        .await
        .unwrap();
    assert_eq!(
        first.get_ref().charge_id,
        "ch_1",
        "the first caller gets it whole"
    );
    let again = client
        .charge(with_key(charge("acct-1", 500), "k-1"))
        .await
        .unwrap_err();
    assert_eq!(again.code(), Code::AlreadyExists);
    assert_eq!(again.message(), Rejection::ResponseNotStored.detail());
    assert_eq!(payments.executions(), 1, "it never runs twice");
}

/// Every rejection is a Trailers-Only status: HTTP 200, the gRPC content
/// type, `grpc-status` and `grpc-message` in the head, no body.
#[test]
fn every_rejection_maps_to_a_trailers_only_status() {
    let table = [
        (Rejection::MissingKey, Code::InvalidArgument, None),
        (
            Rejection::InvalidKey(tower_idempotency::key::KeyError::Empty),
            Code::InvalidArgument,
            None,
        ),
        (
            Rejection::UnreadableBody("no".into()),
            Code::InvalidArgument,
            None,
        ),
        (
            Rejection::BodyTooLarge { limit: 1 },
            Code::ResourceExhausted,
            None,
        ),
        (Rejection::Mismatch, Code::FailedPrecondition, None),
        (
            Rejection::InFlight {
                retry_after_secs: 7,
            },
            Code::Unavailable,
            Some("7000"),
        ),
        (
            Rejection::StoreUnavailable {
                retry_after_secs: 1,
            },
            Code::Unavailable,
            Some("1000"),
        ),
        (Rejection::ResponseNotStored, Code::AlreadyExists, None),
        (Rejection::Unauthenticated, Code::Unauthenticated, None),
        (
            Rejection::StoreFull {
                retry_after_secs: 30,
            },
            Code::Unavailable,
            Some("30000"),
        ),
    ];
    for (rejection, code, pushback) in table {
        let response = example::grpc_rejection(&rejection);
        assert_eq!(response.status(), StatusCode::OK, "{rejection:?}");
        assert!(response.body().is_empty());
        let headers = response.headers();
        assert_eq!(headers["content-type"], "application/grpc");
        assert_eq!(headers["grpc-status"], (code as i32).to_string().as_str());
        assert_eq!(
            headers.get(RETRY_PUSHBACK).map(|v| v.to_str().unwrap()),
            pushback
        );
        let status = tonic::Status::from_header_map(headers).unwrap();
        assert_eq!(status.code(), code);
        assert_eq!(status.message(), rejection.detail());
        // The store policy would store none of the non-transient ones: they
        // never reach it (rejections are not stored), but a handler that
        // answered the same code would be treated the same way.
        assert_eq!(
            example::grpc_store_policy(StatusCode::OK, headers),
            !example::is_transient(code)
        );
    }
}

#[test]
fn the_store_policy_releases_transient_codes_in_the_head() {
    let head = |code: &str| {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", "application/grpc".parse().unwrap());
        headers.insert("grpc-status", code.parse().unwrap());
        headers
    };
    let policy = example::grpc_store_policy;
    // OK, INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, PERMISSION_DENIED,
    // FAILED_PRECONDITION, OUT_OF_RANGE, UNAUTHENTICATED: stored.
    for code in ["0", "3", "5", "6", "7", "9", "11", "16"] {
        assert!(policy(StatusCode::OK, &head(code)), "{code}");
    }
    // CANCELLED, UNKNOWN, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED,
    // UNIMPLEMENTED, INTERNAL, UNAVAILABLE, DATA_LOSS, and garbage: released.
    for code in ["1", "2", "4", "8", "10", "12", "13", "14", "15", "x"] {
        assert!(!policy(StatusCode::OK, &head(code)), "{code}");
    }
    // No status in the head: decided by the HTTP status alone.
    assert!(policy(StatusCode::OK, &HeaderMap::new()));
    assert!(!policy(StatusCode::SERVICE_UNAVAILABLE, &HeaderMap::new()));
}

/// A transient status that comes only in the trailers, after a body, is seen
/// by the policy's second question: the key is released and the retry runs.
#[tokio::test]
async fn a_transient_status_in_the_trailers_releases_the_key() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    let inner = service_fn(move |_req: http::Request<RequestBody<Full<Bytes>>>| {
        counter.fetch_add(1, Ordering::SeqCst);
        async {
            let mut trailers = HeaderMap::new();
            trailers.insert("grpc-status", "14".parse().unwrap());
            let body = Full::new(Bytes::from_static(b"\0\0\0\0\0"))
                .with_trailers(async { Some(Ok(trailers)) });
            let mut response = http::Response::new(body);
            response
                .headers_mut()
                .insert("content-type", "application/grpc".parse().unwrap());
            Ok::<_, Infallible>(response)
        }
    });
    let svc = example::payments_layer(MemoryStore::new()).layer(inner);
    let request = || {
        http::Request::post(example::CHARGE_PATH)
            .header("idempotency-key", "k-1")
            .body(Full::new(Bytes::from_static(b"\0\0\0\0\0")))
            .unwrap()
    };
    let first = svc.clone().oneshot(request()).await.unwrap();
    let first = first.into_body().collect().await.unwrap();
    assert_eq!(first.trailers().unwrap()["grpc-status"], "14");
    let again = svc.clone().oneshot(request()).await.unwrap();
    assert!(again.headers().get("idempotent-replayed").is_none());
    let again = again.into_body().collect().await.unwrap();
    assert_eq!(again.trailers().unwrap()["grpc-status"], "14");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        2,
        "UNAVAILABLE in the trailers released the key: the retry ran"
    );
}
