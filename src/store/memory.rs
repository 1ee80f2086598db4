//! An in-process store for tests and single-process services.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{
    Claim, ClaimRequest, Clock, Completion, Decision, Existing, FencingToken, Inspect, Kind,
    RecordCounts, RecordId, RecordSummary, Refusal, Store, StoreError, SystemClock, decide,
    duration_ms,
};
use crate::fingerprint::Fingerprint;
use crate::response::StoredResponse;

/// Records in a `HashMap` behind a mutex: lost when the process exits, not
/// shared between processes.
///
/// # Capacity
///
/// The store holds at most [`MemoryStore::DEFAULT_CAPACITY`] records (100 000)
/// unless told otherwise ([`MemoryStore::with_max_records`],
/// [`MemoryStore::max_records`]), so that clients sending new keys cannot
/// grow it without bound. When a claim for a new key finds it full, the
/// store first deletes every record past its TTL (one pass over the map,
/// made only when a record may have expired since the last). If every record
/// is still live, the claim fails with [`StoreError::Full`] and the layer
/// answers 503 (`store-full` in [`crate::problem`]) with `Retry-After`: the
/// time until the earliest TTL ends, at most 60 s (releases free room sooner,
/// unannounced), rounded up to whole seconds. Nothing is ever evicted before its TTL
/// ends: a live record still guards its key. Claims for keys the store
/// already holds (replays, in flight, mismatches, take-overs) are answered
/// as usual when full.
///
/// The capacity counts records, not bytes: a completed record holds its
/// response, body included (up to the layer's `max_response_body`, 1 MiB by
/// default). Choose it from the memory you give the store and your typical
/// response size.
///
/// # Example
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, scope::GlobalScope};
///
/// let layer = IdempotencyLayer::new(MemoryStore::with_max_records(10_000), GlobalScope);
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    records: Arc<Mutex<Records>>,
    clock: Arc<dyn Clock>,
}

/// The map, its capacity, and a bound on its earliest TTL end.
struct Records {
    map: HashMap<(String, String), Record>,
    capacity: usize,
    /// At most the earliest `expires_at` in `map` (Unix ms): no record has
    /// expired while the clock is before it. Exact after a pass over the map;
    /// lowered by every insert; left as is when records leave.
    earliest_expiry: i64,
}

/// The longest `Retry-After` of a full store: room may come sooner from a
/// release, which no hint can foresee.
const FULL_RETRY_AFTER_MAX: Duration = Duration::from_secs(60);

impl Records {
    /// Deletes every record past its TTL at `now` in one pass, and makes
    /// `earliest_expiry` exact. Returns how many were deleted.
    fn evict_expired(&mut self, now: i64) -> usize {
        let before = self.map.len();
        let mut earliest = i64::MAX;
        self.map.retain(|_, r| {
            let live = r.expires_at > now;
            if live {
                earliest = earliest.min(r.expires_at);
            }
            live
        });
        self.earliest_expiry = earliest;
        before - self.map.len()
    }

    /// Room for one more record: at once if the map is below capacity;
    /// otherwise by deleting the expired records, if any may exist; else
    /// `Full`. Below capacity nothing is deleted (purging does that).
    fn make_room(&mut self, now: i64) -> Result<(), StoreError> {
        if self.map.len() < self.capacity {
            return Ok(());
        }
        if self.earliest_expiry <= now {
            self.evict_expired(now);
            if self.map.len() < self.capacity {
                return Ok(());
            }
        }
        let wait = u64::try_from(self.earliest_expiry.saturating_sub(now)).unwrap_or(0);
        Err(StoreError::Full {
            capacity: self.capacity,
            retry_after: Duration::from_millis(wait).min(FULL_RETRY_AFTER_MAX),
        })
    }
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
    /// The capacity of [`MemoryStore::new`] and [`MemoryStore::with_clock`],
    /// in records.
    pub const DEFAULT_CAPACITY: usize = 100_000;

    /// An empty store on the system clock, holding up to
    /// [`MemoryStore::DEFAULT_CAPACITY`] records.
    pub fn new() -> Self {
        Self::with_clock(SystemClock)
    }

