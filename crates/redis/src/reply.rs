//! The scripts' replies, read into the store's types: anything odd is an
//! error, never a panic.

use std::time::Duration;

use ::redis::Value;

use tower_idempotency::store::kit::claim::CompletedRow;
use tower_idempotency::store::{Claim, Refusal, StoreError};

pub(super) fn unexpected(script: &str, reply: &Value) -> StoreError {
    StoreError::unavailable(format!(
        "unexpected reply from the {script} script: {reply:?}"
    ))
}

pub(super) fn text(v: Option<&Value>) -> Option<&[u8]> {
    match v {
        Some(Value::BulkString(b)) => Some(b),
        _ => None,
    }
}

pub(super) fn int(v: Option<&Value>) -> Option<i64> {
    match v {
        Some(Value::Int(n)) => Some(*n),
        _ => None,
    }
}

/// What the claim script answered: a claim, or a completed record to
/// replay, with the TTL it has left (ms).
pub(super) enum Claimed {
    Claim(Claim),
    Completed(CompletedRow),
}

impl From<Claim> for Claimed {
    fn from(claim: Claim) -> Self {
        Claimed::Claim(claim)
    }
}

/// The claim script's reply: `{kind, value}`, or `{'completed', response,
/// TTL left}` for a record with the claim's own fingerprint.
pub(super) fn parse_claim(reply: Value, fingerprint: &[u8]) -> Result<Claimed, StoreError> {
    let Value::Array(items) = &reply else {
        return Err(unexpected("claim", &reply));
    };
    match text(items.first()) {
        Some(b"acquired") => match int(items.get(1)) {
            Some(0) => Ok(Claim::Acquired { taken_over: false }.into()),
            Some(1) => Ok(Claim::Acquired { taken_over: true }.into()),
            _ => Err(unexpected("claim", &reply)),
        },
        Some(b"mismatch") => Ok(Claim::from(Refusal::Mismatch).into()),
        Some(b"completed") => match (text(items.get(1)), int(items.get(2))) {
            (Some(blob), Some(ttl_left_ms)) => Ok(Claimed::Completed(CompletedRow {
                fingerprint: fingerprint.to_vec(),
                response: Some(blob.to_vec()),
                ttl_left_ms,
            })),
            _ => Err(unexpected("claim", &reply)),
        },
        Some(b"in_flight") => match int(items.get(1)).and_then(|ms| u64::try_from(ms).ok()) {
            Some(ms) => Ok(Claim::from(Refusal::InFlight {
                lease_remaining: Duration::from_millis(ms),
            })
            .into()),
            None => Err(unexpected("claim", &reply)),
        },
        Some(b"corrupt") => Err(StoreError::Corrupt(
            text(items.get(1))
                .map(|why| String::from_utf8_lossy(why).into_owned())
                .unwrap_or_default(),
        )),
        _ => Err(unexpected("claim", &reply)),
    }
}

/// A script's 0 or 1.
pub(super) fn parse_flag(script: &str, reply: Value) -> Result<bool, StoreError> {
    match reply {
        Value::Int(0) => Ok(false),
        Value::Int(1) => Ok(true),
        other => Err(unexpected(script, &other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn odd_replies_are_errors_not_panics() {
        for reply in [
            Value::Nil,
            Value::Array(vec![]),
            Value::Array(vec![Value::BulkString(b"acquired".to_vec())]),
            Value::Array(vec![
                Value::BulkString(b"in_flight".to_vec()),
                Value::Int(-1),
            ]),
            Value::Array(vec![Value::BulkString(b"completed".to_vec())]),
            // A response without the TTL it has left.
            Value::Array(vec![
                Value::BulkString(b"completed".to_vec()),
                Value::BulkString(b"\x00garbage".to_vec()),
            ]),
        ] {
            assert!(matches!(
                parse_claim(reply, &[1; 32]),
                Err(StoreError::Unavailable(_))
            ));
        }
        // A stored response that does not decode is corrupt, not replayed.
        let garbage = Value::Array(vec![
            Value::BulkString(b"completed".to_vec()),
            Value::BulkString(b"\x00garbage".to_vec()),
            Value::Int(1_000),
        ]);
        let Ok(Claimed::Completed(row)) = parse_claim(garbage, &[1; 32]) else {
            panic!("a completed reply with its TTL left parses");
        };
        let req = tower_idempotency::store::ClaimRequest::new(
            tower_idempotency::store::RecordId::new("s", "k"),
            tower_idempotency::fingerprint::Fingerprint([1; 32]),
            tower_idempotency::store::FencingToken::random(),
        );
        let cache = tower_idempotency::store::kit::replay_cache::ReplayCache::new(4, 1 << 20);
        let answer = tower_idempotency::store::kit::claim::answer_completed(
            row,
            &req,
            &cache,
            std::time::Instant::now(),
        );
        assert!(matches!(answer, Err(StoreError::Corrupt(_))));
        assert!(parse_flag("release", Value::Int(2)).is_err());
    }
}
