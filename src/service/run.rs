//! From the claim to the answer: the claim (or a repeat's wait), the inner
//! service under the hold, and the record's completion or release; and the
//! replay of a completed record.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::first_sent;
use crate::body::{RequestBody, ResponseBody};
use crate::config::{Config, Settings};
use crate::fingerprint::Fingerprint;
use crate::fingerprint::Fingerprinter;
use crate::hooks::EventKind;
use crate::key::ClaimedKey;
use crate::mode::{Hold, Mode};
use crate::policy::{DoNotStore, OutcomeUnknown, StorePolicy};
use crate::problem::{Rejection, STORE_RETRY_AFTER_SECS};
use crate::record::{release, store_response, stream_deadline};
use crate::renew;
use crate::response::{StoredBody, StoredResponse};
use crate::scope::Scope;
use crate::seal::{self, Sealer};
use crate::store::{
    ClaimRequest, FencingToken, RecordId, Refusal, Store, StoreError, retry_after_secs,
};
use crate::telemetry::{self, Operation, Outcome, timed};
use crate::wait::WakeOnEnd;
use tokio::time::Instant;

/// Records the outcome and answers with the rejection.
/// `id` names the record for the application's event hook, once known.
pub(super) fn reject<B: Body>(
    settings: &Settings,
    id: Option<&RecordId>,
    outcome: Outcome,
    rejection: Rejection,
) -> Response<ResponseBody<B>> {
    telemetry::outcome(outcome);
    settings.rejection_response(&rejection, id)
}

