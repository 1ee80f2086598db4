//! The claim's SQL: the read of a record, the claim inside an IMMEDIATE
//! transaction, and the completion fenced by the token.

use rusqlite::{OptionalExtension, params};

use crate::store::kit::claim::decode_stored;
use crate::store::{
    Claim, ClaimRequest, Completion, Decision, Existing, FencingToken, Refusal, StoreError, decide,
    duration_ms,
};

/// What the claim did: acquired the record, or refused.
pub(super) enum Found {
    Acquired { taken_over: bool },
    Refused(Refused),
}

/// Why the claim was refused, before the response blob is decoded.
pub(super) enum Refused {
    Mismatch,
    InFlight(std::time::Duration),
    Completed(Vec<u8>),
}

impl Found {
    pub(super) fn decode(self) -> Result<Claim, StoreError> {
        match self {
            Found::Acquired { taken_over } => Ok(Claim::Acquired { taken_over }),
            Found::Refused(refused) => refused.decode().map(Claim::Refused),
        }
    }
}

impl Refused {
    pub(super) fn decode(self) -> Result<Refusal, StoreError> {
        match self {
            Refused::Mismatch => Ok(Refusal::Mismatch),
            Refused::InFlight(lease_remaining) => Ok(Refusal::InFlight { lease_remaining }),
            Refused::Completed(blob) => decode_stored(blob).map(Refusal::Completed),
        }
    }
}

/// A record's columns, as a claim reads them.
pub(super) struct Record {
    fingerprint: Vec<u8>,
    state: String,
    lease_until: i64,
    expires_at: i64,
    pub(super) response: Option<Vec<u8>>,
}

impl Record {
    /// A completed record's response (empty if none was stored),
    /// fingerprint and expiry, moved out without a copy.
    pub(super) fn into_completed(self) -> (Vec<u8>, Vec<u8>, i64) {
        (
            self.response.unwrap_or_default(),
            self.fingerprint,
            self.expires_at,
        )
    }

    pub(super) fn existing(&self) -> Existing<'_> {
        Existing {
            fingerprint: &self.fingerprint,
            completed: self.state == "completed",
            lease_until: self.lease_until,
            expires_at: self.expires_at,
        }
    }
}

pub(super) fn read_record(
    conn: &rusqlite::Connection,
    scope: &str,
    key: &str,
) -> rusqlite::Result<Option<Record>> {
    // Cached: parsing the statement cost more than running it.
    conn.prepare_cached(
        "SELECT fingerprint, state, lease_until, expires_at, response
         FROM idempotency_records WHERE scope = ?1 AND key = ?2",
    )?
    .query_row(params![scope, key], |r| {
        Ok(Record {
            fingerprint: r.get(0)?,
            state: r.get(1)?,
            lease_until: r.get(2)?,
            expires_at: r.get(3)?,
            response: r.get(4)?,
        })
    })
    .optional()
}

