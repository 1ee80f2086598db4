//! SQL text shared by the two PostgreSQL stores (`PostgresStore`, the crate
//! `tower-idempotency-postgres`; `SqlxPostgresStore`, `tower-idempotency-sqlx`): every
//! statement ([`PgSql`]), the schema and the advisory lock keys, written
//! once, so the two stores read and write the same records and exclude each
//! other on the same keys. Below, the reasoning behind the claim's first two
//! statements (the read-first replay and the insert-first claim of a new
//! key) and the claim's lock statement.
//!
//! # Read first, then insert: replays take no lock, a new key no transaction
//!
//! A claim first runs the `completed` statement, one plain `SELECT` outside
//! any transaction: no advisory lock, no row lock. If it finds a completed
//! record whose TTL has not ended (judged on the server's clock in the same
//! statement), the claim answers at once: the stored response for the same
//! fingerprint, 422 for another (the order of `decide`: past the TTL first,
//! then the fingerprint, then the state).
//!
//! Otherwise it runs `insert_first`, an `INSERT ... ON CONFLICT DO NOTHING`
//! of the in-flight record, also outside any transaction and without a
//! lock (PostgreSQL wraps it in a transaction of its own). If it inserted,
//! the claim holds the key: a new key costs two statements, where the
//! locking claim below costs five (`BEGIN`, the lock, the insert, `COMMIT`,
//! after the read). If it met a record (one in flight, one past its TTL, or
//! one that appeared since the read), the locking claim runs, unchanged.
//!
//! Who is first is decided by the primary key alone: of concurrent inserts
//! of one key, PostgreSQL lets one through and makes the others wait for it
//! and then do nothing, whether they come from `insert_first` or from the
//! locking claim's own insert. Reading a completed record without a lock is
//! safe because a completed record is immutable until its TTL ends:
//! `complete` and `release` only touch a record in flight with the caller's
//! token, a take-over only replaces an in-flight record whose lease ended or
//! a record past its TTL, and the purge deletes only records past their TTL.
//! So a completed, unexpired record seen at the statement's instant is the
//! record every locking claim at that instant would see too, and its answer
//! (a replay or a 422) is the one the locking claim would give. Before the
//! read, concurrent replays of one key each took that key's advisory lock in
//! a transaction and so ran one at a time. The read also returns the TTL
//! the record has left, so that a store with a replay cache
//! ([`replay_cache`](super::replay_cache)) answers the next replays from
//! memory until then, for the same reason.
//!
//! The read and the insert stay two statements: measured with pgbench
//! (`-M prepared -c 8`) on a completed record, one statement that inserts
//! or reads (a data-modifying `WITH`) ran at 26,000 to 33,000 a second, the
//! plain read at 40,000 to 50,000, so joining them would make every replay
//! dearer to save one round trip per new key.
//!
//! # The claim's commit does not wait for the WAL flush
//!
//! The claim's transaction runs with `synchronous_commit = off` (set by
//! the `insert_first` and `lock_now` statements with `set_config(...,
//! true)`, i.e. `SET LOCAL`: it ends with the transaction, the insert's own
//! or the locking claim's, and the pooled connection goes back to the
//! server's setting). Its commit is visible to every session at once; only its
//! durability is deferred (PostgreSQL's WAL writer flushes it within
//! `3 * wal_writer_delay`, 600 ms by default). WAL is flushed in order, so
//! any later durable commit on the server (the handler's transaction with
//! the completion in transactional mode, `complete` in separate mode) also
//! makes the claim durable. If the server crashes first, the claim may be
//! lost, and with it everything written after it on that server: in
//! transactional mode the handler's writes and the completion (they commit
//! after the claim, in one transaction), so a retry runs once, with no
//! second effect; a request still running against a lost claim fails at its
//! completion (the fencing check finds no record with its token) and its
//! writes roll back. What is lost is only the wait for the lease: a retry
//! of a request whose completion had not committed runs at once instead of
//! getting 409 until the lease ends. In separate mode the handler's effect
//! may live outside this server; a lost claim then also lets the retry run
//! at once, where with a durable claim it would have run after the lease
//! (separate mode already allows a second effect after a crash once the
//! lease ends; this only shortens the wait). Under synchronous replication
//! the same holds at a failover: a claim not yet on the standby is lost,
//! and the retry of that request (whose completion had not committed, since
//! a synchronous commit waits for the standby to have all WAL before it,
//! claim included) runs at once instead of waiting for the lease.

