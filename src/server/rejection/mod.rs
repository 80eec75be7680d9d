//! Why the layer answered a request itself, and how that answer is rendered.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Response, StatusCode};

use super::{
    body::ResponseBody,
    grpc::{code, Protocol},
};
use crate::StoredResponse;

pub(crate) mod problem;

/// Why the layer answered a request itself instead of passing it to the inner service:
/// what a [`RenderRejection`] renders.
///
/// Read it through its accessors: [`kind`](Self::kind) says what happened, the rest carry
/// what a client needs to act on it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Rejection {
    reason: Reason,
    endpoint: String,
    /// Where in the body the route reads its key, on a route that reads it there.
    key_in_body: Option<Arc<str>>,
}

/// What kind of [`Rejection`] it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RejectionKind {
    /// No key on a [`required`](crate::IdempotencyLayer::required) route.
    KeyRequired,
    /// A key that is empty, too long, not visible ASCII, malformed, or given twice.
    InvalidKey,
    /// The request body failed before it was read whole.
    InvalidBody,
    /// The request body is over the layer's `max_request_body`
    /// ([`limit`](Rejection::limit)).
    BodyTooLarge,
    /// The key was used for another request (method, path, query, body or a fingerprinted
    /// header differ, or another representation of a negotiated response was asked for).
    ReusedWithDifferentParams,
    /// The key's first request is still running ([`retry_after`](Rejection::retry_after)).
    InProgress,
    /// The store could not be reached; nothing was executed.
    StoreUnavailable,
    /// The key's request was executed, but its response was too large to keep
    /// ([`original_status`](Rejection::original_status)).
    NotReplayable,
    /// The request named no principal, and the route does not allow anonymous requests
    /// ([`allow_anonymous`](crate::IdempotencyLayer::allow_anonymous)): a configuration
    /// to fix, not a client's error. Nothing was executed.
    PrincipalMissing,
}

/// The rejection's data; each kind carries what only it has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reason {
    KeyRequired,
    InvalidKey,
    InvalidBody,
    BodyTooLarge { limit: usize },
    ReusedWithDifferentParams,
    InProgress { retry_after: Duration },
    StoreUnavailable,
    NotReplayable { status: StatusCode },
    PrincipalMissing,
}

/// How long a client is told to wait after the store was unreachable.
const STORE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Renders a layer's rejections of HTTP requests as the application's own errors: set with
/// [`IdempotencyLayer::render_rejections`](crate::IdempotencyLayer::render_rejections).
/// gRPC requests always get gRPC statuses instead.
///
/// Implemented for closures `Fn(&Rejection) -> Response<Bytes>`. When the rejection has a
/// [`retry_after`](Rejection::retry_after) and the rendered response no `Retry-After`, the
/// layer adds one.
///
/// # Example
///
/// A Stripe-style envelope, `{"error":{"type":..,"code":..,"message":..}}`:
///
/// ```
/// use bytes::Bytes;
/// use http::{header, Response};
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, Rejection, RejectionKind};
///
/// fn stripe_style(rejection: &Rejection) -> Response<Bytes> {
///     let kind = match rejection.kind() {
///         RejectionKind::StoreUnavailable => "api_error",
///         RejectionKind::InProgress | RejectionKind::ReusedWithDifferentParams => {
///             "idempotency_error"
///         }
///         _ => "invalid_request_error",
///     };
///     let body = serde_json::json!({ "error": {
///         "type": kind,
///         "code": rejection.code(),
///         "message": rejection.detail(),
///     }});
///     Response::builder()
///         .status(rejection.status())
///         .header(header::CONTENT_TYPE, "application/json")
///         .body(Bytes::from(body.to_string()))
///         .unwrap()
/// }
///
/// let layer = IdempotencyLayer::new(MemoryStore::new()).render_rejections(stripe_style);
/// ```
pub trait RenderRejection: Send + Sync + 'static {
    /// The response for `rejection`.
    fn render(&self, rejection: &Rejection) -> Response<Bytes>;
}

