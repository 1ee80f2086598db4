//! What the layer tells the application, and what it lets the application
//! adjust: events for audit logs ([`IdempotencyLayer::on_event`]), a hook on
//! every replay ([`IdempotencyLayer::on_replay`]), and a namespace that keeps
//! one layer's keys apart from another's in a shared store
//! ([`IdempotencyLayer::namespace`]).
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use tower_idempotency::{IdempotencyLayer, MemoryStore, scope::GlobalScope};
//! use tower_idempotency::hooks::{Event, EventKind};
//!
//! let audit = Arc::new(Mutex::new(Vec::new()));
//! let log = audit.clone();
//! let layer = IdempotencyLayer::new(MemoryStore::new(), GlobalScope)
//!     // Orders and refunds share the store; the same key in each is two records.
//!     .namespace("orders")
//!     // Every replay says so to caches and proxies too.
//!     .on_replay(|_event, headers| {
//!         headers.insert("cache-status", "tower-idempotency; hit".parse().unwrap());
//!     })
//!     // An audit trail without parsing logs.
//!     .on_event(move |event: &Event<'_>| {
//!         if let EventKind::Rejected { status, .. } = event.kind {
//!             log.lock().unwrap().push((status.as_u16(), event.key.map(str::to_owned)));
//!         }
//!     });
//! # let _ = layer;
//! ```
//!
//! Hooks run on the request's task, synchronously, before the answer goes
//! out: keep them short (push to a bounded channel for anything slow). A
//! panicking hook is the application's panic, as a panicking handler is.
//!
//! [`IdempotencyLayer::on_event`]: crate::IdempotencyLayer::on_event
//! [`IdempotencyLayer::on_replay`]: crate::IdempotencyLayer::on_replay
//! [`IdempotencyLayer::namespace`]: crate::IdempotencyLayer::namespace

use std::sync::Arc;

use http::{HeaderMap, StatusCode};

use crate::store::RecordId;

/// The separator between a namespace and a key in the stored key. Keys are
/// printable ASCII (the header's and the key sources' rules), so no key
/// holds it, and a namespaced key never equals a key of another namespace
/// or of none.
const SEPARATOR: char = '\u{1f}';

/// The longest namespace, in characters.
pub const MAX_NAMESPACE_LEN: usize = 64;

/// Something the layer did with a request, for
/// [`on_event`](crate::IdempotencyLayer::on_event) and
/// [`on_replay`](crate::IdempotencyLayer::on_replay).
///
/// `#[non_exhaustive]`: more fields may come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Event<'a> {
    /// What happened.
    pub kind: EventKind,
    /// The key's scope, once the layer knows it (from the claim on).
    pub scope: Option<&'a str>,
    /// The idempotency key as the client sent it (without the namespace),
    /// once the layer knows it (from the claim on).
    pub key: Option<&'a str>,
}

/// The kinds of [`Event`]. `#[non_exhaustive]`: more may come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum EventKind {
    /// A repeat was answered with the stored response, which had `status`.
    Replayed {
        /// The stored response's status.
        status: StatusCode,
    },
    /// The layer answered with a problem instead of running the handler or
    /// replaying: 400 (a bad key or field), 401, 409 (in flight), 410, 412,
    /// 413, 422 (another request under the key), 503 (the store).
    Rejected {
        /// The problem's status.
        status: StatusCode,
        /// The problem's `type` URI (see [`crate::problem::types`]).
        problem_type: &'static str,
    },
    /// A request took over a key whose holder's lease had ended: the
    /// handler runs again for a key that may have run before.
    TakenOver,
    /// A running request lost its key's lease (see
    /// [`max_hold`](crate::IdempotencyLayer::max_hold)).
    LeaseLost,
}

