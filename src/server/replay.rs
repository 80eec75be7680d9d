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

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use http::{header, HeaderMap, StatusCode};

    use super::*;

    /// Headers leave in the order they were recorded, repeated ones included, with the
    /// replay's mark after them, from a copy of the record made to replay.
    #[test]
    fn a_replay_keeps_the_recorded_headers_in_order() {
        let mut recorded = HeaderMap::new();
        recorded.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        recorded.append(header::SET_COOKIE, HeaderValue::from_static("a=1"));
        recorded.insert("x-b", HeaderValue::from_static("b"));
        recorded.append(header::SET_COOKIE, HeaderValue::from_static("c=3"));
        recorded.insert(header::LOCATION, HeaderValue::from_static("/p/1"));
        let stored = StoredResponse {
            status: StatusCode::CREATED,
            headers: recorded.clone(),
            body: Bytes::from_static(b"{}"),
            trailers: None,
        };
        let copy = stored.replayable_copy();
        assert!(copy.headers.capacity() >= recorded.len() + 2);
        let response = replay::<http_body_util::Empty<Bytes>>(copy);
        assert_eq!(response.status(), StatusCode::CREATED);
        let sent: Vec<_> = response.headers().iter().collect();
        let mut expected: Vec<_> = recorded.iter().collect();
        let mark = (
            &HeaderName::from_static(REPLAYED_HEADER),
            &HeaderValue::from_static("true"),
        );
        expected.push(mark);
        assert_eq!(sent, expected);
    }
}
