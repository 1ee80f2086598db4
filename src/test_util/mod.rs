//! The store contract as a test suite, for stores written outside this crate
//! (DynamoDB, MySQL, ...): the same conformance tests every store of this
//! crate passes. Feature `test-util`; meant for a store crate's
//! `[dev-dependencies]`.
//!
//! * [`store_suite!`] writes one `#[test]` per check of the [`Store`]
//!   contract (the table in the [`store`](crate::store) module docs), and with
//!   a third argument `inspect` the checks of [`Inspect`] too.
//! * [`suite`] holds the checks themselves, as generic `async fn`s, for
//!   running one on its own (with [`run`]), and a few checks the macro does
//!   not include (two store handles on the same records, exact figures on a
//!   [`ManualClock`]).
//! * [`ManualClock`] moves time on without sleeping; [`ClockOffset`] turns it
//!   into an offset for stores judged by a server's clock.
//!
//! # A third-party store
//!
//! The macro takes a name for the generated module and a function that makes
//! a fresh, empty store on the suite's clock: `async fn(ManualClock) -> (S,
//! G)`, where `G` is kept alive until the test ends (a temporary directory,
//! a guard that drops a table; `()` if none). Every check uses its own
//! store. Stores judged by a server's clock add [`ClockOffset`] to the
//! server's time, as `tower_idempotency_redis::RedisStore` does with
//! `clock_offset`; the checks allow for the server's clock moving on by itself.
//!
//! In `tests/conformance.rs` of the store's crate (here with this crate's
//! [`MemoryStore`](crate::MemoryStore) standing in for the third-party store):
//!
//! ```
//! use tower_idempotency::MemoryStore;
//! use tower_idempotency::test_util::{self, ManualClock, store_suite};
//!
//! async fn make(clock: ManualClock) -> (MemoryStore, ()) {
//!     (MemoryStore::with_clock(clock), ())
//! }
//!
//! // One #[test] per check, in `mod memory_conformance`.
//! store_suite!(memory_conformance, make, inspect);
//!
//! # fn main() {
//! // A single check, outside the test harness:
//! test_util::run(make, test_util::suite::release_needs_the_token);
//! # }
//! ```
//!
//! The generated tests run on a multi-threaded Tokio runtime of two worker
//! threads, built by [`run`]: the store's crate needs no Tokio features of
//! its own for them.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};

use crate::fingerprint::Fingerprint;
use crate::response::StoredResponse;
use crate::store::{
    Claim, ClaimRequest, Clock, Completion, FencingToken, RecordCounts, RecordId, Store,
    duration_ms,
};

pub mod suite;
mod watch;

pub use watch::WatchClaims;

#[cfg(doc)]
use crate::store::Inspect;

/// The lease of every claim of the suite: 60 s.
pub const LEASE: Duration = Duration::from_secs(60);
/// The TTL of the suite's claims unless a check says otherwise: 1 h.
pub const TTL: Duration = Duration::from_secs(3600);
/// Where the suite's [`ManualClock`] starts, in ms since the Unix epoch
/// (2027-01-15).
pub const START_MS: i64 = 1_800_000_000_000;

/// A clock that moves only when told to: for tests of leases and TTLs.
/// Clones share one reading.
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicI64>);

impl ManualClock {
    /// A clock reading `start_ms` (ms since the Unix epoch).
    pub fn new(start_ms: i64) -> Self {
        ManualClock(Arc::new(start_ms.into()))
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.0.fetch_add(duration_ms(by), Ordering::SeqCst);
    }

    /// Sets the clock to `ms` (ms since the Unix epoch), forward or back: for
    /// tests of a wall clock that steps back (NTP, a restored VM, an
    /// operator), which every store must survive (see
    /// [`ClaimRequest::lease`](crate::store::ClaimRequest::lease)).
    pub fn set(&self, ms: i64) {
        self.0.store(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// How far a [`ManualClock`] has moved since [`START_MS`], in ms: the offset
/// a store judged by a server's clock adds to the server's time (e.g.
/// `RedisStore`'s and `PostgresStore`'s `clock_offset`).
#[derive(Debug, Clone)]
pub struct ClockOffset(pub ManualClock);

impl Clock for ClockOffset {
    fn now_ms(&self) -> i64 {
        self.0.now_ms() - START_MS
    }
}

/// Runs one check: makes a store with `make` on a [`ManualClock`] reading
/// [`START_MS`], and runs `check` on it, on a fresh multi-threaded Tokio
/// runtime (two workers, every driver enabled). Panics when the check fails.
pub fn run<S, G, M, MF, C, CF>(make: M, check: C)
where
    M: FnOnce(ManualClock) -> MF,
    MF: Future<Output = (S, G)>,
    C: FnOnce(S, ManualClock) -> CF,
    CF: Future<Output = ()>,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a Tokio runtime for the store suite");
    runtime.block_on(async move {
        let clock = ManualClock::new(START_MS);
        let (store, _guard) = make(clock.clone()).await;
        check(store, clock).await;
    });
}

/// Writes one `#[test]` per check of the store contract into a module of
/// its own: `store_suite!(module_name, make)`, or
/// `store_suite!(module_name, make, inspect)` to add the checks of
/// [`Inspect`] (the store must implement it). `make` is an
/// `async fn(ManualClock) -> (S, G)`; see the [module docs](self).
/// `store_suite!(module_name, make, purge)` writes the checks of a store's
/// own purge ([`Purge`](crate::store::Purge)), with `make` an
/// `async fn(ManualClock, Purge) -> (S, G)` that builds the store with it.
#[doc(inline)]
pub use crate::__store_suite as store_suite;

#[doc(hidden)]
#[macro_export]
macro_rules! __store_suite {
    ($module:ident, $make:expr $(,)?) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;

            $crate::__store_suite!(@store $make;);
        }
    };
    ($module:ident, $make:expr, inspect $(,)?) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;

