//! The outbox's attempt fence on SQLite: a late finish of an old attempt
//! (its relay stalled past its lease) must not change a row another relay
//! has claimed since, even when a requeue came between them.

#![cfg(all(feature = "sqlite", feature = "outbox"))]

use std::future::Future;
use std::path::Path;
use std::task::{Context, Waker};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tower_idempotency_outbox::{self as outbox, Delivery, Message, Outbox, Outcome, View};

/// One delivery the test answers: its attempt and where its outcome goes.
type Pending = (u32, oneshot::Sender<Outcome>);

/// A sink that hands every delivery to the test and waits for its outcome.
fn scripted(to_test: mpsc::UnboundedSender<Pending>) -> impl outbox::Sink {
    outbox::from_fn(move |d: Delivery| {
        let to_test = to_test.clone();
        async move {
            let (answer, outcome) = oneshot::channel();
            to_test.send((d.attempt, answer)).unwrap();
            outcome
                .await
                .unwrap_or_else(|_| Outcome::Retry("the test dropped it".into()))
        }
    })
}

async fn next(deliveries: &mut mpsc::UnboundedReceiver<Pending>) -> Pending {
    tokio::time::timeout(Duration::from_secs(30), deliveries.recv())
        .await
        .expect("a delivery within 30 s")
        .expect("the sink is alive")
}

fn conn(db: &Path) -> tower_idempotency::rusqlite::Connection {
    let conn = tower_idempotency::rusqlite::Connection::open(db).unwrap();
    conn.busy_timeout(Duration::from_secs(5)).unwrap();
    conn
}

/// Waits (bounded) until `check` holds.
async fn until<F: Future<Output = bool>>(what: &str, mut check: impl FnMut() -> F) {
    for _ in 0..1_500 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting until {what}");
}

/// One message (`key`) in a new SQLite outbox, relays whose every attempt
/// the test answers, and relay 1 stalled past its lease in attempt 1.
struct Scene {
    _dir: tempfile::TempDir,
    db: std::path::PathBuf,
    outbox: Outbox,
    to_test: mpsc::UnboundedSender<Pending>,
    deliveries: mpsc::UnboundedReceiver<Pending>,
}

impl Scene {
    async fn new(key: &str) -> Scene {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("outbox.sqlite3");
        let outbox = Outbox::sqlite(&db).await.unwrap();
        let m = Message::with_key(key, "http://127.0.0.1:9/", "text/plain", b"x".to_vec()).unwrap();
        assert!(outbox::sqlite::enqueue(&conn(&db), &m).unwrap());
        let (to_test, deliveries) = mpsc::unbounded_channel();
        Scene {
            _dir: dir,
            db,
            outbox,
            to_test,
            deliveries,
        }
    }

    fn relay(&self) -> outbox::RelayHandle {
        self.outbox
            .relay(scripted(self.to_test.clone()))
            .max_in_flight(1)
            .lease(Duration::from_secs(60))
            .answer_timeout(Duration::from_secs(60))
            .poll_interval(Duration::from_millis(10))
            .backoff(Duration::from_millis(1), Duration::from_millis(2))
            .max_attempts(Some(10))
            .spawn()
    }

    /// Relay 1 delivers attempt 1, is asked to stop (so it claims nothing
    /// more: its stop flag is set by the first poll of `shutdown`, which
    /// then waits for the attempt in flight), and stalls past its lease
    /// (the lease ends now). Returns attempt 1's answer and relay 1's end.
    async fn stall_first(
        &mut self,
    ) -> (oneshot::Sender<Outcome>, impl Future<Output = ()> + use<>) {
        let first = self.relay();
        let (attempt, late) = next(&mut self.deliveries).await;
        assert_eq!(attempt, 1);
        let mut first_stopped = Box::pin(first.shutdown());
        assert!(
            first_stopped
                .as_mut()
                .poll(&mut Context::from_waker(Waker::noop()))
                .is_pending()
        );
        conn(&self.db)
            .execute("UPDATE tower_idempotency_outbox SET lease_until_ms = 0", [])
            .unwrap();
        (late, first_stopped)
    }
}

/// Relay 1 delivers attempt 1 and stalls past its lease; relay 2 takes the
/// message over (attempt 2), it is refused and dead-lettered; an operator
/// requeues it and relay 2 claims it again (attempt 1 once more, as the
/// requeue resets the count). Relay 1's late finish of *its* attempt 1 must
/// be refused by the fence: relay 2 still holds the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_finish_before_a_requeue_does_not_touch_the_reclaimed_row() {
    let mut scene = Scene::new("fence-1").await;
    let (late, first_stopped) = scene.stall_first().await;

    let second = scene.relay();
    let (attempt, refuse) = next(&mut scene.deliveries).await;
    assert_eq!(attempt, 2, "relay 2 took the message over");
    refuse.send(Outcome::Reject("refused".into())).unwrap();
    until("the message is a dead letter", || async {
        scene.outbox.counts().await.unwrap().dead == 1
    })
    .await;
    let dead = scene.outbox.list(View::Dead, 10).await.unwrap();
    assert_eq!(dead.len(), 1);
    assert!(scene.outbox.requeue(dead[0].id).await.unwrap());
    let (attempt, held) = next(&mut scene.deliveries).await;
    assert_eq!(attempt, 1, "a requeued message starts its attempts again");

    // Relay 1's attempt 1 ends now, long after its lease: its finish must
    // be refused.
    late.send(Outcome::Retry("late answer of the first attempt".into()))
        .unwrap();
    first_stopped.await;
    let counts = scene.outbox.counts().await.unwrap();
    assert_eq!(
        (counts.pending, counts.in_flight, counts.dead, counts.done),
        (0, 1, 0, 0),
        "relay 2 still holds the message: the stale attempt changed nothing"
    );
    let in_flight = scene.outbox.list(View::InFlight, 10).await.unwrap();
    assert_eq!(in_flight.len(), 1);
    assert_eq!(
        in_flight[0].last_error.as_deref(),
        Some("refused"),
        "the last error is relay 2's refusal, not the stale attempt's"
    );

    held.send(Outcome::Delivered).unwrap();
    second.shutdown().await;
    let counts = scene.outbox.counts().await.unwrap();
    assert_eq!(
        (counts.pending, counts.in_flight, counts.dead, counts.done),
        (0, 0, 0, 1)
    );
    assert!(
        scene.deliveries.try_recv().is_err(),
        "three deliveries in all, none while relay 2 held the message"
    );
}

/// Control without a requeue: a late finish of attempt 1 after attempt 2
/// was claimed is refused (attempts only grow).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_finish_of_an_old_attempt_does_not_touch_the_reclaimed_row() {
    let mut scene = Scene::new("fence-2").await;
    let (late, first_stopped) = scene.stall_first().await;
    let second = scene.relay();
    let (attempt, held) = next(&mut scene.deliveries).await;
    assert_eq!(attempt, 2);
    late.send(Outcome::Reject("late refusal of attempt 1".into()))
        .unwrap();
    first_stopped.await;
    let counts = scene.outbox.counts().await.unwrap();
    assert_eq!(
        (counts.pending, counts.in_flight, counts.dead, counts.done),
        (0, 1, 0, 0),
        "the late dead-letter of attempt 1 was refused by the fence"
    );
    held.send(Outcome::Delivered).unwrap();
    second.shutdown().await;
    let counts = scene.outbox.counts().await.unwrap();
    assert_eq!(
        (counts.pending, counts.in_flight, counts.dead, counts.done),
        (0, 0, 0, 1)
    );
    assert!(scene.deliveries.try_recv().is_err());
}
