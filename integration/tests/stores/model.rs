//! Model-based property tests of the record state machine (docs/contract.md §3, the
//! table in the `store` module docs), on every store.
//!
//! `sequences_*`: proptest generates sequences of up to 30 operations over 3
//! keys and 2 fingerprints (claims by fresh holders, completions and
//! releases by any holder not crashed, stale ones included, crashes, clock
//! advances that straddle the 10 s lease and the 100 s TTL, clock steps back
//! (a wall clock set back by NTP or an operator) of a few seconds to an
//! hour, purges). A small
//! reference model, written from the contract and not from any store,
//! predicts every result exactly: the claim's outcome down to the bytes of
//! the response replayed and the milliseconds of lease left, `Stored` or
//! `Fenced`, `true` or `false`, and how many records a purge deletes. After
//! every fenced completion or refused release, the key is probed with
//! claims that change nothing, to show that the record is as before. Each
//! case ends by moving past every TTL and purging: the count is the number of
//! records the model holds, which also empties the store (it moves past the
//! latest instant the clock showed, so records claimed before a step back
//! are past their TTL too).
//!
//! `concurrent_*`: 8 claimers on one key released together by a
//! `tokio::sync::Barrier` on a multi-thread runtime, with random fingerprints.
//! Each case plays 7 rounds on one store, one from each state of the key
//! when the claimers arrive: absent; in flight, 5 s into its lease; in
//! flight, its lease over this very millisecond (exactly one takes it over);
//! in flight, the clock stepped back 5 s after its claim (its deadline is
//! past one lease ahead: exactly one takes it over); completed; past its TTL
//! this very millisecond, in flight or completed.
//! Exactly one claimer acquires where the key is free, and the others meet
//! `InFlight` (same fingerprint as the winner) or `Mismatch`; afterwards
//! only the winner's token completes, and the replay is the winner's.
//!
//! `SqlxSqliteStore` (feature `sqlx-sqlite`) runs the SQLite cases, with
//! the same exact expectations, on a pool of its own per case.
//!
//! Every case gets a fresh store: a new `MemoryStore`, a new SQLite file, a
//! new PostgreSQL table, a new Redis key prefix, so purge counts are exact.
//! PostgreSQL, MySQL/MariaDB and Redis (features `postgres`, `sqlx-postgres`,
//! `mysql`, `redis`) need their servers (`TOWER_IDEMPOTENCY_POSTGRES_URL`,
//! `TOWER_IDEMPOTENCY_MYSQL_URL`, `TOWER_IDEMPOTENCY_REDIS_URL`); a missing
//! server fails the test. The `*_redis_cluster` tests start a private
//! 3-master Redis Cluster (`redis-server` on the `PATH`).
//!
//! # Time on the networked stores
//!
//! PostgreSQL and Redis judge time by the server's clock, which keeps running;
//! the test's `ManualClock` is added to it through `time_offset`. Every
//! advance there is a multiple of 5 s, so every lease and TTL deadline sits on
//! that 5 s grid too, and a comparison with a deadline ends the same way on
//! the server as in the model as long as a case runs in less than 5 s of
//! wall-clock time (each case asserts it does; a case takes milliseconds).
//! `lease_remaining` cannot be exact there: it is asserted within
//! `[model - elapsed - 1 ms, model]`, where `elapsed` is the wall-clock time
//! since the claim that set the lease was sent (the 1 ms: both readings are
//! floored to whole ms). For the same reason a deadline cannot be hit to the
//! millisecond there: a lease "over this very millisecond" is over by the
//! case's few ms of wall-clock time on the server. The embedded stores get
//! the same steps plus 1 ms-precise ones, and exact values throughout.
//!
//! # Cases, seeds and regressions
//!
//! Cases per run: memory and SQLite 256 sequences and 32 concurrent cases
//! (224 rounds) each; PostgreSQL and Redis 48 sequences and 12 concurrent
//! cases (84 rounds) each. `PROPTEST_CASES=n` runs `n` cases of every test
//! instead. Each run draws new random seeds. A failing case is shrunk to a
//! minimal one, printed, and its seed appended to
//! `integration/tests/stores/model.proptest-regressions`; commit that file: proptest runs the
//! seeds in it before any new case, on every later run.

use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::TestCaseError;
use tokio::sync::Barrier;
use tower_idempotency::StoredResponse;
use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::store::{
    Claim, ClaimRequest, Clock, Completion, FencingToken, MemoryStore, RecordId, Refusal,
    SqliteStore, Store, StoreError, Synchronous,
};
use tower_idempotency::test_util::ManualClock;

const LEASE_MS: i64 = 10_000;
const TTL_MS: i64 = 100_000;
const START_MS: i64 = 1_800_000_000_000;
const SCOPE: &str = "model";
const KEYS: [&str; 3] = ["k0", "k1", "k2"];
const FINGERPRINTS: u8 = 2;

