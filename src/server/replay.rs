//! Replays: a stored response, marked.

use http::{HeaderName, HeaderValue, Response};

use super::body::ResponseBody;
use crate::StoredResponse;

/// The header that marks a replayed response.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// The stored response, byte for byte, marked as a replay.
pub(crate) fn replay<B>(stored: StoredResponse) -> Response<ResponseBody<B>> {
    const REPLAYED: HeaderName = HeaderName::from_static(REPLAYED_HEADER);
    let mut headers = stored.headers;
    headers.insert(REPLAYED, HeaderValue::from_static("true"));
    let mut response = Response::new(ResponseBody::with_boxed_trailers(
        stored.body,
        stored.trailers,
    ));
    *response.status_mut() = stored.status;
    *response.headers_mut() = headers;
    response
}