use crate::fingerprint::Hasher;
use crate::store::{FencingToken, RecordId};

/// The channel on which PostgreSQL stores announce completions and
/// releases (`complete_notify`, `release_notify`) to waiting repeats on
/// other servers; the payload is
/// [`change_payload`](crate::store::kit::feed::change_payload)`(table, scope, key)`.
pub const NOTIFY_CHANNEL: &str = "tower_idempotency";

/// The statements of a PostgreSQL store, with the table name in them, each
/// as the driver keeps a statement (`S`: `String` for tokio-postgres,
/// `sqlx::SqlStr` for sqlx).
pub struct PgSql<S> {
    /// The table's name, as given.
    pub table: String,
    /// The key's advisory lock, then the server's clock (unix ms) plus `$2`;
    /// every later lock wait of the transaction bounded by `$3` (ms as text,
    /// [`lock_wait_ms`]).
    pub lock_now: S,
    /// The read-first replay: `($1 scope, $2 key, $3 clock offset ms)`
    /// gives `fingerprint, response, TTL left (ms)` of a completed record
    /// whose TTL has not ended (the clock is read again for the TTL left,
    /// so it is never more than the TTL the condition saw).
    pub completed: S,
    /// The insert of a new key outside a transaction, without the lock (see
    /// the module docs): `($1 scope, $2 key, $3 fingerprint, $4 token,
    /// $5 clock offset ms, $6 lease ms, $7 TTL ms, $8 lock wait ms as text,
    /// [`lock_wait_ms`])`; one row affected when it inserted. Commits with
    /// `synchronous_commit = off`. A claim held in another open transaction
    /// (one phase) is waited for at most `$8`: past it, SQLSTATE
    /// [`LOCK_NOT_AVAILABLE`].
    pub insert_first: S,
    /// [`PgSql::insert_first`] inside the handler's transaction (one
    /// phase, [`one_phase`](super::one_phase)): its first seven parameters
    /// (the lock wait is bounded by [`lock_wait`]), and the transaction's
    /// commit stays synchronous (the handler's writes commit with it).
    pub insert_inside: S,
    /// The server's clock (unix ms) plus `$1`.
    pub now: S,
    /// The claim's `INSERT ... ON CONFLICT DO NOTHING`.
    pub insert: S,
    /// The record an insert met, under the lock.
    pub select: S,
    /// A take-over of an expired lease or TTL.
    pub take_over: S,
    /// The completion, fenced by the token.
    pub complete: S,
    /// The release, fenced by the token.
    pub release: S,
    /// [`PgSql::complete`] that also announces the change (`pg_notify` on
    /// [`NOTIFY_CHANNEL`], payload `$5`, delivered at commit) when it
    /// completed the record; its row count is the records completed.
    pub complete_notify: S,
    /// [`PgSql::release`] that also announces the change, as
    /// [`PgSql::complete_notify`] does.
    pub release_notify: S,
    /// [`PgSql::complete`] that fails ([`NOT_COMPLETED`], which aborts the
    /// transaction) when it completed no record, so that a `COMMIT` sent
    /// behind it without waiting commits nothing.
    pub complete_or_fail: S,
    /// [`PgSql::complete_notify`] that fails as
    /// [`PgSql::complete_or_fail`] does.
    pub complete_notify_or_fail: S,
    /// The lease renewal, fenced by the token: `($1 scope, $2 key,
    /// $3 token, $4 clock offset ms, $5 lease ms)`.
    pub renew: S,
    /// [`PgSql::renew`] for many claims, fenced by each one's token:
    /// `($1 scopes, $2 keys, $3 tokens, $4 clock offset ms, $5 lease ms)`,
    /// three arrays of one length; returns `scope, key` of each record
    /// renewed.
    pub renew_all: S,
    /// The purge of records past their TTL: `(offset, at most this many
    /// rows)`.
    pub purge: S,
    /// [`Inspect::stuck`](crate::store::Inspect::stuck).
    pub stuck: S,
    /// [`Inspect::counts`](crate::store::Inspect::counts).
    pub counts: S,
}