/// Clock steps for every store: multiples of 5 s that land on, just before
/// and past the lease (10 s) and the TTL (100 s), alone or summed.
const STEPS_MS: &[i64] = &[
    5_000, 10_000, 15_000, 45_000, 90_000, 95_000, 100_000, 105_000,
];
/// Extra steps for the stores on a `ManualClock` alone: 1 ms on either side
/// of each deadline.
const PRECISE_STEPS_MS: &[i64] = &[1, 9_999, 10_001, 99_999];
/// Steps back for every store, on the same 5 s grid: within one lease, one
/// lease, and an hour.
const STEPS_BACK_MS: &[i64] = &[5_000, 10_000, 3_600_000];
/// Extra steps back for the stores on a `ManualClock` alone: 1 ms, and 1 ms
/// short of a lease.
const PRECISE_STEPS_BACK_MS: &[i64] = &[1, 9_999];

/// The largest wall-clock time a case on a networked store may take: the
/// grid of its clock steps (see the module docs).
const NETWORKED_CASE_LIMIT: Duration = Duration::from_secs(5);

/// How results are compared, per store.
#[derive(Debug, Clone, Copy)]
struct Kind {
    name: &'static str,
    /// The store's clock is the test's `ManualClock` alone: exact leases.
    exact_clock: bool,
    /// `complete` on a record past its TTL (not yet purged) answers `Fenced`
    /// (`RedisStore` documents it: such a record counts as gone). The others
    /// store the response in it, where no claim will ever replay it.
    fences_past_ttl: bool,
}

const MEMORY: Kind = Kind {
    name: "memory",
    exact_clock: true,
    fences_past_ttl: false,
};
const SQLITE: Kind = Kind {
    name: "sqlite",
    exact_clock: true,
    fences_past_ttl: false,
};
#[cfg(feature = "sqlx-sqlite")]
const SQLX_SQLITE: Kind = Kind {
    name: "sqlx-sqlite",
    exact_clock: true,
    fences_past_ttl: false,
};
#[cfg(feature = "postgres")]
const POSTGRES: Kind = Kind {
    name: "postgres",
    exact_clock: false,
    fences_past_ttl: false,
};
#[cfg(feature = "mysql")]
const MYSQL: Kind = Kind {
    name: "mysql",
    exact_clock: false,
    fences_past_ttl: false,
};
#[cfg(feature = "sqlx-postgres")]
const SQLX_POSTGRES: Kind = Kind {
    name: "sqlx-postgres",
    exact_clock: false,
    fences_past_ttl: false,
};
#[cfg(feature = "redis")]
const REDIS: Kind = Kind {
    name: "redis",
    exact_clock: false,
    fences_past_ttl: true,
};

// ------------------------------------------------------------------ helpers

/// The response a holder stores: its number in the status, a header and a
/// body with bytes that are not text, so a replay shows who completed.
fn response_of(holder: usize) -> StoredResponse {
    let status = [200, 201, 202, 404][holder % 4];
    let mut headers = HeaderMap::new();
    headers.append("x-holder", HeaderValue::from(holder));
    headers.append("link", "</a>; rel=next".parse().unwrap());
    let mut body = format!("holder {holder}").into_bytes();
    body.extend_from_slice(&[0x00, 0xff, holder as u8]);
    StoredResponse::capture(
        StatusCode::from_u16(status).unwrap(),
        &headers,
        Bytes::from(body),
        None,
    )
}

/// The record of `KEYS[key]`.
fn id(key: usize) -> RecordId {
    RecordId::new(SCOPE, KEYS[key])
}

fn request(key: usize, fp: u8, token: FencingToken) -> ClaimRequest {
    ClaimRequest::new(id(key), Fingerprint([fp; 32]), token)
        .with_lease(Duration::from_millis(LEASE_MS as u64))
        .with_ttl(Duration::from_millis(TTL_MS as u64))
}

fn store_ok<T>(result: Result<T, StoreError>, what: &str) -> Result<T, TestCaseError> {
    result.map_err(|e| TestCaseError::fail(format!("{what}: store error {e}")))
}

/// A config with `cases` cases, or `PROPTEST_CASES` when it is set.
fn config(cases: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(cases);
    ProptestConfig {
        cases,
        // A failing case is shrunk for at most this long (ms), then
        // reported as the simplest found so far: each try of a server's
        // case costs round trips, and proptest's default has no limit.
        max_shrink_time: 60_000,
        // Beside this file, as `model.proptest-regressions`.
        failure_persistence: Some(Box::new(
            proptest::test_runner::FileFailurePersistence::WithSource("proptest-regressions"),
        )),
        ..ProptestConfig::default()
    }
}

/// How long one case (its store's set-up included) may run before it fails.
const CASE_LIMIT: Duration = Duration::from_secs(120);

/// Runs one case on [`RUNTIME`]; a case still running after [`CASE_LIMIT`]
/// fails (a store call that never answers is a failure, never a hang).
fn block_on(case: impl Future<Output = Result<(), TestCaseError>>) -> Result<(), TestCaseError> {
    RUNTIME.block_on(async {
        tokio::time::timeout(CASE_LIMIT, case)
            .await
            .unwrap_or_else(|_| {
                Err(TestCaseError::fail(format!(
                    "the case ran past {CASE_LIMIT:?}: a store call never answered"
                )))
            })
    })
}

/// One runtime for every test in this file: `block_on` per case, tasks on
/// its workers.
static RUNTIME: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
        .unwrap()
});

