//! The IETF profile: rejections as RFC 9457 problem details, with the statuses of the
//! `Idempotency-Key` draft.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};

use super::{Rejection, RejectionKind, RenderRejection};

/// Renders rejections as the IETF `Idempotency-Key` draft
/// (`draft-ietf-httpapi-idempotency-key-header`) describes them: `application/problem+json`
/// (RFC 9457) with `type`, `title`, `status` and `detail`, the crate's error `code` as an
/// extension member, and the draft's statuses.
///
/// | rejection | status | extension members |
/// |---|---|---|
/// | key missing or invalid, body unreadable | `400` | `code` |
/// | body too large | `413` | `code`, `limit` |
/// | key reused with a different payload | `422` | `code` |
/// | key in progress | `409` + `Retry-After` | `code`, `retry_after` |
/// | response too large to replay | `409` | `code`, `original_status` |
/// | store unavailable | `503` + `Retry-After` | `code`, `retry_after` |
///
/// The documentation URL is every problem's `type` and is sent as
/// `Link: <url>; rel="describedby"; type="text/html"`, as the draft's examples do.
///
/// # Example
///
/// ```
/// use tower_idempotency::{IdempotencyLayer, MemoryStore, ProblemDetails};
///
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .render_rejections(ProblemDetails::new("https://developer.example.com/idempotency"));
/// ```
#[derive(Clone, Debug)]
pub struct ProblemDetails {
    documentation: String,
    link: HeaderValue,
}

/// The media type of RFC 9457 problem details in JSON.
pub const PROBLEM_JSON: &str = "application/problem+json";

impl ProblemDetails {
    /// The profile, with `documentation` (an absolute URL) as every problem's `type` and
    /// `describedby` link.
    ///
    /// # Panics
    ///
    /// If `documentation` cannot go in a header (control characters, non-ASCII, `>`).
    pub fn new(documentation: impl Into<String>) -> Self {
        let documentation = documentation.into();
        let link = (!documentation.contains('>'))
            .then(|| format!("<{documentation}>; rel=\"describedby\"; type=\"text/html\""))
            .and_then(|link| HeaderValue::from_str(&link).ok())
            .unwrap_or_else(|| panic!("not a URL for a Link header: {documentation:?}"));
        Self {
            documentation,
            link,
        }
    }

    /// The status the draft gives each rejection.
    pub fn status(rejection: &Rejection) -> StatusCode {
        match rejection.kind() {
            RejectionKind::ReusedWithDifferentParams => StatusCode::UNPROCESSABLE_ENTITY,
            _ => rejection.status(),
        }
    }
}

impl RenderRejection for ProblemDetails {
    fn render(&self, rejection: &Rejection) -> Response<Bytes> {
        let status = Self::status(rejection);
        let mut problem = serde_json::Map::with_capacity(7);
        let mut member = |name: &str, value: serde_json::Value| {
            problem.insert(name.to_owned(), value);
        };
        member("type", self.documentation.as_str().into());
        member("title", rejection.title().into());
        member("status", status.as_u16().into());
        member("detail", rejection.detail().into());
        member("code", rejection.code().into());
        if let Some(secs) = rejection.retry_after_secs() {
            member("retry_after", secs.into());
        }
        if let Some(limit) = rejection.limit() {
            member("limit", limit.into());
        }
        if let Some(original) = rejection.original_status() {
            member("original_status", original.as_u16().into());
        }
        let body = serde_json::Value::Object(problem).to_string();
        let mut response = Response::new(Bytes::from(body));
        *response.status_mut() = status;
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        headers.insert(header::CONTENT_LANGUAGE, HeaderValue::from_static("en"));
        headers.insert(header::LINK, self.link.clone());
        if let Some(secs) = rejection.retry_after_secs() {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}
