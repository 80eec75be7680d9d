//! Recording a response: buffered up to the layer's limit, judged by the release policy,
//! stored without the headers that belong to one transmission, and handed on to its
//! client whole, whatever was recorded.

use std::{fmt, future::Future, pin::Pin};

use bytes::{Bytes, BytesMut};
use http::{header, response, HeaderMap, HeaderName, Response, StatusCode};
use http_body::Body;
use http_body_util::BodyExt;
use tokio::time::Instant;

use super::{
    body::ResponseBody,
    grpc::Protocol,
    lease::{Completed, Lease},
    rejection::{Reason, Rejection},
    telemetry::RequestOutcome,
};
use crate::{
    fingerprint::SentHeaders,
    store::record::{map_with_room, replay_holds},
    Fingerprint, StoredResponse,
};

/// A response with its body read, up to `max_response_body`: what [`record`] records.
pub(crate) struct Captured<B: Body> {
    parts: response::Parts,
    buffered: Buffered<B>,
}

/// Reads the response's body, up to `limit` bytes. A streamed body is the handler's work
/// too: the execution reads it where it runs the handler, with the lease renewed and
/// panics caught, so a body that streams past the lease is not executed again and one
/// that panics gives its key back.
pub(crate) async fn capture<B>(response: Response<B>, limit: usize) -> Captured<B>
where
    B: Body<Data = Bytes>,
{
    let (parts, body) = response.into_parts();
    let buffered = buffer_response(body, limit).await;
    Captured { parts, buffered }
}

/// Records a captured response unless the release policy gives the key back, and returns
/// it to its client. The execution, begun at `started`, is timed to the end of the body it
/// captured, and that one reading of the clock also starts the record's write.
pub(crate) async fn record<B>(
    lease: &Lease,
    protocol: Protocol,
    fingerprint: Fingerprint,
    asked: &SentHeaders,
    captured: Captured<B>,
    started: Instant,
) -> Response<ResponseBody<B>>
where
    B: Body<Data = Bytes>,
    B::Error: fmt::Display,
{
    let config = &lease.shared().config;
    let Captured {
        mut parts,
        buffered,
    } = captured;
    let ended = Instant::now();
    lease.shared().state.meters.executed_for(ended - started);
    // With, where the response itself is recorded, the fingerprint a refusal to replay it
    // would be recorded under.
    let (stored, fingerprint, refusable, answer) = match buffered {
        Buffered::Whole { body, trailers } => {
            let releases = config.release.releases_whole(
                protocol,
                parts.status,
                &parts.headers,
                trailers.as_deref(),
            );
            if releases {
                lease.release("the response releases the key").await;
                let body = ResponseBody::with_boxed_trailers(body, trailers);
                return Response::from_parts(parts, body);
            }
            if !replay_holds(&parts.headers) {
                lease.warn(
                    "response with more header names than a replay holds: retries get 409 response_not_replayable",
                );
                // As for a body over the limit: its client gets it, every retry the refusal.
                let stored = not_replayable(lease, protocol, parts.status);
                let answer = Answer::Streamed(ResponseBody::with_boxed_trailers(body, trailers));
                (stored, fingerprint, None, answer)
            } else {
                let plain = fingerprint;
                let fingerprint = fingerprint.varied_by_sent(&parts.headers, asked);
                // The record borrows the response's body, trailers and, when a replay keeps
                // every one, headers, and hands them back once written: copying them
                // would cost a map and a body handle per execution.
                let set_cookie = config.replay_set_cookie;
                let headers_lent = replays_every_header(&parts.headers, set_cookie);
                let headers = if headers_lent {
                    std::mem::take(&mut parts.headers)
                } else {
                    replayable_headers(&parts.headers, set_cookie)
                };
                let stored = StoredResponse {
                    status: parts.status,
                    headers,
                    body,
                    trailers,
                };
                let answer = Answer::Recorded { headers_lent };
                (stored, fingerprint, Some(plain), answer)
            }
        }
        Buffered::TooLarge { prefix, rest } => {
            lease.warn(
                "response larger than max_response_body: retries get 409 response_not_replayable",
            );
            // Not the response but a refusal to replay it, to every retry alike.
            let stored = not_replayable(lease, protocol, parts.status);
            let answer = Answer::Streamed(ResponseBody::spliced(prefix, rest));
            (stored, fingerprint, None, answer)
        }
        Buffered::Failed(error) => {
            tracing::error!(%error, "the response body failed");
            lease.release("the response body failed").await;
            let mut response = Response::new(ResponseBody::full(Bytes::new()));
            *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
            return response;
        }
    };
    let mut outcome = match refusable {
        Some(_) => RequestOutcome::Executed,
        None => RequestOutcome::NotReplayable,
    };
    let completed = lease
        .complete(fingerprint, &stored, ended, refusable.is_some())
        .await;
    if completed != Completed::Recorded && lease.shared().store.commits_handler_writes() {
        // The handler's writes were rolled back with the record: its response would tell
        // of what did not happen. The retry executes again.
        lease.shared().answered(RequestOutcome::StoreUnavailable);
        let endpoint = lease.scope().endpoint().to_owned();
        let rejection = Rejection::new(Reason::StoreUnavailable, endpoint);
        return rejection.into_response(protocol, config.render_rejections.as_deref());
    }
    if let (Completed::Refused, Some(plain)) = (completed, refusable) {
        outcome = refuse_replays(lease, protocol, plain, stored.status).await;
    }
    lease.shared().answered(outcome);
    let body = match answer {
        Answer::Recorded { headers_lent } => {
            if headers_lent {
                parts.headers = stored.headers;
            }
            ResponseBody::with_boxed_trailers(stored.body, stored.trailers)
        }
        Answer::Streamed(body) => body,
    };
    Response::from_parts(parts, body)
}

