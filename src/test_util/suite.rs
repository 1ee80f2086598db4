//! The checks of the store contract, one `async fn` each: `store_suite!`
//! runs them (see the [module docs](super)); [`super::run`] runs one.
//!
//! Each takes a fresh, empty store and the [`ManualClock`] it was made on
//! (reading [`START_MS`]), and panics when the store breaks
//! the contract.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Barrier;

use super::{
    LEASE, ManualClock, START_MS, TTL, acquire, claim_of, claim_ttl, complete, counts, id, response,
};
use crate::fingerprint::Fingerprint;
use crate::response::StoredBody;
use crate::store::{
    Claim, Completion, FencingToken, Inspect, RecordId, RecordSummary, Refusal, Store,
};

/// A key never claimed is acquired, not taken over.
pub async fn new_key_is_acquired<S: Store>(store: S, _clock: ManualClock) {
    acquire(&store, "k").await;
}

/// A completed record answers the next claim with its exact response (bytes
/// that are not UTF-8 included).
pub async fn completed_record_is_replayed<S: Store>(store: S, _clock: ManualClock) {
    let token = acquire(&store, "k").await;
    assert_eq!(
        complete(&store, "k", token, b"\xff\x00\xfe").await,
        Completion::Stored
    );
    let again = store
        .claim(claim_of("s", "k", 1, FencingToken::random()))
        .await
        .unwrap();
    assert_eq!(
        again,
        Claim::Refused(Refusal::Completed(response(b"\xff\x00\xfe")))
    );
}

/// Another fingerprint is a mismatch, in flight or completed: the fingerprint
/// is checked before the state.
pub async fn mismatch_is_checked_first<S: Store>(store: S, _clock: ManualClock) {
    let token = acquire(&store, "k").await;
    // In flight: a different fingerprint is a mismatch, not a 409.
    let other = store
        .claim(claim_of("s", "k", 2, FencingToken::random()))
        .await
        .unwrap();
    assert_eq!(other, Claim::Refused(Refusal::Mismatch));
    complete(&store, "k", token, b"done").await;
    let other = store
        .claim(claim_of("s", "k", 2, FencingToken::random()))
        .await
        .unwrap();
    assert_eq!(other, Claim::Refused(Refusal::Mismatch));
}

/// A claim while the holder's lease is alive is refused as in flight, with the
/// lease left (50 s after 10 s of a 60 s lease).
pub async fn in_flight_reports_remaining_lease<S: Store>(store: S, clock: ManualClock) {
    acquire(&store, "k").await;
    clock.advance(Duration::from_secs(10));
    let again = store
        .claim(claim_of("s", "k", 1, FencingToken::random()))
        .await
        .unwrap();
    // Exactly 50 s on a manual clock; a server's clock also moved on a little.
    let Claim::Refused(Refusal::InFlight { lease_remaining }) = again else {
        panic!("expected in flight, got {again:?}");
    };
    assert!(
        lease_remaining <= Duration::from_secs(50) && lease_remaining > Duration::from_secs(49),
        "{lease_remaining:?}"
    );
}

/// After the lease, a claim takes the record over; the first holder can then
/// neither complete nor release it (the fencing token).
pub async fn expired_lease_is_taken_over_and_fenced<S: Store>(store: S, clock: ManualClock) {
    let first = acquire(&store, "k").await;
    clock.advance(LEASE + Duration::from_millis(1));
    let second = FencingToken::random();
    let claim = store.claim(claim_of("s", "k", 1, second)).await.unwrap();
    assert_eq!(claim, Claim::Acquired { taken_over: true });
    // The first holder comes back late: it can neither complete nor release.
    assert_eq!(
        complete(&store, "k", first, b"first").await,
        Completion::Fenced
    );
    assert!(!store.release(id("k"), first).await.unwrap());
    assert_eq!(
        complete(&store, "k", second, b"second").await,
        Completion::Stored
    );
    let replay = store
        .claim(claim_of("s", "k", 1, FencingToken::random()))
        .await
        .unwrap();
    assert_eq!(
        replay,
        Claim::Refused(Refusal::Completed(response(b"second")))
    );
}

