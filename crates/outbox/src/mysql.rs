//! The outbox on MySQL 8 and MariaDB 10.6+: [`enqueue`] through the
//! request's [`MySqlTransaction`](tower_idempotency_sqlx::MySqlTransaction), and the
//! relay's queue over the store's pool.
//!
//! ```no_run
//! use tower_idempotency::key::ClaimedKey;
//! use tower_idempotency_outbox::{self as outbox, Message};
//! use tower_idempotency::store::StoreError;
//! use tower_idempotency_sqlx::MySqlTransaction;
//!
//! async fn order(tx: MySqlTransaction, claimed: ClaimedKey) -> Result<(), StoreError> {
//!     let event = Message::new(&claimed, 0, "http://billing.internal/events",
//!         "application/json", br#"{"order":17}"#.to_vec()).expect("a valid message");
//!     let mut conn = tx.connection().await?;
//!     outbox::mysql::enqueue(&mut *conn, &event) // commits with the handler's writes
//!         .await
//!         .map_err(StoreError::unavailable)?;
//!     Ok(())
//! }
//! ```
//!
//! Relays in several processes claim with `SELECT ... FOR UPDATE SKIP
//! LOCKED` (MySQL 8.0.1+, MariaDB 10.6+) and mark the rows claimed in the
//! same transaction: each due row goes to one of them, and none waits for
//! another's claim. Times are the database server's clock, so the app
//! servers' clocks need not agree.
//!
//! [`enqueue`] and [`migrate`] are [`outbox::sqlx`](crate::sqlx)'s, which
//! take any sqlx connection the outbox knows.

pub use super::sqlx::{enqueue, migrate};