impl<F> RenderRejection for F
where
    F: Fn(&Rejection) -> Response<Bytes> + Send + Sync + 'static,
{
    fn render(&self, rejection: &Rejection) -> Response<Bytes> {
        self(rejection)
    }
}

impl Rejection {
    pub(crate) fn new(reason: Reason, endpoint: String) -> Self {
        Self {
            reason,
            endpoint,
            key_in_body: None,
        }
    }

    /// The rejection of a request on a route that reads its key from the body, `where`
    /// (`"at /id"`): its key's rejections say so.
    pub(crate) fn with_key_in_body(mut self, place: Option<Arc<str>>) -> Self {
        self.key_in_body = place;
        self
    }

    /// What kind of rejection it is.
    pub fn kind(&self) -> RejectionKind {
        match self.reason {
            Reason::KeyRequired => RejectionKind::KeyRequired,
            Reason::InvalidKey => RejectionKind::InvalidKey,
            Reason::InvalidBody => RejectionKind::InvalidBody,
            Reason::BodyTooLarge { .. } => RejectionKind::BodyTooLarge,
            Reason::ReusedWithDifferentParams => RejectionKind::ReusedWithDifferentParams,
            Reason::InProgress { .. } => RejectionKind::InProgress,
            Reason::StoreUnavailable => RejectionKind::StoreUnavailable,
            Reason::NotReplayable { .. } => RejectionKind::NotReplayable,
            Reason::PrincipalMissing => RejectionKind::PrincipalMissing,
        }
    }

