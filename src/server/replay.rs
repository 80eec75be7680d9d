//! Replays: a stored response, marked.

use http::{HeaderMap, HeaderName, HeaderValue, Response};

use super::body::ResponseBody;
use crate::StoredResponse;

/// The header that marks a replayed response.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";

/// The stored response, byte for byte, marked as a replay.
pub(crate) fn replay<B>(stored: StoredResponse) -> Response<ResponseBody<B>> {
    const REPLAYED: HeaderName = HeaderName::from_static(REPLAYED_HEADER);
    // A record's headers come cloned, with no room to spare: each header added on the way
    // out (ours, then the server's `Content-Length`) would grow the map again, and hyper,
    // which reuses a response's map to parse the next request on its connection, would
    // grow it once more. Copied once into a map with room for them instead, in order.
    let mut headers = HeaderMap::with_capacity(stored.headers.len() + 2);
    headers.extend(stored.headers);
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
    use http::{header, StatusCode};

    use super::*;

    /// Headers leave in the order they were recorded, repeated ones included, with the
    /// replay's mark after them.
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
        let response = replay::<http_body_util::Empty<Bytes>>(stored);
        assert_eq!(response.status(), StatusCode::CREATED);
        let sent: Vec<_> = response.headers().iter().collect();
        let mut expected: Vec<_> = recorded.iter().collect();
        let mark = (
            &HeaderName::from_static(REPLAYED_HEADER),
            &HeaderValue::from_static("true"),
        );
        expected.push(mark);
        assert_eq!(sent, expected);
        assert!(response.headers().capacity() >= recorded.len() + 2);
    }
}
