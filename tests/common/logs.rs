//! What a test logged: one process-wide `tracing` subscriber that hands
//! each span and event to the sink of the thread it happens on, so tests of
//! one binary that run side by side each see their own. A test that reads
//! its logs runs on a current-thread runtime (`#[tokio::test]`), so the
//! tasks it spawns (a server, a database connection) report to it too.
//! (Thread-local subscribers race on tracing's cached per-callsite
//! interest when tests run in parallel; one global subscriber does not.)

use std::cell::RefCell;
use std::fmt::Write;
use std::sync::{Arc, Mutex, Once};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::subscriber::Interest;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;

/// Where one thread's spans and events go.
pub trait Sink: Send + Sync {
    fn new_span(&self, _attrs: &Attributes<'_>, _id: &Id) {}
    fn record(&self, _id: &Id, _values: &Record<'_>) {}
    fn event(&self, event: &tracing::Event<'_>);
    fn close(&self, _id: Id) {}
}

thread_local! {
    static SINK: RefCell<Option<Arc<dyn Sink>>> = const { RefCell::new(None) };
}

/// Sends what happens on this thread from now on to `sink`.
pub fn route_here(sink: Arc<dyn Sink>) {
    static GLOBAL: Once = Once::new();
    GLOBAL.call_once(|| {
        // With the `log` crate's records too (tokio-postgres logs with it).
        tracing_subscriber::registry()
            .with(ToThreadSink)
            .try_init()
            .unwrap();
    });
    SINK.with(|here| *here.borrow_mut() = Some(sink));
}

fn with_sink(f: impl FnOnce(&dyn Sink)) {
    SINK.with(|here| {
        if let Some(sink) = &*here.borrow() {
            f(&**sink);
        }
    });
}

struct ToThreadSink;

impl<S> tracing_subscriber::Layer<S> for ToThreadSink
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    // Asked each time (never cached): on threads with no sink nothing is
    // recorded, so the other tests of the binary pay nothing.
    fn register_callsite(&self, _: &'static tracing::Metadata<'static>) -> Interest {
        Interest::sometimes()
    }

    fn enabled(&self, _: &tracing::Metadata<'_>, _: Context<'_, S>) -> bool {
        SINK.with(|here| here.borrow().is_some())
    }

    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        with_sink(|sink| sink.new_span(attrs, id));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        with_sink(|sink| sink.record(id, values));
    }

    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        with_sink(|sink| sink.event(event));
    }

    fn on_close(&self, id: Id, _: Context<'_, S>) {
        with_sink(|sink| sink.close(id));
    }
}

/// This thread's events that `keep` accepts (their level, their text), each
/// as `field=value;` text.
pub struct Events {
    keep: fn(&tracing::Level, &str) -> bool,
    kept: Mutex<Vec<String>>,
}

impl Events {
    /// The events kept so far.
    pub fn kept(&self) -> Vec<String> {
        self.kept.lock().unwrap().clone()
    }
}

/// Keeps this thread's events that `keep` accepts, from now on.
pub fn capture(keep: fn(&tracing::Level, &str) -> bool) -> Arc<Events> {
    let events = Arc::new(Events {
        keep,
        kept: Mutex::new(Vec::new()),
    });
    route_here(events.clone());
    events
}

struct Text(String);

impl Visit for Text {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, "{}={value:?};", field.name());
    }
}

impl Sink for Events {
    fn event(&self, event: &tracing::Event<'_>) {
        let mut text = Text(String::new());
        event.record(&mut text);
        if (self.keep)(event.metadata().level(), &text.0) {
            self.kept.lock().unwrap().push(text.0);
        }
    }
}