    /// The crate's error code: `idempotency_key_required`, `invalid_idempotency_key`,
    /// `invalid_request_body`, `request_body_too_large`,
    /// `idempotency_key_reused_with_different_params`, `request_in_progress`,
    /// `idempotency_store_unavailable`, `response_not_replayable` or
    /// `idempotency_principal_missing`.
    pub fn code(&self) -> &'static str {
        match self.reason {
            Reason::KeyRequired => "idempotency_key_required",
            Reason::InvalidKey => "invalid_idempotency_key",
            Reason::InvalidBody => "invalid_request_body",
            Reason::BodyTooLarge { .. } => "request_body_too_large",
            Reason::ReusedWithDifferentParams => "idempotency_key_reused_with_different_params",
            Reason::InProgress { .. } => "request_in_progress",
            Reason::StoreUnavailable => "idempotency_store_unavailable",
            Reason::NotReplayable { .. } => "response_not_replayable",
            Reason::PrincipalMissing => "idempotency_principal_missing",
        }
    }

    /// The status of the default JSON errors: `400` (key required or invalid, body
    /// unreadable), `413`, `409` (reused, in progress, not replayable), `503`, or `500`
    /// (no principal on a route that needs one).
    pub fn status(&self) -> StatusCode {
        match self.reason {
            Reason::KeyRequired | Reason::InvalidKey | Reason::InvalidBody => {
                StatusCode::BAD_REQUEST
            }
            Reason::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Reason::ReusedWithDifferentParams
            | Reason::InProgress { .. }
            | Reason::NotReplayable { .. } => StatusCode::CONFLICT,
            Reason::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Reason::PrincipalMissing => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// When to try again, where trying again can succeed: a key in progress (as long
    /// again as its first request has run so far, within the lease) and an unreachable
    /// store (1 s).
    pub fn retry_after(&self) -> Option<Duration> {
        match self.reason {
            Reason::InProgress { retry_after } => Some(retry_after),
            Reason::StoreUnavailable => Some(STORE_RETRY_AFTER),
            _ => None,
        }
    }

    /// [`retry_after`](Self::retry_after) in the whole seconds `Retry-After` says (rounded
    /// up, at least 1).
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after().map(retry_after_secs)
    }

    /// The request body limit, in bytes, of a body too large.
    pub fn limit(&self) -> Option<usize> {
        match self.reason {
            Reason::BodyTooLarge { limit } => Some(limit),
            _ => None,
        }
    }

    /// The status the handler answered, for a response too large to replay.
    pub fn original_status(&self) -> Option<StatusCode> {
        match self.reason {
            Reason::NotReplayable { status } => Some(status),
            _ => None,
        }
    }

    /// The endpoint of the request's scope: `"POST /v1/payments"` (`"POST sha256:…"` for a
    /// path past [`MAX_SCOPE_PART_LEN`](crate::MAX_SCOPE_PART_LEN)), or the layer's endpoint
    /// name.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// A short summary for people, the same for every rejection of a kind (the IETF
    /// draft's wording where it has one).
    pub fn title(&self) -> &'static str {
        match self.reason {
            Reason::KeyRequired => "Idempotency-Key is missing",
            Reason::InvalidKey => "Idempotency-Key is invalid",
            Reason::InvalidBody => "Request body could not be read",
            Reason::BodyTooLarge { .. } => "Request body is too large",
            Reason::ReusedWithDifferentParams => "Idempotency-Key is already used",
            Reason::InProgress { .. } => "A request is outstanding for this Idempotency-Key",
            Reason::StoreUnavailable => "Idempotency store is unavailable",
            Reason::NotReplayable { .. } => "Response cannot be replayed",
            Reason::PrincipalMissing => "Idempotency scope has no principal",
        }
    }

    /// What happened and what to do, for people.
    pub fn detail(&self) -> String {
        const CORRECT_USE: &str =
            "This operation is idempotent and it requires correct usage of Idempotency Key.";
        match (self.reason, self.key_in_body.as_deref()) {
            (Reason::KeyRequired, Some(place)) => format!(
                "{CORRECT_USE} This operation reads it from the request body ({place}), and \
                 this body holds none; nothing was executed."
            ),
            (Reason::InvalidKey, Some(place)) => format!(
                "This operation reads the idempotency key from the request body ({place}): it \
                 must be a JSON string of 1 to 255 visible ASCII characters, named once; \
                 nothing was executed."
            ),
            (Reason::KeyRequired, None) => CORRECT_USE.to_owned(),
            (Reason::InvalidKey, None) => "The Idempotency-Key header must be sent once, with 1 \
                to 255 visible ASCII characters, bare or as a quoted string."
                .to_owned(),
            (Reason::InvalidBody, _) => {
                "The request body failed before it was read whole; nothing was executed.".to_owned()
            }
            (Reason::BodyTooLarge { limit }, _) => {
                format!("The request body is over {limit} bytes; nothing was executed.")
            }
            (Reason::ReusedWithDifferentParams, _) => format!(
                "{CORRECT_USE} Idempotency Key MUST not be reused across different payloads \
                 of this operation."
            ),
            (Reason::InProgress { retry_after }, _) => format!(
                "A request with the same Idempotency-Key for the same operation is being \
                 processed or is outstanding. Retry after {} s.",
                retry_after_secs(retry_after)
            ),
            (Reason::StoreUnavailable, _) => format!(
                "The Idempotency-Key could not be checked, so nothing was executed. Retry \
                 after {} s.",
                retry_after_secs(STORE_RETRY_AFTER)
            ),
            (Reason::NotReplayable { status }, _) => format!(
                "The request was executed and answered HTTP {}, but its response was too \
                 large to keep; it will not be executed again.",
                status.as_u16()
            ),
            (Reason::PrincipalMissing, _) => "The request names no principal to scope its \
                Idempotency-Key by, and this operation does not accept anonymous requests; \
                nothing was executed."
                .to_owned(),
        }
    }

    /// The default rendering: JSON `{"error":"<code>"}`, with `retry_after` (in progress),
    /// `limit` (too large) or `status` (not replayable) beside it, and `Retry-After` where
    /// there is one. A custom renderer can fall back to it for kinds it leaves alone.
    pub fn json_response(&self) -> Response<Bytes> {
        let mut body = serde_json::Map::with_capacity(2);
        body.insert("error".to_owned(), self.code().into());
        match self.reason {
            Reason::BodyTooLarge { limit } => {
                body.insert("limit".to_owned(), limit.into());
            }
            Reason::InProgress { retry_after } => {
                body.insert(
                    "retry_after".to_owned(),
                    retry_after_secs(retry_after).into(),
                );
            }
            Reason::NotReplayable { status } => {
                body.insert("status".to_owned(), status.as_u16().into());
            }
            _ => {}
        }
        let body = serde_json::Value::Object(body).to_string();
        let mut response = Response::new(Bytes::from(body));
        *response.status_mut() = self.status();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(secs) = self.retry_after_secs() {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }

    /// A trailers-only gRPC response: HTTP 200, the status in the headers, no body.
    fn grpc_response(&self) -> Response<Bytes> {
        let (status, detail) = match self.reason {
            Reason::KeyRequired | Reason::InvalidKey | Reason::InvalidBody => {
                (code::INVALID_ARGUMENT, String::new())
            }
            Reason::BodyTooLarge { limit } => (
                code::RESOURCE_EXHAUSTED,
                format!(": the request is over {limit} bytes"),
            ),
            Reason::ReusedWithDifferentParams => (code::FAILED_PRECONDITION, String::new()),
            Reason::InProgress { retry_after } => (
                code::ABORTED,
                format!(": retry after {} s", retry_after_secs(retry_after)),
            ),
            Reason::StoreUnavailable => (code::UNAVAILABLE, String::new()),
            Reason::NotReplayable { status } => (
                code::FAILED_PRECONDITION,
                format!(": it answered HTTP {}", status.as_u16()),
            ),
            Reason::PrincipalMissing => (code::INTERNAL, String::new()),
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
        if let Some(secs) = self.retry_after_secs() {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        let mut response = Response::new(Bytes::new());
        *response.headers_mut() = headers;
        response
    }

    /// The rejection as the layer answers it: a gRPC status to a gRPC request, else the
    /// layer's rendering (default: [`json_response`](Self::json_response)).
    fn render(
        &self,
        protocol: Protocol,
        renderer: Option<&dyn RenderRejection>,
    ) -> Response<Bytes> {
        let mut response = match (protocol, renderer) {
            (Protocol::Grpc, _) => return self.grpc_response(),
            (Protocol::Http, None) => return self.json_response(),
            (Protocol::Http, Some(render)) => render.render(self),
        };
        if let Some(secs) = self.retry_after_secs() {
            let headers = response.headers_mut();
            if !headers.contains_key(header::RETRY_AFTER) {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
            }
        }
        response
    }

    #[cold]
    pub(crate) fn into_response<B>(
        self,
        protocol: Protocol,
        renderer: Option<&dyn RenderRejection>,
    ) -> Response<ResponseBody<B>> {
        self.render(protocol, renderer).map(ResponseBody::full)
    }

    /// The rejection as a record, for answers that every retry must get.
    #[cold]
    pub(crate) fn into_stored(
        self,
        protocol: Protocol,
        renderer: Option<&dyn RenderRejection>,
    ) -> StoredResponse {
        let (parts, body) = self.render(protocol, renderer).into_parts();
        StoredResponse {
            status: parts.status,
            headers: parts.headers,
            body,
            trailers: None,
        }
    }
}

/// How long a client told to come back should wait, in whole seconds (at least 1).
pub(crate) fn retry_after_secs(wait: Duration) -> u64 {
    (wait.as_secs() + u64::from(wait.subsec_nanos() > 0)).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rejection(reason: Reason) -> Rejection {
        Rejection::new(reason, "POST /v1/payments".to_owned())
    }

    #[test]
    fn grpc_requests_get_trailers_only_grpc_statuses() {
        let cases = [
            (Reason::KeyRequired, "3", "idempotency_key_required"),
            (Reason::InvalidKey, "3", "invalid_idempotency_key"),
            (
                Reason::ReusedWithDifferentParams,
                "9",
                "idempotency_key_reused_with_different_params",
            ),
            (
                Reason::InProgress {
                    retry_after: Duration::from_millis(2500),
                },
                "10",
                "request_in_progress: retry after 3 s",
            ),
            (
                Reason::BodyTooLarge { limit: 10 },
                "8",
                "request_body_too_large: the request is over 10 bytes",
            ),
            (
                Reason::StoreUnavailable,
                "14",
                "idempotency_store_unavailable",
            ),
            (
                Reason::PrincipalMissing,
                "13",
                "idempotency_principal_missing",
            ),
        ];
        for (reason, status, message) in cases {
            let response = rejection(reason).grpc_response();
            assert_eq!(response.status(), StatusCode::OK);
            assert!(response.body().is_empty());
            let headers = response.headers();
            assert_eq!(headers["content-type"], "application/grpc");
            assert_eq!(headers["grpc-status"], status, "{reason:?}");
            assert_eq!(headers["grpc-message"], message);
        }
        let in_progress = rejection(Reason::InProgress {
            retry_after: Duration::from_secs(3),
        });
        assert_eq!(in_progress.grpc_response().headers()["retry-after"], "3");
    }

    #[test]
    fn a_key_read_from_the_body_is_said_to_be_missing_or_invalid_there() {
        let at = |reason| {
            Rejection::new(reason, "POST /v1/webhooks".to_owned())
                .with_key_in_body(Some("at /id".into()))
        };
        for reason in [Reason::KeyRequired, Reason::InvalidKey] {
            let detail = at(reason).detail();
            assert!(detail.contains("request body (at /id)"), "{detail}");
            assert!(!detail.contains("header"), "{detail}");
            let header = Rejection::new(reason, "POST /v1/payments".to_owned()).detail();
            assert!(!header.contains("request body"), "{header}");
            // The code, the status and the default JSON are those of a header's key.
            assert_eq!(at(reason).json_response().body(), {
                Rejection::new(reason, String::new()).json_response().body()
            });
        }
    }

    #[test]
    fn the_default_json_is_unchanged() {
        let cases = [
            (
                Reason::KeyRequired,
                400,
                r#"{"error":"idempotency_key_required"}"#,
                None,
            ),
            (
                Reason::InvalidKey,
                400,
                r#"{"error":"invalid_idempotency_key"}"#,
                None,
            ),
            (
                Reason::InvalidBody,
                400,
                r#"{"error":"invalid_request_body"}"#,
                None,
            ),
            (
                Reason::BodyTooLarge { limit: 10 },
                413,
                r#"{"error":"request_body_too_large","limit":10}"#,
                None,
            ),
            (
                Reason::ReusedWithDifferentParams,
                409,
                r#"{"error":"idempotency_key_reused_with_different_params"}"#,
                None,
            ),
            (
                Reason::InProgress {
                    retry_after: Duration::from_millis(1500),
                },
                409,
                r#"{"error":"request_in_progress","retry_after":2}"#,
                Some("2"),
            ),
            (
                Reason::StoreUnavailable,
                503,
                r#"{"error":"idempotency_store_unavailable"}"#,
                Some("1"),
            ),
            (
                Reason::NotReplayable {
                    status: StatusCode::CREATED,
                },
                409,
                r#"{"error":"response_not_replayable","status":201}"#,
                None,
            ),
        ];
        for (reason, status, body, retry_after) in cases {
            let response = rejection(reason).json_response();
            assert_eq!(response.status().as_u16(), status, "{reason:?}");
            assert_eq!(response.body(), body.as_bytes(), "{reason:?}");
            assert_eq!(response.headers()["content-type"], "application/json");
            let header = response.headers().get("retry-after");
            assert_eq!(header.map(|v| v.to_str().unwrap()), retry_after);
        }
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
