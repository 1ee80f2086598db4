//! The store kit: what several stores share, written once, public so that a
//! store in a crate of its own (`tower-idempotency-postgres`, or one written
//! elsewhere) supplies only what really differs: its SQL, its lock step,
//! how it stops a statement. The rules around them live here.
//!
//! * [`claim`]: the claim of a SQL store (insert first, judge the record an
//!   insert met, take it over or refuse); the store supplies its statements
//!   as [`claim::ClaimSteps`].
//! * [`two_phase`]: transactional mode in two phases (the claim commits
//!   first, then the handler's writes and the completion commit together);
//!   the store supplies [`two_phase::TwoPhase`], and
//!   [`two_phase_store!`](crate::store::kit::two_phase::two_phase_store)
//!   writes its `TransactionalStore` impl.
//! * [`one_phase`]: transactional mode with the claim inside the handler's
//!   transaction (PostgreSQL): a crash frees the key at once; the store
//!   supplies [`two_phase::TwoPhase::claim_inside`], the rest is
//!   `two_phase`'s.
//! * [`fate`]: who ends a transaction, the layer or the max-hold timer.
//! * [`release`]: giving a claimed key back, and the guard that does so when
//!   a request is cancelled between the claim and the hand-over.
//! * [`table`]: the rule for a configurable table name; [`builder`]: the
//!   builder settings that go with it (`table`, `purge`, `clock_offset`).
//! * [`pg_sql`]: PostgreSQL's statements, schema and advisory lock keys,
//!   shared by every PostgreSQL store so that they exclude each other on one
//!   key; [`sqlite_sql`]: the schema every SQLite store shares, and its
//!   migration.
//! * [`held`]: the keys held by this process's open transactional
//!   requests, where the claim lives in an uncommitted transaction (SQLite):
//!   422 before any wait, a bounded wait for the holder, never a takeover.
//! * [`purge`]: retention on by default: the purge task every SQL store
//!   keeps, and its bounded batches.
//! * [`feed`]: the change feed that wakes waiting repeats on other servers
//!   (`Store::watch`): the watched keys, the listener's state.
//! * [`transaction_extractor!`]: a store's transaction type as an axum
//!   extractor.
//!
//! The kit follows the crate's version: a change to it is a change of the
//! store crates released with it. A store written elsewhere checks itself
//! with `test_util::store_suite!` (feature `test-util`).

pub mod builder;
pub mod claim;
mod extractor;
pub mod fate;
pub mod feed;
pub mod held;
pub mod one_phase;
pub mod pg_sql;
pub mod purge;
pub mod release;
pub mod replay_cache;
pub mod sqlite_sql;
pub mod table;
pub mod two_phase;
#[doc(inline)]
pub use crate::__transaction_extractor as transaction_extractor;