/// Checks a claim's `lease_remaining` against the model's `expected_ms`:
/// equal on a manual clock; within `[expected - elapsed - 1 ms, expected]`
/// on a server's clock, `elapsed` counted from `since` (before the claim that
/// set the lease was sent) to now (after this claim answered).
fn check_remaining(
    kind: Kind,
    actual: Duration,
    expected_ms: i64,
    since: Instant,
    what: &str,
) -> Result<(), TestCaseError> {
    let expected = Duration::from_millis(expected_ms as u64);
    if kind.exact_clock {
        prop_assert_eq!(actual, expected, "{}: lease_remaining", what);
    } else {
        let slack = since.elapsed() + Duration::from_millis(1);
        prop_assert!(
            actual <= expected && actual + slack >= expected,
            "{}: lease_remaining {:?}, the model says {:?} less at most {:?}",
            what,
            actual,
            expected,
            slack
        );
    }
    Ok(())
}

// -------------------------------------------------------------- the model

/// What the contract says a claim meets.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    Acquired {
        taken_over: bool,
    },
    Mismatch,
    /// Replays the response of this holder.
    Completed(usize),
    /// `ms` of lease left; the lease was set by a claim sent at `since`.
    InFlight {
        ms: i64,
        since: Instant,
    },
}

#[derive(Debug, Clone)]
struct Record {
    fingerprint: u8,
    /// The holder whose token the record carries.
    holder: usize,
    lease_until: i64,
    expires_at: i64,
    completed: bool,
    /// When the claim that wrote this record was sent (wall clock).
    since: Instant,
}

#[derive(Debug)]
struct Holder {
    key: usize,
    token: FencingToken,
    crashed: bool,
}

/// The reference model: one optional record per key, judged by `now`.
#[derive(Debug, Default)]
struct Model {
    now: i64,
    /// The latest `now` so far (the clock may step back).
    latest: i64,
    records: [Option<Record>; KEYS.len()],
    holders: Vec<Holder>,
}

impl Model {
    /// The table of docs/contract.md §3, read top to bottom. A lease is alive while
    /// its deadline is ahead and no further ahead than one lease: a deadline
    /// further ahead is one the clock stepped back from, and counts as over.
    fn decide(&self, key: usize, fingerprint: u8) -> Outcome {
        match &self.records[key] {
            None => Outcome::Acquired { taken_over: false },
            Some(r) if r.expires_at <= self.now => Outcome::Acquired { taken_over: false },
            Some(r) if r.fingerprint != fingerprint => Outcome::Mismatch,
            Some(r) if r.completed => Outcome::Completed(r.holder),
            Some(r) if r.lease_until > self.now && r.lease_until - self.now <= LEASE_MS => {
                Outcome::InFlight {
                    ms: r.lease_until - self.now,
                    since: r.since,
                }
            }
            Some(_) => Outcome::Acquired { taken_over: true },
        }
    }

    /// A claim by a new holder; returns the outcome and, when acquired, the
    /// new holder's number.
    fn claim(
        &mut self,
        key: usize,
        fingerprint: u8,
        token: FencingToken,
        since: Instant,
    ) -> (Outcome, Option<usize>) {
        let outcome = self.decide(key, fingerprint);
        if !matches!(outcome, Outcome::Acquired { .. }) {
            return (outcome, None);
        }
        let holder = self.holders.len();
        self.holders.push(Holder {
            key,
            token,
            crashed: false,
        });
        self.records[key] = Some(Record {
            fingerprint,
            holder,
            lease_until: self.now + LEASE_MS,
            expires_at: self.now + TTL_MS,
            completed: false,
            since,
        });
        (outcome, Some(holder))
    }

    /// Stored only while the record carries the holder's token and is in
    /// flight (and, where `fences_past_ttl`, not past its TTL).
    fn complete(&mut self, kind: Kind, holder: usize) -> Completion {
        let now = self.now;
        match &mut self.records[self.holders[holder].key] {
            Some(r)
                if r.holder == holder
                    && !r.completed
                    && !(kind.fences_past_ttl && r.expires_at <= now) =>
            {
                r.completed = true;
                Completion::Stored
            }
            _ => Completion::Fenced,
        }
    }

    /// Deletes the record only while it carries the holder's token and is
    /// in flight.
    fn release(&mut self, holder: usize) -> bool {
        let slot = &mut self.records[self.holders[holder].key];
        match slot {
            Some(r) if r.holder == holder && !r.completed => {
                *slot = None;
                true
            }
            _ => false,
        }
    }

    fn purge(&mut self) -> u64 {
        let mut purged = 0;
        for slot in &mut self.records {
            if slot.as_ref().is_some_and(|r| r.expires_at <= self.now) {
                *slot = None;
                purged += 1;
            }
        }
        purged
    }

    /// Holders that have not crashed, in order.
    fn live(&self) -> Vec<usize> {
        (0..self.holders.len())
            .filter(|&h| !self.holders[h].crashed)
            .collect()
    }
}

// -------------------------------------------------------------- operations

#[derive(Debug, Clone)]
enum Op {
    /// A claim by a new holder with a fresh token.
    Claim {
        key: usize,
        fingerprint: u8,
    },
    /// A holder (not crashed; possibly fenced, completed or released) completes.
    Complete(Index),
    /// A holder (not crashed) releases.
    Release(Index),
    /// A holder dies: it never completes nor releases; only its lease ending
    /// frees the key.
    Crash(Index),
    /// The clock moves on by this many ms.
    Advance(i64),
    /// The clock steps back by this many ms.
    StepBack(i64),
    Purge,
}

