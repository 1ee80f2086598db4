//! Stores: where records live, and the one atomic claim that decides who is first.
//!
//! # Which store
//!
//! | your service | store (feature) | modes |
//! |---|---|---|
//! | one process, SQLite file | `SqliteStore` (`sqlite`, default) | separate, transactional |
//! | already on sqlx with SQLite | `SqlxSqliteStore` (`sqlx-sqlite`) | separate, transactional |
//! | PostgreSQL through tokio-postgres, or a managed one over TLS | `PostgresStore` (`postgres`, `postgres-tls`) | separate, transactional |
//! | already on sqlx with PostgreSQL | `SqlxPostgresStore` (`sqlx-postgres`) | separate, transactional |
//! | MySQL 8 or MariaDB | `MySqlStore` (`mysql`) | separate, transactional |
//! | a fleet whose data lives elsewhere: Redis, one server or a cluster | `RedisStore` (`redis`, `redis-tls`) | separate |
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
//! `tests/model.rs` checks every store against a reference model of this
//! table with random sequences of claims, completions, releases, crashed
//! holders, clock moves and purges, and with concurrent claims from every
//! starting state.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use crate::fingerprint::Fingerprint;
use crate::response::StoredResponse;

/// Makes a store's transaction type an axum extractor: `T` answers a request
/// without one with a 500 problem (the handler would otherwise write outside
/// the idempotency transaction), and logs the misconfiguration once per
/// process and type; `Option<T>` is `None` for requests that passed through
/// without a key.
#[cfg(any(
    feature = "sqlite",
    feature = "postgres",
    feature = "sqlx-postgres",
    feature = "sqlx-sqlite",
    feature = "mysql"
))]
macro_rules! transaction_extractor {
    ($transaction:ty) => {
        /// Extracts the request's transaction in a handler behind a
        /// [`crate::IdempotencyLayer::transactional`] layer. A request without
        /// one (a route whose layer is not `.transactional()`, or has no
        /// `require_key(true)`) is answered with a 500 problem saying so, and
        /// the first such request of the process is logged at error level.
        /// The compiler cannot catch this: the extractor does not see the
        /// layer's type.
        #[cfg(feature = "axum")]
        impl<S: Sync> axum_core::extract::FromRequestParts<S> for $transaction {
            type Rejection = http::Response<axum_core::body::Body>;

            async fn from_request_parts(
                parts: &mut http::request::Parts,
                _state: &S,
            ) -> Result<Self, Self::Rejection> {
                static LOGGED: std::sync::Once = std::sync::Once::new();
                parts
                    .extensions
                    .get::<$transaction>()
                    .cloned()
                    .ok_or_else(|| {
                        $crate::extract::misconfigured(
                            &LOGGED,
                            concat!(
                                "this handler takes a ",
                                stringify!($transaction),
                                ", and the request has none: put the route behind IdempotencyLayer::transactional() with require_key(true)"
                            ),
                        )
                    })
            }
        }

        /// `Option<_>`: `None` for requests that passed through without a key.
        #[cfg(feature = "axum")]
        impl<S: Sync> axum_core::extract::OptionalFromRequestParts<S> for $transaction {
            type Rejection = std::convert::Infallible;

            async fn from_request_parts(
                parts: &mut http::request::Parts,
                _state: &S,
            ) -> Result<Option<Self>, Self::Rejection> {
                Ok(parts.extensions.get::<$transaction>().cloned())
            }
        }
    };
}
#[cfg(any(
    feature = "sqlite",
    feature = "postgres",
    feature = "sqlx-postgres",
    feature = "sqlx-sqlite",
    feature = "mysql"
))]
pub(crate) use transaction_extractor;

mod clock;
mod decide;
mod memory;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
mod pg_sql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(feature = "sqlx-postgres")]
mod sqlx_postgres;
#[cfg(feature = "sqlx-sqlite")]
mod sqlx_sqlite;

#[cfg(feature = "redis")]
pub use self::redis::{RedisStore, RedisStoreBuilder};
pub use crate::fencing::FencingToken;
pub(crate) use clock::duration_ms;
pub use clock::{Clock, SystemClock};
pub(crate) use decide::{Decision, Existing, Kind, decide, retry_after_secs};
pub use memory::MemoryStore;
#[cfg(feature = "mysql")]
pub use mysql::{MySqlStore, MySqlStoreBuilder, MySqlTransaction, MySqlTransactionConnection};
#[cfg(feature = "postgres")]
pub use postgres::{PostgresStore, PostgresStoreBuilder, PostgresTransaction, TransactionClient};
#[cfg(feature = "sqlite")]
pub use sqlite::{
    GroupCommitStats, SqliteStore, SqliteStoreBuilder, SqliteTransaction, Synchronous,
    TransactionError,
};
#[cfg(feature = "sqlx-postgres")]
pub use sqlx_postgres::{
    SqlxPostgresConnection, SqlxPostgresError, SqlxPostgresStore, SqlxPostgresStoreBuilder,
    SqlxPostgresTransaction,
};
#[cfg(feature = "sqlx-sqlite")]
pub use sqlx_sqlite::{
    SqlxSqliteConnection, SqlxSqliteError, SqlxSqliteStore, SqlxSqliteStoreBuilder,
    SqlxSqliteTransaction,
};

