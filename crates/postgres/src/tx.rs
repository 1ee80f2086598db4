//! [`PgTx`]: a pooled connection inside an open transaction, whichever
//! phase opened it (`transaction.rs`'s two phases, `inside.rs`'s one).

use deadpool_postgres::Object;

/// A pooled connection inside an open transaction. Dropped before its
/// transaction ended cleanly (a cancelled commit, a failed `BEGIN`), it is
/// taken out of the pool and closed, so the server rolls the transaction back
/// and no later request can ever commit it.
// `pub` because it is the associated `Tx` of a public trait's impl (the
// kit's `TwoPhase`); it is not nameable outside this crate.
#[allow(unreachable_pub)]
pub struct PgTx(Option<Object>);

impl PgTx {
    /// `client`, about to open a transaction.
    pub(crate) fn new(client: Object) -> Self {
        PgTx(Some(client))
    }

    /// A transaction the server has ended already, its connection back in
    /// the pool: rolling it back does nothing.
    pub(crate) fn over() -> Self {
        PgTx(None)
    }

    /// Whether it still holds its connection (its transaction not ended).
    pub(crate) fn is_open(&self) -> bool {
        self.0.is_some()
    }

    pub(crate) fn client(&self) -> &Object {
        self.0
            .as_ref()
            .expect("a PgTx holds its connection until it ends")
    }

    /// The connection, for the handler's statements.
    pub(crate) fn client_mut(&mut self) -> &mut Object {
        self.0
            .as_mut()
            .expect("a PgTx holds its connection until it ends")
    }

    /// The transaction ended (`COMMIT` or `ROLLBACK` answered): the
    /// connection may go back to the pool.
    pub(crate) fn ended(mut self) {
        drop(self.0.take());
    }
}

impl Drop for PgTx {
    fn drop(&mut self) {
        if let Some(client) = self.0.take() {
            drop(Object::take(client));
        }
    }
}