/// The claim (the table in the module docs of [`crate::store`]) inside
/// `tx`, an IMMEDIATE transaction: it holds SQLite's write lock, so what it
/// reads is what it decides on. The primary key `(scope, key)` decides who
/// inserts first.
///
/// `held`: a transactional request open in the writer holds the key, for at
/// most this long more (its max hold). Its
/// record is uncommitted and its holder alive by construction (the writer
/// rolls it back at its max hold), so its lease is no judge: the claim is
/// refused as in flight, never a takeover. A takeover there would fence the
/// holder's commit, which rolls back its work and this claim's with it.
pub(super) fn claim_in(
    tx: &rusqlite::Transaction<'_>,
    req: &ClaimRequest,
    now: i64,
    held: Option<std::time::Duration>,
) -> rusqlite::Result<Found> {
    let lease_until = now.saturating_add(duration_ms(req.lease));
    let expires_at = now.saturating_add(duration_ms(req.ttl));
    let fingerprint = &req.fingerprint.0[..];
    let inserted = tx
        .prepare_cached(
            "INSERT INTO idempotency_records
            (scope, key, fingerprint, token, state, lease_until, expires_at)
         VALUES (?1, ?2, ?3, ?4, 'in_flight', ?5, ?6)
         ON CONFLICT (scope, key) DO NOTHING",
        )?
        .execute(params![
            req.scope,
            req.key,
            fingerprint,
            req.token.0,
            lease_until,
            expires_at
        ])?;
    if inserted == 1 {
        return Ok(Found::Acquired { taken_over: false });
    }
    let Some(record) = read_record(tx, &req.scope, &req.key)? else {
        // The insert conflicted, so the row exists under the write lock.
        return Err(rusqlite::Error::QueryReturnedNoRows);
    };
    let existing = record.existing();
    let taken_over = match decide(&existing, &req.fingerprint, now, req.lease) {
        Decision::Replace { taken_over } => match held {
            Some(left) if taken_over => return Ok(Found::Refused(Refused::InFlight(left))),
            _ => taken_over,
        },
        Decision::Mismatch => return Ok(Found::Refused(Refused::Mismatch)),
        Decision::Replay => {
            let blob = record.response.unwrap_or_default();
            return Ok(Found::Refused(Refused::Completed(blob)));
        }
        Decision::InFlight(lease_remaining) => {
            return Ok(Found::Refused(Refused::InFlight(lease_remaining)));
        }
    };
    tx.prepare_cached(
        "UPDATE idempotency_records
         SET fingerprint = ?3, token = ?4, state = 'in_flight',
             lease_until = ?5, expires_at = ?6, response = NULL
         WHERE scope = ?1 AND key = ?2",
    )?
    .execute(params![
        req.scope,
        req.key,
        fingerprint,
        req.token.0,
        lease_until,
        expires_at
    ])?;
    Ok(Found::Acquired { taken_over })
}

/// Completes the record if it still carries `token`.
pub(super) fn complete_in(
    conn: &rusqlite::Connection,
    scope: &str,
    key: &str,
    token: FencingToken,
    blob: &[u8],
) -> rusqlite::Result<Completion> {
    let updated = conn
        .prepare_cached(
            "UPDATE idempotency_records SET state = 'completed', response = ?4
         WHERE scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in_flight'",
        )?
        .execute(params![scope, key, token.0, blob])?;
    Ok(if updated == 1 {
        Completion::Stored
    } else {
        Completion::Fenced
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{Found, Refused, claim_in};
    use crate::fingerprint::Fingerprint;
    use crate::store::{ClaimRequest, FencingToken, RecordId};

    fn claim() -> ClaimRequest {
        let id = RecordId::new("s", "k");
        ClaimRequest::new(id, Fingerprint([1; 32]), FencingToken::random())
            .with_lease(Duration::from_secs(2))
    }

    /// A record past its lease is taken over, unless a request open in the
    /// writer holds it: then it is in flight for that request's hold.
    #[test]
    fn a_held_key_past_its_lease_is_in_flight_never_taken_over() {
        let mut conn = rusqlite::Connection::open_in_memory().unwrap();
        conn.execute_batch(crate::store::kit::sqlite_sql::SCHEMA)
            .unwrap();
        let tx = conn.transaction().unwrap();
        let now = 1_000_000;
        assert!(matches!(
            claim_in(&tx, &claim(), now, None).unwrap(),
            Found::Acquired { taken_over: false }
        ));
        let later = now + 3_000;
        let held = Some(Duration::from_secs(27));
        match claim_in(&tx, &claim(), later, held).unwrap() {
            Found::Refused(Refused::InFlight(left)) => assert_eq!(left, Duration::from_secs(27)),
            _ => panic!("a held key was not refused as in flight"),
        }
        assert!(matches!(
            claim_in(&tx, &claim(), later, None).unwrap(),
            Found::Acquired { taken_over: true }
        ));
    }
}
