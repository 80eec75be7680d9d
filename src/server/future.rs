//! The layer's response future.

use std::{
    future::Future,
    pin::Pin,
    task::{ready, Context, Poll},
};

use futures_util::future::BoxFuture;
use http::Response;
use pin_project_lite::pin_project;

use super::body::ResponseBody;

pin_project! {
    /// The response future of [`Idempotency`](crate::Idempotency).
    ///
    /// Requests the layer does not handle poll the inner future in place, with no
    /// allocation; keyed requests run boxed.
    #[project = Projection]
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        kind: Kind<F, B, E>,
    }
}

pin_project! {
    #[project = KindProjection]
    enum Kind<F, B, E> {
        PassThrough { #[pin] future: F },
        Answered { response: Option<Response<ResponseBody<B>>> },
        Keyed { future: BoxFuture<'static, Result<Response<ResponseBody<B>>, E>> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    pub(crate) fn pass_through(future: F) -> Self {
        Self {
            kind: Kind::PassThrough { future },
        }
    }

    pub(crate) fn answered(response: Response<ResponseBody<B>>) -> Self {
        Self {
            kind: Kind::Answered {
                response: Some(response),
            },
        }
    }

    pub(crate) fn keyed(future: BoxFuture<'static, Result<Response<ResponseBody<B>>, E>>) -> Self {
        Self {
            kind: Kind::Keyed { future },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProjection::PassThrough { future } => {
                let response = ready!(future.poll(cx))?;
                Poll::Ready(Ok(response.map(ResponseBody::inner)))
            }
            KindProjection::Answered { response } => Poll::Ready(Ok(response
                .take()
                .expect("ResponseFuture polled after completion"))),
            KindProjection::Keyed { future } => future.as_mut().poll(cx),
        }
    }
}

/// `Box::pin(make())`, with the future made straight in its allocation. `Box::pin` of a
/// finished future copies the whole of it, unused space included, from the stack into a
/// fresh allocation: a keyed request's future is about a kilobyte, its execution's two, and
/// the copy alone missed the data cache some twenty-five times a request.
#[inline(always)]
pub(crate) fn boxed_in_place<F>(make: impl FnOnce() -> F) -> Pin<Box<F>> {
    Box::into_pin(Box::write(Box::new_uninit(), make()))
}

impl<F, B, E> std::fmt::Debug for ResponseFuture<F, B, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