/// Records a refusal to replay a response of `status` where the store refused its record
/// for good: the retries get `409 response_not_replayable`, as for a response over
/// `max_response_body`, never a second execution. Boxed and out of line: it is rare, and
/// in place it would make every execution's future larger.
#[cold]
#[inline(never)]
fn refuse_replays<'a>(
    lease: &'a Lease,
    protocol: Protocol,
    fingerprint: Fingerprint,
    status: StatusCode,
) -> Pin<Box<dyn Future<Output = RequestOutcome> + Send + 'a>> {
    Box::pin(async move {
        let refusal = not_replayable(lease, protocol, status);
        if lease.record_refusal(fingerprint, &refusal).await {
            RequestOutcome::NotReplayable
        } else {
            RequestOutcome::Executed
        }
    })
}

/// The record of a refusal to replay a response of `status`: `409 response_not_replayable`.
fn not_replayable(lease: &Lease, protocol: Protocol, status: StatusCode) -> StoredResponse {
    let renderer = lease.shared().config.render_rejections.as_deref();
    let endpoint = lease.scope().endpoint().to_owned();
    Rejection::new(Reason::NotReplayable { status }, endpoint).into_stored(protocol, renderer)
}

/// What a recorded execution's client gets once the record is written.
enum Answer<B> {
    /// The response as recorded: its body and trailers handed back from the record, and
    /// its headers too where the record took them whole (`headers_lent`).
    Recorded { headers_lent: bool },
    /// The response's body as it streams on; the record is a refusal to replay it.
    Streamed(ResponseBody<B>),
}

enum Buffered<B: Body> {
    Whole {
        body: Bytes,
        trailers: Option<Box<HeaderMap>>,
    },
    TooLarge {
        prefix: Bytes,
        rest: Pin<Box<B>>,
    },
    Failed(B::Error),
}

/// Reads `body` up to `limit` bytes. Boxed, so that a body that is not `Unpin` can be read
/// in place and still handed on whole when it turns out too large.
async fn buffer_response<B>(body: B, limit: usize) -> Buffered<B>
where
    B: Body<Data = Bytes>,
{
    let mut body = Box::pin(body);
    if body.size_hint().lower() > limit as u64 {
        return Buffered::TooLarge {
            prefix: Bytes::new(),
            rest: body,
        };
    }
    // Most bodies are one frame: keep it without copying.
    let mut first: Option<Bytes> = None;
    let mut trailers: Option<Box<HeaderMap>> = None;
    let mut more = BytesMut::new();
    let mut len = 0;
    while let Some(frame) = body.frame().await {
        let data = match frame {
            Ok(frame) => match frame.into_data() {
                Ok(data) => data,
                Err(frame) => {
                    if let Ok(more) = frame.into_trailers() {
                        trailers.get_or_insert_default().extend(more);
                    }
                    continue;
                }
            },
            Err(error) => return Buffered::Failed(error),
        };
        len += data.len();
        match &first {
            None => first = Some(data),
            Some(head) => {
                if more.is_empty() {
                    more.extend_from_slice(head);
                }
                more.extend_from_slice(&data);
            }
        }
        if len > limit {
            let prefix = if more.is_empty() {
                first.unwrap_or_default()
            } else {
                more.freeze()
            };
            return Buffered::TooLarge { prefix, rest: body };
        }
    }
    let body = if more.is_empty() {
        first.unwrap_or_default()
    } else {
        more.freeze()
    };
    Buffered::Whole { body, trailers }
}

