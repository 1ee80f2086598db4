//! The claim of a SQL store, written once: inside the store's transaction
//! and after its lock step, insert first (the primary key decides who is
//! first), read the record only when the insert met one, judge it by
//! the store's state machine (`decide`), and take it over or refuse. A store supplies [`ClaimSteps`]:
//! its three statements. `SqliteStore` (rusqlite, on its writer thread)
//! and `MemoryStore` decide with `decide` too, in code of their own.

use std::future::Future;
use std::time::{Duration, Instant};

use super::replay_cache::ReplayCache;
use crate::response::StoredResponse;
use crate::store::{
    Claim, ClaimRequest, Decision, Existing, Refusal, StoreError, decide, duration_ms,
};

/// The record an insert met, as read under the store's lock.
pub struct Met {
    /// The record's fingerprint (32 bytes of SHA-256 where it is sound).
    pub fingerprint: Vec<u8>,
    /// Completed (`true`) or in flight.
    pub completed: bool,
    /// Unix ms.
    pub lease_until: i64,
    /// Unix ms.
    pub expires_at: i64,
    /// The stored response, encoded (`None` while in flight).
    pub response: Option<Vec<u8>>,
    /// The store's clock read again with the record, where the lock is the
    /// record's own row lock (MySQL): the claim is judged at this instant.
    pub now: Option<i64>,
}

/// What a claim did: acquired the record, or refused, with a stored
/// response not yet decoded (so that it can be decoded outside a lock).
#[derive(Debug)]
pub enum Found {
    /// The claim holds the key.
    Acquired {
        /// It replaced an in-flight record whose lease had ended.
        taken_over: bool,
    },
    /// The record has another fingerprint: 422.
    Mismatch,
    /// The record is in flight, its lease ending after this: 409.
    InFlight(Duration),
    /// The record is completed: its encoded response, to replay.
    Completed(Vec<u8>),
}

impl Found {
    /// Whether the claim holds the key.
    pub fn is_acquired(&self) -> bool {
        matches!(self, Found::Acquired { .. })
    }

    /// `Ok(taken_over)` when the claim acquired the record, else the
    /// refusal with its response decoded.
    ///
    /// # Errors
    ///
    /// [`StoreError::Corrupt`] for a stored response that does not decode.
    pub fn decode(self) -> Result<Result<bool, Refusal>, StoreError> {
        Ok(Err(match self {
            Found::Acquired { taken_over } => return Ok(Ok(taken_over)),
            Found::Mismatch => Refusal::Mismatch,
            Found::InFlight(lease_remaining) => Refusal::InFlight { lease_remaining },
            Found::Completed(blob) => Refusal::Completed(decode_stored(blob)?),
        }))
    }

    /// As [`Found::decode`], as a [`Claim`].
    pub fn into_claim(self) -> Result<Claim, StoreError> {
        Ok(match self.decode()? {
            Ok(taken_over) => Claim::Acquired { taken_over },
            Err(refusal) => Claim::Refused(refusal),
        })
    }
}

/// A completed record's response, decoded; its body is a slice of `blob`,
/// not a copy ([`StoredResponse::decode_bytes`]).
///
/// # Errors
///
/// [`StoreError::Corrupt`] when it does not decode.
pub fn decode_stored(blob: Vec<u8>) -> Result<StoredResponse, StoreError> {
    StoredResponse::decode_bytes(blob.into()).map_err(|e| StoreError::Corrupt(e.to_string()))
}

/// A completed, unexpired record as a store's read-first statement returns
/// it (`completed` in [`pg_sql`](super::pg_sql) and the MySQL store).
#[derive(Debug)]
pub struct CompletedRow {
    /// The record's fingerprint.
    pub fingerprint: Vec<u8>,
    /// The stored response, encoded.
    pub response: Option<Vec<u8>>,
    /// Milliseconds of its TTL left, on the database's clock when it ran
    /// the statement.
    pub ttl_left_ms: i64,
}

/// The answer to a claim from the store's replay cache, if it holds a live
/// record of the key (see [`replay_cache`](super::replay_cache)); `now` is
/// on the cache's clock.
pub fn answer_cached(cache: &ReplayCache, req: &ClaimRequest, now: Instant) -> Option<Claim> {
    cache
        .refusal(&req.scope, &req.key, &req.fingerprint, now)
        .map(Claim::Refused)
}