/// One claimed request, in five steps: the claim (or a repeat's wait), the
/// first-sent guard, the hold armed, the inner service, and the record's
/// completion or release.
pub(super) async fn claim_and_run<M, S, St, Sc, F, P, ReqBody, ResBody>(
    mut inner: S,
    store: St,
    config: Arc<Config<Sc, F, P>>,
    (claim, waiting_bytes, abandoned): (ClaimRequest, usize, Arc<AtomicBool>),
    mut request: Request<RequestBody<ReqBody>>,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    M: Mode<St>,
    S: Service<Request<RequestBody<ReqBody>>, Response = Response<ResBody>>,
    St: Store,
    Sc: Scope,
    F: Fingerprinter,
    P: StorePolicy,
    ResBody: Body + Send + 'static,
{
    let settings = &config.settings;
    let (id, token, fingerprint) = (claim.record_id(), claim.token, claim.fingerprint);
    // 1. The claim, or a repeat's wait: the hold, or the answer (422, 409,
    //    the replay, 503). `claimed_at` is when the answering claim was
    //    sent: a repeat that waited and then claimed has a lease from its
    //    own claim, not from its arrival.
    let (claimed_at, claimed) =
        claim_or_wait::<M, _>(&store, settings, claim, waiting_bytes, &abandoned).await;
    let (hold, taken_over) = match held_or_answer(settings, &id, &fingerprint, claimed) {
        Ok(held) => held,
        Err(answer) => return Ok(answer),
    };
    // 2. No live record, and first sent longer ago than the TTL: it may
    //    have run under a record that expired (`refuse_expired_retries`).
    if let Some(rejection) =
        first_sent::expired(settings, request.extensions()).filter(|_| !taken_over)
    {
        return Ok(give_back(settings, &id, hold, rejection).await);
    }
    // 3. The hold armed: on the request, renewed, and waking this key's
    //    waiters when it ends.
    let claim = (&store, (id.clone(), token), claimed_at, taken_over);
    let (hold, lease_end) = arm::<M, St, _>(settings, claim, hold, &mut request);
    let sealer = settings.keyring.clone().map(|keyring| Sealer {
        keyring,
        id: id.clone(),
        fingerprint,
    });
    // 4. The inner service.
    let response = match inner.call(request).await {
        Ok(response) => response,
        Err(e) => {
            release(hold).await;
            return Err(e);
        }
    };
    // 5. The record: completed with the response, or given back.
    Ok(finish::<M, St, _, _, _, _>(&config, &id, hold, lease_end, (response, sealer)).await)
}

/// Gives a claimed key back and answers `rejection`; the key's waiters
/// claim again at once.
async fn give_back<H: Hold, B: Body>(
    settings: &Settings,
    id: &RecordId,
    hold: H,
    rejection: Rejection,
) -> Response<ResponseBody<B>> {
    let _wake = settings.wait.clone().map(|waiting| WakeOnEnd {
        waiting,
        id: id.clone(),
    });
    if let Err(e) = timed(Operation::Release, hold.release()).await {
        tracing::error!(error = %e, "releasing the key failed; it stays in flight until its lease ends");
    }
    reject(settings, Some(id), Outcome::Rejected, rejection)
}

/// Puts the hold on the request (for the handler's extractors) with the
/// marker field removed, starts its renewal and its wake-up of waiters,
/// and says when a streamed first response must end: within the lease, or
/// the max hold when the lease is renewed (counted from the claim, less a
/// margin), or it is recorded as not stored (see `finish_stream`).
fn arm<M: Mode<St>, St: Store, B>(
    settings: &Settings,
    claim: (&St, (RecordId, FencingToken), Instant, bool),
    hold: M::Hold,
    request: &mut Request<B>,
) -> (renew::Renewed<M::Hold>, Instant) {
    let (id, claimed_at) = (claim.1.0.clone(), claim.2);
    request.headers_mut().remove(&settings.marker);
    hold.attach(request.extensions_mut());
    // The end of the hold, however it ends, wakes this key's waiters.
    let wake = settings
        .wait
        .clone()
        .map(|waiting| WakeOnEnd { waiting, id });
    let claimed = request.extensions_mut().get_mut::<ClaimedKey>();
    let renewal = renew_and_confirm::<M, St>(settings, claim, claimed, hold.renews());
    let mut lease_end = claimed_at + stream_deadline(settings.lease);
    if renewal.is_some() {
        // Renewed until the record is finished, but never past the max hold
        // (and never less than the first lease).
        lease_end = lease_end.max(claimed_at + stream_deadline(settings.max_hold));
    }
    let hold = renew::Renewed {
        hold,
        renewal,
        wake,
    };
    (hold, lease_end)
}

/// What becomes of the record once the handler has answered: kept in
/// flight (the handler cannot tell whether its effect happened), given
/// back (`DoNotStore`, or a response the policy does not store), or
/// completed with the response, sealed if the layer seals.
async fn finish<M: Mode<St>, St: Store, Sc: Scope, F: Fingerprinter, P: StorePolicy, B>(
    config: &Arc<Config<Sc, F, P>>,
    id: &RecordId,
    mut hold: renew::Renewed<M::Hold>,
    lease_end: Instant,
    (response, sealer): (Response<B>, Option<Sealer>),
) -> Response<ResponseBody<B>>
where
    B: Body + Send + 'static,
{
    let settings = &config.settings;
    // "It may have happened": neither stored nor given back.
    if response.extensions().get::<OutcomeUnknown>().is_some() {
        return outcome_unknown::<M, St, _>(settings, id, hold).await;
    }
    // The handler's `DoNotStore` ("nothing happened") overrides the policy.
    if response.extensions().get::<DoNotStore>().is_some()
        || !config
            .policy
            .should_store(response.status(), response.headers())
    {
        release(hold).await;
        let (mut parts, body) = response.into_parts();
        parts.headers.remove(&settings.marker);
        return Response::from_parts(parts, ResponseBody::inner(body));
    }
    hold.answered();
    let mut response = store_response(hold, config, lease_end, response, sealer).await;
    first_sent::advertise(settings, response.headers_mut());
    response
}

/// What the claim answered: the hold (and whether it took a lapsed lease
/// over), or the client's answer: 422, 409, the replay, or 503.
// The answer is moved once, to the caller that returns it: no chain of `?`.
#[allow(clippy::result_large_err)]
fn held_or_answer<H, B: Body>(
    settings: &Settings,
    id: &RecordId,
    fingerprint: &Fingerprint,
    claimed: Result<Result<(H, bool), Refusal>, StoreError>,
) -> Result<(H, bool), Response<ResponseBody<B>>> {
    match claimed {
        Ok(Ok((hold, taken_over))) => {
            telemetry::claim(if taken_over { "taken_over" } else { "acquired" });
            if taken_over {
                settings.hooks.emit(EventKind::TakenOver, Some(id));
            }
            Ok((hold, taken_over))
        }
        Ok(Err(Refusal::Mismatch)) => {
            telemetry::claim("mismatch");
            Err(reject(
                settings,
                Some(id),
                Outcome::Mismatch,
                Rejection::Mismatch,
            ))
        }
        Ok(Err(Refusal::InFlight { lease_remaining })) => {
            telemetry::claim("in_flight");
            let retry_after_secs = retry_after_secs(
                lease_remaining,
                settings.lease,
                settings.in_flight_retry_after,
            );
            let rejection = Rejection::InFlight { retry_after_secs };
            Err(reject(settings, Some(id), Outcome::InFlight, rejection))
        }
        Ok(Err(Refusal::Completed(stored))) => {
            telemetry::claim("replayed");
            Err(replay_record(settings, id, fingerprint, stored))
        }
        Err(e) => {
            telemetry::claim("store_error");
            tracing::error!(error = %e, "idempotency store failed to claim; answering 503");
            let rejection = Rejection::store_failed(&e, STORE_RETRY_AFTER_SECS);
            Err(reject(settings, Some(id), Outcome::StoreError, rejection))
        }
    }
}

/// Starts renewing the claim's lease while the request runs (where the
/// claim is committed before the handler, up to the max hold), and
/// arms the request's [`ClaimedKey`] with what the store said of the claim
/// and the means to confirm it ([`ClaimedKey::confirm`]).
fn renew_and_confirm<M: Mode<St>, St: Store>(
    settings: &Settings,
    (store, (id, token), claimed_at, taken_over): (&St, (RecordId, FencingToken), Instant, bool),
    claimed: Option<&mut ClaimedKey>,
    renews: bool,
) -> Option<renew::Renewal> {
    let claimed = claimed?;
    // The longest the claim may hold: its max hold (renewed up to it, or a
    // transaction the store ends there).
    let hold_end = claimed_at + settings.max_hold;
    let confirmer = if <M::Hold as Hold>::ATOMIC {
        renew::Confirmer::atomic(hold_end)
    } else {
        let lease = settings.lease;
        // The claim holds one lease from before it was sent.
        claimed.lease_signal().confirmed(claimed_at + lease);
        let claim = (id.clone(), token);
        renew::Confirmer::renewing(
            store.clone(),
            claim,
            lease,
            hold_end,
            claimed.lease_signal(),
        )
    };
    claimed.claimed(taken_over, confirmer);
    // Renewed until the record is completed or released. A transactional
    // store confirmed its claim within the last third of a lease however
    // long its transaction waited for a connection (`kit::two_phase`).
    let lease = settings.lease;
    let mut confirmed_until = claimed_at + lease;
    if <M::Hold as Hold>::ATOMIC {
        confirmed_until = confirmed_until.max(Instant::now() + (lease - lease / 3));
    }
    renews.then(|| {
        settings.renewer.register(renew::Claimed {
            id,
            token,
            lease,
            at: claimed_at,
            confirmed_until,
            max_hold: settings.max_hold,
            signal: claimed.lease_signal(),
            hooks: settings.hooks.clone(),
        })
    })
}

/// The answer to a request whose handler could not tell whether its effect
/// happened ([`OutcomeUnknown`]): in separate mode the key is kept in
/// flight until its lease ends (the hold is disarmed, its renewal stopped);
/// in transactional mode the transaction rolls back. Either way 503
/// `outcome-unknown`, `Retry-After` one lease.
async fn outcome_unknown<M: Mode<St>, St: Store, B: Body>(
    settings: &Settings,
    id: &RecordId,
    mut hold: renew::Renewed<M::Hold>,
) -> Response<ResponseBody<B>> {
    tracing::warn!(
        "the handler could not tell whether its effect happened; the key is kept until its lease ends"
    );
    if M::Hold::ATOMIC {
        release(hold).await;
    } else {
        hold.answered();
        drop(hold);
    }
    let lease = settings.lease;
    let retry_after_secs = lease.as_secs() + u64::from(lease.subsec_nanos() > 0);
    let rejection = Rejection::OutcomeUnknown {
        retry_after_secs: retry_after_secs.max(1),
    };
    reject(settings, Some(id), Outcome::OutcomeUnknown, rejection)
}

/// The answer of one claim, and the instant it was sent.
type Claimed<M, St> = (
    tokio::time::Instant,
    Result<Result<(<M as Mode<St>>::Hold, bool), Refusal>, StoreError>,
);

/// The atomic claim; a repeat that meets its key in flight, when the layer
/// lets repeats wait (`wait_in_flight`), claims again until the key is no
/// longer in flight or its wait is over (see [`crate::wait`]). Answers with
/// the instant the answering claim was sent (a claim acquired after a wait
/// has its lease from then).
async fn claim_or_wait<M: Mode<St>, St: Store>(
    store: &St,
    settings: &Settings,
    claim: ClaimRequest,
    waiting_bytes: usize,
    abandoned: &AtomicBool,
) -> Claimed<M, St> {
    let Some(waiting) = &settings.wait else {
        // No waiting: one claim, and the request's own copy goes to it.
        let sent = tokio::time::Instant::now();
        return (sent, timed(Operation::Claim, M::claim(store, claim)).await);
    };
    // The bound counts from the first claim. The first claim never waits;
    // a repeat that it finds in flight takes a place among the layer's
    // waiters, and only then may its claims wait inside a store that can
    // (`ClaimRequest::wait_in_flight`): the cap counts every waiting repeat.
    let deadline = tokio::time::Instant::now() + waiting.bound;
    let claim_waiting = |wait: bool| {
        let sent = tokio::time::Instant::now();
        let wait = match wait {
            true => deadline.saturating_duration_since(sent),
            false => std::time::Duration::ZERO,
        };
        let claim = claim.clone().with_wait_in_flight(wait);
        let answer = timed(Operation::Claim, M::claim(store, claim));
        async move { (sent, answer.await) }
    };
    let first = claim_waiting(false).await;
    let Ok(Err(Refusal::InFlight { .. })) = &first.1 else {
        return first;
    };
    let id = claim.record_id();
    let Some(waiter) = waiting.enter(&id, waiting_bytes) else {
        telemetry::wait("full");
        return first;
    };
    let once = || claim_waiting(true);
    // Watched before the next claim, so that its change is not missed.
    let watch = store.watch(&id);
    let in_flight = |(_, answer): &Claimed<M, St>| match answer {
        Ok(Err(Refusal::InFlight { lease_remaining })) => Some(*lease_remaining),
        _ => None,
    };
    match waiter
        .claim_until(
            deadline,
            abandoned,
            (watch.as_ref(), settings.signalled_poll),
            once,
            in_flight,
        )
        .await
    {
        // The caller went away while the claim that won the key was under
        // way: nothing has run, so the key is given back (and its other
        // waiters woken) rather than run for nobody.
        Ok((_, Ok(Ok((hold, _))))) if abandoned.load(std::sync::atomic::Ordering::Relaxed) => {
            telemetry::wait("timed_out");
            let wake = WakeOnEnd {
                waiting: waiting.clone(),
                id: id.clone(),
            };
            release(hold).await;
            drop(wake);
            first
        }
        Ok(answer) => {
            telemetry::wait("woken");
            answer
        }
        Err(last) => {
            telemetry::wait("timed_out");
            last.unwrap_or(first)
        }
    }
}

/// The answer to a repeat of the completed record `id`, met by a request
/// with `fingerprint`: the record opened (if it was sealed at rest, see
/// [`crate::seal`]) and replayed, or 410 if its body was not stored. A
/// sealed record that no configured key opens is never replayed: it is
/// logged at ERROR, counted, and answered 503, as a corrupt record is. Every
/// path that replays a stored record goes through here.
pub(crate) fn replay_record<B: Body>(
    settings: &Settings,
    id: &RecordId,
    fingerprint: &Fingerprint,
    stored: StoredResponse,
) -> Response<ResponseBody<B>> {
    match seal::open(settings.keyring.as_ref(), id, fingerprint, stored) {
        Ok(stored) => replay(settings, id, &stored),
        Err(e) => {
            telemetry::unopened();
            tracing::error!(error = %e, "a stored response did not open and is never replayed; answering 503");
            let retry_after_secs = STORE_RETRY_AFTER_SECS;
            reject(
                settings,
                Some(id),
                Outcome::StoreError,
                Rejection::RecordSealed { retry_after_secs },
            )
        }
    }
}

/// The replay of an open record (or 410 if its body was not stored).
fn replay<B: Body>(
    settings: &Settings,
    id: &RecordId,
    stored: &StoredResponse,
) -> Response<ResponseBody<B>> {
    if stored.body == StoredBody::Omitted {
        return reject(
            settings,
            Some(id),
            Outcome::NotStored,
            Rejection::ResponseNotStored,
        );
    }
    telemetry::outcome(Outcome::Replayed);
    let trailers = stored.trailer_map();
    let mut response = stored
        .replay(&settings.marker)
        .map(|body| ResponseBody::full(body, trailers));
    first_sent::advertise(settings, response.headers_mut());
    let status = response.status();
    settings.hooks.replayed(id, status, response.headers_mut());
    response
}
