//! The responses the layer makes itself: errors and replays.

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, HeaderValue, Response, StatusCode};

use crate::{body::ResponseBody, StoredResponse};

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
    fn parts(self) -> (StatusCode, HeaderMap, Bytes) {
        let (status, body, retry_after) = match self {
            Self::KeyRequired => (
                StatusCode::BAD_REQUEST,
                error("idempotency_key_required"),
                None,
            ),
            Self::InvalidKey => (
                StatusCode::BAD_REQUEST,
                error("invalid_idempotency_key"),
                None,
            ),
            Self::InvalidBody => (StatusCode::BAD_REQUEST, error("invalid_request_body"), None),
            Self::BodyTooLarge { limit } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                serde_json::json!({ "error": "request_body_too_large", "limit": limit }),
                None,
            ),
            Self::ReusedWithDifferentParams => (
                StatusCode::CONFLICT,
                error("idempotency_key_reused_with_different_params"),
                None,
            ),
            Self::InProgress { retry_after } => {
                let secs = retry_after_secs(retry_after);
                let body =
                    serde_json::json!({ "error": "request_in_progress", "retry_after": secs });
                (StatusCode::CONFLICT, body, Some(secs))
            }
            Self::StoreUnavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                error("idempotency_store_unavailable"),
                Some(1),
            ),
            Self::NotReplayable { status } => (
                StatusCode::CONFLICT,
                serde_json::json!({ "error": "response_not_replayable", "status": status.as_u16() }),
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

    pub(crate) fn into_response<B>(self) -> Response<ResponseBody<B>> {
        let (status, headers, body) = self.parts();
        let mut response = Response::new(ResponseBody::full(body));
        *response.status_mut() = status;
        *response.headers_mut() = headers;
        response
    }

    /// The rejection as a record, for answers that every retry must get.
    pub(crate) fn into_stored(self) -> StoredResponse {
        let (status, headers, body) = self.parts();
        StoredResponse {
            status,
            headers,
            body,
            trailers: HeaderMap::new(),
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
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_secs(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::from_secs(30)), 30);
    }
}