fn op(steps: Vec<i64>, back: Vec<i64>) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..KEYS.len(), 0..FINGERPRINTS)
            .prop_map(|(key, fingerprint)| Op::Claim { key, fingerprint }),
        3 => any::<Index>().prop_map(Op::Complete),
        1 => any::<Index>().prop_map(Op::Release),
        1 => any::<Index>().prop_map(Op::Crash),
        3 => prop::sample::select(steps).prop_map(Op::Advance),
        1 => prop::sample::select(back).prop_map(Op::StepBack),
        1 => Just(Op::Purge),
    ]
}

fn ops(kind: Kind) -> impl Strategy<Value = Vec<Op>> {
    let mut steps = STEPS_MS.to_vec();
    let mut back = STEPS_BACK_MS.to_vec();
    if kind.exact_clock {
        steps.extend_from_slice(PRECISE_STEPS_MS);
        back.extend_from_slice(PRECISE_STEPS_BACK_MS);
    }
    prop::collection::vec(op(steps, back), 1..=30)
}

/// Compares a claim's result with the model's outcome.
fn check_claim(
    kind: Kind,
    actual: &Claim,
    expected: &Outcome,
    what: &str,
) -> Result<(), TestCaseError> {
    match (actual, expected) {
        (
            Claim::Refused(Refusal::InFlight { lease_remaining }),
            Outcome::InFlight { ms, since },
        ) => check_remaining(kind, *lease_remaining, *ms, *since, what),
        (Claim::Refused(Refusal::Completed(stored)), Outcome::Completed(holder)) => {
            prop_assert_eq!(stored, &response_of(*holder), "{}: replayed response", what);
            Ok(())
        }
        (
            Claim::Acquired { taken_over },
            Outcome::Acquired {
                taken_over: expected,
            },
        ) => {
            prop_assert_eq!(taken_over, expected, "{}: taken_over", what);
            Ok(())
        }
        (Claim::Refused(Refusal::Mismatch), Outcome::Mismatch) => Ok(()),
        _ => Err(TestCaseError::fail(format!(
            "{what}: the store answered {actual:?}, the model says {expected:?}"
        ))),
    }
}

/// Claims that change nothing (the model says mismatch, replay or in
/// flight) on `key`, with either fingerprint: the record is as the model has it.
async fn probe<S: Store>(
    kind: Kind,
    store: &S,
    model: &Model,
    key: usize,
    what: &str,
) -> Result<(), TestCaseError> {
    for fingerprint in 0..FINGERPRINTS {
        let expected = model.decide(key, fingerprint);
        if matches!(expected, Outcome::Acquired { .. }) {
            continue;
        }
        let actual = store_ok(
            store
                .claim(request(key, fingerprint, FencingToken::random()))
                .await,
            what,
        )?;
        check_claim(
            kind,
            &actual,
            &expected,
            &format!("{what}, probe with fingerprint {fingerprint}"),
        )?;
    }
    Ok(())
}

/// Runs `ops` on a fresh `store` whose time is `clock`, checking each result
/// against the model; then moves past every TTL and purges everything.
async fn run_sequence<S: Store>(
    kind: Kind,
    store: S,
    clock: ManualClock,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    let started = Instant::now();
    let mut model = Model::default();
    for (i, op) in ops.iter().enumerate() {
        let what = format!("{} op {i} {op:?}", kind.name);
        match op {
            Op::Claim { key, fingerprint } => {
                let token = FencingToken::random();
                let since = Instant::now();
                let actual =
                    store_ok(store.claim(request(*key, *fingerprint, token)).await, &what)?;
                let (expected, _) = model.claim(*key, *fingerprint, token, since);
                check_claim(kind, &actual, &expected, &what)?;
            }
            Op::Complete(index) | Op::Release(index) => {
                let live = model.live();
                if live.is_empty() {
                    continue;
                }
                let holder = live[index.index(live.len())];
                let (key, token) = (model.holders[holder].key, model.holders[holder].token);
                let what = format!("{what} by holder {holder}");
                let unchanged = if let Op::Complete(_) = op {
                    let actual = store_ok(
                        store.complete(id(key), token, response_of(holder)).await,
                        &what,
                    )?;
                    let expected = model.complete(kind, holder);
                    prop_assert_eq!(actual, expected, "{}", what);
                    actual == Completion::Fenced
                } else {
                    let actual = store_ok(store.release(id(key), token).await, &what)?;
                    prop_assert_eq!(actual, model.release(holder), "{}", what);
                    !actual
                };
                if unchanged {
                    probe(kind, &store, &model, key, &what).await?;
                }
            }
            Op::Crash(index) => {
                let live = model.live();
                if !live.is_empty() {
                    model.holders[live[index.index(live.len())]].crashed = true;
                }
            }
            Op::Advance(ms) => {
                model.now += ms;
                model.latest = model.latest.max(model.now);
                clock.advance(Duration::from_millis(*ms as u64));
            }
            Op::StepBack(ms) => {
                model.now -= ms;
                clock.set(clock.now_ms() - ms);
            }
            Op::Purge => {
                let actual = store_ok(store.purge_expired().await, &what)?;
                prop_assert_eq!(actual, model.purge(), "{}: records purged", what);
            }
        }
        if !kind.exact_clock {
            prop_assert!(
                started.elapsed() < NETWORKED_CASE_LIMIT,
                "{}: the case took {:?}, past the {:?} grid of its clock steps; the machine is too slow for this test",
                what,
                started.elapsed(),
                NETWORKED_CASE_LIMIT
            );
        }
    }
    // Past every TTL: records claimed before a step back expire after the
    // latest instant, not after `now`.
    let forward = model.latest - model.now + TTL_MS;
    model.now += forward;
    clock.advance(Duration::from_millis(forward as u64));
    let held = model.records.iter().flatten().count() as u64;
    let purged = store_ok(store.purge_expired().await, "final purge")?;
    prop_assert_eq!(purged, held, "{}: final purge past every TTL", kind.name);
    Ok(())
}

