//! What a test needs to run the real [`Relay`](crate::Relay) over an outbox
//! table of its own: the [`Queue`] a relay asks of the table, and
//! [`Outbox::from_queue`](crate::Outbox::from_queue). Feature `test-util`;
//! not part of the stable API.
//!
//! ```
//! use std::time::Duration;
//! use tower_idempotency::StoreError;
//! use tower_idempotency_outbox::test_util::{BoxFut, Claimed, Fate, Queue};
//! use tower_idempotency_outbox::{Counts, Entry, Outbox, View, from_fn, Outcome};
//!
//! /// A table that never holds a message.
//! struct Empty;
//!
//! impl Queue for Empty {
//!     fn claim(&self, _: &str, _: usize, _: Duration) -> BoxFut<'_, Result<Vec<Claimed>, StoreError>> {
//!         Box::pin(async { Ok(Vec::new()) })
//!     }
//!     fn finish(&self, _: i64, _: u32, _: i64, _: Fate) -> BoxFut<'_, Result<bool, StoreError>> {
//!         Box::pin(async { Ok(false) })
//!     }
//!     fn purge(&self, _: Duration, _: usize) -> BoxFut<'_, Result<u64, StoreError>> {
//!         Box::pin(async { Ok(0) })
//!     }
//!     fn list(&self, _: View, _: usize) -> BoxFut<'_, Result<Vec<Entry>, StoreError>> {
//!         Box::pin(async { Ok(Vec::new()) })
//!     }
//!     fn requeue(&self, _: i64) -> BoxFut<'_, Result<bool, StoreError>> {
//!         Box::pin(async { Ok(false) })
//!     }
//!     fn counts(&self) -> BoxFut<'_, Result<Counts, StoreError>> {
//!         Box::pin(async { Ok(Counts::default()) })
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let outbox = Outbox::from_queue(Empty);
//! let relay = outbox.relay(from_fn(|_| async { Outcome::Delivered })).spawn();
//! assert_eq!(outbox.counts().await.unwrap(), Counts::default());
//! relay.abort();
//! # }
//! ```
//!
//! A [`Queue`] keeps the table's rules, which every database's SQL keeps:
//! a claim takes due messages held by nobody (or whose lease has ended),
//! gives each the next attempt number and a new lease deadline, and a
//! finish changes a row only while it still carries that attempt and
//! deadline.

pub use crate::queue::{BoxFut, Claimed, Fate, Queue};
