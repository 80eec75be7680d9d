//! What a completed request created, for the `resource_id` column.

use std::{fmt, sync::Arc};

use http::{header::LOCATION, HeaderName};

use crate::StoredResponse;

/// The longest id kept, in bytes. A longer one is no id of a row in a business table worth
/// joining on: the column is left `NULL` rather than holding a cut one that could match
/// the wrong row.
pub const MAX_RESOURCE_ID_LEN: usize = 255;

/// Finds, in the response a request completed with, the id of what it created (a payment,
/// an order), which [`PostgresStore`](super::PostgresStore) writes to the row's
/// `resource_id` column so that reconciliation can join the idempotency record to the
/// business table.
///
/// [`ResourceId`] has the usual ones; a closure
/// `Fn(&StoredResponse) -> Option<String>` is one too. It runs once per completion, on the
/// response as it is recorded (hop-by-hop headers and `Date` removed, the body as the
/// handler sent it: compressed, if a compression layer runs inside this one), whatever its
/// status. An id that is empty, longer than [`MAX_RESOURCE_ID_LEN`] bytes or holds a
/// control character is not written (the column stays `NULL`).
///
/// # Example
///
/// ```no_run
/// use tower_idempotency::{PostgresStore, StoredResponse};
///
/// # async fn run() -> Result<(), tower_idempotency::store::PostgresStoreError> {
/// // Only successful responses created something.
/// let store = PostgresStore::connect("postgres://localhost/app")
///     .await?
///     .resource_id(|response: &StoredResponse| {
///         if !response.status.is_success() {
///             return None;
///         }
///         Some(response.headers.get("x-payment-id")?.to_str().ok()?.to_owned())
///     });
/// # Ok(())
/// # }
/// ```
pub trait ExtractResourceId: Send + Sync + 'static {
    /// The id of what `response` created, if it names one.
    fn resource_id(&self, response: &StoredResponse) -> Option<String>;
}

impl<F> ExtractResourceId for F
where
    F: Fn(&StoredResponse) -> Option<String> + Send + Sync + 'static,
{
    fn resource_id(&self, response: &StoredResponse) -> Option<String> {
        self(response)
    }
}

/// The built-in [`ExtractResourceId`]s: the last path segment of `Location` (the default),
/// a header's value, a string or number at a JSON pointer into the body, or none.
///
/// # Example
///
/// ```no_run
/// use http::HeaderName;
/// use tower_idempotency::{store::ResourceId, PostgresStore};
///
/// # async fn run() -> Result<(), tower_idempotency::store::PostgresStoreError> {
/// let url = "postgres://localhost/app";
/// // `201 Created`, `Location: /v1/payments/pay_123` → `pay_123` (the default).
/// let store = PostgresStore::connect(url).await?.resource_id(ResourceId::location());
/// // `X-Payment-Id: pay_123` → `pay_123`.
/// let store = PostgresStore::connect(url)
///     .await?
///     .resource_id(ResourceId::header(HeaderName::from_static("x-payment-id")));
/// // `{"id": "pay_123", ...}` → `pay_123`.
/// let store = PostgresStore::connect(url).await?.resource_id(ResourceId::json_pointer("/id"));
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResourceId(Kind);

#[derive(Clone, Debug, Default, PartialEq, Eq)]
enum Kind {
    #[default]
    Location,
    Header(HeaderName),
    JsonPointer(String),
    None,
}

impl ResourceId {
    /// The last path segment of the `Location` header, its query and fragment left out:
    /// `pay_123` from `/v1/payments/pay_123`, `https://api.example.com/v1/payments/pay_123/`
    /// or `/v1/payments/pay_123?expand=card`. As sent, not percent-decoded. The default.
    pub fn location() -> Self {
        Self(Kind::Location)
    }

    /// The value of header `name`, when it is visible ASCII.
    pub fn header(name: HeaderName) -> Self {
        Self(Kind::Header(name))
    }

    /// The string or number at `pointer` (RFC 6901, as `serde_json::Value::pointer` reads
    /// it: `/id`, `/payment/id`) in a JSON body. The body is parsed once per completion; a
    /// body that is not JSON names no id.
    pub fn json_pointer(pointer: impl Into<String>) -> Self {
        Self(Kind::JsonPointer(pointer.into()))
    }

    /// No id: the column stays `NULL`.
    pub fn none() -> Self {
        Self(Kind::None)
    }
}

impl ExtractResourceId for ResourceId {
    fn resource_id(&self, response: &StoredResponse) -> Option<String> {
        match &self.0 {
            Kind::Location => {
                let location = response.headers.get(LOCATION)?.to_str().ok()?;
                last_segment(location).map(str::to_owned)
            }
            Kind::Header(name) => Some(response.headers.get(name)?.to_str().ok()?.to_owned()),
            Kind::JsonPointer(pointer) => {
                let body: serde_json::Value = serde_json::from_slice(&response.body).ok()?;
                match body.pointer(pointer)? {
                    serde_json::Value::String(id) => Some(id.clone()),
                    serde_json::Value::Number(id) => Some(id.to_string()),
                    _ => None,
                }
            }
            Kind::None => None,
        }
    }
}

