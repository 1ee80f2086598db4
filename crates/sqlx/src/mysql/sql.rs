//! The statements of [`MySqlStore`](super::MySqlStore), with the table name
//! in them, and the table's schema.

use std::sync::Arc;

use sqlx::AssertSqlSafe;
use sqlx::mysql::{MySql, MySqlArguments};

/// The statements, with the table name in them.
pub(super) struct Sql {
    pub(super) table: String,
    pub(super) now: Arc<str>,
    /// The read-first replay: `(offset, id, offset)` gives the record's
    /// `fingerprint, response, TTL left (ms)` if it is completed and its TTL
    /// has not ended on the server's clock; a consistent read, no lock.
    pub(super) completed: Arc<str>,
    /// The insert of a new key on its own, outside a transaction:
    /// `(id, scope, key, fingerprint, token, lease ms, TTL ms, offset)`,
    /// deadlines on the server's clock. A record already there fails it
    /// with a duplicate-key error (1062), whatever the client's
    /// CLIENT_FOUND_ROWS flag.
    pub(super) insert_first: Arc<str>,
    /// The claim's insert inside the handler's transaction (one phase),
    /// with `insert_first`'s parameters: the row's exclusive lock, on a new
    /// record (1 row affected) or on the committed record there (2), after
    /// a wait on another open transaction's record of the key.
    pub(super) insert_inside: Arc<str>,
    /// The claim's insert, in its transaction.
    pub(super) insert: Arc<str>,
    pub(super) select: Arc<str>,
    pub(super) take_over: Arc<str>,
    pub(super) complete: Arc<str>,
    /// `complete` that also requires an open transaction (MariaDB's
    /// `@@in_transaction`), used when the server has the variable.
    pub(super) complete_in_transaction: Arc<str>,
    pub(super) in_transaction_check: bool,
    /// The session variable that ends a transaction left idle past its max
    /// hold: MariaDB's `idle_transaction_timeout` where the server has it
    /// (it acts only inside a transaction, so it can stay set), else
    /// `wait_timeout` (set back before the transaction ends).
    pub(super) backstop: Backstop,
    /// MariaDB 10.5 and later: the one-phase claim's insert bounds its own
    /// lock wait and returns what it did (`insert_inside_returning`).
    pub(super) returning: bool,
    pub(super) release: Arc<str>,
    /// `(lease ms + offset, id, token, offset)`. The new deadline is later
    /// than the last (renewals are a third of a lease apart), so a renewed
    /// row always counts as changed, whatever CLIENT_FOUND_ROWS says.
    pub(super) renew: Arc<str>,
    /// `(offset, at most this many rows)`.
    pub(super) purge: Arc<str>,
    pub(super) stuck: Arc<str>,
    pub(super) counts: Arc<str>,
}

/// See [`Sql::backstop`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Backstop {
    /// MariaDB's `idle_transaction_timeout`.
    IdleTransaction,
    /// `wait_timeout`, set back before the transaction ends.
    WaitTimeout,
}

impl Backstop {
    /// The variable's name.
    pub(super) fn variable(self) -> &'static str {
        match self {
            Backstop::IdleTransaction => "idle_transaction_timeout",
            Backstop::WaitTimeout => "wait_timeout",
        }
    }
}

/// The server's clock in Unix milliseconds (the session's time zone is UTC,
/// so no daylight-saving fold), shifted by one `?` parameter (ms).
const NOW_MS: &str = "(CAST(FLOOR(UNIX_TIMESTAMP(NOW(6)) * 1000) AS SIGNED) + ?)";

