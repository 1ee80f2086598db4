//! The outbox's SQL, one [`OutboxSql`] per dialect (PostgreSQL, SQLite,
//! MySQL/MariaDB), shared by every driver of that dialect: tokio-postgres
//! and sqlx on PostgreSQL, rusqlite and sqlx on SQLite, sqlx on MySQL.
//!
//! Every time is the database's clock in unix milliseconds (`NOW_MS`), read
//! in the statement itself, so app servers' clocks need not agree. Each
//! statement takes its parameters in the order its doc names, whatever the
//! dialect's placeholders (`$n`, `?n`, `?`); integer results are `BIGINT`.

use std::sync::LazyLock;

use super::TABLE;

/// How a dialect claims due messages.
pub(crate) enum ClaimSql {
    /// One `UPDATE ... RETURNING` (`owner, lease_ms, limit`), after an
    /// optional read (`lease_ms`) that says whether anything is due, so
    /// an idle relay polls without taking a write lock.
    ///
    /// Every claim takes a message whose lease ends further ahead than two
    /// leases from now as free: no claim made at or before now set it, so
    /// the database's clock stepped back since, and trusting it would hold
    /// the message for as long as the step. (The records' claims allow one
    /// lease, reading the clock after the row is locked; a claim here may
    /// read it before another relay's claim of the same row commits, so
    /// the second lease is the margin for that, and the clock is read in
    /// the condition itself, row by row, where the dialect allows.)
    #[cfg_attr(
        not(any(
            feature = "sqlite",
            feature = "postgres",
            feature = "sqlx-postgres",
            feature = "sqlx-sqlite"
        )),
        allow(dead_code)
    )]
    Returning {
        probe: Option<String>,
        update: String,
    },
    /// MySQL/MariaDB, which have no `UPDATE ... RETURNING`: in one
    /// transaction, `now` (no parameters), then the due ids locked with
    /// `SKIP LOCKED` (`now, now, lease_ms, limit`), then `update` (`owner,
    /// lease_until, ids...`) and `select` (`ids...`), whose `{ids}` is
    /// replaced by one placeholder per id.
    #[cfg_attr(not(feature = "mysql"), allow(dead_code))]
    LockThenUpdate {
        now: String,
        lock: String,
        update: String,
        select: String,
    },
}

/// The outbox's statements in one dialect.
pub(crate) struct OutboxSql {
    /// Creates the table and its indexes if missing (several statements).
    pub(crate) schema: String,
    /// `key, destination, content_type, payload`; affects 0 rows when the
    /// key is there already.
    pub(crate) enqueue: String,
    /// Returns `id, attempts, lease_until_ms, msg_key, destination,
    /// content_type, payload`.
    pub(crate) claim: ClaimSql,
    /// `id`: the message is done, whoever holds its lease now.
    pub(crate) done: String,
    /// `after_ms, error, id, attempt, lease_until_ms`: only the attempt that
    /// holds the claim schedules the next (the lease deadline tells a claim
    /// from an older one with the same attempt number, as after a requeue).
    pub(crate) retry: String,
    /// `error, id, attempt, lease_until_ms`.
    pub(crate) dead: String,
    /// `older_than_ms, limit`.
    pub(crate) purge: String,
    /// One per view (pending, in flight, dead), `limit`; returns `id,
    /// msg_key, destination, attempts, age_ms, due_in_ms,
    /// lease_remaining_ms (NULL when unleased), last_error`.
    pub(crate) list: [String; 3],
    /// `id`.
    pub(crate) requeue: String,
    /// Returns one row: `pending, in_flight, dead, done,
    /// oldest_pending_age_ms (NULL when none)`.
    pub(crate) counts: String,
}

/// The conditions of the three views, over a now-column `n.ms`.
const VIEWS: [&str; 3] = [
    "state = 'pending' AND (lease_until_ms IS NULL OR lease_until_ms <= n.ms)",
    "state = 'pending' AND lease_until_ms > n.ms",
    "state = 'dead'",
];