/// Only the holder's token releases a record; once released, any request
/// (another fingerprint too) acquires it afresh.
pub async fn release_needs_the_token<S: Store>(store: S, _clock: ManualClock) {
    let token = acquire(&store, "k").await;
    let stranger = FencingToken::random();
    assert!(!store.release(id("k"), stranger).await.unwrap());
    assert!(matches!(
        store
            .claim(claim_of("s", "k", 1, FencingToken::random()))
            .await
            .unwrap(),
        Claim::Refused(Refusal::InFlight { .. })
    ));
    assert!(store.release(id("k"), token).await.unwrap());
    // Released: the next request runs at once, even with another fingerprint.
    let next = store
        .claim(claim_of("s", "k", 2, FencingToken::random()))
        .await
        .unwrap();
    assert_eq!(next, Claim::Acquired { taken_over: false });
}

/// A renewal moves the lease deadline to `lease` from now, fenced by the
/// token: 50 s into a 60 s lease, a renewal of 60 s leaves 60 s, and a
/// claim 30 s later still meets the holder (no take-over at the old
/// deadline).
pub async fn renewal_extends_the_lease<S: Store>(store: S, clock: ManualClock) {
    let token = acquire(&store, "k").await;
    clock.advance(Duration::from_secs(50));
    assert!(store.renew(id("k"), token, LEASE).await.unwrap());
    clock.advance(Duration::from_secs(30));
    let again = store
        .claim(claim_of("s", "k", 1, FencingToken::random()))
        .await
        .unwrap();
    let Claim::Refused(Refusal::InFlight { lease_remaining }) = again else {
        panic!("expected in flight after the renewal, got {again:?}");
    };
    assert!(
        lease_remaining <= Duration::from_secs(30) && lease_remaining > Duration::from_secs(29),
        "{lease_remaining:?}"
    );
    // The renewed holder completes as usual.
    assert_eq!(
        complete(&store, "k", token, b"done").await,
        Completion::Stored
    );
}

/// Only the token renews, and only an in-flight record: after a take-over
/// the first holder's renewal is refused (and changes nothing), as is any
/// renewal of a completed, released or unknown record.
pub async fn renewal_is_fenced<S: Store>(store: S, clock: ManualClock) {
    let first = acquire(&store, "k").await;
    assert!(
        !store
            .renew(id("k"), FencingToken::random(), LEASE)
            .await
            .unwrap()
    );
    clock.advance(LEASE + Duration::from_millis(1));
    let second = FencingToken::random();
    let claim = store.claim(claim_of("s", "k", 1, second)).await.unwrap();
    assert_eq!(claim, Claim::Acquired { taken_over: true });
    assert!(!store.renew(id("k"), first, LEASE).await.unwrap());
    assert_eq!(
        complete(&store, "k", second, b"second").await,
        Completion::Stored
    );
    assert!(!store.renew(id("k"), second, LEASE).await.unwrap());
    assert!(!store.renew(id("never"), second, LEASE).await.unwrap());
    let released = acquire(&store, "r").await;
    assert!(store.release(id("r"), released).await.unwrap());
    assert!(!store.renew(id("r"), released, LEASE).await.unwrap());
}

/// [`Store::renew_all`] answers for each claim in order, fenced as
/// [`Store::renew`] is: of four claims (two held, one taken over, one
/// completed), exactly the two held are renewed, and their leases then end
/// `lease` from the renewal.
pub async fn renew_all_renews_each_claim_fenced<S: Store>(store: S, clock: ManualClock) {
    let a = acquire(&store, "a").await;
    let lost = acquire(&store, "lost").await;
    let done = acquire(&store, "done").await;
    clock.advance(LEASE + Duration::from_millis(1));
    let b = acquire(&store, "b").await;
    let thief = FencingToken::random();
    let taken = store.claim(claim_of("s", "lost", 1, thief)).await.unwrap();
    assert_eq!(taken, Claim::Acquired { taken_over: true });
    assert_eq!(
        complete(&store, "done", done, b"done").await,
        Completion::Stored
    );
    let claims = vec![
        (id("a"), a),
        (id("lost"), lost),
        (id("b"), b),
        (id("done"), done),
    ];
    let renewed = store.renew_all(claims, LEASE).await.unwrap();
    assert_eq!(renewed, vec![true, false, true, false]);
    clock.advance(LEASE - Duration::from_secs(1));
    for key in ["a", "b"] {
        let again = store
            .claim(claim_of("s", key, 1, FencingToken::random()))
            .await
            .unwrap();
        assert!(
            matches!(again, Claim::Refused(Refusal::InFlight { .. })),
            "{key}: {again:?}"
        );
    }
    assert!(store.renew_all(Vec::new(), LEASE).await.unwrap().is_empty());
}

