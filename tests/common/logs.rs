//! A collector of the process's log events, for tests that assert what was
//! logged: each event kept as `field=value;` text. One per test binary (it
//! is the process's subscriber).

use std::fmt::Write;
use std::sync::Mutex;

use tracing::field::{Field, Visit};
use tracing_subscriber::layer::Context;

/// Keeps the events `keep` accepts (their level, their text) in `into`.
pub struct Collector {
    pub keep: fn(&tracing::Level, &str) -> bool,
    pub into: &'static Mutex<Vec<String>>,
}

struct Text(String);

impl Visit for Text {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, "{}={value:?};", field.name());
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Collector {
    fn on_event(&self, event: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut text = Text(String::new());
        event.record(&mut text);
        if (self.keep)(event.metadata().level(), &text.0) {
            self.into.lock().unwrap().push(text.0);
        }
    }
}