/// The default lease: how long an in-flight claim holds, 60 seconds.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);
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
}

impl ClaimRequest {
    /// A claim of `id` by a request with `fingerprint`, whose record will
    /// carry `token`, with the layer's default lease
    /// ([`DEFAULT_LEASE`], 60 s) and TTL
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
        }
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

/// A store failure. The layer never replays or runs the request on a store
/// error during the claim: it answers 503 (`store-unavailable`, worth a
/// retry), or 500 (`store-misconfigured`) for [`StoreError::Config`].
#[derive(Debug)]
#[non_exhaustive]
pub enum StoreError {
    /// The store did not answer: locked past its busy timeout, unreachable,
    /// an I/O error, a pool timeout. Retrying may succeed.
    Unavailable(Box<dyn std::error::Error + Send + Sync>),
    /// A record could not be decoded.
    Corrupt(String),
    /// The store holds as many live records as its capacity allows
    /// ([`MemoryStore::with_capacity`]): the claim was refused and nothing
    /// was recorded. The layer answers 503 with `Retry-After`.
    Full {
        /// The capacity, in records.
        capacity: usize,
        /// How long until the store expects room again.
        retry_after: Duration,
    },
    /// The store's configuration is invalid: a table name, URL or key
    /// prefix the store rejects. Returned by the builders' `open`, before
    /// any connection is tried; retrying with the same input fails the same
    /// way. A store that returned it from a request would be answered with
    /// a 500 problem, not 503.
    Config(Box<dyn std::error::Error + Send + Sync>),
}

impl StoreError {
    /// Wraps any error as [`StoreError::Unavailable`].
    pub fn unavailable(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        StoreError::Unavailable(e.into())
    }

    /// Wraps any error (or a message) as [`StoreError::Config`].
    pub fn config(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        StoreError::Config(e.into())
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Unavailable(e) => write!(f, "idempotency store unavailable: {e}"),
            StoreError::Corrupt(why) => write!(f, "idempotency record corrupt: {why}"),
            StoreError::Full { capacity, .. } => {
                write!(f, "idempotency store full: {capacity} live records")
            }
            StoreError::Config(e) => write!(f, "idempotency store misconfigured: {e}"),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StoreError::Unavailable(e) | StoreError::Config(e) => Some(&**e),
            StoreError::Corrupt(_) | StoreError::Full { .. } => None,
        }
    }
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
}

/// What an operator sees of a store: records stuck in flight, and how many
/// records of each kind it holds (`admin::router`, feature `admin`, serves
/// them over HTTP).
///
/// Every answer is judged by the store's clock, as [`Store::claim`] judges
/// leases and TTLs: the [`Clock`] of [`MemoryStore`] and [`SqliteStore`], the
/// database server's clock for `PostgresStore`, the Redis server's `TIME` for
/// `RedisStore`. A record is in exactly one of the four kinds of
/// [`RecordCounts`] at a given instant; [`RecordCounts::expired`] is what
/// [`Store::purge_expired`] would delete at that instant.
///
/// Both calls read every record (no store keeps an index on the lease): they
/// are for an operator's occasional look, not for each request.
///
/// A record whose lease deadline the clock stepped back from (further ahead
/// than one lease) counts as in flight here, not stuck: records keep their
/// deadline, not the lease that set it, and `Inspect` is not given a lease,
/// so it cannot tell such a deadline from a long lease. The next claim of
/// its key still takes it over (see [`ClaimRequest::lease`]).
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::fingerprint::Fingerprint;
/// use tower_idempotency::store::{ClaimRequest, FencingToken, Inspect, MemoryStore, RecordCounts, RecordId, Store};
/// use tower_idempotency::test_util::ManualClock; // feature `test-util`
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// let clock = ManualClock::new(1_000_000);
/// let store = MemoryStore::with_clock(clock.clone());
/// let id = RecordId::new("alice", "k-1");
/// store.claim(
///     ClaimRequest::new(id, Fingerprint([7; 32]), FencingToken::random())
///         .with_lease(Duration::from_secs(60))
///         .with_ttl(Duration::from_secs(86_400)),
/// ).await.unwrap();
/// // The holder crashed: 90 s later its lease has been over for 30 s.
/// clock.advance(Duration::from_secs(90));
/// let stuck = store.stuck(10).await.unwrap();
/// assert_eq!(stuck[0].key, "k-1");
/// assert_eq!(stuck[0].lease_ended_ms_ago, 30_000);
/// assert_eq!(stuck[0].ttl_remaining_ms, 86_310_000);
/// assert_eq!(store.counts().await.unwrap(), RecordCounts { in_flight: 0, stuck: 1, completed: 0, expired: 0 });
/// # }
/// ```
pub trait Inspect: Store {
    /// Up to `limit` in-flight records whose lease has ended and whose TTL
    /// has not: their holder is gone or overran its lease, and the next
    /// retry with the same key and request takes them over. Oldest lease
    /// end first (ties by scope, then key).
    fn stuck(
        &self,
        limit: usize,
    ) -> impl Future<Output = Result<Vec<RecordSummary>, StoreError>> + Send;