// ------------------------------------------------------- the concurrent round

/// The key's state when the claimers arrive.
#[derive(Debug, Clone, Copy)]
enum Prior {
    Absent,
    /// In flight with fingerprint 0, 5 s into its lease.
    InFlight,
    /// In flight with fingerprint 0, its lease over this very millisecond.
    LeaseJustOver,
    /// In flight with fingerprint 0, the clock stepped back 5 s right after
    /// its claim: its deadline is one lease and 5 s ahead.
    SteppedBack,
    /// Completed with fingerprint 0, 5 s after its claim.
    Completed,
    /// Fingerprint 0, its TTL over this very millisecond.
    TtlJustOver {
        completed: bool,
    },
}

/// Every case runs one round from each, in this order, on one store (each
/// round leaves it empty).
const PRIORS: [Prior; 7] = [
    Prior::Absent,
    Prior::InFlight,
    Prior::LeaseJustOver,
    Prior::SteppedBack,
    Prior::Completed,
    Prior::TtlJustOver { completed: false },
    Prior::TtlJustOver { completed: true },
];

const CLAIMERS: usize = 8;
/// The holder number of the prior record's response.
const PRIOR_HOLDER: usize = 1_000;

/// Fingerprints of the claimers; the first has the prior record's (0), so
/// that a round where the lease just ended always has one to take it over.
fn claimer_fingerprints() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(0..FINGERPRINTS, CLAIMERS - 1).prop_map(|mut rest| {
        rest.insert(0, 0);
        rest
    })
}

/// One round per prior state, each with its claimers' fingerprints.
fn rounds() -> impl Strategy<Value = Vec<Vec<u8>>> {
    prop::collection::vec(claimer_fingerprints(), PRIORS.len())
}

/// Runs a round from each of [`PRIORS`] on `store`.
async fn run_rounds<S: Store>(
    kind: Kind,
    store: S,
    clock: ManualClock,
    rounds: &[Vec<u8>],
) -> Result<(), TestCaseError> {
    for (prior, fingerprints) in PRIORS.into_iter().zip(rounds) {
        run_round(kind, &store, &clock, prior, fingerprints).await?;
    }
    Ok(())
}

