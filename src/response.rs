//! The responses the layer makes itself: errors and replays.

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

use crate::{
    body::ResponseBody,
    grpc::{code, Protocol},
    StoredResponse,
};

/// The header that marks a replayed response.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// Why the layer answered instead of the inner service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rejection {
    KeyRequired,
    InvalidKey,
    InvalidBody,
    BodyTooLarge { limit: usize },
    ReusedWithDifferentParams,
    InProgress { retry_after: Duration },
    StoreUnavailable,
    NotReplayable { status: StatusCode },
}

/// How long a client told to come back should wait, in whole seconds (at least 1).
pub(crate) fn retry_after_secs(wait: Duration) -> u64 {
    (wait.as_secs() + u64::from(wait.subsec_nanos() > 0)).max(1)
}

impl Rejection {
    /// The error code, as the JSON body's `error` and a gRPC message's first word say it.
    fn code(self) -> &'static str {
        match self {
            Self::KeyRequired => "idempotency_key_required",
            Self::InvalidKey => "invalid_idempotency_key",
            Self::InvalidBody => "invalid_request_body",
            Self::BodyTooLarge { .. } => "request_body_too_large",
            Self::ReusedWithDifferentParams => "idempotency_key_reused_with_different_params",
            Self::InProgress { .. } => "request_in_progress",
            Self::StoreUnavailable => "idempotency_store_unavailable",
            Self::NotReplayable { .. } => "response_not_replayable",
        }
    }

    fn parts(self, protocol: Protocol) -> (StatusCode, HeaderMap, Bytes) {
        match protocol {
            Protocol::Http => self.http_parts(),
            Protocol::Grpc => self.grpc_parts(),
        }
    }

    /// A trailers-only gRPC response: HTTP 200, the status in the headers, no body.
    fn grpc_parts(self) -> (StatusCode, HeaderMap, Bytes) {
        let (status, detail, retry_after) = match self {
            Self::KeyRequired | Self::InvalidKey | Self::InvalidBody => {
                (code::INVALID_ARGUMENT, String::new(), None)
            }
            Self::BodyTooLarge { limit } => (
                code::RESOURCE_EXHAUSTED,
                format!(": the request is over {limit} bytes"),
                None,
            ),
            Self::ReusedWithDifferentParams => (code::FAILED_PRECONDITION, String::new(), None),
            Self::InProgress { retry_after } => {
                let secs = retry_after_secs(retry_after);
                (code::ABORTED, format!(": retry after {secs} s"), Some(secs))
            }
            Self::StoreUnavailable => (code::UNAVAILABLE, String::new(), Some(1)),
            Self::NotReplayable { status } => (
                code::FAILED_PRECONDITION,
                format!(": it answered HTTP {}", status.as_u16()),
                None,
            ),
        };
        let message = format!("{}{detail}", self.code());
        let mut headers = HeaderMap::with_capacity(4);
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/grpc"),
        );
        headers.insert("grpc-status", HeaderValue::from(status));
        // Plain ASCII without `%`: valid as a grpc-message without percent-encoding.
        if let Ok(message) = HeaderValue::from_str(&message) {
            headers.insert("grpc-message", message);
        }
        if let Some(secs) = retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        (StatusCode::OK, headers, Bytes::new())
    }

    fn http_parts(self) -> (StatusCode, HeaderMap, Bytes) {
        let (status, body, retry_after) = match self {
            Self::KeyRequired => (StatusCode::BAD_REQUEST, error(self.code()), None),
            Self::InvalidKey => (StatusCode::BAD_REQUEST, error(self.code()), None),
            Self::InvalidBody => (StatusCode::BAD_REQUEST, error(self.code()), None),
            Self::BodyTooLarge { limit } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                serde_json::json!({ "error": self.code(), "limit": limit }),
                None,
            ),
            Self::ReusedWithDifferentParams => (StatusCode::CONFLICT, error(self.code()), None),
            Self::InProgress { retry_after } => {
                let secs = retry_after_secs(retry_after);
                let body = serde_json::json!({ "error": self.code(), "retry_after": secs });
                (StatusCode::CONFLICT, body, Some(secs))
            }
            Self::StoreUnavailable => {
                (StatusCode::SERVICE_UNAVAILABLE, error(self.code()), Some(1))
            }
            Self::NotReplayable { status } => (
                StatusCode::CONFLICT,
                serde_json::json!({ "error": self.code(), "status": status.as_u16() }),
                None,
            ),
        };
        let mut headers = HeaderMap::with_capacity(2);
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(secs) = retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        (status, headers, Bytes::from(body.to_string()))
    }

    pub(crate) fn into_response<B>(self, protocol: Protocol) -> Response<ResponseBody<B>> {
        let (status, headers, body) = self.parts(protocol);
        let mut response = Response::new(ResponseBody::full(body));
        *response.status_mut() = status;
        *response.headers_mut() = headers;
        response
    }

    /// The rejection as a record, for answers that every retry must get.
    pub(crate) fn into_stored(self, protocol: Protocol) -> StoredResponse {
        let (status, headers, body) = self.parts(protocol);
        StoredResponse {
            status,
            headers,
            body,
            trailers: None,
        }
    }
}

fn error(code: &str) -> serde_json::Value {
    serde_json::json!({ "error": code })
}

/// The stored response, byte for byte, marked as a replay.
pub(crate) fn replay<B>(stored: StoredResponse) -> Response<ResponseBody<B>> {
    const REPLAYED: HeaderName = HeaderName::from_static(REPLAYED_HEADER);
    let mut headers = stored.headers;
    headers.insert(REPLAYED, HeaderValue::from_static("true"));
    let mut response = Response::new(ResponseBody::with_trailers(stored.body, stored.trailers));
    *response.status_mut() = stored.status;
    *response.headers_mut() = headers;
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_requests_get_trailers_only_grpc_statuses() {
        let cases = [
            (Rejection::KeyRequired, "3", "idempotency_key_required"),
            (Rejection::InvalidKey, "3", "invalid_idempotency_key"),
            (
                Rejection::ReusedWithDifferentParams,
                "9",
                "idempotency_key_reused_with_different_params",
            ),
            (
                Rejection::InProgress {
                    retry_after: Duration::from_millis(2500),
                },
                "10",
                "request_in_progress: retry after 3 s",
            ),
            (
                Rejection::BodyTooLarge { limit: 10 },
                "8",
                "request_body_too_large: the request is over 10 bytes",
            ),
            (
                Rejection::StoreUnavailable,
                "14",
                "idempotency_store_unavailable",
            ),
        ];
        for (rejection, status, message) in cases {
            let (http, headers, body) = rejection.parts(Protocol::Grpc);
            assert_eq!(http, StatusCode::OK);
            assert!(body.is_empty());
            assert_eq!(headers["content-type"], "application/grpc");
            assert_eq!(headers["grpc-status"], status, "{rejection:?}");
            assert_eq!(headers["grpc-message"], message);
        }
        let (_, headers, _) = Rejection::InProgress {
            retry_after: Duration::from_secs(3),
        }
        .parts(Protocol::Grpc);
        assert_eq!(headers["retry-after"], "3");
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_secs(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::from_secs(30)), 30);
    }
}
