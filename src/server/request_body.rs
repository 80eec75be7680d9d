//! The request body: read whole to fingerprint a keyed request, and what the inner service
//! gets instead (the caller's own body, or one rebuilt from the bytes read).

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use bytes::{Buf, Bytes, BytesMut};
use http::request::Parts;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use pin_project_lite::pin_project;

use super::rejection::Reason;

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

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
    type HandedOn: Body;

    /// The body of a request the layer passes through, unread.
    fn unread(self) -> Self::HandedOn;

    /// The body of a keyed request, rebuilt from the `bytes` the layer read.
    fn rebuilt(bytes: Bytes) -> Self::HandedOn;
}

impl HandOnBody for Full<Bytes> {
    type HandedOn = Self;

    fn unread(self) -> Self {
        self
    }

    fn rebuilt(bytes: Bytes) -> Self {
        Full::new(bytes)
    }
}

#[cfg(feature = "axum")]
impl HandOnBody for axum::body::Body {
    type HandedOn = Self;

    fn unread(self) -> Self {
        self
    }

    fn rebuilt(bytes: Bytes) -> Self {
        Self::from(bytes)
    }
}

#[cfg(feature = "hyper")]
#[cfg_attr(docsrs, doc(cfg(feature = "hyper")))]
impl HandOnBody for hyper::body::Incoming {
    type HandedOn = RequestBody<Self>;

    fn unread(self) -> RequestBody<Self> {
        RequestBody::streaming(self)
    }

    fn rebuilt(bytes: Bytes) -> RequestBody<Self> {
        RequestBody::buffered(bytes)
    }
}

#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
impl HandOnBody for tonic::body::Body {
    type HandedOn = Self;

    fn unread(self) -> Self {
        self
    }

    fn rebuilt(bytes: Bytes) -> Self {
        Self::new(Full::new(bytes))
    }
}

impl<B> HandOnBody for RequestBody<B>
where
    B: Body,
    B::Data: Into<Bytes>,
{
    type HandedOn = Self;

    fn unread(self) -> Self {
        self
    }

    fn rebuilt(bytes: Bytes) -> Self {
        RequestBody::buffered(bytes)
    }
}

/// Reads a keyed request's body whole, up to `limit` bytes.
pub(crate) async fn read_whole<B>(parts: &Parts, body: B, limit: usize) -> Result<Bytes, Reason>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    let too_large = Reason::BodyTooLarge { limit };
    // A declared length over the limit is refused before reading a byte.
    let declared = parts
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(too_large);
    }
    // A limit layer outside this one fails the body with its own `LengthLimitError`,
    // which a router between them may wrap: look through the causes.
    let reading = |error: BoxError| {
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&*error);
        while let Some(error) = cause {
            if error.is::<LengthLimitError>() {
                return too_large;
            }
            cause = error.source();
        }
        Reason::InvalidBody
    };
    // Most bodies arrive as one chunk, kept as it came; more are joined. (`collect` would
    // queue every chunk in a list first, one allocation more per request.)
    let mut body = std::pin::pin!(Limited::new(body, limit));
    let (mut first, mut joined) = (Bytes::new(), BytesMut::new());
    while let Some(frame) = body.frame().await {
        let Ok(mut data) = frame.map_err(reading)?.into_data() else {
            continue;
        };
        let data = data.copy_to_bytes(data.remaining());
        if first.is_empty() {
            first = data;
        } else {
            if joined.is_empty() {
                joined.extend_from_slice(&first);
            }
            joined.extend_from_slice(&data);
        }
    }
    Ok(if joined.is_empty() {
        first
    } else {
        joined.freeze()
    })
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
    use http::Request;
    use http_body_util::StreamBody;

    use super::*;

    /// The body `read_whole` makes of `frames` (data, or trailers where `None`).
    async fn buffered(frames: &[Option<&str>], limit: usize) -> Result<Bytes, Reason> {
        let frames: Vec<Result<Frame<Bytes>, std::io::Error>> = frames
            .iter()
            .map(|frame| {
                Ok(match frame {
                    Some(data) => Frame::data(Bytes::copy_from_slice(data.as_bytes())),
                    None => Frame::trailers(http::HeaderMap::new()),
                })
            })
            .collect();
        let body = StreamBody::new(futures_util::stream::iter(frames));
        let parts = Request::new(()).into_parts().0;
        read_whole(&parts, body, limit).await
    }

    #[tokio::test]
    async fn chunks_are_joined_in_order_and_trailers_skipped() {
        assert_eq!(buffered(&[Some("abc")], 64).await.unwrap(), "abc");
        assert_eq!(
            buffered(&[Some(""), Some("ab"), Some(""), Some("c"), None], 64)
                .await
                .unwrap(),
            "abc"
        );
        assert_eq!(
            buffered(&[Some("a"), Some("b"), Some("c")], 64)
                .await
                .unwrap(),
            "abc"
        );
        assert_eq!(buffered(&[], 64).await.unwrap(), "");
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_refused_however_it_is_chunked() {
        assert_eq!(
            buffered(&[Some("ab"), Some("cd")], 3).await,
            Err(Reason::BodyTooLarge { limit: 3 })
        );
        assert_eq!(
            buffered(&[Some("abcd")], 3).await,
            Err(Reason::BodyTooLarge { limit: 3 })
        );
        assert_eq!(buffered(&[Some("ab"), Some("c")], 3).await.unwrap(), "abc");
    }

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
