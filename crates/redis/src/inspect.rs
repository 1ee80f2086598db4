//! [`Inspect`] for [`RedisStore`]: one `SCAN` walk, each page judged by the
//! inspect script.

use ::redis::Value;

use super::{INSPECT_SCRIPT, RedisStore, SCAN_COUNT, Walk, int, scan_pattern, text};
use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::store::{Inspect, RecordCounts, RecordSummary, StoreError};

/// A stuck record as the inspect script lists it.
struct StuckEntry {
    scope: String,
    key: String,
    fingerprint: Fingerprint,
    lease_until: i64,
    expires_at: i64,
}

/// One batch's answer from the inspect script.
struct Inspected {
    counts: RecordCounts,
    stuck: Vec<StuckEntry>,
    /// The server's time (ms, with the test offset) when it was judged; for
    /// a whole walk, the last page's.
    now: i64,
}

/// A decimal reply field (the scripts write whole numbers as strings).
fn decimal(v: Option<&Value>) -> Option<i64> {
    std::str::from_utf8(text(v)?).ok()?.parse().ok()
}

/// The inspect script's reply; record names are parsed with `prefix`.
fn parse_inspect(prefix: &str, reply: Value) -> Result<Inspected, StoreError> {
    // Not the reply itself: it names records (scopes and keys).
    let bad = || StoreError::unavailable("unexpected reply from the inspect script");
    let Value::Array(items) = &reply else {
        return Err(bad());
    };
    match text(items.first()) {
        Some(b"ok") => {}
        Some(b"corrupt") => {
            return Err(StoreError::Corrupt(
                text(items.get(1))
                    .map(|why| String::from_utf8_lossy(why).into_owned())
                    .unwrap_or_default(),
            ));
        }
        _ => return Err(bad()),
    }
    let now = decimal(items.get(1)).ok_or_else(bad)?;
    let count = |i: usize| {
        int(items.get(i))
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(bad)
    };
    let counts = RecordCounts {
        in_flight: count(2)?,
        stuck: count(3)?,
        completed: count(4)?,
        expired: count(5)?,
    };
    let Some(Value::Array(listed)) = items.get(6) else {
        return Err(bad());
    };
    let stuck = listed
        .iter()
        .map(|entry| {
            let Value::Array(fields) = entry else {
                return Err(bad());
            };
            let name = text(fields.first()).ok_or_else(bad)?;
            // Not the name: it holds a scope and a key, which logs never show.
            let corrupt = |why: &str| StoreError::Corrupt(why.to_owned());
            let (scope, key) = parse_record_key(prefix, name).ok_or_else(|| {
                corrupt("a stuck record's name is not prefix, scope length, ':', scope, ':', key")
            })?;
            let fingerprint = text(fields.get(1))
                .and_then(|f| <[u8; 32]>::try_from(f).ok())
                .ok_or_else(|| corrupt("a stuck record's fingerprint is not 32 bytes"))?;
            Ok(StuckEntry {
                scope,
                key,
                fingerprint: Fingerprint(fingerprint),
                lease_until: decimal(fields.get(2)).ok_or_else(bad)?,
                expires_at: decimal(fields.get(3)).ok_or_else(bad)?,
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(Inspected { counts, stuck, now })
}

/// `(scope, key)` from a record's name,
/// `{prefix}{{{scope length}:{scope}:{key}}}`.
fn parse_record_key(prefix: &str, name: &[u8]) -> Option<(String, String)> {
    let rest = name
        .strip_prefix(prefix.as_bytes())?
        .strip_prefix(b"{")?
        .strip_suffix(b"}")?;
    let colon = rest.iter().position(|b| *b == b':')?;
    let len: usize = std::str::from_utf8(&rest[..colon]).ok()?.parse().ok()?;
    let rest = &rest[colon + 1..];
    let scope = rest.get(..len)?;
    let key = rest.get(len..)?.strip_prefix(b":")?;
    Some((
        String::from_utf8(scope.to_vec()).ok()?,
        String::from_utf8(key.to_vec()).ok()?,
    ))
}

impl RedisStore {
    /// Runs the inspect script over every key under the prefix, one `SCAN`
    /// page at a time. `SCAN` may return a key twice; each is judged once.
    /// With `list`, keeps the `limit` stuck records with the oldest lease end.
    async fn inspect(&self, list: Option<usize>) -> Result<Inspected, StoreError> {
        let mut walk = Walk::new(&self.conn, scan_pattern(&self.prefix)).await?;
        let mut seen = std::collections::HashSet::new();
        let mut total = Inspected {
            counts: RecordCounts::default(),
            stuck: Vec::new(),
            now: i64::MIN,
        };
        let order = |a: &StuckEntry, b: &StuckEntry| {
            (a.lease_until, &a.scope, &a.key).cmp(&(b.lease_until, &b.scope, &b.key))
        };
        while let Some(keys) = walk.next_page().await? {
            let fresh: Vec<Vec<u8>> = keys
                .into_iter()
                .filter(|k| seen.insert(k.clone()))
                .collect();
            if fresh.is_empty() {
                continue;
            }
            let args = vec![
                self.offset_ms().to_string().into_bytes(),
                if list.is_some() {
                    b"1".to_vec()
                } else {
                    b"0".to_vec()
                },
            ];
            for reply in walk.run(&INSPECT_SCRIPT, fresh, args).await? {
                let batch = parse_inspect(&self.prefix, reply)?;
                total.now = total.now.max(batch.now);
                let counts = &mut total.counts;
                counts.in_flight += batch.counts.in_flight;
                counts.stuck += batch.counts.stuck;
                counts.completed += batch.counts.completed;
                counts.expired += batch.counts.expired;
                if let Some(limit) = list {
                    total.stuck.extend(batch.stuck);
                    if total.stuck.len() > limit.saturating_mul(2).max(SCAN_COUNT) {
                        total.stuck.sort_by(order);
                        total.stuck.truncate(limit);
                    }
                }
            }
        }
        if let Some(limit) = list {
            total.stuck.sort_by(order);
            total.stuck.truncate(limit);
        }
        Ok(total)
    }
}

/// Walks every key under the prefix with `SCAN` (as
/// [`Store::purge_expired`](tower_idempotency::Store::purge_expired) does),
/// judging each page in one script at one reading of the Redis server's
/// clock. So an answer is not one snapshot:
/// records written or deleted during the walk may or may not be counted, and
/// pages are judged some milliseconds apart (the figures of
/// [`RecordSummary`] are all taken at the last page's reading, so they
/// agree with the order of the list). The walk keeps the names it has
/// seen in memory (`SCAN` may return a key twice), so it costs memory in
/// proportion to the records. Records past their TTL usually vanish by
/// Redis's own expiry before any purge, so [`RecordCounts::expired`] is
/// rarely above 0 here.
impl Inspect for RedisStore {
    async fn stuck(&self, limit: usize) -> Result<Vec<RecordSummary>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let inspected = self.inspect(Some(limit)).await?;
        Ok(inspected
            .stuck
            .into_iter()
            .map(|e| {
                RecordSummary::from_deadlines(
                    e.scope,
                    e.key,
                    e.fingerprint,
                    e.lease_until,
                    e.expires_at,
                    inspected.now,
                )
            })
            .collect())
    }

    async fn counts(&self) -> Result<RecordCounts, StoreError> {
        Ok(self.inspect(None).await?.counts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record_key;

    #[test]
    fn record_names_parse_back_to_scope_and_key() {
        for (scope, key) in [
            ("alice", "k-1"),
            ("a:b", "c"),
            ("a", "b:c"),
            ("", ""),
            ("é", ":"),
        ] {
            let name = record_key("p:", scope, key);
            assert_eq!(
                parse_record_key("p:", name.as_bytes()),
                Some((scope.to_owned(), key.to_owned())),
                "{name}"
            );
        }
        for name in [
            "q:{5:alice:k}",
            "p:{x:alice:k}",
            "p:{9:alice:k}",
            "p:{5:alicek}",
            "p:{5}",
            "p:5:alice:k",
            "p:{5:alice:k",
        ] {
            assert_eq!(parse_record_key("p:", name.as_bytes()), None, "{name}");
        }
    }

    #[test]
    fn odd_inspect_replies_are_errors_that_name_no_record() {
        let bulk = |b: &[u8]| Value::BulkString(b.to_vec());
        let reply = |stuck: Vec<Value>| {
            Value::Array(vec![
                bulk(b"ok"),
                bulk(b"1800000000000"),
                Value::Int(0),
                Value::Int(1),
                Value::Int(0),
                Value::Int(0),
                Value::Array(stuck),
            ])
        };
        let entry = |name: &[u8], fingerprint: &[u8]| {
            Value::Array(vec![
                bulk(name),
                bulk(fingerprint),
                bulk(b"1799999999000"),
                bulk(b"1800000003600"),
            ])
        };
        let ok = parse_inspect("p:", reply(vec![entry(b"p:{5:alice:k-1}", &[9; 32])])).unwrap();
        assert_eq!(ok.now, 1_800_000_000_000);
        assert_eq!(ok.counts.stuck, 1);
        assert_eq!(
            (ok.stuck[0].scope.as_str(), ok.stuck[0].key.as_str()),
            ("alice", "k-1")
        );
        for odd in [
            Value::Nil,
            Value::Array(vec![bulk(b"p:{5:alice:secret-key}")]),
            reply(vec![entry(b"p:{5:alice}", &[9; 32])]),
            reply(vec![entry(b"p:{5:alice:secret-key}", &[9; 31])]),
            reply(vec![Value::Array(vec![bulk(b"p:{5:alice:secret-key}")])]),
        ] {
            let Err(e) = parse_inspect("p:", odd) else {
                panic!("accepted an odd reply");
            };
            assert!(!e.to_string().contains("alice"), "{e}");
        }
    }
}