impl<S> PgSql<S> {
    /// The statements for `table` (checked by
    /// [`check_table_name`](crate::store::kit::table::check_table_name)),
    /// each made into an `S` by `statement`.
    pub fn new(table: &str, statement: impl Fn(String) -> S) -> PgSql<S> {
        PgSql {
            table: table.to_owned(),
            lock_now: statement(lock_now()),
            completed: statement(completed(table)),
            insert_first: statement(insert_new(table, true)),
            insert_inside: statement(insert_new(table, false)),
            now: statement(format!("SELECT {}", now_ms(1))),
            insert: statement(format!(
                "INSERT INTO {table} (scope, key, fingerprint, token, state, lease_until, expires_at)
                 VALUES ($1, $2, $3, $4, 'in_flight', $5, $6)
                 ON CONFLICT (scope, key) DO NOTHING"
            )),
            select: statement(format!(
                "SELECT fingerprint, state, lease_until, expires_at, response
                 FROM {table} WHERE scope = $1 AND key = $2 FOR UPDATE"
            )),
            take_over: statement(format!(
                "UPDATE {table}
                 SET fingerprint = $3, token = $4, state = 'in_flight',
                     lease_until = $5, expires_at = $6, response = NULL
                 WHERE scope = $1 AND key = $2"
            )),
            complete: statement(complete(table, false, false)),
            release: statement(format!(
                "DELETE FROM {table}
                 WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_flight'"
            )),
            complete_notify: statement(complete(table, true, false)),
            complete_or_fail: statement(complete(table, false, true)),
            complete_notify_or_fail: statement(complete(table, true, true)),
            release_notify: statement(format!(
                "WITH gone AS (
                    DELETE FROM {table}
                    WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_flight'
                    RETURNING 1)
                 SELECT pg_notify('{NOTIFY_CHANNEL}', $4::text) FROM gone"
            )),
            renew: statement(format!(
                "UPDATE {table} SET lease_until = {now} + $5::bigint
                 WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_flight'
                   AND expires_at > {now}",
                now = now_ms(4)
            )),
            renew_all: statement(renew_all(table)),
            purge: statement(purge(table)),
            // The clock is read once per statement (a MATERIALIZED CTE is
            // evaluated once), so every row is judged at the same instant.
            stuck: statement(format!(
                "WITH now AS MATERIALIZED (SELECT {} AS ms)
                 SELECT scope, key, fingerprint, lease_until, expires_at, now.ms
                 FROM {table}, now
                 WHERE state = 'in_flight' AND lease_until <= now.ms AND expires_at > now.ms
                 ORDER BY lease_until, scope, key
                 LIMIT $2",
                now_ms(1)
            )),
            counts: statement(format!(
                "WITH now AS MATERIALIZED (SELECT {} AS ms)
                 SELECT
                    count(*) FILTER (WHERE expires_at > now.ms AND state = 'in_flight' AND lease_until > now.ms),
                    count(*) FILTER (WHERE expires_at > now.ms AND state = 'in_flight' AND lease_until <= now.ms),
                    count(*) FILTER (WHERE expires_at > now.ms AND state = 'completed'),
                    count(*) FILTER (WHERE expires_at <= now.ms)
                 FROM {table}, now",
                now_ms(1)
            )),
        }
    }
}

