//! gRPC over the layer: which requests are gRPC, and the status codes the layer answers
//! with or looks for (which of them release a key is `release.rs`'s to say).

use http::{header, HeaderMap};

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
}