/// `CLAIMERS` claims on one key released together: exactly the outcomes the
/// contract allows, and exactly one holder afterwards. Starts and ends with
/// an empty store.
async fn run_round<S: Store>(
    kind: Kind,
    store: &S,
    clock: &ManualClock,
    prior: Prior,
    fingerprints: &[u8],
) -> Result<(), TestCaseError> {
    let name = kind.name;
    let started = Instant::now();
    let key = 0;
    if !matches!(prior, Prior::Absent) {
        let token = FencingToken::random();
        let claim = store_ok(store.claim(request(key, 0, token)).await, "prior claim")?;
        prop_assert_eq!(claim, Claim::Acquired { taken_over: false });
        if matches!(
            prior,
            Prior::Completed | Prior::TtlJustOver { completed: true }
        ) {
            let done = store_ok(
                store
                    .complete(id(key), token, response_of(PRIOR_HOLDER))
                    .await,
                "prior completion",
            )?;
            prop_assert_eq!(done, Completion::Stored);
        }
    }
    let advance = match prior {
        Prior::Absent => 0,
        Prior::InFlight | Prior::Completed => 5_000,
        Prior::LeaseJustOver => LEASE_MS,
        Prior::TtlJustOver { .. } => TTL_MS,
        Prior::SteppedBack => 0,
    };
    clock.advance(Duration::from_millis(advance as u64));
    if let Prior::SteppedBack = prior {
        clock.set(clock.now_ms() - 5_000);
    }

    let barrier = Arc::new(Barrier::new(CLAIMERS));
    let tasks: Vec<_> = fingerprints
        .iter()
        .map(|&fingerprint| {
            let (store, barrier) = (store.clone(), barrier.clone());
            let token = FencingToken::random();
            tokio::spawn(async move {
                barrier.wait().await;
                (token, store.claim(request(key, fingerprint, token)).await)
            })
        })
        .collect();
    let mut results = Vec::with_capacity(CLAIMERS);
    for task in tasks {
        let (token, claim) = task.await.expect("a claimer panicked");
        results.push((token, store_ok(claim, "concurrent claim")?));
    }

    let winners: Vec<usize> = (0..CLAIMERS)
        .filter(|&i| matches!(results[i].1, Claim::Acquired { .. }))
        .collect();
    // Who may win, and what the others meet.
    let (expect_winner, taken_over) = match prior {
        Prior::Absent | Prior::TtlJustOver { .. } => (true, false),
        Prior::LeaseJustOver | Prior::SteppedBack => (true, true),
        Prior::InFlight | Prior::Completed => (false, false),
    };
    prop_assert_eq!(
        winners.len(),
        usize::from(expect_winner),
        "{}: {:?}, fingerprints {:?}: acquired by {:?}",
        name,
        prior,
        fingerprints,
        winners
    );
    let record_fingerprint = match winners.first() {
        Some(&w) => {
            prop_assert_eq!(&results[w].1, &Claim::Acquired { taken_over });
            if taken_over {
                prop_assert_eq!(
                    fingerprints[w],
                    0,
                    "{}: took over with another fingerprint",
                    name
                );
            }
            fingerprints[w]
        }
        None => 0,
    };
    for (i, (_, claim)) in results.iter().enumerate() {
        if winners.first() == Some(&i) {
            continue;
        }
        let what = format!("{name}: {prior:?}, claimer {i}, fingerprints {fingerprints:?}");
        let expected = if fingerprints[i] != record_fingerprint {
            Outcome::Mismatch
        } else if matches!(prior, Prior::Completed) {
            Outcome::Completed(PRIOR_HOLDER)
        } else if matches!(prior, Prior::InFlight) {
            Outcome::InFlight {
                ms: LEASE_MS - 5_000,
                since: started,
            }
        } else {
            Outcome::InFlight {
                ms: LEASE_MS,
                since: started,
            }
        };
        check_claim(kind, claim, &expected, &what)?;
    }

    // The losers hold nothing; the winner holds the key and completes it.
    for (i, (token, _)) in results.iter().enumerate() {
        if winners.first() != Some(&i) {
            let released = store_ok(store.release(id(key), *token).await, "loser's release")?;
            prop_assert!(
                !released,
                "{}: claimer {} released a key it never held",
                name,
                i
            );
        }
    }
    if let Some(&w) = winners.first() {
        let done = store_ok(
            store.complete(id(key), results[w].0, response_of(w)).await,
            "winner's completion",
        )?;
        prop_assert_eq!(
            done,
            Completion::Stored,
            "{}: the winner's completion",
            name
        );
        let replay = store_ok(
            store
                .claim(request(key, fingerprints[w], FencingToken::random()))
                .await,
            "replay",
        )?;
        prop_assert_eq!(
            replay,
            Claim::Refused(Refusal::Completed(response_of(w))),
            "{}: replay",
            name
        );
    }
    // Past every TTL, the one record goes.
    clock.advance(Duration::from_millis(TTL_MS as u64));
    let purged = store_ok(store.purge_expired().await, "final purge")?;
    prop_assert_eq!(purged, 1, "{}: {:?}: final purge", name, prior);
    Ok(())
}

// ------------------------------------------------------------------ stores

fn memory(clock: &ManualClock) -> MemoryStore {
    MemoryStore::with_clock(clock.clone())
}

/// `synchronous=NORMAL`: no fsync per commit (the state machine is the same;
/// what differs is only what a power loss keeps), so 256 cases take seconds.
async fn sqlite(clock: &ManualClock) -> (SqliteStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::builder(dir.path().join("model.sqlite3"))
        .synchronous(Synchronous::Normal)
        .clock(clock.clone())
        .open()
        .await
        .unwrap();
    (store, dir)
}

/// `SqlxSqliteStore` over a WAL pool of its own, `synchronous=NORMAL` as above.
#[cfg(feature = "sqlx-sqlite")]
async fn sqlx_sqlite(
    clock: &ManualClock,
) -> (tower_idempotency_sqlx::SqlxSqliteStore, tempfile::TempDir) {
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
    let dir = tempfile::tempdir().unwrap();
    let options = SqliteConnectOptions::new()
        .filename(dir.path().join("model.sqlite3"))
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal);
    let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
    let store = tower_idempotency_sqlx::SqlxSqliteStore::builder(pool)
        .clock(clock.clone())
        .open()
        .await
        .unwrap();
    (store, dir)
}

/// The test's clock as an offset from a server's clock.
#[cfg(any(
    feature = "postgres",
    feature = "sqlx-postgres",
    feature = "redis",
    feature = "mysql"
))]
struct Offset(ManualClock);

#[cfg(any(
    feature = "postgres",
    feature = "sqlx-postgres",
    feature = "redis",
    feature = "mysql"
))]
impl tower_idempotency::store::Clock for Offset {
    fn now_ms(&self) -> i64 {
        self.0.now_ms() - START_MS
    }
}

#[cfg(feature = "postgres")]
mod pg {
    use super::*;
    use tower_idempotency_postgres::PostgresStore;

    fn url() -> String {
        crate::common::services::postgres_url()
    }

