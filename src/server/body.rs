//! The response body the layer returns.

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// The body of every response that passes through the layer: the inner service's own
    /// body (passed through untouched), a buffered one (recorded or replayed responses and
    /// the layer's errors), or a buffered prefix followed by the rest of the inner body (a
    /// response too large to record, streamed on to its client). A buffered body ends with
    /// the trailers it was recorded with, if any.
    ///
    /// A service in front of the layer that answers by itself can build one with
    /// [`full`](Self::full).
    #[derive(Debug)]
    pub struct ResponseBody<B> {
        prefix: Option<Bytes>,
        #[pin]
        rest: Option<B>,
        // The rest of a body read in part (boxed to be read in place).
        spilled: Option<Pin<Box<B>>>,
        // Boxed: rare outside gRPC, and every response moves this struct several times.
        trailers: Option<Box<HeaderMap>>,
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self {
            prefix: None,
            rest: Some(body),
            spilled: None,
            trailers: None,
        }
    }

    /// A body of `bytes`, whole.
    pub fn full(bytes: impl Into<Bytes>) -> Self {
        Self {
            prefix: Some(bytes.into()),
            rest: None,
            spilled: None,
            trailers: None,
        }
    }

    /// A body of `bytes` followed by `trailers` (none when `None` or empty).
    pub fn with_trailers(bytes: impl Into<Bytes>, trailers: Option<HeaderMap>) -> Self {
        Self::with_boxed_trailers(bytes, trailers.map(Box::new))
    }

    /// [`with_trailers`](Self::with_trailers) of trailers already boxed, as a record keeps
    /// them.
    pub(crate) fn with_boxed_trailers(
        bytes: impl Into<Bytes>,
        trailers: Option<Box<HeaderMap>>,
    ) -> Self {
        Self {
            prefix: Some(bytes.into()),
            rest: None,
            spilled: None,
            trailers: trailers.filter(|trailers| !trailers.is_empty()),
        }
    }

    /// The body [`inner`](Self::inner) wrapped, when that is all this is.
    #[cfg(feature = "client")]
    pub(crate) fn into_inner(self) -> Result<B, Self> {
        match self {
            Self {
                prefix: None,
                rest: Some(rest),
                spilled: None,
                trailers: None,
            } => Ok(rest),
            other => Err(other),
        }
    }

    pub(crate) fn spliced(prefix: Bytes, rest: Pin<Box<B>>) -> Self {
        Self {
            prefix: Some(prefix),
            rest: None,
            spilled: Some(rest),
            trailers: None,
        }
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.project();
        if let Some(prefix) = this.prefix.take().filter(|p| !p.is_empty()) {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        if let Some(rest) = this.rest.as_pin_mut() {
            return rest.poll_frame(cx);
        }
        if let Some(spilled) = this.spilled {
            return spilled.as_mut().poll_frame(cx);
        }
        Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(*t))))
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.as_ref().is_none_or(Bytes::is_empty)
            && self.rest.as_ref().is_none_or(Body::is_end_stream)
            && self
                .spilled
                .as_ref()
                .is_none_or(|rest| rest.is_end_stream())
            && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        let prefix = self.prefix.as_ref().map_or(0, |p| p.len() as u64);
        let rest = match (&self.rest, &self.spilled) {
            (Some(rest), _) => rest.size_hint(),
            (None, Some(spilled)) => spilled.size_hint(),
            (None, None) => SizeHint::with_exact(0),
        };
        let mut hint = SizeHint::new();
        // Upper first: set_lower asserts it stays at or below the upper bound. None for a
        // body that ends with trailers: HTTP/1.1 sends them only in chunked encoding, which
        // an exact size would rule out (hyper would send `Content-Length` and drop them).
        if let Some(upper) = rest.upper().filter(|_| self.trailers.is_none()) {
            hint.set_upper(upper + prefix);
        }
        hint.set_lower(rest.lower() + prefix);
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};

    #[tokio::test]
    async fn spliced_body_yields_prefix_then_rest() {
        let body = ResponseBody::spliced(
            Bytes::from_static(b"ab"),
            Box::pin(Full::new(Bytes::from_static(b"cd"))),
        );
        assert_eq!(body.size_hint().exact(), Some(4));
        assert_eq!(body.collect().await.unwrap().to_bytes(), "abcd");
        let full = ResponseBody::<Full<Bytes>>::full(Bytes::from_static(b"x"));
        assert!(!full.is_end_stream());
        assert_eq!(full.collect().await.unwrap().to_bytes(), "x");
    }

    #[tokio::test]
    async fn a_buffered_body_ends_with_its_trailers() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", "0".parse().unwrap());
        let body = ResponseBody::<Full<Bytes>>::with_trailers("x", Some(trailers.clone()));
        assert_eq!(body.size_hint().exact(), None);
        assert_eq!(body.size_hint().lower(), 1);
        let collected = body.collect().await.unwrap();
        assert_eq!(collected.trailers(), Some(&trailers));
        assert_eq!(collected.to_bytes(), "x");
        let empty = ResponseBody::<Full<Bytes>>::with_trailers("", Some(HeaderMap::new()));
        assert!(empty.is_end_stream());
    }
}