            $crate::__store_suite!(@store $make;
                counts_sort_every_record_into_one_kind,
                stuck_lists_ended_leases_oldest_first,
            );
        }
    };
    // Retention: `$make` is an `async fn(ManualClock, Purge) -> (S, G)`.
    ($module:ident, $make:expr, purge $(,)?) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;

            #[test]
            fn expired_records_are_purged_on_their_own() {
                let every = std::time::Duration::from_millis(20);
                let purge = $crate::store::Purge::every(every).batch(2);
                $crate::test_util::run(
                    |clock| $make(clock, purge),
                    $crate::test_util::suite::expired_records_are_purged_on_their_own,
                );
            }

            #[test]
            fn purge_deletes_in_batches_until_none_is_left() {
                let purge = $crate::store::Purge::off().batch(2);
                $crate::test_util::run(
                    |clock| $make(clock, purge),
                    $crate::test_util::suite::purge_deletes_in_batches_until_none_is_left,
                );
            }
        }
    };
    // The `Store` checks, then `$extra`.
    (@store $make:expr; $($extra:ident),* $(,)?) => {
        $crate::__store_suite!(@tests $make;
                new_key_is_acquired,
                completed_record_is_replayed,
                mismatch_is_checked_first,
                in_flight_reports_remaining_lease,
                expired_lease_is_taken_over_and_fenced,
                release_needs_the_token,
                renewal_extends_the_lease,
                renewal_is_fenced,
                renew_all_renews_each_claim_fenced,
                an_ended_lease_nobody_took_is_renewed,
                completed_record_is_final,
                record_past_ttl_is_new,
                purge_removes_only_expired,
                scopes_never_meet,
                concurrent_claims_have_one_winner,
                omitted_body_round_trips,
                stepped_back_clock_lease_is_taken_over,
                $($extra,)*
        );
    };
    (@tests $make:expr; $($check:ident),* $(,)?) => {
        $(
            #[test]
            fn $check() {
                $crate::test_util::run($make, $crate::test_util::suite::$check);
            }
        )*
    };
}

/// A claim of `key` in `scope` with the fingerprint `[fp; 32]`, the suite's
/// [`LEASE`] and [`TTL`].
pub fn claim_of(scope: &str, key: &str, fp: u8, token: FencingToken) -> ClaimRequest {
    ClaimRequest::new(RecordId::new(scope, key), Fingerprint([fp; 32]), token)
        .with_lease(LEASE)
        .with_ttl(TTL)
}

/// A 201 response with two `Link` fields and `body`.
pub fn response(body: &'static [u8]) -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.append("link", "</a>; rel=next".parse().unwrap());
    headers.append("link", "</b>; rel=prev".parse().unwrap());
    StoredResponse::capture(
        StatusCode::CREATED,
        &headers,
        Bytes::from_static(body),
        None,
    )
}

/// The [`ClaimedKey`](crate::key::ClaimedKey) the layer hands a handler
/// whose request claimed `key` under `scope`, for tests of code that takes
/// one (an outbox message's key is derived from it).
pub fn claimed_key(key: &str, scope: &str) -> crate::key::ClaimedKey {
    crate::key::ClaimedKey::new(key.to_owned(), scope.to_owned())
}

/// The record of `key` in scope `"s"`, the scope of most checks.
pub fn id(key: &str) -> RecordId {
    RecordId::new("s", key)
}

/// Claims `key` in scope `"s"` (fingerprint 1) and asserts it was acquired
/// afresh; returns the token.
pub async fn acquire<S: Store>(store: &S, key: &str) -> FencingToken {
    let token = FencingToken::random();
    assert_eq!(
        store.claim(claim_of("s", key, 1, token)).await.unwrap(),
        Claim::Acquired { taken_over: false }
    );
    token
}

/// Completes `key` in scope `"s"` with [`response`]`(body)`.
pub async fn complete<S: Store>(
    store: &S,
    key: &str,
    token: FencingToken,
    body: &'static [u8],
) -> Completion {
    store
        .complete(id(key), token, response(body))
        .await
        .unwrap()
}

/// Claims with its own fingerprint and TTL (the lease is [`LEASE`]) and
/// asserts it was acquired afresh.
pub async fn claim_ttl<S: Store>(store: &S, scope: &str, key: &str, fp: u8, ttl: Duration) {
    let claim = claim_of(scope, key, fp, FencingToken::random()).with_ttl(ttl);
    assert_eq!(
        store.claim(claim).await.unwrap(),
        Claim::Acquired { taken_over: false }
    );
}

/// [`RecordCounts`] with these four figures.
pub fn counts(in_flight: u64, stuck: u64, completed: u64, expired: u64) -> RecordCounts {
    RecordCounts {
        in_flight,
        stuck,
        completed,
        expired,
    }
}
