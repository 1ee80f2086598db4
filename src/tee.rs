//! Streaming a first response to its caller while its body is recorded
//! (separate mode).
//!
//! [`Tee`] is the body the first caller reads: each frame of the inner
//! service's body goes out as soon as it is produced, and its data is copied
//! into a buffer for the record, up to the response limit. When the body
//! ends, the tee hands the recorded body to a [`Recorder`] (a task that
//! completes the record) and waits for its answer before it ends the stream
//! for the caller, so a caller that has read a response to its end finds its
//! record final. A tee dropped before the end (the client left) drops the
//! inner body with it: nothing polls the stream any more, and the recorder
//! learns it from the closed channel.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use tokio::sync::oneshot;

/// How a streamed body ended, as the tee tells the recorder.
#[derive(Debug)]
pub(crate) enum Ending {
    /// The whole body, within the limit, and its trailers if it had any.
    Complete {
        body: Bytes,
        trailers: Option<HeaderMap>,
    },
    /// The body grew past the response limit (sent as soon as it does;
    /// the caller still gets the rest).
    OverLimit,
    /// The inner body failed.
    Failed,
}

/// The recorder's side: how the stream ended, then the answer to the tee.
#[derive(Debug)]
pub(crate) struct Recorder {
    ending: oneshot::Receiver<Ending>,
    done: oneshot::Sender<()>,
}

impl Recorder {
    /// How the stream ended, or `Err` if the tee was dropped before its end
    /// (the client left mid-stream). Waits as long as the caller's body lives.
    pub(crate) async fn ending(&mut self) -> Result<Ending, oneshot::error::RecvError> {
        (&mut self.ending).await
    }

    /// Stops waiting for the end: the tee stops recording at its next frame.
    pub(crate) fn stop(&mut self) {
        self.ending.close();
    }

    /// Tells the tee the record is final, so it can end the stream.
    pub(crate) fn finished(self) {
        // The tee may be gone already; then nobody waits.
        let _ = self.done.send(());
    }
}

/// The data recorded so far, and the channel to the recorder.
#[derive(Debug)]
struct Recording {
    chunks: Vec<Bytes>,
    size: usize,
    limit: usize,
    ending: oneshot::Sender<Ending>,
}

impl Recording {
    /// Adds one data frame. `false` once the body has grown past the limit
    /// (the recorder is told, and nothing more is recorded).
    fn push(&mut self, data: &Bytes) -> bool {
        self.size = self.size.saturating_add(data.len());
        if self.size > self.limit {
            return false;
        }
        if !data.is_empty() {
            self.chunks.push(data.clone());
        }
        true
    }

    fn body(&mut self) -> Bytes {
        match self.chunks.len() {
            0 => Bytes::new(),
            1 => self.chunks.pop().unwrap_or_default(),
            _ => {
                let mut out = BytesMut::with_capacity(self.size);
                for chunk in &self.chunks {
                    out.extend_from_slice(chunk);
                }
                out.freeze()
            }
        }
    }

    fn send(self, ending: Ending) {
        // The recorder may have stopped waiting (the lease ended); then the
        // record is already final.
        let _ = self.ending.send(ending);
    }
}

/// The first caller's body in separate mode: the inner body, frame by
/// frame, with its data recorded up to the response limit.
pub(crate) struct Tee<B> {
    /// Frames read before the head was sent (already recorded).
    queued: VecDeque<Frame<Bytes>>,
    body: Pin<Box<B>>,
    recording: Option<Recording>,
    /// Resolves once the recorder has finished the record.
    done: Option<oneshot::Receiver<()>>,
    /// The body's end (its trailers, or `None`), held until the record is final.
    end: Option<Option<Frame<Bytes>>>,
    finished: bool,
}

impl<B> std::fmt::Debug for Tee<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tee")
            .field("queued", &self.queued.len())
            .field("recording", &self.recording.is_some())
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