/// The answer to a claim whose read found a completed, unexpired record:
/// a replay of its stored response, or 422 for another fingerprint. A
/// replay's record is cached until `sent` (the instant the read was sent)
/// plus its TTL left: never later than the database's own deadline.
///
/// # Errors
///
/// [`StoreError::Corrupt`] for a stored response that does not decode.
pub fn answer_completed(
    row: CompletedRow,
    req: &ClaimRequest,
    cache: &ReplayCache,
    sent: Instant,
) -> Result<Claim, StoreError> {
    if row.fingerprint != req.fingerprint.0 {
        return Ok(Refusal::Mismatch.into());
    }
    let blob = row.response.unwrap_or_default();
    let size = blob.len();
    let stored = decode_stored(blob)?;
    if cache.is_on()
        && let Ok(left) = u64::try_from(row.ttl_left_ms)
        && let Some(deadline) = sent.checked_add(Duration::from_millis(left))
    {
        cache.insert(
            &req.scope,
            &req.key,
            &row.fingerprint,
            deadline,
            &stored,
            size,
        );
    }
    Ok(Refusal::Completed(stored).into())
}

/// A SQL store's statements for one claim, run inside its transaction after
/// its lock step.
pub trait ClaimSteps: Send {
    /// The driver's error (or [`StoreError`]).
    type Error: Send;

    /// Inserts the in-flight record for `req` unless one exists: `true`
    /// when it inserted.
    fn insert(
        &mut self,
        req: &ClaimRequest,
        lease_until: i64,
        expires_at: i64,
    ) -> impl Future<Output = Result<bool, Self::Error>> + Send;

    /// The record of `req` under the lock; `None` if it is gone.
    fn select(
        &mut self,
        req: &ClaimRequest,
    ) -> impl Future<Output = Result<Option<Met>, Self::Error>> + Send;

    /// Overwrites the record with `req`'s claim.
    fn take_over(
        &mut self,
        req: &ClaimRequest,
        lease_until: i64,
        expires_at: i64,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// The error when the record an insert met kept vanishing.
    fn vanished() -> Self::Error;
}

/// The claim (the table in the module docs of [`crate::store`]) through
/// `steps`, whose transaction holds the store's lock on the key; `now` is
/// the store's clock read after that lock was taken (unix ms).
pub async fn claim_in<S: ClaimSteps>(
    steps: &mut S,
    req: &ClaimRequest,
    now: i64,
) -> Result<Found, S::Error> {
    let deadlines = |now: i64| {
        (
            now.saturating_add(duration_ms(req.lease)),
            now.saturating_add(duration_ms(req.ttl)),
        )
    };
    let (lease_until, expires_at) = deadlines(now);
    // Where a release or a purge does not take the claim's lock
    // (PostgreSQL's advisory lock), it may delete the record between the
    // insert and the select: then the insert is tried again, and wins.
    let mut met = None;
    for _ in 0..3 {
        if steps.insert(req, lease_until, expires_at).await? {
            return Ok(Found::Acquired { taken_over: false });
        }
        met = steps.select(req).await?;
        if met.is_some() {
            break;
        }
    }
    let met = met.ok_or_else(S::vanished)?;
    let now = met.now.unwrap_or(now);
    let existing = Existing {
        fingerprint: &met.fingerprint,
        completed: met.completed,
        lease_until: met.lease_until,
        expires_at: met.expires_at,
    };
    Ok(match decide(&existing, &req.fingerprint, now, req.lease) {
        Decision::Replace { taken_over } => {
            let (lease_until, expires_at) = deadlines(now);
            steps.take_over(req, lease_until, expires_at).await?;
            Found::Acquired { taken_over }
        }
        Decision::Mismatch => Found::Mismatch,
        Decision::Replay => Found::Completed(met.response.unwrap_or_default()),
        Decision::InFlight(lease_remaining) => Found::InFlight(lease_remaining),
    })
}

/// A claim that commits first ([`crate::store::Store::claim`]) whose lock
/// wait reached its bound (PostgreSQL's `lock_timeout`, InnoDB's
/// `innodb_lock_wait_timeout`; told by the driver's error:
/// `is_lock_timeout`) met a claim held in another open transaction (one
/// phase): refused as in flight. That holder ends within its max hold,
/// which this claim takes to be its own (`hold`).
///
/// # Errors
///
/// `result`'s other errors.
pub fn busy_is_in_flight(
    result: Result<crate::store::Claim, crate::store::StoreError>,
    hold: std::time::Duration,
    is_lock_timeout: impl Fn(&(dyn std::error::Error + Send + Sync + 'static)) -> bool,
) -> Result<crate::store::Claim, crate::store::StoreError> {
    match result {
        Err(crate::store::StoreError::Unavailable(e)) if is_lock_timeout(e.as_ref()) => {
            Ok(crate::store::Refusal::InFlight {
                lease_remaining: hold,
            }
            .into())
        }
        other => other,
    }
}
