//! An in-process store for tests and single-process services.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::{
    Claim, ClaimRequest, Clock, Completion, Decision, Existing, FencingToken, Inspect, Kind,
    RecordCounts, RecordSummary, Store, StoreError, SystemClock, decide, duration_ms,
};
use crate::fingerprint::Fingerprint;
use crate::response::StoredResponse;

/// Records in a `HashMap` behind a mutex: lost when the process exits, not
/// shared between processes.
///
/// # Example
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, scope::GlobalScope};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new(), GlobalScope);
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    records: Arc<Mutex<HashMap<(String, String), Record>>>,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore").finish_non_exhaustive()
    }
}

struct Record {
    fingerprint: Fingerprint,
    token: FencingToken,
    lease_until: i64,
    expires_at: i64,
    response: Option<StoredResponse>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store on the system clock.
    pub fn new() -> Self {
        Self::with_clock(SystemClock)
    }

    /// An empty store on `clock` (e.g. a [`super::ManualClock`] in tests).
    pub fn with_clock(clock: impl Clock) -> Self {
        MemoryStore {
            records: Arc::default(),
            clock: Arc::new(clock),
        }
    }

    /// How many records (expired or not) the store holds.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Record>> {
        // A panic while the lock was held cannot leave a record half-written
        // (every update below is one assignment), so a poisoned map is usable.
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Store for MemoryStore {
    async fn claim(&self, req: ClaimRequest) -> Result<Claim, StoreError> {
        let now = self.clock.now_ms();
        let fresh = Record {
            fingerprint: req.fingerprint,
            token: req.token,
            lease_until: now.saturating_add(duration_ms(req.lease)),
            expires_at: now.saturating_add(duration_ms(req.ttl)),
            response: None,
        };
        let mut records = self.lock();
        let record = match records.entry((req.scope, req.key)) {
            std::collections::hash_map::Entry::Vacant(vacant) => {
                vacant.insert(fresh);
                return Ok(Claim::Acquired { taken_over: false });
            }
            std::collections::hash_map::Entry::Occupied(occupied) => occupied.into_mut(),
        };
        let existing = Existing {
            fingerprint: &record.fingerprint.0,
            completed: record.response.is_some(),
            lease_until: record.lease_until,
            expires_at: record.expires_at,
        };
        match decide(&existing, &req.fingerprint, now, req.lease) {
            Decision::Replace { taken_over } => {
                *record = fresh;
                Ok(Claim::Acquired { taken_over })
            }
            Decision::Mismatch => Ok(Claim::Mismatch),
            Decision::Replay => record
                .response
                .clone()
                .map(Claim::Completed)
                .ok_or_else(|| StoreError::Corrupt("completed without a response".into())),
            Decision::InFlight(lease_remaining) => Ok(Claim::InFlight { lease_remaining }),
        }
    }

    async fn complete(
        &self,
        scope: String,
        key: String,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        let mut records = self.lock();
        match records.get_mut(&(scope, key)) {
            Some(record) if record.token == token && record.response.is_none() => {
                record.response = Some(response);
                Ok(Completion::Stored)
            }
            _ => Ok(Completion::Fenced),
        }
    }

    async fn release(
        &self,
        scope: String,
        key: String,
        token: FencingToken,
    ) -> Result<bool, StoreError> {
        let mut records = self.lock();
        let id = (scope, key);
        match records.get(&id) {
            Some(record) if record.token == token && record.response.is_none() => {
                records.remove(&id);
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let now = self.clock.now_ms();
        let mut records = self.lock();
        let before = records.len();
        records.retain(|_, r| r.expires_at > now);
        Ok((before - records.len()) as u64)
    }
}

impl Inspect for MemoryStore {
    async fn stuck(&self, limit: usize) -> Result<Vec<RecordSummary>, StoreError> {
        let now = self.clock.now_ms();
        let records = self.lock();
        let mut stuck: Vec<_> = records
            .iter()
            .filter(|(_, r)| {
                Kind::of(r.response.is_some(), r.lease_until, r.expires_at, now) == Kind::Stuck
            })
            .collect();
        stuck.sort_by(|(a_id, a), (b_id, b)| (a.lease_until, a_id).cmp(&(b.lease_until, b_id)));
        Ok(stuck
            .into_iter()
            .take(limit)
            .map(|((scope, key), r)| {
                RecordSummary::new(
                    scope.clone(),
                    key.clone(),
                    r.fingerprint,
                    r.lease_until,
                    r.expires_at,
                    now,
                )
            })
            .collect())
    }

    async fn counts(&self) -> Result<RecordCounts, StoreError> {
        let now = self.clock.now_ms();
        let mut counts = RecordCounts::default();
        for r in self.lock().values() {
            counts.add(Kind::of(
                r.response.is_some(),
                r.lease_until,
                r.expires_at,
                now,
            ));
        }
        Ok(counts)
    }
}
