//! The first response's record: read whole and stored before the answer
//! (transactional mode, and bodies ready at once), or streamed to the caller
//! through a [`tee`](crate::tee) and stored at its end (separate mode).

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Response};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use tracing::Instrument;

use crate::body::ResponseBody;
use crate::config::{Config, Settings};
use crate::fingerprint::Fingerprinter;
use crate::mode::Hold;
use crate::policy::StorePolicy;
use crate::problem::{Rejection, STORE_RETRY_AFTER_SECS};
use crate::response::{StoredBody, StoredResponse};
use crate::scope::Scope;
use crate::seal::Sealer;
use crate::store::{Completion, StoreError};
use crate::tee::{self, Ending, Recorder, frame_to_bytes};
use crate::telemetry::{self, Operation, Outcome, timed};

/// Reads the first response's body and completes the record.
///
/// In transactional mode (an atomic hold) the record commits before the
/// answer: the whole body is read up to the response limit first, and if the
/// commit fails the first caller gets 503 instead, since nothing happened.
///
/// In separate mode the frames the inner body has ready at once are read
/// first; a body that ends (or passes the limit) without waiting completes
/// the record before the head goes out, as a buffered response always did.
/// The first time the body would wait, the head goes out at once and the
/// rest streams through a [`tee`](crate::tee), which records it as it passes
/// and completes the record at its end (see `finish_stream`).
pub(crate) async fn store_response<H: Hold, Sc: Scope, F: Fingerprinter, P: StorePolicy, B>(
    mut hold: H,
    config: &Arc<Config<Sc, F, P>>,
    lease_end: tokio::time::Instant,
    response: Response<B>,
    sealer: Option<Sealer>,
) -> Response<ResponseBody<B>>
where
    B: Body + Send + 'static,
{
    let settings = &config.settings;
    let (mut parts, body) = response.into_parts();
    parts.headers.remove(&settings.marker);
    let mut body = Box::pin(body);
    // The recorder of a streamed body runs in a task of its own.
    let runtime = if H::ATOMIC {
        None
    } else {
        tokio::runtime::Handle::try_current().ok()
    };
    let mut frames = VecDeque::new();
    let mut size = 0usize;
    let stored_body = loop {
        let next = match &runtime {
            Some(runtime) => match std::future::poll_fn(|cx| {
                Poll::Ready(ready_now(body.as_mut().poll_frame(cx)))
            })
            .await
            {
                Some(next) => next,
                // The body would wait: stream it from here.
                None => {
                    let read = (frames, size, body);
                    return stream_from_here(
                        hold,
                        config,
                        runtime,
                        (parts, read),
                        (lease_end, sealer),
                    );
                }
            },
            None if H::ATOMIC => match atomic_frame(&mut hold, body.as_mut(), lease_end).await {
                Some(next) => next,
                None => return rolled_back_mid_body(settings, hold),
            },
            None => body.frame().await,
        };
        match next {
            None => break StoredBody::Complete(concat(&frames, size)),
            Some(Ok(frame)) => {
                let frame = frame_to_bytes(frame);
                size += frame.data_ref().map_or(0, Bytes::len);
                frames.push_back(frame);
                if size > settings.max_response_body {
                    break StoredBody::Omitted;
                }
            }
            Some(Err(e)) => {
                // No response can be stored. Separate mode keeps the key in
                // flight (the effect may exist; the lease decides);
                // transactional mode rolls the effect back.
                tracing::warn!("the response body failed before it was stored");
                telemetry::outcome(Outcome::ResponseFailed);
                drop(hold);
                return Response::from_parts(parts, ResponseBody::then_error(frames, e));
            }
        }
    };
    complete_then_answer(hold, config, (parts, frames, body), stored_body, sealer).await
}

/// The frames read so far, their size in bytes, and the rest of the body.
type ReadSoFar<B> = (VecDeque<Frame<Bytes>>, usize, Pin<Box<B>>);

/// The rest of a body that would wait, streamed to the caller through a
/// [`tee`](crate::tee) whose recorder completes the record at its end, in a
/// task of its own on `runtime` (`finish_stream`).
fn stream_from_here<H: Hold, Sc: Scope, F: Fingerprinter, P: StorePolicy, B>(
    hold: H,
    config: &Arc<Config<Sc, F, P>>,
    runtime: &tokio::runtime::Handle,
    (parts, (frames, size, body)): (http::response::Parts, ReadSoFar<B>),
    (lease_end, sealer): (tokio::time::Instant, Option<Sealer>),
) -> Response<ResponseBody<B>>
where
    B: Body + Send + 'static,
{
    let (tee, recorder) = tee::tee(frames, size, body, config.settings.max_response_body);
    let finish = finish_stream(
        hold,
        config.clone(),
        parts.status,
        parts.headers.clone(),
        recorder,
        lease_end,
        sealer,
    );
    drop(runtime.spawn(finish.in_current_span()));
    Response::from_parts(parts, ResponseBody::teeing(tee))
}