/// A lease that ended but was not taken over is renewed: nobody else ran.
pub async fn an_ended_lease_nobody_took_is_renewed<S: Store>(store: S, clock: ManualClock) {
    let token = acquire(&store, "k").await;
    clock.advance(LEASE + Duration::from_secs(5));
    assert!(store.renew(id("k"), token, LEASE).await.unwrap());
    let again = store
        .claim(claim_of("s", "k", 1, FencingToken::random()))
        .await
        .unwrap();
    assert!(
        matches!(again, Claim::Refused(Refusal::InFlight { .. })),
        "{again:?}"
    );
}

/// A completed record is neither completed again nor released.
pub async fn completed_record_is_final<S: Store>(store: S, _clock: ManualClock) {
    let token = acquire(&store, "k").await;
    assert_eq!(
        complete(&store, "k", token, b"one").await,
        Completion::Stored
    );
    assert_eq!(
        complete(&store, "k", token, b"two").await,
        Completion::Fenced
    );
    assert!(!store.release(id("k"), token).await.unwrap());
    let replay = store
        .claim(claim_of("s", "k", 1, FencingToken::random()))
        .await
        .unwrap();
    assert_eq!(replay, Claim::Refused(Refusal::Completed(response(b"one"))));
}

/// A record past its TTL counts as absent, whatever its fingerprint.
pub async fn record_past_ttl_is_new<S: Store>(store: S, clock: ManualClock) {
    let token = acquire(&store, "k").await;
    complete(&store, "k", token, b"old").await;
    // A second of slack for stores on a server's clock, which moves on by itself.
    clock.advance(TTL - Duration::from_secs(1));
    assert!(matches!(
        store
            .claim(claim_of("s", "k", 1, FencingToken::random()))
            .await
            .unwrap(),
        Claim::Refused(Refusal::Completed(_))
    ));
    clock.advance(Duration::from_secs(1));
    // Past its TTL the record is ignored, whatever its fingerprint was.
    let fresh = store
        .claim(claim_of("s", "k", 2, FencingToken::random()))
        .await
        .unwrap();
    assert_eq!(fresh, Claim::Acquired { taken_over: false });
}

/// `purge_expired` deletes the records past their TTL and only those, and
/// returns how many.
pub async fn purge_removes_only_expired<S: Store>(store: S, clock: ManualClock) {
    acquire(&store, "old").await;
    clock.advance(TTL / 2);
    acquire(&store, "young").await;
    assert_eq!(store.purge_expired().await.unwrap(), 0);
    clock.advance(TTL / 2);
    assert_eq!(store.purge_expired().await.unwrap(), 1);
    // "young" survived the purge: its lease is long over, so it is taken over
    // (a purged record would be claimed afresh).
    assert_eq!(
        store
            .claim(claim_of("s", "young", 1, FencingToken::random()))
            .await
            .unwrap(),
        Claim::Acquired { taken_over: true }
    );
    assert_eq!(store.purge_expired().await.unwrap(), 0);
}

/// The same key in two scopes is two records.
pub async fn scopes_never_meet<S: Store>(store: S, _clock: ManualClock) {
    let token = FencingToken::random();
    store.claim(claim_of("alice", "k", 1, token)).await.unwrap();
    store
        .complete(RecordId::new("alice", "k"), token, response(b"alice's"))
        .await
        .unwrap();
    let bob = store
        .claim(claim_of("bob", "k", 1, FencingToken::random()))
        .await
        .unwrap();
    assert_eq!(bob, Claim::Acquired { taken_over: false });
}

