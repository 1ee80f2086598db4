//! The relay's queue written once, over any driver: [`SqlQueue`] runs a
//! dialect's [`OutboxSql`] through an [`Exec`], which is all a driver
//! supplies (run a statement with parameters; read rows of known shape).

use std::time::Duration;

use super::queue::{BoxFut, Claimed, Counts, Entry, Fate, Queue, View};
use super::sql::{ClaimSql, OutboxSql};
use super::{Message, TABLE};
use tower_idempotency::StoreError;

/// A parameter of a statement.
#[derive(Debug, Clone)]
pub(crate) enum Value {
    Int(i64),
    Text(String),
}

/// What a result column holds, so a driver knows how to read it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Col {
    Int,
    OptInt,
    Text,
    OptText,
    Bytes,
}

/// A result column, read as its [`Col`] says.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Cell {
    Int(i64),
    Text(String),
    Bytes(Vec<u8>),
    Null,
}

/// A row of [`Cell`]s.
pub(crate) type Row = Vec<Cell>;

/// What a driver supplies to run the outbox's statements.
pub(crate) trait Exec: Send + Sync + 'static {
    /// Runs `sql` (several statements, no parameters): the schema.
    fn batch<'a>(&'a self, sql: &'a str) -> BoxFut<'a, Result<(), StoreError>>;

    /// Runs `sql` with `params`; returns the rows it changed.
    fn execute<'a>(
        &'a self,
        sql: &'a str,
        params: Vec<Value>,
    ) -> BoxFut<'a, Result<u64, StoreError>>;

    /// Runs `sql` with `params`; returns its rows, each column read as
    /// `shape` says.
    fn fetch<'a>(
        &'a self,
        sql: &'a str,
        params: Vec<Value>,
        shape: &'static [Col],
    ) -> BoxFut<'a, Result<Vec<Row>, StoreError>>;

    /// [`ClaimSql::LockThenUpdate`] in one transaction. Only the drivers of
    /// a dialect that claims so implement it.
    fn claim_locked<'a>(
        &'a self,
        sql: &'a ClaimSql,
        owner: String,
        lease_ms: i64,
        limit: i64,
    ) -> BoxFut<'a, Result<Vec<Row>, StoreError>> {
        let _ = (sql, owner, lease_ms, limit);
        Box::pin(async {
            Err(StoreError::config(
                "this driver's dialect claims with UPDATE ... RETURNING",
            ))
        })
    }
}

/// The columns a claim returns.
pub(crate) const CLAIMED: &[Col] = &[
    Col::Int,
    Col::Int,
    Col::Int,
    Col::Text,
    Col::Text,
    Col::Text,
    Col::Bytes,
];
const ENTRY: &[Col] = &[
    Col::Int,
    Col::Text,
    Col::Text,
    Col::Int,
    Col::Int,
    Col::Int,
    Col::OptInt,
    Col::OptText,
];
const COUNTS: &[Col] = &[Col::Int, Col::Int, Col::Int, Col::Int, Col::OptInt];
const EXISTS: &[Col] = &[Col::Int];

/// A driver returned a row of another shape than asked for.
fn shape_error() -> StoreError {
    StoreError::unavailable(format!(
        "the {TABLE} table returned a row of an unexpected shape"
    ))
}

fn int(cell: &Cell) -> Result<i64, StoreError> {
    match cell {
        Cell::Int(v) => Ok(*v),
        _ => Err(shape_error()),
    }
}

fn opt_int(cell: &Cell) -> Result<Option<i64>, StoreError> {
    match cell {
        Cell::Null => Ok(None),
        other => int(other).map(Some),
    }
}

fn take_text(cell: &mut Cell) -> Result<String, StoreError> {
    match std::mem::replace(cell, Cell::Null) {
        Cell::Text(v) => Ok(v),
        _ => Err(shape_error()),
    }
}

fn take_opt_text(cell: &mut Cell) -> Result<Option<String>, StoreError> {
    match cell {
        Cell::Null => Ok(None),
        other => take_text(other).map(Some),
    }
}

fn take_bytes(cell: &mut Cell) -> Result<Vec<u8>, StoreError> {
    match std::mem::replace(cell, Cell::Null) {
        Cell::Bytes(v) => Ok(v),
        _ => Err(shape_error()),
    }
}

fn to_u64(v: i64) -> u64 {
    v.max(0) as u64
}

/// The longest error recorded, in bytes (MySQL's `TEXT` holds 64 KiB).
const MAX_ERROR: usize = 4096;

/// A sink's error as every dialect can store it: without NUL characters
/// (PostgreSQL's `TEXT` refuses them) and at most [`MAX_ERROR`] bytes. An
/// error the table refused would leave the attempt unrecorded and the
/// message attempted again and again, never a dead letter.
fn error_text(error: String) -> String {
    let mut error = if error.contains('\0') {
        error.replace('\0', "\u{fffd}")
    } else {
        error
    };
    if error.len() > MAX_ERROR {
        let mut end = MAX_ERROR - '…'.len_utf8();
        while !error.is_char_boundary(end) {
            end -= 1;
        }
        error.truncate(end);
        error.push('…');
    }
    error
}

/// Milliseconds, as the statements take them.
pub(crate) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4)
}

/// A claimed message from a row of [`CLAIMED`].
pub(crate) fn claimed(mut row: Row) -> Result<Claimed, StoreError> {
    if row.len() != CLAIMED.len() {
        return Err(shape_error());
    }
    Ok(Claimed {
        id: int(&row[0])?,
        attempt: u32::try_from(int(&row[1])?).unwrap_or(u32::MAX),
        lease_until_ms: int(&row[2])?,
        message: Message {
            key: take_text(&mut row[3])?,
            destination: take_text(&mut row[4])?,
            content_type: take_text(&mut row[5])?,
            payload: take_bytes(&mut row[6])?,
        },
    })
}