/// The table and its index, created if missing (several statements: run
/// as a batch, not prepared, in a transaction or as one multi-statement
/// query). A table already there is skipped without PostgreSQL's NOTICE
/// ("relation ... already exists, skipping"), which drivers log at INFO on
/// every start: `SET LOCAL` raises `client_min_messages` to the end of the
/// transaction.
pub fn schema(table: &str) -> String {
    format!(
        "SET LOCAL client_min_messages = warning;
        CREATE TABLE IF NOT EXISTS {table} (
            scope       TEXT   NOT NULL,
            key         TEXT   NOT NULL,
            fingerprint BYTEA  NOT NULL,
            token       BIGINT NOT NULL,
            state       TEXT   NOT NULL CHECK (state IN ('in_flight', 'completed')),
            lease_until BIGINT NOT NULL, -- unix ms, server clock
            expires_at  BIGINT NOT NULL, -- unix ms, server clock
            response    BYTEA,
            PRIMARY KEY (scope, key)
        );
        CREATE INDEX IF NOT EXISTS {table}_expires_at ON {table} (expires_at);"
    )
}

/// Whether [`schema`] has run on `table` (its index, made last, is there):
/// a server that starts beside running ones then runs no DDL at all.
/// `CREATE INDEX IF NOT EXISTS` takes the table's SHARE lock before it
/// finds the index there, so it would wait for every open transaction that
/// wrote the table (a transactional request, up to its max hold), and every
/// claim of every server would queue behind it meanwhile.
pub fn schema_current(table: &str) -> String {
    format!("SELECT to_regclass('{table}_expires_at') IS NOT NULL")
}

/// Phase two's `BEGIN`, with its server-side backstop: the session is ended
/// by PostgreSQL once the transaction has sat idle a second past `hold`
/// (`idle_in_transaction_session_timeout`, in milliseconds). PostgreSQL
/// takes at most `i32::MAX` ms (about 24.8 days) there, so a longer hold
/// gets that: past it, an idle session still ends, a little before the
/// store's own max-hold rollback would have ended it.
pub fn begin_with_backstop(hold: std::time::Duration) -> String {
    let backstop_ms = crate::store::duration_ms(hold)
        .saturating_add(1_000)
        .min(i64::from(i32::MAX));
    format!("BEGIN; SET LOCAL idle_in_transaction_session_timeout = {backstop_ms}")
}

/// The advisory lock key of a record: 64 bits of SHA-256 over table, scope
/// and key, framed so no two records share an input. `("migrate", "")`
/// guards the schema's creation.
pub fn advisory_key(table: &str, scope: &str, key: &str) -> i64 {
    let mut hasher = Hasher::new("tower-idempotency/pg-lock/v1");
    hasher
        .part(table.as_bytes())
        .part(scope.as_bytes())
        .part(key.as_bytes());
    let digest = hasher.finish().0;
    i64::from_be_bytes([
        digest[0], digest[1], digest[2], digest[3], digest[4], digest[5], digest[6], digest[7],
    ])
}

/// The server's clock in unix milliseconds, shifted by parameter `$n` (ms).
/// The purge: at most `$2` rows a statement (`kit::purge`). The outer test
/// of the deadline is checked again on a row a claim replaced meanwhile
/// (READ COMMITTED re-reads it), so a record taken over since the subquery
/// read it stays.
/// The arrays [`PgSql::renew_all`] takes: scopes, keys and tokens.
pub fn renew_arrays(claims: &[(RecordId, FencingToken)]) -> (Vec<String>, Vec<String>, Vec<i64>) {
    let scopes = claims.iter().map(|(id, _)| id.scope().to_owned()).collect();
    let keys = claims.iter().map(|(id, _)| id.key().to_owned()).collect();
    let tokens = claims.iter().map(|(_, token)| token.0).collect();
    (scopes, keys, tokens)
}

