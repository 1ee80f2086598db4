//! The settings every SQL store with a configurable table and a two-phase
//! transaction shares, written once: `table`, `max_hold` and (feature
//! `test-util`) `clock_offset`, with one documentation.

/// The shared setters of `$builder`, whose fields `table: String`,
/// `max_hold: Duration` and `offset: Option<Arc<dyn Clock>>` they set;
/// `$transaction` is the store's transaction type, whose docs say what
/// happens past the max hold time.
macro_rules! sql_builder_settings {
    ($builder:ty, $transaction:ident) => {
        impl $builder {
            /// The table (default `idempotency_records`): 1 to 48 ASCII
            /// letters, digits and underscores, not starting with a digit, so
            /// that the index named after it fits every database's
            /// identifiers. Checked when the store opens.
            pub fn table(mut self, table: impl Into<String>) -> Self {
                self.table = table.into();
                self
            }

            /// The longest a transactional request may hold its transaction
            /// (and its pooled connection) open (default 30 s); the layer's
            /// lease caps it further. Past it the store stops a statement
            /// still running, rolls the transaction back, gives the key back,
            /// and the request is answered 503 with `Retry-After`: see
            #[doc = concat!("[`", stringify!($transaction), "`], \"Max hold time\".")]
            pub fn max_hold(mut self, hold: std::time::Duration) -> Self {
                self.max_hold = hold;
                self
            }

            /// For tests of leases and TTLs: a [`Clock`](crate::store::Clock)
            /// whose reading, in milliseconds, is added to the database
            /// server's clock, which judges leases and TTLs on this store.
            #[cfg(feature = "test-util")]
            pub fn clock_offset(mut self, offset: impl crate::store::Clock) -> Self {
                self.offset = Some(std::sync::Arc::new(offset));
                self
            }
        }
    };
}
pub(crate) use sql_builder_settings;
