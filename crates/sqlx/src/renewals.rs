//! The lease renewals' own connection: a pool of one, made with the
//! application's connect options, so that renewals (one statement for every
//! claim due, `Store::renew_all`) never wait behind requests holding the
//! application's pool.

use sqlx::pool::PoolOptions;
use sqlx::{Database, Pool};

/// The options of a pool of one connection beside `pool`, connected on
/// first use (`connect_lazy_with` `pool`'s connect options), with the same
/// acquire timeout; a store adds what its connections need
/// (`after_connect`).
pub(crate) fn options_beside<DB: Database>(pool: &Pool<DB>) -> PoolOptions<DB> {
    PoolOptions::<DB>::new()
        .max_connections(1)
        .min_connections(0)
        .acquire_timeout(pool.options().get_acquire_timeout())
}