/// 32 claims of one key at once: exactly one acquires it, every other sees it
/// in flight.
pub async fn concurrent_claims_have_one_winner<S: Store>(store: S, _clock: ManualClock) {
    const N: usize = 32;
    let barrier = Arc::new(Barrier::new(N));
    let tasks: Vec<_> = (0..N)
        .map(|_| {
            let (store, barrier) = (store.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store
                    .claim(claim_of("s", "k", 1, FencingToken::random()))
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut acquired = 0;
    for task in tasks {
        match task.await.unwrap() {
            Claim::Acquired { taken_over: false } => acquired += 1,
            Claim::Refused(Refusal::InFlight { .. }) => {}
            other => panic!("unexpected claim outcome {other:?}"),
        }
    }
    assert_eq!(acquired, 1);
}

/// A response stored without its body (`StoredBody::Omitted`) is replayed as
/// such.
pub async fn omitted_body_round_trips<S: Store>(store: S, _clock: ManualClock) {
    let token = acquire(&store, "k").await;
    let mut stored = response(b"");
    stored.body = StoredBody::Omitted;
    store
        .complete(id("k"), token, stored.clone())
        .await
        .unwrap();
    let replay = store
        .claim(claim_of("s", "k", 1, FencingToken::random()))
        .await
        .unwrap();
    assert_eq!(replay, Claim::Refused(Refusal::Completed(stored)));
}

// ------------------------------------------------------------- inspection

/// Asserts one stuck record. Its lease ended `ago` before the suite's clock
/// reading; a store on a server's clock also saw the real time pass since
/// the test began (`started`), so it may read up to that much later. Either
/// way the two figures add up to exactly TTL minus lease.
fn assert_summary(
    got: &RecordSummary,
    (scope, key, fp): (&str, &str, u8),
    ago: Duration,
    ttl: Duration,
    started: Instant,
) {
    let drift = started.elapsed().as_millis() as u64 + 1;
    assert_eq!(
        (got.scope.as_str(), got.key.as_str()),
        (scope, key),
        "{got:?}"
    );
    assert_eq!(got.fingerprint, Fingerprint([fp; 32]), "{got:?}");
    assert_eq!(got.fingerprint_hex(), format!("{fp:02x}").repeat(32));
    let ago = ago.as_millis() as u64;
    assert!(
        (ago..=ago + drift).contains(&got.lease_ended_ms_ago),
        "lease ended {} ms ago, expected {ago} (+ up to {drift})",
        got.lease_ended_ms_ago
    );
    assert_eq!(
        got.lease_ended_ms_ago + got.ttl_remaining_ms,
        (ttl - LEASE).as_millis() as u64,
        "{got:?}"
    );
}

/// [`Inspect::counts`] puts each record in exactly one kind as the clock moves,
/// and the purge removes the expired ones.
pub async fn counts_sort_every_record_into_one_kind<S: Inspect>(store: S, clock: ManualClock) {
    assert_eq!(store.counts().await.unwrap(), counts(0, 0, 0, 0));
    // t0: one to expire in flight, one whose holder crashes, one completed.
    claim_ttl(&store, "s", "short", 1, Duration::from_secs(30)).await;
    claim_ttl(&store, "s", "crashed", 1, TTL).await;
    let token = acquire(&store, "done").await;
    complete(&store, "done", token, b"ok").await;
    assert_eq!(store.counts().await.unwrap(), counts(2, 0, 1, 0));
    // t0 + 61 s: the leases of t0 are over; "short" is past its TTL too.
    clock.advance(LEASE + Duration::from_secs(1));
    claim_ttl(&store, "s", "alive", 1, TTL).await;
    assert_eq!(store.counts().await.unwrap(), counts(1, 1, 1, 1));
    assert_eq!(store.purge_expired().await.unwrap(), 1);
    assert_eq!(store.counts().await.unwrap(), counts(1, 1, 1, 0));
    // t0 + 1 h + 1 s: only "alive" (claimed at t0 + 61 s) is within its TTL,
    // and its lease is long over.
    clock.advance(TTL - LEASE);
    assert_eq!(store.counts().await.unwrap(), counts(0, 1, 0, 2));
    assert_eq!(store.purge_expired().await.unwrap(), 2);
    assert_eq!(store.counts().await.unwrap(), counts(0, 1, 0, 0));
}

/// Retention on by default: `store`, built with a purge every few
/// milliseconds in batches of 2 (`.purge(Purge::every(Duration::from_millis(20)).batch(2))`),
/// deletes its 5 records past their TTL on its own, completed or not, and
/// keeps the one still within it.
pub async fn expired_records_are_purged_on_their_own<S: Inspect>(store: S, clock: ManualClock) {
    for key in ["a", "b", "c"] {
        acquire(&store, key).await;
    }
    for key in ["d", "e"] {
        let token = acquire(&store, key).await;
        complete(&store, key, token, b"ok").await;
    }
    clock.advance(TTL + Duration::from_secs(1));
    claim_ttl(&store, "s", "alive", 1, TTL).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = store.counts().await.unwrap();
        if now == counts(1, 0, 0, 0) {
            return;
        }
        assert!(Instant::now() < deadline, "no purge within 10 s: {now:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// [`Store::purge_expired`] on a store whose statements delete at most 2
/// rows (`.purge(Purge::off().batch(2))`) still deletes every record past
/// its TTL, 5 here, in one call, and nothing else.
pub async fn purge_deletes_in_batches_until_none_is_left<S: Inspect>(store: S, clock: ManualClock) {
    for key in ["a", "b", "c", "d", "e"] {
        acquire(&store, key).await;
    }
    clock.advance(TTL + Duration::from_secs(1));
    claim_ttl(&store, "s", "alive", 1, TTL).await;
    assert_eq!(store.counts().await.unwrap(), counts(1, 0, 0, 5));
    assert_eq!(store.purge_expired().await.unwrap(), 5);
    assert_eq!(store.counts().await.unwrap(), counts(1, 0, 0, 0));
    assert_eq!(store.purge_expired().await.unwrap(), 0);
}

/// [`Inspect::stuck`] lists in-flight records whose lease ended, oldest lease
/// end first, up to the limit; a takeover takes one off the list.
pub async fn stuck_lists_ended_leases_oldest_first<S: Inspect>(store: S, clock: ManualClock) {
    let started = Instant::now();
    claim_ttl(&store, "s", "old", 1, TTL).await;
    claim_ttl(&store, "s", "gone", 3, Duration::from_secs(70)).await;
    clock.advance(Duration::from_secs(10));
    claim_ttl(&store, "t", "new", 2, TTL).await;
    let token = acquire(&store, "done").await;
    complete(&store, "done", token, b"ok").await;
    assert_eq!(store.stuck(10).await.unwrap(), vec![]);
    // t0 + 75 s: "old" ended 15 s ago, "new" 5 s ago; "gone" is past its
    // TTL and "done" is completed, so neither is stuck.
    clock.advance(Duration::from_secs(65));
    claim_ttl(&store, "s", "alive", 4, TTL).await;
    let stuck = store.stuck(10).await.unwrap();
    assert_eq!(stuck.len(), 2, "{stuck:?}");
    assert_summary(
        &stuck[0],
        ("s", "old", 1),
        Duration::from_secs(15),
        TTL,
        started,
    );
    assert_summary(
        &stuck[1],
        ("t", "new", 2),
        Duration::from_secs(5),
        TTL,
        started,
    );
    let first = store.stuck(1).await.unwrap();
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].record_id(), id("old"));
    assert_eq!(store.stuck(0).await.unwrap(), vec![]);
    // The retry takes "old" over: a fresh lease, no longer stuck.
    assert_eq!(
        store
            .claim(claim_of("s", "old", 1, FencingToken::random()))
            .await
            .unwrap(),
        Claim::Acquired { taken_over: true }
    );
    let stuck = store.stuck(10).await.unwrap();
    assert_eq!(stuck.len(), 1, "{stuck:?}");
    assert_summary(
        &stuck[0],
        ("t", "new", 2),
        Duration::from_secs(5),
        TTL,
        started,
    );
}

/// For stores judged by the [`Clock`](crate::store::Clock) they are given
/// (not a server's): on a [`ManualClock`] the figures are exact, ties in the lease end go by
/// scope then key, and the boundaries are those of the claim: a lease ending
/// now is over, a TTL ending now is over.
pub async fn inspect_is_exact_on_a_manual_clock<S: Inspect>(store: S, clock: ManualClock) {
    for (scope, key) in [("b", "k"), ("a", "z"), ("a", "k")] {
        claim_ttl(&store, scope, key, 5, TTL).await;
    }
    clock.advance(LEASE - Duration::from_millis(1));
    assert_eq!(store.counts().await.unwrap(), counts(3, 0, 0, 0));
    clock.advance(Duration::from_millis(1));
    assert_eq!(store.counts().await.unwrap(), counts(0, 3, 0, 0));
    let summary = |scope: &str, key: &str, ago: u64| {
        let ttl_remaining_ms = (TTL - LEASE).as_millis() as u64 - ago;
        RecordSummary::new(
            RecordId::new(scope, key),
            Fingerprint([5; 32]),
            ago,
            ttl_remaining_ms,
        )
    };
    assert_eq!(
        store.stuck(10).await.unwrap(),
        vec![
            summary("a", "k", 0),
            summary("a", "z", 0),
            summary("b", "k", 0)
        ]
    );
    clock.advance(Duration::from_millis(1234));
    assert_eq!(
        store.stuck(2).await.unwrap(),
        vec![summary("a", "k", 1234), summary("a", "z", 1234)]
    );
    clock.advance(TTL - LEASE - Duration::from_millis(1235));
    assert_eq!(
        store.stuck(1).await.unwrap(),
        vec![RecordSummary::new(
            RecordId::new("a", "k"),
            Fingerprint([5; 32]),
            3_539_999,
            1
        )]
    );
    clock.advance(Duration::from_millis(1));
    assert_eq!(store.counts().await.unwrap(), counts(0, 0, 0, 3));
    assert_eq!(store.stuck(10).await.unwrap(), vec![]);
}

/// Two independent handles on the same records (as two processes or app
/// servers would have): the store itself decides, not anything in either
/// handle. Ten rounds of 16 claimers of one key, half through each of two store
/// handles on the same records: exactly one wins each round.
pub async fn two_handles_one_winner<S: Store>(one: S, two: S) {
    for round in 0..10 {
        let key = format!("k{round}");
        let barrier = Arc::new(Barrier::new(16));
        let tasks: Vec<_> = (0..16)
            .map(|i| {
                let store = if i % 2 == 0 { one.clone() } else { two.clone() };
                let (barrier, key) = (barrier.clone(), key.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    store
                        .claim(claim_of("s", &key, 1, FencingToken::random()))
                        .await
                        .unwrap()
                })
            })
            .collect();
        let mut acquired = 0;
        for task in tasks {
            if let Claim::Acquired { .. } = task.await.unwrap() {
                acquired += 1;
            }
        }
        assert_eq!(acquired, 1, "round {round}");
    }
}

/// A wall clock stepped back by an hour after the claim: the record's lease
/// deadline is an hour ahead, further than one lease, so it counts as over
/// and the next claim takes it over; the first holder is fenced.
pub async fn stepped_back_clock_lease_is_taken_over<S: Store>(store: S, clock: ManualClock) {
    clock.set(START_MS + 3_600_000);
    let first = acquire(&store, "k").await;
    clock.set(START_MS);
    let second = FencingToken::random();
    let claim = store.claim(claim_of("s", "k", 1, second)).await.unwrap();
    assert_eq!(claim, Claim::Acquired { taken_over: true });
    let again = store
        .claim(claim_of("s", "k", 1, FencingToken::random()))
        .await
        .unwrap();
    let Claim::Refused(Refusal::InFlight { lease_remaining }) = again else {
        panic!("expected in flight, got {again:?}");
    };
    assert!(lease_remaining <= LEASE, "{lease_remaining:?}");
    assert_eq!(
        complete(&store, "k", first, b"first").await,
        Completion::Fenced
    );
    assert_eq!(
        complete(&store, "k", second, b"second").await,
        Completion::Stored
    );
}

/// A store with its replay cache on (`cached`, e.g. `replay_cache(16)`)
/// beside a handle without one on the same records (`plain`), each on a
/// clock of its own. A record replayed once through `cached` is answered
/// from memory (its replay, and 422 for another fingerprint) after `plain`
/// has purged it; a record never replayed through `cached` is read (and,
/// purged, claimed anew); and a cached record is never used past the TTL
/// it had left on `cached`'s clock.
pub async fn replays_come_from_the_cache_until_the_ttl_ends<S: Store>(
    cached: S,
    cached_clock: ManualClock,
    plain: S,
    plain_clock: ManualClock,
) {
    let claim = |key: &str, fp: u8| claim_of("s", key, fp, FencingToken::random());
    for key in ["c", "d"] {
        let token = acquire(&plain, key).await;
        complete(&plain, key, token, b"done").await;
    }
    let replay = Claim::Refused(Refusal::Completed(response(b"done")));
    assert_eq!(cached.claim(claim("c", 1)).await.unwrap(), replay);
    // Past the TTL on `plain`'s clock only: its purge deletes both records.
    plain_clock.advance(TTL + Duration::from_secs(1));
    assert_eq!(plain.purge_expired().await.unwrap(), 2);
    assert_eq!(cached.claim(claim("c", 1)).await.unwrap(), replay);
    assert_eq!(
        cached.claim(claim("c", 2)).await.unwrap(),
        Claim::Refused(Refusal::Mismatch)
    );
    // Never replayed through `cached`: read, found gone, claimed anew.
    assert_eq!(
        cached.claim(claim("d", 1)).await.unwrap(),
        Claim::Acquired { taken_over: false }
    );
    // A second of slack on each side for the server's clock, which moves
    // on by itself between the completion and the read.
    cached_clock.advance(TTL - Duration::from_secs(2));
    assert_eq!(cached.claim(claim("c", 1)).await.unwrap(), replay);
    cached_clock.advance(Duration::from_secs(3));
    assert_eq!(
        cached.claim(claim("c", 1)).await.unwrap(),
        Claim::Acquired { taken_over: false }
    );
}
