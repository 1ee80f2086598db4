//! Stores: where records live, and the one atomic claim that decides who is first.
//!
//! # Which store
//!
//! | your service | store (feature) | modes |
//! |---|---|---|
//! | one process, SQLite file | `SqliteStore` (`sqlite`, default) | separate, transactional |
//! | already on sqlx with SQLite | `SqlxSqliteStore` (the crate `tower-idempotency-sqlx`, its feature `sqlite`) | separate, transactional |
//! | PostgreSQL through tokio-postgres, or a managed one over TLS | `PostgresStore` (the crate `tower-idempotency-postgres`, its feature `tls`) | separate, transactional |
//! | already on sqlx with PostgreSQL | `SqlxPostgresStore` (`tower-idempotency-sqlx`, feature `postgres`) | separate, transactional |
//! | MySQL 8 or MariaDB | `MySqlStore` (`tower-idempotency-sqlx`, feature `mysql`) | separate, transactional |
//! | a fleet whose data lives elsewhere: Redis, one server or a cluster | `RedisStore` (the crate `tower-idempotency-redis`) | separate |
//! | tests, a single process that may forget on restart | [`MemoryStore`] | separate |
//!
//! Transactional mode (the handler writes through the request's
//! transaction, so its writes and the record commit together) needs the
//! records in the database the handler writes to. The rest of this page is
//! the contract every store keeps, for readers and implementors.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use tower_idempotency::store::{
//!     Claim, ClaimRequest, Completion, FencingToken, MemoryStore, RecordId, Refusal, Store,
//! };
//! use tower_idempotency::fingerprint::Fingerprint;
//! use tower_idempotency::StoredResponse;
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let store = MemoryStore::new();
//! let id = RecordId::new("alice", "k-1");
//! let request = |token| {
//!     ClaimRequest::new(id.clone(), Fingerprint([7; 32]), token)
//!         .with_lease(Duration::from_secs(60))
//! };
//! let first = FencingToken::random();
//! assert_eq!(store.claim(request(first)).await.unwrap(), Claim::Acquired { taken_over: false });
//! // A second claim while the first holds its lease is refused.
//! assert!(matches!(
//!     store.claim(request(FencingToken::random())).await.unwrap(),
//!     Claim::Refused(Refusal::InFlight { .. })
//! ));
//! // The holder stores its response (only its token may); repeats replay it.
//! let response = StoredResponse::capture(http::StatusCode::CREATED, &http::HeaderMap::new(), "ok".into(), None);
//! assert_eq!(store.complete(id.clone(), first, response.clone()).await.unwrap(), Completion::Stored);
//! assert_eq!(
//!     store.claim(request(FencingToken::random())).await.unwrap(),
//!     Claim::Refused(Refusal::Completed(response))
//! );
//! # }
//! ```
//!
//! # The contract
//!
//! A record is identified by `(scope, key)` and holds a fingerprint, a state
//! (in flight or completed), a fencing token, a lease deadline, a TTL
//! deadline and, once completed, the stored response. [`Store::claim`] is ONE
//! atomic operation that, for the record it finds:
//!
//! | found | does | returns |
//! |---|---|---|
//! | nothing, or a record past its TTL | inserts an in-flight record | [`Claim::Acquired`] |
//! | a different fingerprint | nothing | [`Claim::Refused`]`(`[`Refusal::Mismatch`]`)` |
//! | completed | nothing | [`Claim::Refused`]`(`[`Refusal::Completed`]`)` |
//! | in flight, lease alive | nothing | [`Claim::Refused`]`(`[`Refusal::InFlight`]`)` |
//! | in flight, lease over | takes it over with the new token and lease | [`Claim::Acquired`] `{ taken_over: true }` |
//!
//! "Lease alive" means `now < lease_until <= now + lease`, with `lease` the
//! claiming request's [`ClaimRequest::lease`]. A deadline further ahead than
//! one lease cannot come from a claim made at or before `now`: the store's
//! clock stepped back after the claim (NTP, a restored VM, an operator), and
//! trusting it would keep the key in flight for as long as the step. Such a
//! lease counts as over. So a claim with a shorter lease takes over a record
//! claimed with a longer one while more than the shorter lease of it
//! remains: layers that share a store's keys should share one lease.
//!
//! [`Store::complete`] and [`Store::release`] act only while the record still
//! carries the caller's token, so a holder whose lease was taken over cannot
//! overwrite or delete the new holder's record.
//!
//! Expiry is judged by the store's clock, never by a caller's. A completion
//! that arrives after the record's TTL may answer [`Completion::Stored`]
//! (memory, SQLite, PostgreSQL: the response is written into a record no
//! claim will replay, and purging removes it) or [`Completion::Fenced`]
//! (Redis: the record is already gone); either way no request replays it.
//!
//! `integration/tests/stores/model.rs` checks every store against a reference model of this
//! table with random sequences of claims, completions, releases, crashed
//! holders, clock moves and purges, and with concurrent claims from every
//! starting state.

