//! The lease renewals' own connection: a pool of one, made with the
//! application's connect options, so that renewals (one statement for every
//! claim due, `Store::renew_all`) never wait behind requests holding the
//! application's pool.

use sqlx::pool::PoolOptions;
use sqlx::{Database, Pool};

/// A pool of one connection beside `pool`, connected on first use, with the
/// same connect options and acquire timeout.
pub(crate) fn pool_beside<DB: Database>(pool: &Pool<DB>) -> Pool<DB> {
    options_beside(pool).connect_lazy_with((*pool.connect_options()).clone())
}

/// The options of [`pool_beside`], for a store that sets up its
/// connections as well (`after_connect`).
pub(crate) fn options_beside<DB: Database>(pool: &Pool<DB>) -> PoolOptions<DB> {
    PoolOptions::<DB>::new()
        .max_connections(1)
        .min_connections(0)
        .acquire_timeout(pool.options().get_acquire_timeout())
}
