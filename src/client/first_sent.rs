//! [`FirstSent`]: `Repeatability-First-Sent` on the calls that
//! [`IdempotencyKeyLayer`](super::IdempotencyKeyLayer) gives a key.

use std::fmt;
use std::sync::Arc;

use http::HeaderMap;

use crate::first_sent::{REPEATABILITY_FIRST_SENT, format};
use crate::store::{Clock, SystemClock};

/// How [`IdempotencyKeyLayer`](super::IdempotencyKeyLayer) stamps a call with
/// `Repeatability-First-Sent` (OASIS Repeatable Requests 1.0): the time the
/// layer made the call's key, as an IMF-fixdate. The layer sits outside the
/// retries, so every attempt of the call carries the same time; a server
/// with [`refuse_expired_retries`](crate::IdempotencyLayer::refuse_expired_retries)
/// then refuses (412) a retry that outlived its record instead of running
/// it again (see [`crate::first_sent`]).
///
/// On by default; off with
/// [`send_first_sent(false)`](super::IdempotencyKeyLayer::send_first_sent).
/// A request that already carries the field keeps it, and a request that
/// already carries a key gets no field from the layer: its caller made the
/// key, and only the caller knows when it first sent it.
#[derive(Clone)]
pub struct FirstSent {
    pub(super) send: bool,
    pub(super) clock: Arc<dyn Clock>,
}

impl Default for FirstSent {
    fn default() -> Self {
        FirstSent {
            send: true,
            clock: Arc::new(SystemClock),
        }
    }
}

impl fmt::Debug for FirstSent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FirstSent")
            .field("send", &self.send)
            .finish_non_exhaustive()
    }
}

impl FirstSent {
    /// Adds the field, at the clock's time, unless it is off or present.
    pub(super) fn stamp(&self, headers: &mut HeaderMap) {
        if self.send && !headers.contains_key(&REPEATABILITY_FIRST_SENT) {
            headers.insert(REPEATABILITY_FIRST_SENT, format(self.clock.now_ms()));
        }
    }
}
