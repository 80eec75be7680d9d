//! The request body the inner service gets: the caller's own, or the layer's buffered copy.

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use pin_project_lite::pin_project;

/// A request body type the layer can hand on to the inner service: untouched when the
/// layer lets a request pass (a `GET`, no key), or rebuilt from the bytes it buffered to
/// fingerprint a keyed request.
///
/// Bodies that can be rebuilt from bytes hand on their own type: axum's
/// [`Body`](axum::body::Body), tonic's (feature `tonic`) and [`Full<Bytes>`]. A body that cannot, such as hyper's
/// `Incoming` (feature `hyper`), hands on [`RequestBody`] around it, so the inner service
/// takes `Request<RequestBody<Incoming>>`.
pub trait HandOnBody: Body + Sized {
    /// The body type the inner service takes.
    type Inner: Body;

    /// A request the layer passes through, its body unread.
    fn pass(self) -> Self::Inner;

    /// A keyed request, its body read whole into `bytes`.
    fn buffered(bytes: Bytes) -> Self::Inner;
}

impl HandOnBody for Full<Bytes> {
    type Inner = Self;

    fn pass(self) -> Self {
        self
    }

    fn buffered(bytes: Bytes) -> Self {
        Full::new(bytes)
    }
}

#[cfg(feature = "axum")]
impl HandOnBody for axum::body::Body {
    type Inner = Self;

    fn pass(self) -> Self {
        self
    }

    fn buffered(bytes: Bytes) -> Self {
        Self::from(bytes)
    }
}

#[cfg(feature = "hyper")]
#[cfg_attr(docsrs, doc(cfg(feature = "hyper")))]
impl HandOnBody for hyper::body::Incoming {
    type Inner = RequestBody<Self>;

    fn pass(self) -> RequestBody<Self> {
        RequestBody::streaming(self)
    }

    fn buffered(bytes: Bytes) -> RequestBody<Self> {
        RequestBody::buffered(bytes)
    }
}

#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
impl HandOnBody for tonic::body::Body {
    type Inner = Self;

    fn pass(self) -> Self {
        self
    }

    fn buffered(bytes: Bytes) -> Self {
        Self::new(Full::new(bytes))
    }
}

impl<B> HandOnBody for RequestBody<B>
where
    B: Body,
    B::Data: Into<Bytes>,
{
    type Inner = Self;

    fn pass(self) -> Self {
        self
    }

    fn buffered(bytes: Bytes) -> Self {
        RequestBody::buffered(bytes)
    }
}

pin_project! {
    /// The body of a request handed on by the layer when the caller's body type cannot be
    /// rebuilt from bytes (hyper's `Incoming`): the caller's body, unread, for requests the
    /// layer passes through, or the bytes the layer read, for keyed ones. Read it as any
    /// body (`http_body_util::BodyExt::collect`); a buffered one also gives its bytes at
    /// once ([`as_bytes`](Self::as_bytes)).
    #[derive(Debug)]
    pub struct RequestBody<B> {
        #[pin]
        streaming: Option<B>,
        buffered: Option<Bytes>,
    }
}

impl<B> RequestBody<B> {
    /// The caller's body, unread.
    pub fn streaming(body: B) -> Self {
        Self {
            streaming: Some(body),
            buffered: None,
        }
    }

    /// A body of `bytes`, read already.
    pub fn buffered(bytes: Bytes) -> Self {
        Self {
            streaming: None,
            buffered: Some(bytes),
        }
    }

    /// The bytes of a buffered body not yet read as frames; `None` for a streaming one.
    pub fn as_bytes(&self) -> Option<&Bytes> {
        self.buffered.as_ref()
    }
}

impl<B> Body for RequestBody<B>
where
    B: Body,
    B::Data: Into<Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.project();
        if let Some(bytes) = this.buffered.take() {
            return Poll::Ready((!bytes.is_empty()).then(|| Ok(Frame::data(bytes))));
        }
        match this.streaming.as_pin_mut() {
            Some(body) => body
                .poll_frame(cx)
                .map(|frame| frame.map(|frame| frame.map(|frame| frame.map_data(Into::into)))),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        match (&self.streaming, &self.buffered) {
            (Some(body), _) => body.is_end_stream(),
            (None, Some(bytes)) => bytes.is_empty(),
            (None, None) => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.streaming, &self.buffered) {
            (Some(body), _) => body.size_hint(),
            (None, Some(bytes)) => SizeHint::with_exact(bytes.len() as u64),
            (None, None) => SizeHint::with_exact(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    #[tokio::test]
    async fn a_request_body_is_its_bytes_or_the_callers_body() {
        let buffered = RequestBody::<Full<Bytes>>::buffered(Bytes::from_static(b"abc"));
        assert_eq!(buffered.size_hint().exact(), Some(3));
        assert_eq!(buffered.as_bytes().unwrap(), "abc");
        assert_eq!(buffered.collect().await.unwrap().to_bytes(), "abc");
        let streaming = RequestBody::streaming(Full::new(Bytes::from_static(b"xyz")));
        assert!(streaming.as_bytes().is_none());
        assert_eq!(streaming.collect().await.unwrap().to_bytes(), "xyz");
        assert!(RequestBody::<Full<Bytes>>::buffered(Bytes::new()).is_end_stream());
    }
}