/// The headers a replay does not carry: the hop-by-hop ones (RFC 9110 §7.6.1) and `Date`,
/// which belong to one transmission, not to the response. (`Trailer` is end to end: it
/// names the trailers the replay ends with too, which HTTP/1.1 sends only so declared.)
const NOT_REPLAYED: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "transfer-encoding",
    "upgrade",
    "date",
];

/// Whether a replay carries a header named `name` (leaving aside those that `Connection`
/// names); `Set-Cookie` only if `set_cookie`: it belongs to one client's session, and a
/// replay goes to whoever sends the key again.
fn replayed(name: &HeaderName, set_cookie: bool) -> bool {
    !NOT_REPLAYED.contains(&name.as_str()) && (set_cookie || name != header::SET_COOKIE)
}

/// Whether a replay carries every one of `headers`, as most responses' are: then the record
/// can take the map as it is. (One that names others in `Connection` has `Connection`.)
fn replays_every_header(headers: &HeaderMap, set_cookie: bool) -> bool {
    headers.keys().all(|name| replayed(name, set_cookie))
}

/// The headers a replay carries: every one but those [`replayed`] refuses and any that
/// `Connection` names.
fn replayable_headers(headers: &HeaderMap, set_cookie: bool) -> HeaderMap {
    let named_by_connection: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    // Room for the headers a replay adds, without growing the map.
    let mut kept = map_with_room(headers.len(), headers.keys_len());
    for (name, value) in headers {
        if replayed(name, set_cookie) && !named_by_connection.contains(name) {
            kept.append(name.clone(), value.clone());
        }
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use http_body_util::{Full, StreamBody};

    #[test]
    fn hop_by_hop_headers_and_date_are_not_replayed() {
        let mut headers = HeaderMap::new();
        headers.append("content-type", HeaderValue::from_static("application/json"));
        headers.append(
            "date",
            HeaderValue::from_static("Tue, 01 Dec 2026 00:00:00 GMT"),
        );
        headers.append("connection", HeaderValue::from_static("x-hop"));
        headers.append("x-hop", HeaderValue::from_static("1"));
        headers.append("transfer-encoding", HeaderValue::from_static("chunked"));
        headers.append("set-cookie", HeaderValue::from_static("a=1"));
        headers.append("set-cookie", HeaderValue::from_static("b=2"));
        let kept = |set_cookie| {
            let kept = replayable_headers(&headers, set_cookie);
            kept.iter()
                .map(|(n, v)| (n.as_str().to_owned(), v.to_str().unwrap().to_owned()))
                .collect::<Vec<_>>()
        };
        let pairs = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            kept(true),
            pairs(&[
                ("content-type", "application/json"),
                ("set-cookie", "a=1"),
                ("set-cookie", "b=2")
            ])
        );
        // By default a session cookie is not handed to whoever replays.
        assert_eq!(kept(false), pairs(&[("content-type", "application/json")]));
        // Such a map is copied for the record; one a replay keeps whole is lent to it.
        assert!(!replays_every_header(&headers, true));
        let mut plain = HeaderMap::new();
        plain.append("content-type", HeaderValue::from_static("application/json"));
        plain.append("location", HeaderValue::from_static("/v1/payments/pay_1"));
        assert!(replays_every_header(&plain, false));
        plain.append("set-cookie", HeaderValue::from_static("a=1"));
        assert!(replays_every_header(&plain, true));
        assert!(!replays_every_header(&plain, false));
        plain.append("keep-alive", HeaderValue::from_static("timeout=5"));
        assert!(!replays_every_header(&plain, true));
    }

    #[tokio::test]
    async fn buffering_stops_at_the_limit_and_keeps_the_rest() {
        let chunks = (0..10u8).map(|i| {
            Ok::<_, std::convert::Infallible>(http_body::Frame::data(Bytes::from(vec![i; 100])))
        });
        let body = StreamBody::new(futures_util::stream::iter(chunks));
        match buffer_response(body, 250).await {
            Buffered::TooLarge { prefix, rest } => {
                assert_eq!(prefix.len(), 300);
                let rest = rest.collect().await.unwrap().to_bytes();
                assert_eq!(prefix.len() + rest.len(), 1000);
                assert_eq!(rest[0], 3);
            }
            _ => panic!("expected TooLarge"),
        }
        match buffer_response(Full::new(Bytes::from_static(b"abc")), 3).await {
            Buffered::Whole { body, trailers } => {
                assert_eq!(body, "abc");
                assert!(trailers.is_none());
            }
            _ => panic!("expected Whole"),
        }
    }
}