impl Sql {
    pub(super) fn new(table: &str) -> Sql {
        let s = |text: String| Arc::<str>::from(text);
        Sql {
            table: table.to_owned(),
            now: s(format!("SELECT {NOW_MS}")),
            completed: s(format!(
                "SELECT fingerprint, response, expires_at - {NOW_MS} FROM {table}
                 WHERE id = ? AND state = 'completed' AND expires_at > {NOW_MS}"
            )),
            insert_first: s(format!(
                "INSERT INTO {table}
                    (id, scope, `key`, fingerprint, token, state, lease_until, expires_at, claims)
                 SELECT ?, ?, ?, ?, ?, 'in_flight', n.ms + ?, n.ms + ?, 1
                 FROM (SELECT {NOW_MS} AS ms) AS n"
            )),
            insert_inside: s(format!(
                "INSERT INTO {table}
                    (id, scope, `key`, fingerprint, token, state, lease_until, expires_at, claims)
                 SELECT ?, ?, ?, ?, ?, 'in_flight', n.ms + ?, n.ms + ?, 1
                 FROM (SELECT {NOW_MS} AS ms) AS n
                 ON DUPLICATE KEY UPDATE claims = claims + 1"
            )),
            // `claims` changes on a duplicate, so the affected-row count is
            // 1 for an insert and 2 for a duplicate whatever the client's
            // CLIENT_FOUND_ROWS flag; the update also takes the row's
            // exclusive lock.
            insert: s(format!(
                "INSERT INTO {table}
                    (id, scope, `key`, fingerprint, token, state, lease_until, expires_at, claims)
                 VALUES (?, ?, ?, ?, ?, 'in_flight', ?, ?, 1)
                 ON DUPLICATE KEY UPDATE claims = claims + 1"
            )),
            select: s(format!(
                "SELECT fingerprint, state, lease_until, expires_at, response, {NOW_MS}
                 FROM {table} WHERE id = ? FOR UPDATE"
            )),
            take_over: s(format!(
                "UPDATE {table}
                 SET fingerprint = ?, token = ?, state = 'in_flight',
                     lease_until = ?, expires_at = ?, response = NULL
                 WHERE id = ?"
            )),
            complete: s(format!(
                "UPDATE {table} SET state = 'completed', response = ?
                 WHERE id = ? AND token = ? AND state = 'in_flight'"
            )),
            complete_in_transaction: s(format!(
                "UPDATE {table} SET state = 'completed', response = ?
                 WHERE id = ? AND token = ? AND state = 'in_flight' AND @@in_transaction = 1"
            )),
            in_transaction_check: false,
            backstop: Backstop::WaitTimeout,
            returning: false,
            release: s(format!(
                "DELETE FROM {table} WHERE id = ? AND token = ? AND state = 'in_flight'"
            )),
            renew: s(format!(
                "UPDATE {table} SET lease_until = {NOW_MS}
                 WHERE id = ? AND token = ? AND state = 'in_flight' AND expires_at > {NOW_MS}"
            )),
            // At most `?` rows a statement (`kit::purge`), oldest first:
            // ORDER BY makes the rows a LIMIT picks deterministic, as
            // statement-based replication needs.
            purge: s(format!(
                "DELETE FROM {table} WHERE expires_at <= {NOW_MS} ORDER BY expires_at LIMIT ?"
            )),
            // `NOW(6)` is read once per statement: every row is judged at
            // the same instant.
            stuck: s(format!(
                "SELECT t.scope, t.`key`, t.fingerprint, t.lease_until, t.expires_at, n.ms
                 FROM {table} AS t CROSS JOIN (SELECT {NOW_MS} AS ms) AS n
                 WHERE t.state = 'in_flight' AND t.lease_until <= n.ms AND t.expires_at > n.ms
                 ORDER BY t.lease_until, t.scope, t.`key`
                 LIMIT ?"
            )),
            counts: s(counts(table)),
        }
    }

    /// `insert_inside` with its lock wait bounded to `wait_s` seconds
    /// (MariaDB's `SET STATEMENT ... FOR`), returning the record's `claims`
    /// (1 only for a record it inserted: a duplicate adds one to at least 1)
    /// and `CONNECTION_ID()`.
    pub(super) fn insert_inside_returning(&self, wait_s: u64) -> Arc<str> {
        Arc::from(format!(
            "SET STATEMENT innodb_lock_wait_timeout = {wait_s} FOR {} RETURNING claims, CONNECTION_ID()",
            self.insert_inside
        ))
    }

    pub(super) fn schema(&self) -> String {
        let table = &self.table;
        format!(
            "CREATE TABLE IF NOT EXISTS {table} (
                id          BINARY(32)  NOT NULL, -- SHA-256 of (scope, key)
                scope       BLOB        NOT NULL,
                `key`       BLOB        NOT NULL,
                fingerprint BINARY(32)  NOT NULL,
                token       BIGINT      NOT NULL,
                state       VARCHAR(9) CHARACTER SET ascii NOT NULL,
                lease_until BIGINT      NOT NULL, -- unix ms, server clock
                expires_at  BIGINT      NOT NULL, -- unix ms, server clock
                response    LONGBLOB,
                claims      BIGINT      NOT NULL,
                PRIMARY KEY (id),
                KEY {table}_expires_at (expires_at),
                CHECK (state IN ('in_flight', 'completed'))
            ) ENGINE=InnoDB"
        )
    }
}

impl Sql {
    /// [`Sql::renew`] for `n` claims at once: `(lease ms + offset, offset,
    /// then the ids, then the id and token of each claim)`. Its row count is
    /// the records renewed (each deadline moves later, as for `renew`).
    /// `id IN (...)` keeps it to the primary key's rows: MariaDB does not
    /// look a row constructor up in the index, and a scan would wait on the
    /// row locks of other keys' uncommitted claims (one phase).
    pub(super) fn renew_all(&self, n: usize) -> String {
        let ids = vec!["?"; n].join(", ");
        let claims = vec!["(?, ?)"; n].join(", ");
        format!(
            "UPDATE {} SET lease_until = {NOW_MS}
             WHERE state = 'in_flight' AND expires_at > {NOW_MS}
               AND id IN ({ids}) AND (id, token) IN ({claims})",
            self.table
        )
    }
}

/// The records counted by kind, each judged at the same instant (`NOW(6)`
/// is read once per statement): live in flight, stuck, completed, expired.
fn counts(table: &str) -> String {
    format!(
        "SELECT
            CAST(COALESCE(SUM(t.expires_at > n.ms AND t.state = 'in_flight' AND t.lease_until > n.ms), 0) AS SIGNED),
            CAST(COALESCE(SUM(t.expires_at > n.ms AND t.state = 'in_flight' AND t.lease_until <= n.ms), 0) AS SIGNED),
            CAST(COALESCE(SUM(t.expires_at > n.ms AND t.state = 'completed'), 0) AS SIGNED),
            CAST(COALESCE(SUM(t.expires_at <= n.ms), 0) AS SIGNED)
         FROM {table} AS t CROSS JOIN (SELECT {NOW_MS} AS ms) AS n"
    )
}

/// The query of one of the statements.
pub(super) fn q(sql: &Arc<str>) -> sqlx::query::Query<'static, MySql, MySqlArguments> {
    sqlx::query(AssertSqlSafe(sql.clone()))
}