/// The transaction ended (rolled back past its max hold time) or the lease
/// is near its end while the body is still running: nothing of it will
/// commit, 503.
fn rolled_back_mid_body<H: Hold, B: Body>(
    settings: &Settings,
    hold: H,
) -> Response<ResponseBody<B>> {
    tracing::warn!(
        "the response did not end before its transaction did; rolled back, answering 503"
    );
    telemetry::outcome(Outcome::StoreError);
    drop(hold);
    let retry_after_secs = STORE_RETRY_AFTER_SECS;
    settings.rejection_response(&Rejection::HeldTooLong { retry_after_secs }, None)
}

/// Completes the record with the body read whole (or omitted past the
/// limit), then answers: the frames read (and the rest of an omitted body),
/// or 503 when a transactional commit failed.
async fn complete_then_answer<H: Hold, Sc: Scope, F: Fingerprinter, P: StorePolicy, B>(
    hold: H,
    config: &Arc<Config<Sc, F, P>>,
    (parts, frames, body): (http::response::Parts, VecDeque<Frame<Bytes>>, Pin<Box<B>>),
    stored_body: StoredBody,
    sealer: Option<Sealer>,
) -> Response<ResponseBody<B>>
where
    B: Body + Send + 'static,
{
    let settings = &config.settings;
    let trailers = frames.iter().find_map(|f| f.trailers_ref()).cloned();
    let omitted = stored_body == StoredBody::Omitted;
    let head = (parts.status, &parts.headers);
    if let Err(failed) = complete_record(
        hold,
        settings,
        &config.policy,
        head,
        stored_body,
        trailers.as_ref(),
        sealer.as_ref(),
    )
    .await
    {
        let rejection = Rejection::store_failed(&failed.0, STORE_RETRY_AFTER_SECS);
        return settings.rejection_response(&rejection, None);
    }
    let body = if omitted {
        ResponseBody::then_rest(frames, body)
    } else {
        ResponseBody::frames(frames)
    };
    Response::from_parts(parts, body)
}

/// The body's next frame in transactional mode, or `None` if the hold's
/// transaction ends first (see [`Hold::ended`]) or `deadline` passes: the
/// commit must come before the answer, so a body that outlives its
/// transaction can only be answered 503.
async fn atomic_frame<H: Hold, B: Body>(
    hold: &mut H,
    mut body: Pin<&mut B>,
    deadline: tokio::time::Instant,
) -> Option<Option<Result<Frame<B::Data>, B::Error>>> {
    let ended = hold.ended();
    let sleep = tokio::time::sleep_until(deadline);
    let mut ended = std::pin::pin!(ended);
    let mut sleep = std::pin::pin!(sleep);
    std::future::poll_fn(|cx| {
        if let Poll::Ready(frame) = body.as_mut().poll_frame(cx) {
            return Poll::Ready(Some(frame));
        }
        if ended.as_mut().poll(cx).is_ready() || sleep.as_mut().poll(cx).is_ready() {
            return Poll::Ready(None);
        }
        Poll::Pending
    })
    .await
}

/// A poll's result if it is ready now, `None` if it would wait.
fn ready_now<T>(poll: Poll<T>) -> Option<T> {
    match poll {
        Poll::Ready(value) => Some(value),
        Poll::Pending => None,
    }
}

/// The atomic commit failed: nothing happened, and the first caller gets 503.
struct CommitFailed(StoreError);

/// Completes the record with `body` (or releases it, if the policy declines
/// the trailers), sealed by `sealer` if there is one, and records the
/// outcome. `Err` only when an atomic commit failed; a separate completion
/// that fails leaves the key in flight until its lease ends, and is logged.
async fn complete_record<H: Hold, P: StorePolicy>(
    hold: H,
    settings: &Settings,
    policy: &P,
    (status, headers): (http::StatusCode, &HeaderMap),
    body: StoredBody,
    trailers: Option<&HeaderMap>,
    sealer: Option<&Sealer>,
) -> Result<(), CommitFailed> {
    if trailers.is_some_and(|t| !policy.should_store_trailers(t)) {
        // E.g. a transient `grpc-status` in the trailers: a retry runs again.
        release(hold).await;
        return Ok(());
    }
    // Refused by an axum extractor before the handler ran: nothing
    // happened, so the corrected request may keep the key.
    #[cfg(feature = "axum")]
    if let StoredBody::Complete(bytes) = &body
        && crate::policy::is_axum_rejection(status, headers, bytes)
    {
        release(hold).await;
        return Ok(());
    }
    let omitted = body == StoredBody::Omitted;
    let stored = StoredResponse::capture_with_marker(
        status,
        headers,
        body,
        trailers,
        Some(&settings.marker),
    );
    // Sealed here, once, whatever the store: it keeps only the ciphertext.
    let stored = match sealer.map(|sealer| sealer.seal(&stored)).transpose() {
        Ok(sealed) => sealed.unwrap_or(stored),
        Err(e) => {
            telemetry::outcome(Outcome::StoreError);
            drop(hold);
            if H::ATOMIC {
                tracing::error!(error = %e, "sealing the response failed; rolled back; answering 503");
                return Err(CommitFailed(StoreError::unavailable(e)));
            }
            tracing::error!(error = %e, "sealing the response failed; nothing stored; the key stays in flight until its lease ends");
            return Ok(());
        }
    };
    match timed(Operation::Complete, hold.complete(stored)).await {
        Ok(Completion::Stored) => {
            telemetry::outcome(if omitted {
                Outcome::CompletedWithoutBody
            } else {
                Outcome::Completed
            });
        }
        Ok(Completion::Fenced) => {
            telemetry::outcome(Outcome::Fenced);
            tracing::warn!(
                "the lease ended and another request took the key over; this response was not stored"
            );
        }
        Err(e) if H::ATOMIC => {
            telemetry::outcome(Outcome::StoreError);
            tracing::error!(error = %e, "committing the request failed; nothing happened; answering 503");
            return Err(CommitFailed(e));
        }
        Err(e) => {
            telemetry::outcome(Outcome::StoreError);
            tracing::error!(error = %e, "storing the response failed; the key stays in flight until its lease ends");
        }
    }
    Ok(())
}