/// A tee over `body`, which follows `queued` (frames already read and
/// recorded, `size` data bytes), and the recorder that completes the record.
pub(crate) fn tee<B>(
    queued: VecDeque<Frame<Bytes>>,
    size: usize,
    body: Pin<Box<B>>,
    limit: usize,
) -> (Tee<B>, Recorder) {
    let (ending_tx, ending_rx) = oneshot::channel();
    let (done_tx, done_rx) = oneshot::channel();
    let chunks = queued.iter().filter_map(Frame::data_ref).cloned().collect();
    let recording = Recording {
        chunks,
        size,
        limit,
        ending: ending_tx,
    };
    let tee = Tee {
        queued,
        body,
        recording: Some(recording),
        done: Some(done_rx),
        end: None,
        finished: false,
    };
    let recorder = Recorder {
        ending: ending_rx,
        done: done_tx,
    };
    (tee, recorder)
}

impl<B: Body> Tee<B> {
    /// The body has ended (with these trailers or none): hands the recorded
    /// body to the recorder, and holds the end until it answers.
    fn end_with(&mut self, trailers: Option<Frame<Bytes>>) {
        if let Some(mut recording) = self.recording.take() {
            let body = recording.body();
            let map = trailers.as_ref().and_then(Frame::trailers_ref).cloned();
            recording.send(Ending::Complete {
                body,
                trailers: map,
            });
        }
        self.end = Some(trailers);
    }

    pub(crate) fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        loop {
            if self.end.is_some() {
                if let Some(done) = self.done.as_mut() {
                    // Sent or dropped, the recorder is finished either way.
                    let _ = ready!(Pin::new(done).poll(cx));
                    self.done = None;
                }
                self.finished = true;
                return Poll::Ready(self.end.take().flatten().map(Ok));
            }
            if let Some(frame) = self.queued.pop_front() {
                return Poll::Ready(Some(Ok(frame)));
            }
            if self.finished {
                return Poll::Ready(None);
            }
            match ready!(self.body.as_mut().poll_frame(cx)) {
                Some(Ok(frame)) => {
                    let frame = frame_to_bytes(frame);
                    match frame.data_ref() {
                        Some(data) => {
                            self.record(data);
                            return Poll::Ready(Some(Ok(frame)));
                        }
                        // Trailers are a body's last frame.
                        None => self.end_with(Some(frame)),
                    }
                }
                Some(Err(e)) => {
                    if let Some(recording) = self.recording.take() {
                        recording.send(Ending::Failed);
                    }
                    self.finished = true;
                    return Poll::Ready(Some(Err(e)));
                }
                None => self.end_with(None),
            }
        }
    }

    fn record(&mut self, data: &Bytes) {
        let Some(recording) = self.recording.as_mut() else {
            return;
        };
        if recording.ending.is_closed() {
            // The recorder gave up waiting (the lease ended): stop copying.
            self.recording = None;
        } else if !recording.push(data)
            && let Some(recording) = self.recording.take()
        {
            recording.send(Ending::OverLimit);
        }
    }

    pub(crate) fn is_end_stream(&self) -> bool {
        self.finished && self.end.is_none() && self.queued.is_empty()
    }

    pub(crate) fn size_hint(&self) -> SizeHint {
        let held: u64 = self
            .queued
            .iter()
            .filter_map(|f| f.data_ref().map(|d| d.len() as u64))
            .sum();
        if self.finished {
            return SizeHint::with_exact(held);
        }
        let more = self.body.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(held.saturating_add(more.lower()));
        if let Some(upper) = more.upper() {
            hint.set_upper(held.saturating_add(upper));
        }
        hint
    }
}

/// A frame with its data as [`Bytes`].
pub(crate) fn frame_to_bytes<D: Buf>(frame: Frame<D>) -> Frame<Bytes> {
    frame.map_data(|mut d| d.copy_to_bytes(d.remaining()))
}