    /// Runs `case` on a store over a table of its own, then drops the table
    /// (also when the case failed).
    pub(crate) async fn with_store<F, Fut>(
        clock: &ManualClock,
        case: F,
    ) -> Result<(), TestCaseError>
    where
        F: FnOnce(PostgresStore) -> Fut,
        Fut: Future<Output = Result<(), TestCaseError>>,
    {
        let table = format!("model_{:016x}", FencingToken::random().0);
        let store = PostgresStore::builder(&url())
            .table(table.clone())
            .clock_offset(Offset(clock.clone()))
            .open()
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {} is required for these tests: {e}", url()));
        let pool = store.pool().clone();
        let result = case(store).await;
        let client = pool.get().await.unwrap();
        client
            .batch_execute(&format!("DROP TABLE {table}"))
            .await
            .unwrap();
        result
    }
}

#[cfg(feature = "mysql")]
mod my {
    use super::*;
    use tower_idempotency_sqlx::MySqlStore;
    use tower_idempotency_sqlx::sqlx;

    fn url() -> String {
        crate::common::services::mysql_url()
    }

    /// Runs `case` on a store over a table of its own, then drops the table
    /// (also when the case failed).
    pub(crate) async fn with_store<F, Fut>(
        clock: &ManualClock,
        case: F,
    ) -> Result<(), TestCaseError>
    where
        F: FnOnce(MySqlStore) -> Fut,
        Fut: Future<Output = Result<(), TestCaseError>>,
    {
        let table = format!("model_{:016x}", FencingToken::random().0);
        let store = MySqlStore::builder(&url())
            .table(table.clone())
            .clock_offset(Offset(clock.clone()))
            .open()
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "MySQL/MariaDB at {} is required for these tests: {e}",
                    url()
                )
            });
        let pool = store.pool().clone();
        let result = case(store).await;
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
            .execute(&pool)
            .await
            .unwrap();
        result
    }
}

/// `SqlxPostgresStore`: the same as `pg`, through a `sqlx::PgPool`.
#[cfg(feature = "sqlx-postgres")]
mod sqlx_pg {
    use super::*;
    use tower_idempotency_sqlx::SqlxPostgresStore;

    fn url() -> String {
        crate::common::services::postgres_url()
    }

    /// Runs `case` on a store over a table of its own, then drops the table
    /// (also when the case failed).
    pub(crate) async fn with_store<F, Fut>(
        clock: &ManualClock,
        case: F,
    ) -> Result<(), TestCaseError>
    where
        F: FnOnce(SqlxPostgresStore) -> Fut,
        Fut: Future<Output = Result<(), TestCaseError>>,
    {
        let table = format!("model_sqlx_{:016x}", FencingToken::random().0);
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(10)
            .connect(&url())
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {} is required for these tests: {e}", url()));
        let store = SqlxPostgresStore::builder(pool.clone())
            .table(table.clone())
            .clock_offset(Offset(clock.clone()))
            .open()
            .await
            .unwrap();
        let result = case(store).await;
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;
        result
    }
}

#[cfg(feature = "redis")]
async fn redis(clock: &ManualClock) -> tower_idempotency_redis::RedisStore {
    let url = crate::common::services::redis_url();
    tower_idempotency_redis::RedisStore::builder(&url)
        .prefix(format!(
            "tower-idempotency-model:{:016x}:",
            FencingToken::random().0
        ))
        .clock_offset(Offset(clock.clone()))
        .open()
        .await
        .unwrap_or_else(|e| panic!("Redis at {url} is required for these tests: {e}"))
}

/// `RedisStore` on a private 3-master Redis Cluster (ports 15630-15632),
/// started by the first case and stopped after the last.
#[cfg(feature = "redis")]
use crate::rediscluster;

#[cfg(feature = "redis")]
static CLUSTER: std::sync::Mutex<std::sync::Weak<rediscluster::RedisCluster>> =
    std::sync::Mutex::new(std::sync::Weak::new());

#[cfg(feature = "redis")]
async fn redis_cluster(
    clock: &ManualClock,
) -> (
    tower_idempotency_redis::RedisStore,
    std::sync::Arc<rediscluster::RedisCluster>,
) {
    let nodes = tokio::task::spawn_blocking(|| rediscluster::RedisCluster::shared(&CLUSTER, 15630))
        .await
        .unwrap();
    // One cluster for all the cases of a test: the test's thread holds it
    // until the thread ends.
    thread_local! {
        static HELD: std::cell::RefCell<Option<std::sync::Arc<rediscluster::RedisCluster>>> =
            const { std::cell::RefCell::new(None) };
    }
    HELD.with(|held| *held.borrow_mut() = Some(nodes.clone()));
    let store = tower_idempotency_redis::RedisStore::cluster_builder(nodes.urls())
        .prefix(format!(
            "tower-idempotency-model:{:016x}:",
            FencingToken::random().0
        ))
        .clock_offset(Offset(clock.clone()))
        .open()
        .await
        .unwrap();
    (store, nodes)
}

// ------------------------------------------------------------------- tests

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn sequences_memory(ops in ops(MEMORY)) {
        let clock = ManualClock::new(START_MS);
        block_on(run_sequence(MEMORY, memory(&clock), clock.clone(), &ops))?;
    }

    #[test]
    fn sequences_sqlite(ops in ops(SQLITE)) {
        block_on(async {
            let clock = ManualClock::new(START_MS);
            let (store, _dir) = sqlite(&clock).await;
            run_sequence(SQLITE, store, clock, &ops).await
        })?;
    }
}

