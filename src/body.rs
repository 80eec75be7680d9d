//! The response body the layer returns.

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// The body of every response that passes through the layer: the inner service's own
    /// body (passed through untouched), a buffered one (recorded or replayed responses and
    /// the layer's errors), or a buffered prefix followed by the rest of the inner body (a
    /// response too large to record, streamed on to its client).
    #[derive(Debug)]
    pub struct ResponseBody<B> {
        prefix: Option<Bytes>,
        #[pin]
        rest: Option<B>,
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self {
            prefix: None,
            rest: Some(body),
        }
    }

    pub(crate) fn full(bytes: Bytes) -> Self {
        Self {
            prefix: Some(bytes),
            rest: None,
        }
    }

    pub(crate) fn spliced(prefix: Bytes, rest: B) -> Self {
        Self {
            prefix: Some(prefix),
            rest: Some(rest),
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
        match this.rest.as_pin_mut() {
            Some(rest) => rest.poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.as_ref().is_none_or(Bytes::is_empty)
            && self.rest.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        let prefix = self.prefix.as_ref().map_or(0, |p| p.len() as u64);
        let rest = self
            .rest
            .as_ref()
            .map_or(SizeHint::with_exact(0), Body::size_hint);
        let mut hint = SizeHint::new();
        // Upper first: set_lower asserts it stays at or below the upper bound.
        if let Some(upper) = rest.upper() {
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
            Full::new(Bytes::from_static(b"cd")),
        );
        assert_eq!(body.size_hint().exact(), Some(4));
        assert_eq!(body.collect().await.unwrap().to_bytes(), "abcd");
        let full = ResponseBody::<Full<Bytes>>::full(Bytes::from_static(b"x"));
        assert!(!full.is_end_stream());
        assert_eq!(full.collect().await.unwrap().to_bytes(), "x");
    }
}