/// Whether each of `claims` is among the `(scope, key)` rows
/// [`PgSql::renew_all`] returned.
pub fn renewed_in_order(
    claims: &[(RecordId, FencingToken)],
    rows: impl IntoIterator<Item = (String, String)>,
) -> Vec<bool> {
    let rows: std::collections::HashSet<(String, String)> = rows.into_iter().collect();
    claims
        .iter()
        .map(|(id, _)| rows.contains(&(id.scope().to_owned(), id.key().to_owned())))
        .collect()
}

/// [`PgSql::renew_all`]: one `UPDATE` joined to the claims' arrays.
fn renew_all(table: &str) -> String {
    format!(
        "UPDATE {table} AS t SET lease_until = {now} + $5::bigint
         FROM unnest($1::text[], $2::text[], $3::bigint[]) AS c(scope, key, token)
         WHERE t.scope = c.scope AND t.key = c.key AND t.token = c.token
           AND t.state = 'in_flight' AND t.expires_at > {now}
         RETURNING t.scope, t.key",
        now = now_ms(4)
    )
}

fn purge(table: &str) -> String {
    format!(
        "DELETE FROM {table}
         WHERE (scope, key) IN (
             SELECT scope, key FROM {table} WHERE expires_at <= {now} LIMIT $2::bigint)
           AND expires_at <= {now}",
        now = now_ms(1)
    )
}

fn now_ms(n: u8) -> String {
    format!("(floor(extract(epoch from clock_timestamp()) * 1000)::bigint + ${n}::bigint)")
}

/// Inside the claim's transaction: takes the key's advisory lock (`$1`),
/// sets `synchronous_commit = off` for this transaction only, and returns
/// the server's clock (unix ms) plus `$2` as column 0.
fn lock_now() -> String {
    format!(
        "SELECT {}, set_config('synchronous_commit', 'off', true),
                set_config('lock_timeout', $3::text, true)
         FROM pg_advisory_xact_lock($1)",
        now_ms(2)
    )
}

/// The read-first replay: `fingerprint, response` of the record
/// `($1 scope, $2 key)` if it is completed and its TTL has not ended on the
/// server's clock plus `$3` (ms); no row otherwise. Takes no lock.
/// The completion, fenced by the token: `($1 scope, $2 key, $3 token,
/// $4 response)`. `notify`: it also announces the change (`pg_notify` on
/// [`NOTIFY_CHANNEL`], payload `$5`, delivered at commit) when it completed
/// the record. `or_fail`: it fails with [`NOT_COMPLETED`] when it completed
/// none (`1 / count(*)`; the subquery keeps `pg_notify`, which is
/// volatile, to the row completed).
fn complete(table: &str, notify: bool, or_fail: bool) -> String {
    let update = format!(
        "UPDATE {table} SET state = 'completed', response = $4
                 WHERE scope = $1 AND key = $2 AND token = $3 AND state = 'in_flight'"
    );
    let notify_done = format!("SELECT pg_notify('{NOTIFY_CHANNEL}', $5::text) FROM done");
    match (notify, or_fail) {
        (false, false) => update,
        (true, false) => format!("WITH done AS ({update} RETURNING 1) {notify_done}"),
        (false, true) => {
            format!("WITH done AS ({update} RETURNING 1) SELECT 1 / count(*)::int FROM done")
        }
        (true, true) => format!(
            "WITH done AS ({update} RETURNING 1) SELECT 1 / count(*)::int FROM ({notify_done}) AS told"
        ),
    }
}

fn completed(table: &str) -> String {
    let now = now_ms(3);
    format!(
        "SELECT fingerprint, response, expires_at - {now} FROM {table}
         WHERE scope = $1 AND key = $2 AND state = 'completed'
           AND expires_at > {now}"
    )
}