fn entry(mut row: Row) -> Result<Entry, StoreError> {
    if row.len() != ENTRY.len() {
        return Err(shape_error());
    }
    Ok(Entry {
        id: int(&row[0])?,
        key: take_text(&mut row[1])?,
        destination: take_text(&mut row[2])?,
        attempts: u32::try_from(int(&row[3])?).unwrap_or(0),
        age_ms: to_u64(int(&row[4])?),
        due_in_ms: to_u64(int(&row[5])?),
        lease_remaining_ms: opt_int(&row[6])?.filter(|l| *l > 0).map(to_u64),
        last_error: take_opt_text(&mut row[7])?,
    })
}

/// The relay's queue over one driver and its dialect's statements.
pub(crate) struct SqlQueue<E> {
    exec: E,
    sql: &'static OutboxSql,
}

impl<E: Exec> SqlQueue<E> {
    /// The queue, with its table created if missing.
    pub(crate) async fn open(exec: E, sql: &'static OutboxSql) -> Result<SqlQueue<E>, StoreError> {
        exec.batch(&sql.schema).await?;
        Ok(SqlQueue { exec, sql })
    }
}

impl<E: Exec> Queue for SqlQueue<E> {
    fn claim(
        &self,
        owner: &str,
        limit: usize,
        lease: Duration,
    ) -> BoxFut<'_, Result<Vec<Claimed>, StoreError>> {
        let owner = owner.to_owned();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        Box::pin(async move {
            let rows = match &self.sql.claim {
                ClaimSql::Returning { probe, update } => {
                    if let Some(probe) = probe {
                        let params = vec![Value::Int(ms(lease))];
                        let due = self.exec.fetch(probe, params, EXISTS).await?;
                        if due.first().and_then(|row| row.first()) != Some(&Cell::Int(1)) {
                            return Ok(Vec::new());
                        }
                    }
                    let params = vec![Value::Text(owner), Value::Int(ms(lease)), Value::Int(limit)];
                    self.exec.fetch(update, params, CLAIMED).await?
                }
                locked @ ClaimSql::LockThenUpdate { .. } => {
                    self.exec
                        .claim_locked(locked, owner, ms(lease), limit)
                        .await?
                }
            };
            rows.into_iter().map(claimed).collect()
        })
    }

    fn finish(
        &self,
        id: i64,
        attempt: u32,
        lease_until_ms: i64,
        fate: Fate,
    ) -> BoxFut<'_, Result<bool, StoreError>> {
        let (attempt, lease) = (Value::Int(i64::from(attempt)), Value::Int(lease_until_ms));
        let (sql, params) = match fate {
            Fate::Done => (&self.sql.done, vec![Value::Int(id)]),
            Fate::Retry { after, error } => (
                &self.sql.retry,
                vec![
                    Value::Int(ms(after)),
                    Value::Text(error_text(error)),
                    Value::Int(id),
                    attempt,
                    lease,
                ],
            ),
            Fate::Dead { error } => (
                &self.sql.dead,
                vec![
                    Value::Text(error_text(error)),
                    Value::Int(id),
                    attempt,
                    lease,
                ],
            ),
        };
        Box::pin(async move { Ok(self.exec.execute(sql, params).await? == 1) })
    }

    fn purge(&self, older_than: Duration, limit: usize) -> BoxFut<'_, Result<u64, StoreError>> {
        let params = vec![
            Value::Int(ms(older_than)),
            Value::Int(i64::try_from(limit).unwrap_or(i64::MAX)),
        ];
        Box::pin(self.exec.execute(&self.sql.purge, params))
    }

    fn list(&self, view: View, limit: usize) -> BoxFut<'_, Result<Vec<Entry>, StoreError>> {
        let sql = &self.sql.list[match view {
            View::Pending => 0,
            View::InFlight => 1,
            View::Dead => 2,
        }];
        let params = vec![Value::Int(i64::try_from(limit).unwrap_or(i64::MAX))];
        Box::pin(async move {
            let rows = self.exec.fetch(sql, params, ENTRY).await?;
            rows.into_iter().map(entry).collect()
        })
    }

    fn requeue(&self, id: i64) -> BoxFut<'_, Result<bool, StoreError>> {
        Box::pin(async move {
            Ok(self
                .exec
                .execute(&self.sql.requeue, vec![Value::Int(id)])
                .await?
                == 1)
        })
    }

    fn counts(&self) -> BoxFut<'_, Result<Counts, StoreError>> {
        Box::pin(async move {
            let rows = self
                .exec
                .fetch(&self.sql.counts, Vec::new(), COUNTS)
                .await?;
            let row = rows.first().ok_or_else(shape_error)?;
            if row.len() != COUNTS.len() {
                return Err(shape_error());
            }
            Ok(Counts {
                pending: to_u64(int(&row[0])?),
                in_flight: to_u64(int(&row[1])?),
                dead: to_u64(int(&row[2])?),
                done: to_u64(int(&row[3])?),
                oldest_pending_age_ms: opt_int(&row[4])?.map(to_u64),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_kept_storable() {
        assert_eq!(error_text("plain".into()), "plain");
        assert_eq!(error_text("a\0b".into()), "a\u{fffd}b");
        let long = error_text("é".repeat(5_000));
        assert!(long.len() <= MAX_ERROR, "{}", long.len());
        assert!(long.ends_with('…'));
        assert!(long.starts_with("éé"));
        let exact = "x".repeat(MAX_ERROR);
        assert_eq!(error_text(exact.clone()), exact);
    }
}