use std::future::Future;
use std::time::Duration;

use crate::fingerprint::Fingerprint;
use crate::response::StoredResponse;

mod clock;
mod decide;
mod error;
mod inspect;
pub mod kit;
mod memory;
#[cfg(feature = "sqlite")]
mod sqlite;

pub use crate::fencing::FencingToken;
pub use clock::duration_ms;
pub use clock::{Clock, SystemClock};
pub(crate) use decide::{Decision, Existing, Kind, decide, retry_after_secs};
pub use error::StoreError;
pub use inspect::{Inspect, RecordCounts, RecordSummary};
pub use kit::feed::Watch;
pub use kit::purge::Purge;
pub use memory::MemoryStore;
#[cfg(feature = "sqlite")]
pub use sqlite::{
    GroupCommitStats, SqliteStore, SqliteStoreBuilder, SqliteTransaction, Synchronous,
    TransactionError,
};

/// The default lease: how long an in-flight claim holds unless renewed, 10
/// seconds. The layer renews it while the request runs (up to
/// [`DEFAULT_MAX_HOLD`]), so it bounds how long a crashed holder's keys stay
/// in flight, not how long a handler may run.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);
/// The default max hold: the longest a request may hold its key, counted
/// from its claim, while its lease is renewed, 60 seconds. It also bounds a
/// transactional request's transaction.
pub const DEFAULT_MAX_HOLD: Duration = Duration::from_secs(60);
/// The default record TTL, 24 hours (Stripe keeps keys at least 24 hours).
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 60 * 60);

/// Everything [`Store::claim`] needs.
///
/// `#[non_exhaustive]`: the claim may grow inputs. Build one with
/// [`ClaimRequest::new`] (the layer's default lease and TTL) and
/// [`ClaimRequest::with_lease`] / [`ClaimRequest::with_ttl`]; the fields stay
/// public for stores to read.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ClaimRequest {
    /// Who the key belongs to (see [`crate::scope`]).
    pub scope: String,
    /// The parsed idempotency key.
    pub key: String,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The token the new or taken-over record will carry.
    pub token: FencingToken,
    /// How long an in-flight claim holds before another request may take it
    /// over. Also the longest lease this claim believes in: an in-flight
    /// record whose lease deadline is further ahead than `now + lease` (the
    /// store's clock stepped back since it was claimed) is taken over as if
    /// its lease had ended, on every store.
    pub lease: Duration,
    /// How long the record is kept, counted from the claim.
    pub ttl: Duration,
    /// The longest the request may hold the key while the layer renews its
    /// lease ([`IdempotencyLayer::max_hold`](crate::IdempotencyLayer::max_hold));
    /// `None`: one lease. A store that ends a transaction held too long
    /// counts from the claim up to [`ClaimRequest::hold`].
    pub max_hold: Option<Duration>,
    /// How long the store may keep this claim waiting for a live holder of
    /// its key to end, where the store itself can wait for it, before it
    /// answers [`Refusal::InFlight`]: both SQLite stores queue a
    /// transactional claim behind the open request that holds its key.
    /// Stores that cannot wait answer at once. The layer sets it to what is
    /// left of [`IdempotencyLayer::wait_in_flight`](crate::IdempotencyLayer::wait_in_flight)'s
    /// bound when the repeat has a place among the layer's waiters; zero
    /// (the default: 409 at once, the IETF draft's rule) otherwise. A store
    /// never waits past its own bound (SQLite: its busy timeout).
    pub wait_in_flight: Duration,
}

impl ClaimRequest {
    /// A claim of `id` by a request with `fingerprint`, whose record will
    /// carry `token`, with the layer's default lease
    /// ([`DEFAULT_LEASE`], 10 s) and TTL
    /// ([`DEFAULT_TTL`], 24 h).
    pub fn new(id: RecordId, fingerprint: Fingerprint, token: FencingToken) -> Self {
        let (scope, key) = id.into_parts();
        ClaimRequest {
            scope,
            key,
            fingerprint,
            token,
            lease: DEFAULT_LEASE,
            ttl: DEFAULT_TTL,
            max_hold: None,
            wait_in_flight: Duration::ZERO,
        }
    }

    /// The same claim, kept waiting in the store for a live holder of its
    /// key at most `wait` ([`ClaimRequest::wait_in_flight`]).
    #[must_use]
    pub fn with_wait_in_flight(mut self, wait: Duration) -> Self {
        self.wait_in_flight = wait;
        self
    }

    /// The same claim, held for at most `max_hold` while its lease is renewed.
    #[must_use]
    pub fn with_max_hold(mut self, max_hold: Duration) -> Self {
        self.max_hold = Some(max_hold);
        self
    }

