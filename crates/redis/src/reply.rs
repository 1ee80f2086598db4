//! The scripts' replies, read into the store's types: anything odd is an
//! error, never a panic.

use std::time::Duration;

use ::redis::Value;

use tower_idempotency::StoredResponse;
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

/// The claim script's reply: `{kind, value}`.
pub(super) fn parse_claim(reply: Value) -> Result<Claim, StoreError> {
    let Value::Array(items) = &reply else {
        return Err(unexpected("claim", &reply));
    };
    match text(items.first()) {
        Some(b"acquired") => match int(items.get(1)) {
            Some(0) => Ok(Claim::Acquired { taken_over: false }),
            Some(1) => Ok(Claim::Acquired { taken_over: true }),
            _ => Err(unexpected("claim", &reply)),
        },
        Some(b"mismatch") => Ok(Refusal::Mismatch.into()),
        Some(b"completed") => match text(items.get(1)) {
            Some(blob) => StoredResponse::decode(blob)
                .map(|stored| Refusal::Completed(stored).into())
                .map_err(|e| StoreError::Corrupt(e.to_string())),
            None => Err(unexpected("claim", &reply)),
        },
        Some(b"in_flight") => match int(items.get(1)).and_then(|ms| u64::try_from(ms).ok()) {
            Some(ms) => Ok(Refusal::InFlight {
                lease_remaining: Duration::from_millis(ms),
            }
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
        ] {
            assert!(matches!(
                parse_claim(reply),
                Err(StoreError::Unavailable(_))
            ));
        }
        let garbage = Value::Array(vec![
            Value::BulkString(b"completed".to_vec()),
            Value::BulkString(b"\x00garbage".to_vec()),
        ]);
        assert!(matches!(parse_claim(garbage), Err(StoreError::Corrupt(_))));
        assert!(parse_flag("release", Value::Int(2)).is_err());
    }
}