/// Completes the record of a streamed first response (separate mode), in a
/// task of its own, once the stream has ended for its caller:
///
/// - the body ended within the response limit: the record completes with
///   it (and its trailers), so repeats get the byte-identical replay; the
///   caller sees the end of the stream only after that write;
/// - the body grew past the limit: the record completes without the body
///   at once (repeats get 410) and the caller still gets every byte;
/// - the caller went away before the end: its body, and with it the inner
///   body, was dropped, so nothing reads the stream any more. The handler's
///   effect happened, but no complete response exists: the record completes
///   without the body (repeats get 410), never released for a second run;
/// - the stream was still running near the lease's end
///   ([`stream_deadline`]): recorded the same way, so a repeat gets 410
///   rather than taking the key over and running the handler a second time
///   beside the first stream;
/// - the inner body failed: the key stays in flight until its lease ends
///   (the effect may exist), as for a buffered body.
///
/// A store error here cannot reach the caller, who has its bytes already:
/// it is logged and the key stays in flight until its lease ends.
async fn finish_stream<H: Hold, Sc, F, P: StorePolicy>(
    hold: H,
    config: Arc<Config<Sc, F, P>>,
    status: http::StatusCode,
    headers: HeaderMap,
    mut recorder: Recorder,
    lease_end: tokio::time::Instant,
    sealer: Option<Sealer>,
) {
    let settings = &config.settings;
    let (body, trailers) = match tokio::time::timeout_at(lease_end, recorder.ending()).await {
        Ok(Ok(Ending::Complete { body, trailers })) => (StoredBody::Complete(body), trailers),
        Ok(Ok(Ending::OverLimit)) => (StoredBody::Omitted, None),
        Ok(Ok(Ending::Failed)) => {
            tracing::warn!("the streamed response body failed before it was stored");
            telemetry::outcome(Outcome::ResponseFailed);
            drop(hold);
            recorder.finished();
            return;
        }
        Ok(Err(_)) => {
            tracing::info!(
                "the client left before the streamed response ended; recording it as not stored"
            );
            (StoredBody::Omitted, None)
        }
        Err(_) => {
            tracing::warn!("the streamed response outlived the lease; recording it as not stored");
            recorder.stop();
            (StoredBody::Omitted, None)
        }
    };
    let head = (status, &headers);
    // Not atomic: `complete_record` logs a failure and never answers `Err`.
    let _ = complete_record(
        hold,
        settings,
        &config.policy,
        head,
        body,
        trailers.as_ref(),
        sealer.as_ref(),
    )
    .await;
    recorder.finished();
}

/// How long after the claim a streamed first response may run before it is
/// recorded as not stored: the lease less a margin of a tenth of it, at
/// most 5 s. The record must say "not stored" before the store sees the
/// lease end, or a repeat in between would take the key over and run the
/// handler a second time beside the live stream; the margin covers the
/// completion's write and the gap between this process's timer and the
/// store's clock.
pub(crate) fn stream_deadline(lease: std::time::Duration) -> std::time::Duration {
    lease - (lease / 10).min(std::time::Duration::from_secs(5))
}

/// The data frames' bytes as one buffer (no copy when there is one frame).
fn concat(frames: &VecDeque<Frame<Bytes>>, size: usize) -> Bytes {
    let mut data = frames.iter().filter_map(Frame::data_ref);
    match (data.next(), data.next()) {
        (None, _) => Bytes::new(),
        (Some(only), None) => only.clone(),
        _ => {
            let mut out = BytesMut::with_capacity(size);
            for chunk in frames.iter().filter_map(Frame::data_ref) {
                out.extend_from_slice(chunk);
            }
            out.freeze()
        }
    }
}

/// Gives the key back (a retry runs again) and records it.
pub(crate) async fn release<H: Hold>(hold: H) {
    match timed(Operation::Release, hold.release()).await {
        Ok(()) => telemetry::outcome(Outcome::Released),
        Err(e) => {
            telemetry::outcome(Outcome::StoreError);
            tracing::error!(error = %e, "releasing the key failed; it stays in flight until its lease ends");
        }
    }
}