    /// How many records of each kind the store holds now.
    fn counts(&self) -> impl Future<Output = Result<RecordCounts, StoreError>> + Send;
}

/// One in-flight record whose lease has ended, from [`Inspect::stuck`].
///
/// `#[non_exhaustive]`: it may show more of the record later. A store built
/// outside this crate makes one with [`RecordSummary::new`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordSummary {
    /// Who the key belongs to (see [`crate::scope`]).
    pub scope: String,
    /// The idempotency key.
    pub key: String,
    /// The fingerprint of the request that claimed it.
    pub fingerprint: Fingerprint,
    /// Milliseconds since the lease ended, by the store's clock (0: it ended
    /// this millisecond).
    pub lease_ended_ms_ago: u64,
    /// Milliseconds until the record's TTL ends and it counts as absent, by
    /// the store's clock (at least 1).
    pub ttl_remaining_ms: u64,
}

impl RecordSummary {
    /// The record's [`RecordId`], e.g. to release it by hand.
    pub fn record_id(&self) -> RecordId {
        RecordId::new(self.scope.clone(), self.key.clone())
    }

    /// The fingerprint as 64 lowercase hexadecimal digits.
    pub fn fingerprint_hex(&self) -> String {
        self.fingerprint
            .0
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// The summary of the record `id`, claimed by a request with
    /// `fingerprint`, whose lease ended `lease_ended_ms_ago` milliseconds ago
    /// and whose TTL ends in `ttl_remaining_ms` milliseconds (both by the
    /// store's clock).
    pub fn new(
        id: RecordId,
        fingerprint: Fingerprint,
        lease_ended_ms_ago: u64,
        ttl_remaining_ms: u64,
    ) -> Self {
        let (scope, key) = id.into_parts();
        RecordSummary {
            scope,
            key,
            fingerprint,
            lease_ended_ms_ago,
            ttl_remaining_ms,
        }
    }

    /// A summary from a record's deadlines (Unix ms) and the store's `now`.
    pub(crate) fn from_deadlines(
        scope: String,
        key: String,
        fingerprint: Fingerprint,
        lease_until: i64,
        expires_at: i64,
        now: i64,
    ) -> Self {
        let non_negative = |ms: i64| u64::try_from(ms).unwrap_or(0);
        RecordSummary {
            scope,
            key,
            fingerprint,
            lease_ended_ms_ago: non_negative(now.saturating_sub(lease_until)),
            ttl_remaining_ms: non_negative(expires_at.saturating_sub(now)),
        }
    }
}

/// How many records of each kind a store holds, from [`Inspect::counts`].
/// Each record is in exactly one kind, judged by the store's clock.
///
/// Not `#[non_exhaustive]`: the four kinds partition the records, so a new
/// kind would change what the existing counts mean (a breaking change
/// either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RecordCounts {
    /// In flight, lease alive: a request is (or should be) running.
    pub in_flight: u64,
    /// In flight, lease over, TTL not: the records [`Inspect::stuck`] lists.
    pub stuck: u64,
    /// Completed, TTL not over: repeats are replayed.
    pub completed: u64,
    /// Past the TTL (either state): ignored by every lookup, deleted by the
    /// next [`Store::purge_expired`].
    pub expired: u64,
}

impl RecordCounts {
    pub(crate) fn add(&mut self, kind: Kind) {
        match kind {
            Kind::InFlight => self.in_flight += 1,
            Kind::Stuck => self.stuck += 1,
            Kind::Completed => self.completed += 1,
            Kind::Expired => self.expired += 1,
        }
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
