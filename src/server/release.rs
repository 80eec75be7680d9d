//! The release policy: which outcomes of a handler give the key back, so that a retry
//! executes again, instead of being recorded and replayed.
//!
//! An inner error or a panic always releases. A response releases when its status does
//! ([`IdempotencyLayer::release_on`](crate::IdempotencyLayer::release_on), judged before
//! the body is read), or when the whole response does
//! ([`IdempotencyLayer::release_when`](crate::IdempotencyLayer::release_when), judged once
//! the body is buffered, headers and trailers in view).

use std::{fmt, sync::Arc};

use http::{HeaderMap, StatusCode};

use super::grpc::{code, Protocol};

/// A response as the release decision sees it, once its body has been buffered: status,
/// headers and trailers.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct ResponseHead<'a> {
    /// The HTTP status.
    pub status: StatusCode,
    /// The headers.
    pub headers: &'a HeaderMap,
    /// The trailers (empty when the response had none).
    pub trailers: &'a HeaderMap,
}

impl<'a> ResponseHead<'a> {
    pub(crate) fn new(status: StatusCode, headers: &'a HeaderMap, trailers: &'a HeaderMap) -> Self {
        Self {
            status,
            headers,
            trailers,
        }
    }

    /// The response's `grpc-status`: in the trailers, or in the headers of a trailers-only
    /// response.
    pub fn grpc_status(&self) -> Option<u16> {
        self.trailers
            .get("grpc-status")
            .or_else(|| self.headers.get("grpc-status"))
            .and_then(|value| value.to_str().ok()?.trim().parse().ok())
    }

    /// Whether the response is a gRPC status that says the call may not have happened
    /// and may be tried again: `UNKNOWN`, `DEADLINE_EXCEEDED`, `RESOURCE_EXHAUSTED`,
    /// `INTERNAL` or `UNAVAILABLE`. The layer releases the key on these by default, as on
    /// a 5xx.
    pub fn is_transient_grpc_status(&self) -> bool {
        matches!(
            self.grpc_status(),
            Some(
                code::UNKNOWN
                    | code::DEADLINE_EXCEEDED
                    | code::RESOURCE_EXHAUSTED
                    | code::INTERNAL
                    | code::UNAVAILABLE
            )
        )
    }
}

/// A judge of statuses, set by `release_on`.
type ReleaseOn = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;
/// A judge of whole responses, set by `release_when`.
type ReleaseWhen = Arc<dyn Fn(&ResponseHead<'_>) -> bool + Send + Sync>;

/// A layer's release settings.
#[derive(Clone)]
pub(crate) struct ReleasePolicy {
    on_status: ReleaseOn,
    /// `None`: the default, transient gRPC statuses, looked for on gRPC requests only.
    when: Option<ReleaseWhen>,
}

impl Default for ReleasePolicy {
    fn default() -> Self {
        Self {
            on_status: Arc::new(releases_by_default),
            when: None,
        }
    }
}

impl ReleasePolicy {
    pub(crate) fn on_status(
        &mut self,
        release: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) {
        self.on_status = Arc::new(release);
    }

    pub(crate) fn when(
        &mut self,
        release: impl Fn(&ResponseHead<'_>) -> bool + Send + Sync + 'static,
    ) {
        self.when = Some(Arc::new(release));
    }

    /// Whether a response with `status` releases the key, before its body is read.
    pub(crate) fn releases_status(&self, status: StatusCode) -> bool {
        (self.on_status)(status)
    }

    /// Whether a whole response releases the key: the layer's `release_when`, or by
    /// default a transient gRPC status, looked for only on gRPC requests (a plain HTTP
    /// response pays nothing for it).
    pub(crate) fn releases_whole(
        &self,
        protocol: Protocol,
        status: StatusCode,
        headers: &HeaderMap,
        trailers: Option<&HeaderMap>,
    ) -> bool {
        let judge = |judge: &dyn Fn(&ResponseHead<'_>) -> bool| {
            let none = HeaderMap::new();
            judge(&ResponseHead::new(
                status,
                headers,
                trailers.unwrap_or(&none),
            ))
        };
        match &self.when {
            Some(release_when) => judge(release_when.as_ref()),
            None => {
                protocol == Protocol::Grpc
                    && judge(&|head: &ResponseHead<'_>| head.is_transient_grpc_status())
            }
        }
    }
}

impl fmt::Debug for ReleasePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReleasePolicy")
            .field("custom_when", &self.when.is_some())
            .finish_non_exhaustive()
    }
}

/// The statuses that say the operation was not done, or its outcome is unknown: 5xx,
/// `408 Request Timeout` (a timeout layer inside gave up on the handler) and
/// `429 Too Many Requests` (a rate limiter inside turned the request away).
fn releases_by_default(status: StatusCode) -> bool {
    status.is_server_error()
        || status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    #[test]
    fn the_status_is_read_from_trailers_then_headers() {
        let (mut headers, mut trailers) = (HeaderMap::new(), HeaderMap::new());
        let head = ResponseHead::new(StatusCode::OK, &headers, &trailers);
        assert_eq!(head.grpc_status(), None);
        assert!(!head.is_transient_grpc_status());
        headers.insert("grpc-status", HeaderValue::from_static("14"));
        let head = ResponseHead::new(StatusCode::OK, &headers, &trailers);
        assert!(head.is_transient_grpc_status());
        trailers.insert("grpc-status", HeaderValue::from_static("9"));
        let head = ResponseHead::new(StatusCode::OK, &headers, &trailers);
        assert_eq!(head.grpc_status(), Some(9));
        assert!(!head.is_transient_grpc_status());
    }

    #[test]
    fn by_default_5xx_408_and_429_release_and_grpc_statuses_only_on_grpc() {
        let policy = ReleasePolicy::default();
        for status in [500, 503, 408, 429] {
            assert!(policy.releases_status(StatusCode::from_u16(status).unwrap()));
        }
        for status in [200, 201, 400, 404, 409, 422] {
            assert!(!policy.releases_status(StatusCode::from_u16(status).unwrap()));
        }
        let mut headers = HeaderMap::new();
        headers.insert("grpc-status", HeaderValue::from_static("14"));
        let whole = |protocol| policy.releases_whole(protocol, StatusCode::OK, &headers, None);
        assert!(whole(Protocol::Grpc));
        assert!(!whole(Protocol::Http));
    }
}
