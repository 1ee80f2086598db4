//! The layer's side of the `Repeatability-First-Sent` guard
//! ([`crate::first_sent`]): the field read before the claim, the refusal
//! after a fresh claim, and the advertised retention.

use http::request::Parts;
use http::{Extensions, HeaderMap, HeaderValue};

use crate::config::Settings;
use crate::first_sent::{FirstSent, parse};
use crate::problem::Rejection;
use crate::store::duration_ms;

/// Before the claim: reads the field into the extensions, or refuses it.
pub(crate) fn read(settings: &Settings, parts: &mut Parts) -> Result<(), Rejection> {
    if !settings.refuse_expired {
        return Ok(());
    }
    match parse(&parts.headers, settings.clock.now_ms()) {
        Ok(Some(ms)) => {
            parts.extensions.insert(FirstSent(ms));
            Ok(())
        }
        Ok(None) => Ok(()),
        Err(e) => Err(Rejection::InvalidFirstSent(e)),
    }
}

/// After a claim that found no live record: the refusal when the request was
/// first sent longer ago than the TTL.
pub(crate) fn expired(settings: &Settings, extensions: &Extensions) -> Option<Rejection> {
    let FirstSent(first_ms) = extensions.get::<FirstSent>()?;
    let age = settings.clock.now_ms().saturating_sub(*first_ms);
    (age > duration_ms(settings.ttl)).then_some(Rejection::ExpiredRetry {
        retention_secs: settings.ttl.as_secs(),
    })
}

/// Adds the retention field to a first response or a replay.
pub(crate) fn advertise(settings: &Settings, headers: &mut HeaderMap) {
    if let Some(name) = &settings.retention_header {
        headers.insert(name.clone(), HeaderValue::from(settings.ttl.as_secs()));
    }
}
