//! The request body the inner service sees, and the response body the layer
//! returns.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Limited};
use pin_project_lite::pin_project;

use crate::problem::Rejection;
use crate::tee::{Tee, frame_to_bytes};

pin_project! {
    /// The inner service's request body: the caller's body untouched when the
    /// request passes through, or the bytes the layer buffered (to fingerprint
    /// them) for a request with a key. Either way the inner service receives
    /// exactly the bytes the client sent.
    pub struct RequestBody<B> {
        #[pin]
        kind: RequestKind<B>,
    }
}

pin_project! {
    #[project = RequestBodyProj]
    enum RequestKind<B> {
        Inner { #[pin] body: B },
        Buffered { data: Option<Bytes>, trailers: Option<HeaderMap> },
    }
}

impl<B> RequestBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        RequestBody {
            kind: RequestKind::Inner { body },
        }
    }

    pub(crate) fn buffered(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        RequestBody {
            kind: RequestKind::Buffered {
                data: Some(data).filter(|d| !d.is_empty()),
                trailers,
            },
        }
    }
}

impl<B> Body for RequestBody<B>
where
    B: Body,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            RequestBodyProj::Inner { body } => body
                .poll_frame(cx)
                .map_ok(|frame| frame.map_data(|mut d| d.copy_to_bytes(d.remaining()))),
            RequestBodyProj::Buffered { data, trailers } => Poll::Ready(
                data.take()
                    .map(Frame::data)
                    .or_else(|| trailers.take().map(Frame::trailers))
                    .map(Ok),
            ),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            RequestKind::Inner { body } => body.is_end_stream(),
            RequestKind::Buffered { data, trailers } => data.is_none() && trailers.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            RequestKind::Inner { body } => body.size_hint(),
            RequestKind::Buffered { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

pin_project! {
    /// The layer's response body: the inner service's body untouched (pass
    /// through, and responses the policy releases), or frames the layer holds
    /// (replays, rejections, stored first responses), possibly followed by
    /// the rest of the inner body (a first response larger than the response
    /// limit) or by the error that cut it short.
    pub struct ResponseBody<B: Body> {
        #[pin]
        kind: ResponseKind<B>,
    }
}

pin_project! {
    #[project = ResponseBodyProj]
    enum ResponseKind<B: Body> {
        Inner { #[pin] body: B },
        Buffered {
            frames: VecDeque<Frame<Bytes>>,
            rest: Option<Pin<Box<B>>>,
            error: Option<B::Error>,
        },
        Teeing { tee: Tee<B> },
    }
}

impl<B: Body> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        ResponseBody {
            kind: ResponseKind::Inner { body },
        }
    }

    pub(crate) fn full(data: Bytes, trailers: Option<HeaderMap>) -> Self {
        let mut frames = VecDeque::with_capacity(2);
        if !data.is_empty() {
            frames.push_back(Frame::data(data));
        }
        if let Some(trailers) = trailers {
            frames.push_back(Frame::trailers(trailers));
        }
        Self::frames(frames)
    }

    pub(crate) fn frames(frames: VecDeque<Frame<Bytes>>) -> Self {
        ResponseBody {
            kind: ResponseKind::Buffered {
                frames,
                rest: None,
                error: None,
            },
        }
    }

    pub(crate) fn then_rest(frames: VecDeque<Frame<Bytes>>, rest: Pin<Box<B>>) -> Self {
        ResponseBody {
            kind: ResponseKind::Buffered {
                frames,
                rest: Some(rest),
                error: None,
            },
        }
    }

    pub(crate) fn then_error(frames: VecDeque<Frame<Bytes>>, error: B::Error) -> Self {
        ResponseBody {
            kind: ResponseKind::Buffered {
                frames,
                rest: None,
                error: Some(error),
            },
        }
    }

    /// The first response in separate mode: streamed, and recorded by `tee`.
    pub(crate) fn teeing(tee: Tee<B>) -> Self {
        ResponseBody {
            kind: ResponseKind::Teeing { tee },
        }
    }
}

impl<B: Body> Body for ResponseBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project().kind.project() {
            ResponseBodyProj::Inner { body } => body.poll_frame(cx).map_ok(frame_to_bytes),
            ResponseBodyProj::Buffered {
                frames,
                rest,
                error,
            } => {
                if let Some(frame) = frames.pop_front() {
                    return Poll::Ready(Some(Ok(frame)));
                }
                if let Some(e) = error.take() {
                    return Poll::Ready(Some(Err(e)));
                }
                match rest {
                    Some(body) => body.as_mut().poll_frame(cx).map_ok(frame_to_bytes),
                    None => Poll::Ready(None),
                }
            }
            ResponseBodyProj::Teeing { tee } => tee.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ResponseKind::Inner { body } => body.is_end_stream(),
            ResponseKind::Buffered {
                frames,
                rest,
                error,
            } => {
                frames.is_empty()
                    && error.is_none()
                    && rest.as_ref().is_none_or(|b| b.is_end_stream())
            }
            ResponseKind::Teeing { tee } => tee.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ResponseKind::Inner { body } => body.size_hint(),
            ResponseKind::Buffered { frames, rest, .. } => {
                let held: u64 = frames
                    .iter()
                    .filter_map(|f| f.data_ref().map(|d| d.len() as u64))
                    .sum();
                match rest {
                    None => SizeHint::with_exact(held),
                    Some(body) => {
                        let more = body.size_hint();
                        let mut hint = SizeHint::new();
                        hint.set_lower(held + more.lower());
                        if let Some(upper) = more.upper() {
                            hint.set_upper(held + upper);
                        }
                        hint
                    }
                }
            }
            ResponseKind::Teeing { tee } => tee.size_hint(),
        }
    }
}

impl<B> std::fmt::Debug for RequestBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.kind {
            RequestKind::Inner { .. } => "inner",
            RequestKind::Buffered { .. } => "buffered",
        };
        f.debug_struct("RequestBody").field("kind", &kind).finish()
    }
}

impl<B: Body> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.kind {
            ResponseKind::Inner { .. } => "inner",
            ResponseKind::Buffered { .. } => "buffered",
            ResponseKind::Teeing { .. } => "streamed",
        };
        f.debug_struct("ResponseBody").field("kind", &kind).finish()
    }
}

/// Buffers the request body up to `limit` bytes.
pub(crate) async fn buffer_request<B>(
    body: B,
    limit: usize,
) -> Result<(Bytes, Option<HeaderMap>), Rejection>
where
    B: Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(Rejection::BodyTooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => {
            let trailers = collected.trailers().cloned();
            Ok((collected.to_bytes(), trailers))
        }
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(Rejection::BodyTooLarge { limit })
        }
        Err(e) => Err(Rejection::UnreadableBody(format!(
            "the request body could not be read: {e}"
        ))),
    }
}