/// The list's columns, over a now-column `n.ms`, with `int` wrapping an
/// integer expression into the dialect's 64-bit integer.
fn list(now: &str, int: impl Fn(&str) -> String, limit: &str) -> [String; 3] {
    VIEWS.map(|filter| {
        format!(
            "SELECT id, msg_key, destination, {}, n.ms - created_ms, due_ms - n.ms,
               lease_until_ms - n.ms, last_error
             FROM {TABLE}, (SELECT {now} AS ms) n WHERE {filter} ORDER BY id LIMIT {limit}",
            int("attempts")
        )
    })
}

/// PostgreSQL's clock, in unix milliseconds.
#[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
const POSTGRES_NOW: &str = "(floor(extract(epoch from clock_timestamp()) * 1000))::bigint";

/// MySQL's clock, in unix milliseconds.
#[cfg(feature = "mysql")]
const MYSQL_NOW: &str = "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS SIGNED)";

/// What the relay writes once an attempt has ended: the fields of the same
/// names of [`OutboxSql`].
#[cfg(any(feature = "postgres", feature = "sqlx-postgres", feature = "mysql"))]
struct Outcomes {
    done: String,
    retry: String,
    dead: String,
}

/// What the admin router and the outbox's counts read and do: the fields
/// of the same names of [`OutboxSql`].
#[cfg(any(feature = "postgres", feature = "sqlx-postgres", feature = "mysql"))]
struct Admin {
    list: [String; 3],
    requeue: String,
    counts: String,
}