proptest! {
    #![proptest_config(config(32))]

    #[test]
    fn concurrent_memory(rounds in rounds()) {
        let clock = ManualClock::new(START_MS);
        block_on(run_rounds(MEMORY, memory(&clock), clock.clone(), &rounds))?;
    }

    #[test]
    fn concurrent_sqlite(rounds in rounds()) {
        block_on(async {
            let clock = ManualClock::new(START_MS);
            let (store, _dir) = sqlite(&clock).await;
            run_rounds(SQLITE, store, clock, &rounds).await
        })?;
    }
}

#[cfg(feature = "sqlx-sqlite")]
proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn sequences_sqlx_sqlite(ops in ops(SQLX_SQLITE)) {
        block_on(async {
            let clock = ManualClock::new(START_MS);
            let (store, _dir) = sqlx_sqlite(&clock).await;
            run_sequence(SQLX_SQLITE, store, clock, &ops).await
        })?;
    }
}

#[cfg(feature = "sqlx-sqlite")]
proptest! {
    #![proptest_config(config(32))]

    #[test]
    fn concurrent_sqlx_sqlite(rounds in rounds()) {
        block_on(async {
            let clock = ManualClock::new(START_MS);
            let (store, _dir) = sqlx_sqlite(&clock).await;
            run_rounds(SQLX_SQLITE, store, clock, &rounds).await
        })?;
    }
}

#[cfg(feature = "postgres")]
proptest! {
    #![proptest_config(config(48))]

    #[test]
    fn sequences_postgres(ops in ops(POSTGRES)) {
        block_on(async {
            let clock = ManualClock::new(START_MS);
            pg::with_store(&clock, |store| run_sequence(POSTGRES, store, clock.clone(), &ops)).await
        })?;
    }
}

#[cfg(feature = "postgres")]
proptest! {
    #![proptest_config(config(12))]

    #[test]
    fn concurrent_postgres(rounds in rounds()) {
        block_on(async {
            let clock = ManualClock::new(START_MS);
            pg::with_store(&clock, |store| run_rounds(POSTGRES, store, clock.clone(), &rounds)).await
        })?;
    }
}

#[cfg(feature = "sqlx-postgres")]
proptest! {
    #![proptest_config(config(48))]

    #[test]
    fn sequences_sqlx_postgres(ops in ops(SQLX_POSTGRES)) {
        block_on(async {
            let clock = ManualClock::new(START_MS);
            sqlx_pg::with_store(&clock, |store| run_sequence(SQLX_POSTGRES, store, clock.clone(), &ops)).await
        })?;
    }
}

#[cfg(feature = "sqlx-postgres")]
proptest! {
    #![proptest_config(config(12))]

    #[test]
    fn concurrent_sqlx_postgres(rounds in rounds()) {
        block_on(async {
            let clock = ManualClock::new(START_MS);
            sqlx_pg::with_store(&clock, |store| run_rounds(SQLX_POSTGRES, store, clock.clone(), &rounds)).await
        })?;
    }
}

#[cfg(feature = "redis")]
proptest! {
    #![proptest_config(config(48))]

    #[test]
    fn sequences_redis(ops in ops(REDIS)) {
        block_on(async {
            let clock = ManualClock::new(START_MS);
            let store = redis(&clock).await;
            run_sequence(REDIS, store, clock, &ops).await
        })?;
    }
}

#[cfg(feature = "redis")]
proptest! {
    #![proptest_config(config(12))]

    #[test]
    fn concurrent_redis(rounds in rounds()) {
        block_on(async {
            let clock = ManualClock::new(START_MS);
            let store = redis(&clock).await;
            run_rounds(REDIS, store, clock, &rounds).await
        })?;
    }
}

#[cfg(feature = "mysql")]
proptest! {
    #![proptest_config(config(48))]

    #[test]
    fn sequences_mysql(ops in ops(MYSQL)) {
        block_on(async {
            let clock = ManualClock::new(START_MS);
            my::with_store(&clock, |store| run_sequence(MYSQL, store, clock.clone(), &ops)).await
        })?;
    }
}

#[cfg(feature = "mysql")]
proptest! {
    #![proptest_config(config(12))]

    #[test]
    fn concurrent_mysql(rounds in rounds()) {
        block_on(async {
            let clock = ManualClock::new(START_MS);
            my::with_store(&clock, |store| run_rounds(MYSQL, store, clock.clone(), &rounds)).await
        })?;
    }
}

#[cfg(feature = "redis")]
proptest! {
    #![proptest_config(config(48))]

    #[test]
    fn sequences_redis_cluster(ops in ops(REDIS)) {
        block_on(async {
            let clock = ManualClock::new(START_MS);
            let (store, _nodes) = redis_cluster(&clock).await;
            run_sequence(REDIS, store, clock, &ops).await
        })?;
    }
}

#[cfg(feature = "redis")]
proptest! {
    #![proptest_config(config(12))]

    #[test]
    fn concurrent_redis_cluster(rounds in rounds()) {
        block_on(async {
            let clock = ManualClock::new(START_MS);
            let (store, _nodes) = redis_cluster(&clock).await;
            run_rounds(REDIS, store, clock, &rounds).await
        })?;
    }
}