    /// The longest this claim may be held: [`ClaimRequest::max_hold`], or one lease.
    pub fn hold(&self) -> Duration {
        self.max_hold.unwrap_or(self.lease)
    }

    /// The same claim with a lease of `lease`.
    #[must_use]
    pub fn with_lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// The same claim with a TTL of `ttl`.
    #[must_use]
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The record this claim is for, as [`Store::complete`] and
    /// [`Store::release`] take it.
    pub fn record_id(&self) -> RecordId {
        RecordId::new(self.scope.clone(), self.key.clone())
    }
}

/// Which record: a scope and an idempotency key. Records are identified by
/// the pair; a type of its own so that the two strings cannot be swapped in
/// [`Store::complete`] and [`Store::release`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RecordId {
    scope: String,
    key: String,
}

impl RecordId {
    /// The record of `key` in `scope` (see [`crate::scope`]).
    pub fn new(scope: impl Into<String>, key: impl Into<String>) -> Self {
        RecordId {
            scope: scope.into(),
            key: key.into(),
        }
    }

    /// Who the key belongs to.
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The idempotency key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// `(scope, key)`.
    pub fn into_parts(self) -> (String, String) {
        (self.scope, self.key)
    }
}

/// The outcome of [`Store::claim`]: the record is the caller's, or it is
/// not and [`Refusal`] says why.
///
/// Not `#[non_exhaustive]`: the split in two is what the type means; any new
/// reason to refuse goes into [`Refusal`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The caller holds the record now and runs the request.
    Acquired {
        /// `true` when an in-flight record whose lease had ended was taken over.
        taken_over: bool,
    },
    /// The request must not run: why.
    Refused(Refusal),
}

/// Why a claim was refused: every outcome of [`Store::claim`] except
/// [`Claim::Acquired`].
///
/// `#[non_exhaustive]`: a store outside this crate can still return every
/// variant; code outside the crate that matches one needs a `_` arm, so a
/// new reason (answered by the layer) is not a breaking change.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// The record was made by a request with another fingerprint.
    Mismatch,
    /// The record is completed: replay this.
    Completed(StoredResponse),
    /// Another holder's lease is alive for this long.
    InFlight {
        /// Time left on the holder's lease.
        lease_remaining: Duration,
    },
}

impl From<Refusal> for Claim {
    fn from(refusal: Refusal) -> Self {
        Claim::Refused(refusal)
    }
}

/// The outcome of [`Store::complete`].
///
/// `#[non_exhaustive]`, as [`Refusal`] is: stores outside this crate
/// construct it freely; matches outside it need a `_` arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Completion {
    /// The response is stored; repeats replay it.
    Stored,
    /// The record no longer carries the caller's token (its lease was taken
    /// over, or it expired and was purged): nothing was written.
    Fenced,
}