impl OutboxSql {
    /// PostgreSQL: claims with `FOR UPDATE SKIP LOCKED`, so relays in
    /// several processes each get other rows and none waits for another.
    #[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
    pub(crate) fn postgres() -> &'static OutboxSql {
        static SQL: LazyLock<OutboxSql> = LazyLock::new(OutboxSql::postgres_sql);
        &SQL
    }

    #[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
    fn postgres_sql() -> OutboxSql {
        const NOW: &str = POSTGRES_NOW;
        let Outcomes { done, retry, dead } = OutboxSql::postgres_outcomes();
        let Admin {
            list,
            requeue,
            counts,
        } = OutboxSql::postgres_admin();
        OutboxSql {
            // 1. The table, and how a message enters it.
            schema: OutboxSql::postgres_schema(),
            enqueue: format!(
                "INSERT INTO {TABLE} (msg_key, destination, content_type, payload)
                 VALUES ($1, $2, $3, $4) ON CONFLICT (msg_key) DO NOTHING"
            ),
            // 2. The relay's claims of due messages.
            claim: OutboxSql::postgres_claim(),
            // 3. What the relay writes once an attempt has ended.
            done,
            retry,
            dead,
            // 4. The purge of delivered messages.
            purge: format!(
                "DELETE FROM {TABLE} WHERE id IN (SELECT id FROM {TABLE}
                 WHERE state = 'done' AND finished_ms <= {NOW} - $1::bigint LIMIT $2::bigint)"
            ),
            // 5. The admin's views, counts and requeue of a dead letter.
            list,
            requeue,
            counts,
        }
    }

    /// PostgreSQL's table and indexes, under an advisory lock, so processes
    /// starting together do not race on CREATE. No BEGIN/COMMIT of its
    /// own: run alone (a simple query of several statements) it is one
    /// implicit transaction, and run inside the request's transaction
    /// (`outbox::sqlx::migrate`) it must not commit that. Tables and
    /// indexes already there are skipped without a NOTICE (drivers log
    /// those at INFO on every start), to the end of that transaction.
    #[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
    fn postgres_schema() -> String {
        const NOW: &str = POSTGRES_NOW;
        format!(
            "SELECT pg_advisory_xact_lock(7261, 15);
                 SET LOCAL client_min_messages = warning;
                 CREATE TABLE IF NOT EXISTS {TABLE} (
                    id BIGSERIAL PRIMARY KEY,
                    msg_key TEXT NOT NULL UNIQUE,
                    destination TEXT NOT NULL,
                    content_type TEXT NOT NULL,
                    payload BYTEA NOT NULL,
                    state TEXT NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'done', 'dead')),
                    attempts INTEGER NOT NULL DEFAULT 0,
                    created_ms BIGINT NOT NULL DEFAULT {NOW},
                    due_ms BIGINT NOT NULL DEFAULT {NOW},
                    lease_until_ms BIGINT,
                    lease_owner TEXT,
                    finished_ms BIGINT,
                    last_error TEXT
                 );
                 CREATE INDEX IF NOT EXISTS {TABLE}_due ON {TABLE} (due_ms) WHERE state = 'pending';
                 CREATE INDEX IF NOT EXISTS {TABLE}_finished ON {TABLE} (finished_ms) WHERE state = 'done';"
        )
    }

    /// PostgreSQL's claim: one `UPDATE ... RETURNING` of the due rows
    /// locked `FOR UPDATE SKIP LOCKED`, with no probe first.
    #[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
    fn postgres_claim() -> ClaimSql {
        const NOW: &str = POSTGRES_NOW;
        ClaimSql::Returning {
            probe: None,
            update: format!(
                "WITH now AS (SELECT {NOW} AS ms)
                     UPDATE {TABLE} SET lease_owner = $1, lease_until_ms = (SELECT ms FROM now) + $2::bigint,
                       attempts = attempts + 1
                     WHERE id IN (SELECT id FROM {TABLE} WHERE state = 'pending'
                       AND due_ms <= (SELECT ms FROM now)
                       AND (lease_until_ms IS NULL OR lease_until_ms <= (SELECT ms FROM now)
                         OR lease_until_ms > {NOW} + 2 * $2::bigint)
                       ORDER BY due_ms, id LIMIT $3::bigint FOR UPDATE SKIP LOCKED)
                     RETURNING id, attempts::bigint, lease_until_ms, msg_key, destination, content_type, payload"
            ),
        }
    }

    /// PostgreSQL's [`Outcomes`].
    #[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
    fn postgres_outcomes() -> Outcomes {
        const NOW: &str = POSTGRES_NOW;
        Outcomes {
            done: format!(
                "UPDATE {TABLE} SET state = 'done', finished_ms = {NOW}, lease_until_ms = NULL,
                 lease_owner = NULL, last_error = NULL WHERE id = $1 AND state = 'pending'"
            ),
            retry: format!(
                "UPDATE {TABLE} SET due_ms = {NOW} + $1::bigint, lease_until_ms = NULL, lease_owner = NULL,
                 last_error = $2 WHERE id = $3 AND attempts = $4::bigint AND lease_until_ms = $5::bigint
                 AND state = 'pending'"
            ),
            dead: format!(
                "UPDATE {TABLE} SET state = 'dead', finished_ms = {NOW}, lease_until_ms = NULL,
                 lease_owner = NULL, last_error = $1
                 WHERE id = $2 AND attempts = $3::bigint AND lease_until_ms = $4::bigint
                 AND state = 'pending'"
            ),
        }
    }

    /// PostgreSQL's [`Admin`] statements; the counts read the clock once,
    /// in a CTE.
    #[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
    fn postgres_admin() -> Admin {
        const NOW: &str = POSTGRES_NOW;
        Admin {
            list: list(NOW, |e| format!("{e}::bigint"), "$1::bigint"),
            requeue: format!(
                "UPDATE {TABLE} SET state = 'pending', attempts = 0, due_ms = {NOW}, finished_ms = NULL
                 WHERE id = $1 AND state = 'dead'"
            ),
            counts: format!(
                "WITH n AS (SELECT {NOW} AS ms) SELECT
                   COUNT(*) FILTER (WHERE state = 'pending'
                     AND (lease_until_ms IS NULL OR lease_until_ms <= (SELECT ms FROM n))),
                   COUNT(*) FILTER (WHERE state = 'pending' AND lease_until_ms > (SELECT ms FROM n)),
                   COUNT(*) FILTER (WHERE state = 'dead'),
                   COUNT(*) FILTER (WHERE state = 'done'),
                   (SELECT ms FROM n) - MIN(created_ms) FILTER (WHERE state = 'pending')
                 FROM {TABLE}"
            ),
        }
    }

    /// SQLite: a claim is one `UPDATE ... RETURNING`, which SQLite runs
    /// under its write lock, so two relays (in one process or several
    /// sharing the file) never claim one message at once. `NOW_MS` is the
    /// machine's clock, which processes sharing a file share; SQLite reads
    /// it once per statement.
    #[cfg(any(feature = "sqlite", feature = "sqlx-sqlite"))]
    pub(crate) fn sqlite() -> &'static OutboxSql {
        static SQL: LazyLock<OutboxSql> = LazyLock::new(OutboxSql::sqlite_sql);
        &SQL
    }

    #[cfg(any(feature = "sqlite", feature = "sqlx-sqlite"))]
    fn sqlite_sql() -> OutboxSql {
        const NOW: &str = "CAST(round(unixepoch('subsec') * 1000) AS INTEGER)";
        OutboxSql {
            schema: format!(
                "CREATE TABLE IF NOT EXISTS {TABLE} (
                    id INTEGER PRIMARY KEY AUTOINCREMENT,
                    msg_key TEXT NOT NULL UNIQUE,
                    destination TEXT NOT NULL,
                    content_type TEXT NOT NULL,
                    payload BLOB NOT NULL,
                    state TEXT NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'done', 'dead')),
                    attempts INTEGER NOT NULL DEFAULT 0,
                    created_ms INTEGER NOT NULL,
                    due_ms INTEGER NOT NULL,
                    lease_until_ms INTEGER,
                    lease_owner TEXT,
                    finished_ms INTEGER,
                    last_error TEXT
                );
                CREATE INDEX IF NOT EXISTS {TABLE}_due ON {TABLE} (due_ms) WHERE state = 'pending';
                CREATE INDEX IF NOT EXISTS {TABLE}_finished ON {TABLE} (finished_ms) WHERE state = 'done';"
            ),
            enqueue: format!(
                "INSERT INTO {TABLE} (msg_key, destination, content_type, payload, created_ms, due_ms)
                 VALUES (?1, ?2, ?3, ?4, {NOW}, {NOW}) ON CONFLICT (msg_key) DO NOTHING"
            ),
            claim: ClaimSql::Returning {
                probe: Some(format!(
                    "SELECT EXISTS (SELECT 1 FROM {TABLE}, (SELECT {NOW} AS ms) n
                     WHERE state = 'pending' AND due_ms <= n.ms
                       AND (lease_until_ms IS NULL OR lease_until_ms <= n.ms OR lease_until_ms > n.ms + 2 * ?1))"
                )),
                update: format!(
                    "UPDATE {TABLE} SET lease_owner = ?1, lease_until_ms = {NOW} + ?2, attempts = attempts + 1
                     WHERE id IN (SELECT id FROM {TABLE} WHERE state = 'pending' AND due_ms <= {NOW}
                       AND (lease_until_ms IS NULL OR lease_until_ms <= {NOW} OR lease_until_ms > {NOW} + 2 * ?2)
                       ORDER BY due_ms, id LIMIT ?3)
                     RETURNING id, attempts, lease_until_ms, msg_key, destination, content_type, payload"
                ),
            },
            done: format!(
                "UPDATE {TABLE} SET state = 'done', finished_ms = {NOW}, lease_until_ms = NULL,
                 lease_owner = NULL, last_error = NULL WHERE id = ?1 AND state = 'pending'"
            ),
            retry: format!(
                "UPDATE {TABLE} SET due_ms = {NOW} + ?1, lease_until_ms = NULL, lease_owner = NULL,
                 last_error = ?2 WHERE id = ?3 AND attempts = ?4 AND lease_until_ms = ?5
                 AND state = 'pending'"
            ),
            dead: format!(
                "UPDATE {TABLE} SET state = 'dead', finished_ms = {NOW}, lease_until_ms = NULL,
                 lease_owner = NULL, last_error = ?1 WHERE id = ?2 AND attempts = ?3
                 AND lease_until_ms = ?4 AND state = 'pending'"
            ),
            purge: format!(
                "DELETE FROM {TABLE} WHERE id IN (SELECT id FROM {TABLE}
                 WHERE state = 'done' AND finished_ms <= {NOW} - ?1 LIMIT ?2)"
            ),
            list: list(NOW, str::to_owned, "?1"),
            requeue: format!(
                "UPDATE {TABLE} SET state = 'pending', attempts = 0, due_ms = {NOW}, finished_ms = NULL
                 WHERE id = ?1 AND state = 'dead'"
            ),
            counts: format!(
                "SELECT
                   COUNT(*) FILTER (WHERE state = 'pending' AND (lease_until_ms IS NULL OR lease_until_ms <= n.ms)),
                   COUNT(*) FILTER (WHERE state = 'pending' AND lease_until_ms > n.ms),
                   COUNT(*) FILTER (WHERE state = 'dead'),
                   COUNT(*) FILTER (WHERE state = 'done'),
                   n.ms - MIN(created_ms) FILTER (WHERE state = 'pending')
                 FROM (SELECT {NOW} AS ms) n LEFT JOIN {TABLE} ON 1"
            ),
        }
    }

    /// MySQL 8.0.1+ and MariaDB 10.6+: claims with `SELECT ... FOR UPDATE
    /// SKIP LOCKED`, marking the rows claimed in the same transaction.
    /// Column sizes hold what [`Message`](crate::Message) accepts (keys of
    /// 255 bytes, destinations of 2048, payloads of 1 MiB in a
    /// `MEDIUMBLOB`).
    #[cfg(feature = "mysql")]
    pub(crate) fn mysql() -> &'static OutboxSql {
        static SQL: LazyLock<OutboxSql> = LazyLock::new(OutboxSql::mysql_sql);
        &SQL
    }

    #[cfg(feature = "mysql")]
    fn mysql_sql() -> OutboxSql {
        const NOW: &str = MYSQL_NOW;
        let Outcomes { done, retry, dead } = OutboxSql::mysql_outcomes();
        let Admin {
            list,
            requeue,
            counts,
        } = OutboxSql::mysql_admin();
        OutboxSql {
            // 1. The table, and how a message enters it.
            schema: OutboxSql::mysql_schema(),
            // `INSERT IGNORE` ignores only the duplicate key here: every
            // other field was checked by `Message` to fit its column, and
            // the table's text is utf8mb4 whatever the database's default
            // (IGNORE would store a character latin1 lacks as `?`).
            enqueue: format!(
                "INSERT IGNORE INTO {TABLE} (msg_key, destination, content_type, payload, created_ms, due_ms)
                 VALUES (?, ?, ?, ?, {NOW}, {NOW})"
            ),
            // 2. The relay's claims of due messages.
            claim: OutboxSql::mysql_claim(),
            // 3. What the relay writes once an attempt has ended.
            done,
            retry,
            dead,
            // 4. The purge of delivered messages.
            purge: format!(
                "DELETE FROM {TABLE} WHERE state = 'done' AND finished_ms <= {NOW} - ?
                 ORDER BY id LIMIT ?"
            ),
            // 5. The admin's views, counts and requeue of a dead letter.
            list,
            requeue,
            counts,
        }
    }

    /// MySQL's table, its unique key and indexes, in InnoDB with utf8mb4
    /// text whatever the database's defaults.
    #[cfg(feature = "mysql")]
    fn mysql_schema() -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {TABLE} (
                    id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
                    msg_key VARCHAR(255) CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
                    destination VARCHAR(2048) NOT NULL,
                    content_type VARCHAR(255) NOT NULL,
                    payload MEDIUMBLOB NOT NULL,
                    state VARCHAR(8) NOT NULL DEFAULT 'pending',
                    attempts INT NOT NULL DEFAULT 0,
                    created_ms BIGINT NOT NULL,
                    due_ms BIGINT NOT NULL,
                    lease_until_ms BIGINT NULL,
                    lease_owner VARCHAR(64) NULL,
                    finished_ms BIGINT NULL,
                    last_error TEXT NULL,
                    UNIQUE KEY {TABLE}_key (msg_key),
                    KEY {TABLE}_due (state, due_ms),
                    KEY {TABLE}_finished (state, finished_ms)
                ) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
        )
    }

    /// MySQL's claim, in the steps of [`ClaimSql::LockThenUpdate`].
    #[cfg(feature = "mysql")]
    fn mysql_claim() -> ClaimSql {
        const NOW: &str = MYSQL_NOW;
        ClaimSql::LockThenUpdate {
            now: format!("SELECT {NOW}"),
            lock: format!(
                "SELECT id FROM {TABLE} WHERE state = 'pending' AND due_ms <= ?
                       AND (lease_until_ms IS NULL OR lease_until_ms <= ? OR lease_until_ms > {NOW} + 2 * ?)
                     ORDER BY due_ms, id LIMIT ? FOR UPDATE SKIP LOCKED"
            ),
            update: format!(
                "UPDATE {TABLE} SET lease_owner = ?, lease_until_ms = ?, attempts = attempts + 1
                     WHERE id IN ({{ids}})"
            ),
            select: format!(
                "SELECT id, CAST(attempts AS SIGNED), lease_until_ms, msg_key, destination,
                       content_type, payload
                     FROM {TABLE} WHERE id IN ({{ids}}) ORDER BY due_ms, id"
            ),
        }
    }

    /// MySQL's [`Outcomes`].
    #[cfg(feature = "mysql")]
    fn mysql_outcomes() -> Outcomes {
        const NOW: &str = MYSQL_NOW;
        Outcomes {
            done: format!(
                "UPDATE {TABLE} SET state = 'done', finished_ms = {NOW}, lease_until_ms = NULL,
                 lease_owner = NULL, last_error = NULL WHERE id = ? AND state = 'pending'"
            ),
            retry: format!(
                "UPDATE {TABLE} SET due_ms = {NOW} + ?, lease_until_ms = NULL, lease_owner = NULL,
                 last_error = ? WHERE id = ? AND attempts = ? AND lease_until_ms = ?
                 AND state = 'pending'"
            ),
            dead: format!(
                "UPDATE {TABLE} SET state = 'dead', finished_ms = {NOW}, lease_until_ms = NULL,
                 lease_owner = NULL, last_error = ?
                 WHERE id = ? AND attempts = ? AND lease_until_ms = ? AND state = 'pending'"
            ),
        }
    }

    /// MySQL's [`Admin`] statements; MySQL has no `FILTER`, so each count
    /// sums a `CASE`.
    #[cfg(feature = "mysql")]
    fn mysql_admin() -> Admin {
        const NOW: &str = MYSQL_NOW;
        let count = |cond: &str| {
            format!("CAST(COALESCE(SUM(CASE WHEN {cond} THEN 1 ELSE 0 END), 0) AS SIGNED)")
        };
        Admin {
            list: list(NOW, |e| format!("CAST({e} AS SIGNED)"), "?"),
            requeue: format!(
                "UPDATE {TABLE} SET state = 'pending', attempts = 0, due_ms = {NOW}, finished_ms = NULL
                 WHERE id = ? AND state = 'dead'"
            ),
            counts: format!(
                "SELECT {}, {}, {}, {},
                   n.ms - MIN(CASE WHEN state = 'pending' THEN created_ms END)
                 FROM (SELECT {NOW} AS ms) n LEFT JOIN {TABLE} ON TRUE GROUP BY n.ms",
                count(VIEWS[0]),
                count(VIEWS[1]),
                count("state = 'dead'"),
                count("state = 'done'"),
            ),
        }
    }
}
