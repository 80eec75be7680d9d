//! gRPC over the layer: which requests are gRPC, which statuses mean "not done", and the
//! response head the release decision sees.

use http::{header, HeaderMap, StatusCode};

/// How a request expects to be answered when the layer answers it itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Protocol {
    /// Plain HTTP: a status code and a JSON body.
    Http,
    /// gRPC (`content-type: application/grpc…`): HTTP 200 with a `grpc-status`.
    Grpc,
}

impl Protocol {
    pub(crate) fn of(headers: &HeaderMap) -> Self {
        let grpc = headers
            .get(header::CONTENT_TYPE)
            .is_some_and(|value| value.as_bytes().starts_with(b"application/grpc"));
        if grpc {
            Self::Grpc
        } else {
            Self::Http
        }
    }
}

/// gRPC status codes the layer uses or looks for.
pub(crate) mod code {
    pub(crate) const UNKNOWN: u16 = 2;
    pub(crate) const INVALID_ARGUMENT: u16 = 3;
    pub(crate) const DEADLINE_EXCEEDED: u16 = 4;
    pub(crate) const RESOURCE_EXHAUSTED: u16 = 8;
    pub(crate) const FAILED_PRECONDITION: u16 = 9;
    pub(crate) const ABORTED: u16 = 10;
    pub(crate) const INTERNAL: u16 = 13;
    pub(crate) const UNAVAILABLE: u16 = 14;
}

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

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    #[test]
    fn grpc_requests_are_told_by_their_content_type() {
        let mut headers = HeaderMap::new();
        assert_eq!(Protocol::of(&headers), Protocol::Http);
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        assert_eq!(Protocol::of(&headers), Protocol::Http);
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc+proto"),
        );
        assert_eq!(Protocol::of(&headers), Protocol::Grpc);
    }

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
}