/// A place to keep idempotency records. See the module docs for the contract
/// every implementation follows.
pub trait Store: Clone + Send + Sync + 'static {
    /// Claims `(scope, key)` in one atomic operation (the table in the module docs).
    fn claim(
        &self,
        request: ClaimRequest,
    ) -> impl Future<Output = Result<Claim, StoreError>> + Send;

    /// Stores `response` and marks the record completed, if it still carries
    /// `token`.
    fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> impl Future<Output = Result<Completion, StoreError>> + Send;

    /// Deletes the in-flight record if it still carries `token`, so a retry
    /// runs at once. Returns whether a record was deleted.
    fn release(
        &self,
        id: RecordId,
        token: FencingToken,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Deletes every record past its TTL. Returns how many were deleted.
    fn purge_expired(&self) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Renews the lease of the in-flight record that still carries `token`:
    /// it now ends `lease` from now, on the store's clock. `false` when no
    /// in-flight record carries `token` (its lease ended and another request
    /// took the key over, or it was released or completed): the caller has
    /// lost the key. A record whose lease ended but which nobody took over
    /// is renewed, since nobody else ran.
    fn renew(
        &self,
        id: RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// [`Store::renew`] for many claims at once, each by `lease` from now:
    /// one answer per claim, in their order. The layer's renewal task calls
    /// it with every claim due (at most 500). The default renews them one at
    /// a time; the PostgreSQL and MySQL stores renew them in one statement
    /// on a connection of their own, so renewals never wait behind requests
    /// for the pool.
    fn renew_all(
        &self,
        claims: Vec<(RecordId, FencingToken)>,
        lease: Duration,
    ) -> impl Future<Output = Result<Vec<bool>, StoreError>> + Send {
        async move {
            let mut renewed = Vec::with_capacity(claims.len());
            for (id, token) in claims {
                renewed.push(self.renew(id, token, lease).await?);
            }
            Ok(renewed)
        }
    }

    /// A watch on `id` for a repeat waiting on it
    /// ([`IdempotencyLayer::wait_in_flight`](crate::IdempotencyLayer::wait_in_flight)):
    /// woken when any server completes or releases the record, through the
    /// store's own signal (PostgreSQL `LISTEN`/`NOTIFY`, Redis pub/sub; see
    /// [`kit::feed`]). The waiter still polls, more slowly while the watch
    /// is live. The default, `None`, is a store without a signal: waiters
    /// on other servers are woken by polling alone.
    fn watch(&self, id: &RecordId) -> Option<Watch> {
        let _ = id;
        None
    }
}

/// A store that can claim a key inside a transaction the handler writes
/// through, and commit the handler's writes, the record and the response
/// together ([`crate::mode::Transactional`]).
pub trait TransactionalStore: Store {
    /// The open transaction, handed to the handler through the request's
    /// extensions (so: `Clone + Send + Sync`).
    type Transaction: Clone + Send + Sync + 'static;

    /// Claims the key (the table in the module docs) and opens the
    /// transaction the handler writes in. SQLite claims inside that
    /// transaction; PostgreSQL commits the claim first, so that other servers
    /// see it. Refused, no transaction stays open.
    fn claim_in_transaction(
        &self,
        request: ClaimRequest,
    ) -> impl Future<Output = Result<TransactionClaim<Self::Transaction>, StoreError>> + Send;

    /// Completes the record with `response` and commits the transaction.
    /// An error means nothing was committed.
    fn commit(
        &self,
        transaction: &Self::Transaction,
        response: StoredResponse,
    ) -> impl Future<Output = Result<Completion, StoreError>> + Send;

    /// Rolls the transaction back: the handler's writes and the claim vanish.
    /// Returns at once; safe to call from `Drop`.
    fn rollback(&self, transaction: &Self::Transaction);

    /// Rolls back as [`TransactionalStore::rollback`] does, and returns once
    /// the key is free again, so that a retry sent as soon as the answer
    /// arrives runs at once instead of meeting 409. The layer awaits this when
    /// the handler's answer is not stored. The default calls `rollback`, for
    /// stores where the key is free when it returns.
    fn roll_back_and_wait(
        &self,
        transaction: &Self::Transaction,
    ) -> impl Future<Output = ()> + Send {
        self.rollback(transaction);
        std::future::ready(())
    }

    /// Whether the claim commits before the handler runs (two phases: the
    /// PostgreSQL and MySQL stores with `commit_claims_first(true)`), so
    /// other servers see it and a crash leaves it in flight until its lease
    /// ends; then the layer renews its lease. `false` (the default) where
    /// the claim lives in the open transaction and vanishes with it (SQLite;
    /// the PostgreSQL and MySQL stores by default): nothing to renew.
    const CLAIM_COMMITS_FIRST: bool = false;

    /// [`TransactionalStore::CLAIM_COMMITS_FIRST`] for this store as it
    /// was built: a store that can do either (PostgreSQL, MySQL) says which it
    /// does. The layer renews a claim's lease only where it is `true`.
    fn claim_commits_first(&self) -> bool {
        Self::CLAIM_COMMITS_FIRST
    }

    /// Resolves once the store has ended `transaction` on its own, e.g.
    /// rolled it back past its max hold time. The layer races it against
    /// reading the handler's response, so that a response that never ends
    /// is answered (503) when its transaction is gone. The default never
    /// resolves, for stores that never end a transaction on their own.
    fn ended(&self, transaction: &Self::Transaction) -> impl Future<Output = ()> + Send {
        let _ = transaction;
        std::future::pending()
    }
}

/// The outcome of [`TransactionalStore::claim_in_transaction`]. Not
/// `#[non_exhaustive]`, as [`Claim`] is not.
#[derive(Debug)]
pub enum TransactionClaim<T> {
    /// The caller holds the key inside `transaction`.
    Acquired {
        /// The open transaction.
        transaction: T,
        /// `true` when an in-flight record whose lease had ended was taken over.
        taken_over: bool,
    },
    /// The claim was refused; no transaction is open.
    Refused(Refusal),
}

/// Spawns a task on the current Tokio runtime that calls
/// [`Store::purge_expired`] every `period`. Errors are logged and the loop
/// goes on; abort the returned handle to stop it.
///
/// Expired records are already ignored by every lookup; purging only reclaims
/// their space.
pub fn spawn_purge_task<S: Store>(store: S, period: Duration) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut interval = tokio::time::interval(period);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            interval.tick().await;
            match store.purge_expired().await {
                Ok(n) => tracing::debug!(purged = n, "purged expired idempotency records"),
                Err(e) => tracing::warn!(error = %e, "purging expired idempotency records failed"),
            }
        }
    })
}