pub(crate) type EventFn = Arc<dyn Fn(&Event<'_>) + Send + Sync>;
pub(crate) type ReplayFn = Arc<dyn Fn(&Event<'_>, &mut HeaderMap) + Send + Sync>;

/// A layer's hooks and namespace; cheap to clone.
#[derive(Clone, Default)]
pub(crate) struct Hooks {
    pub(crate) namespace: Option<Arc<str>>,
    pub(crate) on_event: Option<EventFn>,
    pub(crate) on_replay: Option<ReplayFn>,
}

impl Hooks {
    /// The key as stored: the namespace, the separator and `key`.
    pub(crate) fn stored_key(&self, key: String) -> String {
        match &self.namespace {
            Some(namespace) => format!("{namespace}{SEPARATOR}{key}"),
            None => key,
        }
    }

    /// The event of `kind` about record `id` (if known), as the client
    /// named it.
    fn event<'a>(&self, kind: EventKind, id: Option<&'a RecordId>) -> Event<'a> {
        let key = id.map(|id| match &self.namespace {
            Some(_) => id
                .key()
                .split_once(SEPARATOR)
                .map_or(id.key(), |(_, key)| key),
            None => id.key(),
        });
        Event {
            kind,
            scope: id.map(RecordId::scope),
            key,
        }
    }

    /// Tells the application, if it listens.
    pub(crate) fn emit(&self, kind: EventKind, id: Option<&RecordId>) {
        if let Some(on_event) = &self.on_event {
            on_event(&self.event(kind, id));
        }
    }

    /// A replay of record `id`: its headers adjusted by the replay hook,
    /// then the event.
    pub(crate) fn replayed(&self, id: &RecordId, status: StatusCode, headers: &mut HeaderMap) {
        if self.on_replay.is_none() && self.on_event.is_none() {
            return;
        }
        let event = self.event(EventKind::Replayed { status }, Some(id));
        if let Some(on_replay) = &self.on_replay {
            on_replay(&event, headers);
        }
        if let Some(on_event) = &self.on_event {
            on_event(&event);
        }
    }
}

/// Checks a namespace: 1 to [`MAX_NAMESPACE_LEN`] printable ASCII
/// characters.
pub(crate) fn check_namespace(namespace: &str) -> Result<(), &'static str> {
    if namespace.is_empty() || namespace.len() > MAX_NAMESPACE_LEN {
        return Err("a namespace is 1 to 64 characters");
    }
    if !namespace.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
        return Err("a namespace is printable ASCII");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    #[test]
    fn namespaced_keys_never_meet_and_events_name_the_clients_key() {
        let orders = Hooks {
            namespace: Some("orders".into()),
            ..Hooks::default()
        };
        let plain = Hooks::default();
        assert_eq!(orders.stored_key("k".into()), "orders\u{1f}k");
        assert_eq!(plain.stored_key("k".into()), "k");
        let id = RecordId::new("alice", orders.stored_key("a\u{1f}b".into()));
        let event = orders.event(EventKind::TakenOver, Some(&id));
        assert_eq!((event.scope, event.key), (Some("alice"), Some("a\u{1f}b")));
    }

    #[test]
    fn the_replay_hook_sees_the_event_and_changes_headers() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let hooks = Hooks {
            namespace: None,
            on_event: Some(Arc::new(move |e: &Event<'_>| {
                log.lock()
                    .unwrap()
                    .push(format!("{:?} {:?}", e.kind, e.key));
            })),
            on_replay: Some(Arc::new(|e: &Event<'_>, h: &mut HeaderMap| {
                h.insert("x-replayed-key", e.key.unwrap().parse().unwrap());
            })),
        };
        let mut headers = HeaderMap::new();
        hooks.replayed(&RecordId::new("s", "k"), StatusCode::CREATED, &mut headers);
        assert_eq!(headers["x-replayed-key"], "k");
        assert_eq!(
            *seen.lock().unwrap(),
            ["Replayed { status: 201 } Some(\"k\")"]
        );
    }

    #[test]
    fn namespaces_are_bounded_printable_ascii() {
        assert!(check_namespace("orders-v1").is_ok());
        assert!(check_namespace("").is_err());
        assert!(check_namespace(&"n".repeat(65)).is_err());
        assert!(check_namespace("a\u{1f}").is_err());
        assert!(check_namespace("caf\u{e9}").is_err());
    }
}