    /// An empty store on the system clock, holding up to `capacity` records
    /// (0: every claim for a new key fails with [`StoreError::Full`]).
    pub fn with_max_records(capacity: usize) -> Self {
        Self::new().max_records(capacity)
    }

    /// An empty store on `clock` (e.g. a `test_util::ManualClock` in tests,
    /// feature `test-util`),
    /// holding up to [`MemoryStore::DEFAULT_CAPACITY`] records.
    pub fn with_clock(clock: impl Clock) -> Self {
        MemoryStore {
            records: Arc::new(Mutex::new(Records {
                map: HashMap::new(),
                capacity: Self::DEFAULT_CAPACITY,
                earliest_expiry: i64::MAX,
            })),
            clock: Arc::new(clock),
        }
    }

    /// Holds up to `capacity` records from now on (this store and its
    /// clones). Records already held stay, even above it.
    pub fn max_records(self, capacity: usize) -> Self {
        self.lock().capacity = capacity;
        self
    }

    /// How many records the store may hold.
    pub fn capacity(&self) -> usize {
        self.lock().capacity
    }

    /// How many records (expired or not) the store holds.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// Whether the store holds no record.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The records' shared allocation, for tests that count its holders.
    #[cfg(test)]
    pub(crate) fn records_handle(&self) -> Arc<dyn std::any::Any + Send + Sync> {
        self.records.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Records> {
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
        let records = &mut *records;
        let id = (req.scope, req.key);
        let Some(record) = records.map.get_mut(&id) else {
            records.make_room(now)?;
            records.earliest_expiry = records.earliest_expiry.min(fresh.expires_at);
            records.map.insert(id, fresh);
            return Ok(Claim::Acquired { taken_over: false });
        };
        let existing = Existing {
            fingerprint: &record.fingerprint.0,
            completed: record.response.is_some(),
            lease_until: record.lease_until,
            expires_at: record.expires_at,
        };
        match decide(&existing, &req.fingerprint, now, req.lease) {
            Decision::Replace { taken_over } => {
                records.earliest_expiry = records.earliest_expiry.min(fresh.expires_at);
                *record = fresh;
                Ok(Claim::Acquired { taken_over })
            }
            Decision::Mismatch => Ok(Refusal::Mismatch.into()),
            Decision::Replay => record
                .response
                .clone()
                .map(|stored| Refusal::Completed(stored).into())
                .ok_or_else(|| StoreError::Corrupt("completed without a response".into())),
            Decision::InFlight(lease_remaining) => Ok(Refusal::InFlight { lease_remaining }.into()),
        }
    }

    async fn complete(
        &self,
        id: RecordId,
        token: FencingToken,
        response: StoredResponse,
    ) -> Result<Completion, StoreError> {
        let mut records = self.lock();
        match records.map.get_mut(&id.into_parts()) {
            Some(record) if record.token == token && record.response.is_none() => {
                record.response = Some(response);
                Ok(Completion::Stored)
            }
            _ => Ok(Completion::Fenced),
        }
    }

    async fn release(&self, id: RecordId, token: FencingToken) -> Result<bool, StoreError> {
        let mut records = self.lock();
        let id = id.into_parts();
        match records.map.get(&id) {
            Some(record) if record.token == token && record.response.is_none() => {
                records.map.remove(&id);
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        let now = self.clock.now_ms();
        Ok(self.lock().evict_expired(now) as u64)
    }

    async fn renew(
        &self,
        id: RecordId,
        token: FencingToken,
        lease: Duration,
    ) -> Result<bool, StoreError> {
        let now = self.clock.now_ms();
        let mut records = self.lock();
        match records.map.get_mut(&id.into_parts()) {
            Some(record)
                if record.token == token
                    && record.response.is_none()
                    && record.expires_at > now =>
            {
                record.lease_until = now.saturating_add(duration_ms(lease));
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

impl Inspect for MemoryStore {
    async fn stuck(&self, limit: usize) -> Result<Vec<RecordSummary>, StoreError> {
        let now = self.clock.now_ms();
        let records = self.lock();
        let mut stuck: Vec<_> = records
            .map
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
                RecordSummary::from_deadlines(
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
        for r in self.lock().map.values() {
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