/// The last segment of a URI reference's path: after the scheme and authority (of an
/// absolute URI, or of a network-path reference `//host/...`), before the query and
/// fragment, a trailing `/` ignored.
fn last_segment(location: &str) -> Option<&str> {
    let end = location.find(['?', '#']).unwrap_or(location.len());
    let mut path = &location[..end];
    let authority = match path.find("://") {
        Some(colon) if is_scheme(&path[..colon]) => Some(&path[colon + 3..]),
        _ => path.strip_prefix("//"),
    };
    if let Some(after) = authority {
        path = after.find('/').map_or("", |slash| &after[slash..]);
    }
    let segment = path.trim_end_matches('/').rsplit('/').next()?;
    (!segment.is_empty()).then_some(segment)
}

/// Whether `name` is a URI scheme (RFC 3986 §3.1): a letter, then letters, digits, `+`,
/// `-` or `.`.
fn is_scheme(name: &str) -> bool {
    let mut chars = name.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// The extractor a store holds.
#[derive(Clone)]
pub(super) struct Extractor(Arc<dyn ExtractResourceId>);

impl Extractor {
    pub(super) fn new(extractor: impl ExtractResourceId) -> Self {
        Self(Arc::new(extractor))
    }

    /// The id `response` names, if it is one to write.
    pub(super) fn extract(&self, response: &StoredResponse) -> Option<String> {
        let id = self.0.resource_id(response)?;
        let writable =
            !id.is_empty() && id.len() <= MAX_RESOURCE_ID_LEN && !id.chars().any(char::is_control);
        if !writable {
            tracing::debug!(
                len = id.len(),
                "resource id not recorded: empty, too long or with a control character"
            );
        }
        writable.then_some(id)
    }
}

impl Default for Extractor {
    fn default() -> Self {
        Self::new(ResourceId::location())
    }
}

impl fmt::Debug for Extractor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ExtractResourceId")
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http::{HeaderMap, HeaderValue, StatusCode};

    use super::*;

    fn response(headers: &[(&'static str, &'static str)], body: &'static str) -> StoredResponse {
        let mut map = HeaderMap::new();
        for (name, value) in headers {
            map.append(*name, HeaderValue::from_static(value));
        }
        StoredResponse {
            status: StatusCode::CREATED,
            headers: map,
            body: Bytes::from_static(body.as_bytes()),
            trailers: None,
        }
    }

    fn extract(extractor: impl ExtractResourceId, response: &StoredResponse) -> Option<String> {
        Extractor::new(extractor).extract(response)
    }

    #[test]
    fn location_gives_its_last_path_segment() {
        for (location, id) in [
            ("/v1/payments/pay_123", Some("pay_123")),
            ("/v1/payments/pay_123/", Some("pay_123")),
            ("/v1/payments/pay_123?expand=card#top", Some("pay_123")),
            (
                "https://api.example.com/v1/payments/pay_123",
                Some("pay_123"),
            ),
            ("pay_123", Some("pay_123")),
            ("https://api.example.com", None),
            ("https://api.example.com/", None),
            ("https://api.example.com?next=/v1/payments/pay_1", None),
            ("https://api.example.com#/v1/payments/pay_1", None),
            (
                "https://api.example.com/v1/payments/pay_9?next=/a/b#/c/d",
                Some("pay_9"),
            ),
            ("/v1/payments/pay_123#frag", Some("pay_123")),
            ("/v1/payments/pay_123?next=/v1/other/x", Some("pay_123")),
            // A network-path reference: its first segment is the host, not a path.
            ("//api.example.com", None),
            ("//api.example.com/", None),
            ("//api.example.com?x=/y", None),
            ("//api.example.com/v1/payments/pay_123", Some("pay_123")),
            ("/", None),
            ("?x=1", None),
        ] {
            let response = response(&[("location", location)], "");
            assert_eq!(
                extract(ResourceId::default(), &response).as_deref(),
                id,
                "{location}"
            );
        }
        assert_eq!(extract(ResourceId::location(), &response(&[], "")), None);
    }

    #[test]
    fn header_and_json_pointer_give_their_value() {
        let response = response(
            &[("x-payment-id", "pay_9")],
            r#"{"id":"pay_7","n":42,"card":{"id":"card_1"},"ok":true}"#,
        );
        let header = ResourceId::header(HeaderName::from_static("x-payment-id"));
        assert_eq!(extract(header, &response).as_deref(), Some("pay_9"));
        for (pointer, id) in [
            ("/id", Some("pay_7")),
            ("/n", Some("42")),
            ("/card/id", Some("card_1")),
            ("/ok", None),
            ("/missing", None),
        ] {
            let extractor = ResourceId::json_pointer(pointer);
            assert_eq!(extract(extractor, &response).as_deref(), id, "{pointer}");
        }
        let not_json = self::response(&[], "pay_7");
        assert_eq!(extract(ResourceId::json_pointer("/id"), &not_json), None);
        assert_eq!(extract(ResourceId::none(), &response), None);
    }

    #[test]
    fn ids_are_bounded_and_free_of_control_characters() {
        let long = "a".repeat(MAX_RESOURCE_ID_LEN);
        let id = move |_: &StoredResponse| Some(long.clone());
        assert_eq!(
            extract(id, &response(&[], "")).map(|id| id.len()),
            Some(255)
        );
        for bad in [
            "",
            "pay\u{0}1",
            "pay\n1",
            &"a".repeat(MAX_RESOURCE_ID_LEN + 1),
        ] {
            let bad = bad.to_owned();
            let id = move |_: &StoredResponse| Some(bad.clone());
            assert_eq!(extract(id, &response(&[], "")), None);
        }
    }
}