/// [`PgSql::insert_first`] (`async_commit`) or [`PgSql::insert_inside`].
/// The clock is read once (the subquery holds a volatile function, so it is
/// not folded into the insert); the `set_config` call is what makes the
/// first's own commit asynchronous.
fn insert_new(table: &str, async_commit: bool) -> String {
    let async_commit = match async_commit {
        true => {
            ", set_config('synchronous_commit', 'off', true) AS async_commit,
             set_config('lock_timeout', $8::text, true) AS lock_wait"
        }
        false => "",
    };
    format!(
        "INSERT INTO {table} (scope, key, fingerprint, token, state, lease_until, expires_at)
         SELECT $1, $2, $3, $4, 'in_flight', now.ms + $6::bigint, now.ms + $7::bigint
         FROM (SELECT {} AS ms{async_commit}) AS now
         ON CONFLICT (scope, key) DO NOTHING",
        now_ms(5)
    )
}

/// The statements that bound a lock wait inside a transaction: before, the
/// wait (`lock_timeout`, at least [`IN_TRANSACTION_CLAIM_MIN_WAIT`]); after,
/// the session's own setting again, so the bound never reaches the
/// handler's statements. PostgreSQL answers a wait past it with SQLSTATE
/// `55P03` ([`LOCK_NOT_AVAILABLE`]), which aborts the transaction.
pub fn lock_wait(wait: std::time::Duration) -> (String, &'static str) {
    (
        format!(
            "SET LOCAL lock_timeout = {}",
            bound_ms(wait.max(IN_TRANSACTION_CLAIM_MIN_WAIT))
        ),
        "SET LOCAL lock_timeout TO DEFAULT",
    )
}

/// The least a claim inside the handler's transaction (one phase) waits on
/// a lock before it is refused as in flight: 100 ms.
///
/// `lock_timeout` bounds every lock wait of the statement, not only the
/// wait on another request's uncommitted claim of the key: also the
/// table's own brief locks, such as autovacuum truncating the table's end
/// (`ACCESS EXCLUSIVE`, given up within about 20 ms of a waiter), the
/// lock that extends the table or an index by a page, or a
/// `CREATE INDEX`'s `SHARE` lock. At 1 ms, new keys met such locks and
/// were answered 409 while nothing held them: 10 of 198,706 credits with
/// 10,000,000 records expiring around them (`bench/ledger/retention.sh`,
/// BENCHMARKS.md; the server logged each as a lock timeout of the claim's
/// `INSERT`, none while waiting on another transaction's row). A repeat from another
/// server of a key truly in flight waits this long before its 409; this
/// server's own repeats are answered in memory ([`HeldKeys`](super::held::HeldKeys)).
pub const IN_TRANSACTION_CLAIM_MIN_WAIT: std::time::Duration =
    std::time::Duration::from_millis(100);

/// A lock wait's bound in milliseconds, as `lock_timeout` takes it: at
/// least 1 (0 would mean no bound), at most `i32::MAX`.
fn bound_ms(wait: std::time::Duration) -> String {
    wait.as_millis().clamp(1, i32::MAX as u128).to_string()
}

/// The least a claim that commits first waits on a lock:
/// [`PgSql::insert_first`] and the locking claim meet other such claims'
/// short transactions (an insert's own, a judgement under the row lock),
/// which end within milliseconds; waiting for them keeps the answer the
/// committed record gives (422 before 409). Only a claim held in another
/// open transaction (one phase) outlasts it.
pub const COMMITTED_CLAIM_MIN_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The lock wait's bound of a claim that commits first
/// ([`PgSql::insert_first`]'s `$8`, [`PgSql::lock_now`]'s `$3`), in
/// milliseconds as text: its own wait, at least
/// [`COMMITTED_CLAIM_MIN_WAIT`].
pub fn lock_wait_ms(wait: std::time::Duration) -> String {
    bound_ms(wait.max(COMMITTED_CLAIM_MIN_WAIT))
}

/// SQLSTATE `lock_not_available`: a lock wait past `lock_timeout`.
pub const LOCK_NOT_AVAILABLE: &str = "55P03";

/// The SQLSTATE of [`PgSql::complete_or_fail`] when it completed no record
/// (`division_by_zero`): the record no longer carries the request's token.
pub const NOT_COMPLETED: &str = "22012";

pub use super::claim::busy_is_in_flight;
