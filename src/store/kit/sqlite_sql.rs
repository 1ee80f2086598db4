//! The SQLite schema both SQLite stores share (`SqliteStore`, feature
//! `sqlite`; `SqlxSqliteStore`, `tower-idempotency-sqlx`), so that either opens
//! a file the other made, and its migration.
//!
//! # Version 2: a rowid table
//!
//! Version 1 kept the records in a `WITHOUT ROWID` table, whose rows live in
//! the cells of its primary-key B-tree. SQLite compares a search key with a
//! cell of such a tree from the cell's whole payload: when a row does not fit
//! on its page (a stored response over about 1 KB with 4 KiB pages), every
//! comparison with it during a search reads all of its overflow pages first.
//! One stored 1 MiB response made replays of another, 64 KiB record about 4
//! times slower (21,400 against 5,000 per second under wrk `-c32`), and the
//! cost grew with every large response on a lookup's path. Version 2 is an
//! ordinary rowid table: the primary key `(scope, key)` is a separate index
//! of small cells, and a row's payload is read only when the row itself is.

/// The version this crate writes, kept in `PRAGMA user_version`.
pub const SCHEMA_VERSION: i64 = 2;

/// Creates the table and its index if they are missing.
pub const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS idempotency_records (
    scope       TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    fingerprint BLOB    NOT NULL,
    token       INTEGER NOT NULL,
    state       TEXT    NOT NULL CHECK (state IN ('in_flight', 'completed')),
    lease_until INTEGER NOT NULL, -- unix ms; meaningful while in flight
    expires_at  INTEGER NOT NULL, -- unix ms; the record's TTL deadline
    response    BLOB,             -- StoredResponse::encode, once completed
    PRIMARY KEY (scope, key)
);
CREATE INDEX IF NOT EXISTS idempotency_records_expires_at ON idempotency_records (expires_at);
";

/// Whether the table exists as version 1 made it (`WITHOUT ROWID`). One
/// row, one column: 1 or 0. Its answer is [`migration`]'s argument.
pub const IS_WITHOUT_ROWID: &str = "
SELECT count(*) FROM sqlite_master
WHERE type = 'table' AND name = 'idempotency_records' AND sql LIKE '%WITHOUT ROWID%'";

/// The statements that bring the file to [`SCHEMA_VERSION`], to run in one
/// write transaction: [`SCHEMA`], after which `user_version` is set; before
/// it, for a `WITHOUT ROWID` table, the old table is renamed, and after it
/// every record is copied into the new one and the old table dropped.
pub fn migration(without_rowid: bool) -> String {
    let version = format!("PRAGMA user_version = {SCHEMA_VERSION};");
    if !without_rowid {
        return format!("{SCHEMA}{version}");
    }
    format!(
        "ALTER TABLE idempotency_records RENAME TO idempotency_records_v1;
         DROP INDEX IF EXISTS idempotency_records_expires_at;
         {SCHEMA}
         INSERT INTO idempotency_records
             (scope, key, fingerprint, token, state, lease_until, expires_at, response)
         SELECT scope, key, fingerprint, token, state, lease_until, expires_at, response
         FROM idempotency_records_v1;
         DROP TABLE idempotency_records_v1;
         {version}"
    )
}

/// The purge of at most `?2` records past their TTL at `?1` (unix ms), as
/// `kit::purge` runs it, in both SQLite stores.
pub const PURGE: &str = "DELETE FROM idempotency_records WHERE rowid IN (
    SELECT rowid FROM idempotency_records WHERE expires_at <= ?1 LIMIT ?2)";

/// The lease renewal, fenced by the token: `(?1 scope, ?2 key, ?3 token,
/// ?4 the new lease deadline, ?5 now)`, unix ms.
pub const RENEW: &str = "UPDATE idempotency_records SET lease_until = ?4
     WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in_flight' AND expires_at > ?5";
