//! What a store keeps for a key, and its versioned byte encoding.

use std::{
    cell::Cell,
    fmt,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

use crate::Fingerprint;

/// The proof that a request holds a key: every write after the claim must present it, so a
/// holder whose lease was lost and re-claimed by another request cannot touch the new claim.
///
/// Its first 8 bytes are when it was issued (unix milliseconds), so that a store which
/// finds a key held can say how long its holder has been running ([`ClaimToken::age`])
/// without keeping a time of its own.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClaimToken([u8; 16]);

impl ClaimToken {
    /// A token no other claim holds: the time, then a count each thread runs up from a
    /// random 64-bit start. Two tokens collide only if two threads' counts meet within the
    /// same millisecond, without a random draw per claim.
    pub fn unique() -> Self {
        Self::issued(unix_millis(SystemTime::now()))
    }

    /// A token no other claim holds, as [`unique`](Self::unique), issued at `now`: a
    /// reading of the monotonic clock its caller took anyway. The wall-clock time comes
    /// from this thread's last reading of the system clock, taken again once it is a
    /// second old: one clock reading fewer for every keyed request, and a time that is at
    /// most that second off (the system clock stepped meanwhile), as good for
    /// [`age`](Self::age), which counts in seconds of a lease.
    pub(crate) fn unique_at(now: Instant) -> Self {
        const REREAD: Duration = Duration::from_secs(1);
        thread_local! {
            static WALL: Cell<Option<(Instant, u64)>> = const { Cell::new(None) };
        }
        let millis = WALL.with(|wall| {
            let derived = wall.get().and_then(|(read, millis)| {
                let since = now.checked_duration_since(read)?;
                (since < REREAD).then(|| millis + u64::from(since.subsec_millis()))
            });
            derived.unwrap_or_else(|| {
                let millis = unix_millis(SystemTime::now());
                wall.set(Some((now, millis)));
                millis
            })
        });
        Self::issued(millis)
    }

    /// The token of unix time `millis`, then this thread's next count.
    fn issued(millis: u64) -> Self {
        thread_local! {
            static NEXT: Cell<u64> = Cell::new(rand::random());
        }
        let count = NEXT.with(|next| next.replace(next.get().wrapping_add(1)));
        let mut bytes = [0; 16];
        bytes[..8].copy_from_slice(&millis.to_be_bytes());
        bytes[8..].copy_from_slice(&count.to_be_bytes());
        Self(bytes)
    }

    /// How long ago the token was issued, by this machine's clock; `None` when its time is
    /// not plausible (more than a minute ahead, or more than 30 days old), as for a token
    /// made by [`from_bytes`](Self::from_bytes) of other bytes.
    pub fn age(&self) -> Option<Duration> {
        const SKEW: u64 = 60_000;
        const OLDEST: u64 = 30 * 86_400_000;
        let issued = u64::from_be_bytes(self.0[..8].try_into().unwrap_or_default());
        let now = unix_millis(SystemTime::now());
        if issued > now.saturating_add(SKEW) || now.saturating_sub(issued) > OLDEST {
            return None;
        }
        Some(Duration::from_millis(now.saturating_sub(issued)))
    }

    /// A token from its stored bytes.
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    /// The token's bytes.
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

/// The instant `after` from `now`, for a store's expiry: as `now + after`, but a duration
/// further than the clock counts (`Duration::MAX`, for a record kept for ever) is as far as
/// it does, at most [`LONGEST_DURATION`](crate::LONGEST_DURATION) on, not a panic.
pub(crate) fn expiry(now: Instant, after: Duration) -> Instant {
    let mut after = after;
    loop {
        match now.checked_add(after) {
            Some(at) => return at,
            None => after = (after / 2).min(crate::LONGEST_DURATION),
        }
    }
}

fn unix_millis(time: SystemTime) -> u64 {
    let since_epoch = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    u64::try_from(since_epoch.as_millis()).unwrap_or(u64::MAX)
}

impl fmt::Debug for ClaimToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Only the end of the count: enough to correlate log lines, not enough to forge a
        // write. (The start is the time, the same for every token of a moment.)
        write!(f, "ClaimToken(…{:02x}{:02x})", self.0[14], self.0[15])
    }
}

/// A response as the client first received it, to replay byte for byte.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status code.
    pub status: StatusCode,
    /// The headers, hop-by-hop headers and `Date` already removed.
    pub headers: HeaderMap,
    /// The body bytes.
    pub body: Bytes,
    /// The trailers that followed the body (gRPC's status lives there), if any. Boxed:
    /// most responses have none, and every record, claim and cache entry would carry an
    /// empty map's size.
    pub trailers: Option<Box<HeaderMap>>,
}

/// The headers a replay adds on its way out: its mark, then the server's `Content-Length`.
/// Maps a replay starts from leave room for them, so that neither grows the map: hyper
/// reuses a response's map to parse the next request on its connection, where a map grown
/// from an exact fit grows once more.
const REPLAY_ROOM: usize = 2;

/// The most header names a [`HeaderMap`] holds: the http crate caps a map at 2^15 slots,
/// three quarters of them usable. Values count against it only by their names: a map holds
/// any number of values under one name.
const MOST_HEADER_NAMES: usize = 24_576;

/// Whether a replay can carry `headers`: whether they leave room, in one map, for the
/// headers a replay adds. A response with more names than that is recorded as not
/// replayable; adding the replay's mark to its map would panic.
pub(crate) fn replay_holds(headers: &HeaderMap) -> bool {
    headers.keys_len() + REPLAY_ROOM <= MOST_HEADER_NAMES
}

/// An empty map for `values` header values under `names` names, with room for the headers
/// a replay adds: sized for every value and those, as most maps are, or, where that is more
/// than a map holds, for the names and those, or else sized as it grows: never the panic
/// of `HeaderMap::with_capacity` past a map's limit.
pub(crate) fn map_with_room(values: usize, names: usize) -> HeaderMap {
    HeaderMap::try_with_capacity(values.saturating_add(REPLAY_ROOM))
        .or_else(|_| HeaderMap::try_with_capacity(names.saturating_add(REPLAY_ROOM)))
        .unwrap_or_default()
}

impl StoredResponse {
    /// A copy to replay: as `clone`, but its headers in a map with room for the headers a
    /// replay adds, in the same order. For stores that keep records in memory and answer
    /// each claim with a copy (a cloned map has no room to spare). Never a panic, however
    /// many headers the response has: the copy holds no more names than the original.
    pub(crate) fn replayable_copy(&self) -> Self {
        let mut headers = map_with_room(self.headers.len(), self.headers.keys_len());
        for (name, value) in &self.headers {
            // No more names than the original map holds: there is room for each.
            let _ = headers.try_append(name.clone(), value.clone());
        }
        Self {
            status: self.status,
            headers,
            body: self.body.clone(),
            trailers: self.trailers.clone(),
        }
    }
}

/// What a store keeps for one key, with its byte encoding ([`encode`](Self::encode)): a
/// claim in progress, or a completed request and the [`StoredResponse`] that replays it.
/// Stores that keep records as bytes use it; a store answers
/// [`Store::claim`](crate::Store::claim) with a [`Claim`](crate::store::Claim), made from
/// the record it found.
#[derive(Clone, Debug, PartialEq, Eq)]
// The completed variant is the one replays read: boxing it would cost them an allocation.
#[allow(clippy::large_enum_variant)]
pub enum Record {
    /// A request holds the key and is executing.
    InProgress {
        /// The fingerprint of the holder's request.
        fingerprint: Fingerprint,
        /// The holder's claim token.
        token: ClaimToken,
    },
    /// The operation finished; its response is replayed to every retry.
    Completed {
        /// The fingerprint of the request that ran.
        fingerprint: Fingerprint,
        /// What it answered.
        response: StoredResponse,
    },
}

/// Bytes that are not a record this version can read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("undecodable idempotency record: {0}")]
pub struct DecodeError(&'static str);

/// The first byte of every encoded record; a later release that changes the layout bumps
/// it and keeps reading this one.
pub(crate) const VERSION_1: u8 = 1;
pub(crate) const IN_PROGRESS: u8 = b'P';
/// Where the claim token starts in an in-progress record: after the version, the kind and
/// the fingerprint. The Redis scripts compare it there, in place.
pub(crate) const TOKEN_OFFSET: usize = 2 + 32;
/// The length of an in-progress record: the token ends it.
pub(crate) const IN_PROGRESS_LEN: usize = TOKEN_OFFSET + 16;
const COMPLETED: u8 = b'C';

impl Record {
    /// The fingerprint of the request that claimed the key.
    pub fn fingerprint(&self) -> &Fingerprint {
        match self {
            Self::InProgress { fingerprint, .. } | Self::Completed { fingerprint, .. } => {
                fingerprint
            }
        }
    }

    /// Encodes the record: `version, kind, fingerprint`, then the token (in progress) or
    /// `status u16, headers, trailers, body` (completed), where headers and trailers are
    /// each `count u32, (name len u32, name, value len u32, value)*` (no trailers: a count
    /// of 0). Integers are big-endian; the body runs to the end.
    pub fn encode(&self) -> Bytes {
        match self {
            Self::InProgress { fingerprint, token } => {
                let mut out = BytesMut::with_capacity(IN_PROGRESS_LEN);
                out.put_u8(VERSION_1);
                out.put_u8(IN_PROGRESS);
                out.put_slice(fingerprint.as_bytes());
                out.put_slice(token.as_bytes());
                out.freeze()
            }
            Self::Completed {
                fingerprint,
                response,
            } => encode_completed(fingerprint, response),
        }
    }

    /// Decodes what [`Record::encode`] wrote; any other bytes are an error, never a panic.
    pub fn decode(mut bytes: Bytes) -> Result<Self, DecodeError> {
        if take_u8(&mut bytes)? != VERSION_1 {
            return Err(DecodeError("unknown version"));
        }
        let kind = take_u8(&mut bytes)?;
        let fingerprint = Fingerprint::from_bytes(take_array(&mut bytes)?);
        match kind {
            IN_PROGRESS => {
                let token = ClaimToken::from_bytes(take_array(&mut bytes)?);
                if bytes.has_remaining() {
                    return Err(DecodeError("trailing bytes"));
                }
                Ok(Self::InProgress { fingerprint, token })
            }
            COMPLETED => {
                let status = StatusCode::from_u16(u16::from_be_bytes(take_array(&mut bytes)?))
                    .map_err(|_| DecodeError("invalid status"))?;
                let (headers, trailers) = take_headers_and_trailers(&mut bytes)?;
                let response = StoredResponse {
                    status,
                    headers,
                    body: bytes,
                    trailers,
                };
                Ok(Self::Completed {
                    fingerprint,
                    response,
                })
            }
            _ => Err(DecodeError("unknown record kind")),
        }
    }
}

/// [`Record::encode`] of a completed record, without building the record.
pub(crate) fn encode_completed(fingerprint: &Fingerprint, response: &StoredResponse) -> Bytes {
    let mut out = BytesMut::with_capacity(completed_len(response));
    put_completed(&mut out, fingerprint, response);
    out.freeze()
}

/// The length of the completed record of `response`.
pub(crate) fn completed_len(response: &StoredResponse) -> usize {
    2 + 32 + 2 + headers_and_trailers_len(response) + response.body.len()
}

/// The length of what [`put_headers_and_trailers`] writes for `response`.
pub(crate) fn headers_and_trailers_len(response: &StoredResponse) -> usize {
    headers_len(&response.headers) + response.trailers.as_deref().map_or(4, headers_len)
}

/// The length of what [`put_headers`] writes for `headers`.
fn headers_len(headers: &HeaderMap) -> usize {
    4 + headers
        .iter()
        .map(|(name, value)| 8 + name.as_str().len() + value.len())
        .sum::<usize>()
}

/// Writes the completed record of `response` at the end of `out`, for a store that frames
/// it with bytes of its own.
pub(crate) fn put_completed(
    out: &mut BytesMut,
    fingerprint: &Fingerprint,
    response: &StoredResponse,
) {
    out.put_u8(VERSION_1);
    out.put_u8(COMPLETED);
    out.put_slice(fingerprint.as_bytes());
    out.put_u16(response.status.as_u16());
    put_headers_and_trailers(out, response);
    out.put_slice(&response.body);
}

/// Writes the response's headers, then its trailers (a count of 0 when it had none), for
/// a record or a store that keeps them in a column of their own.
pub(crate) fn put_headers_and_trailers(out: &mut BytesMut, response: &StoredResponse) {
    put_headers(out, &response.headers);
    match &response.trailers {
        Some(trailers) => put_headers(out, trailers),
        None => out.put_u32(0),
    }
}

/// Reads what [`put_headers_and_trailers`] wrote; no trailers, or none, read as `None`.
pub(crate) fn take_headers_and_trailers(
    bytes: &mut Bytes,
) -> Result<(HeaderMap, Option<Box<HeaderMap>>), DecodeError> {
    // Room for the headers a replay adds, without growing the map.
    let headers =
        take_headers(bytes, REPLAY_ROOM)?.unwrap_or_else(|| HeaderMap::with_capacity(REPLAY_ROOM));
    let trailers = take_headers(bytes, 0)?.map(Box::new);
    Ok((headers, trailers))
}

/// Writes `header count u32, (name len u32, name, value len u32, value)*`, keeping order
/// and repeated headers.
fn put_headers(out: &mut BytesMut, headers: &HeaderMap) {
    out.put_u32(headers.len() as u32);
    for (name, value) in headers {
        put_bytes(out, name.as_str().as_bytes());
        put_bytes(out, value.as_bytes());
    }
}

/// Reads what [`put_headers`] wrote into a map with room for `room` more; `None` for an
/// empty set, which makes no map at all (most responses have no trailers).
fn take_headers(bytes: &mut Bytes, room: usize) -> Result<Option<HeaderMap>, DecodeError> {
    let count = u32::from_be_bytes(take_array(bytes)?) as usize;
    if count == 0 {
        return Ok(None);
    }
    // Each header takes at least 8 bytes: a count larger than that is corrupt, and must
    // not size an allocation.
    if count > bytes.len() / 8 {
        return Err(DecodeError("header count exceeds record"));
    }
    // Sized for every value where a map holds that many, else as it grows: names, not
    // values, count against a map's limit, and bytes past it are no record a replay carries.
    let mut headers = HeaderMap::try_with_capacity(count + room).unwrap_or_default();
    for _ in 0..count {
        let name = HeaderName::from_bytes(&take_bytes(bytes)?)
            .map_err(|_| DecodeError("invalid header name"))?;
        let value = HeaderValue::from_maybe_shared(take_bytes(bytes)?)
            .map_err(|_| DecodeError("invalid header value"))?;
        headers
            .try_append(name, value)
            .map_err(|_| DecodeError("more header names than a map holds"))?;
    }
    if headers.keys_len() + room > MOST_HEADER_NAMES {
        return Err(DecodeError("more header names than a replay holds"));
    }
    Ok(Some(headers))
}

fn put_bytes(out: &mut BytesMut, bytes: &[u8]) {
    out.put_u32(bytes.len() as u32);
    out.put_slice(bytes);
}

fn take_u8(bytes: &mut Bytes) -> Result<u8, DecodeError> {
    take_array::<1>(bytes).map(|[b]| b)
}

fn take_array<const N: usize>(bytes: &mut Bytes) -> Result<[u8; N], DecodeError> {
    if bytes.len() < N {
        return Err(DecodeError("truncated"));
    }
    let mut out = [0; N];
    bytes.copy_to_slice(&mut out);
    Ok(out)
}

fn take_bytes(bytes: &mut Bytes) -> Result<Bytes, DecodeError> {
    let len = u32::from_be_bytes(take_array(bytes)?) as usize;
    if bytes.len() < len {
        return Err(DecodeError("truncated"));
    }
    Ok(bytes.split_to(len))
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn an_in_progress_record_has_the_layout_the_redis_scripts_compare() {
        let token = ClaimToken::unique();
        let fingerprint = Fingerprint::from_bytes([7; 32]);
        let encoded = Record::InProgress { fingerprint, token }.encode();
        assert_eq!(encoded.len(), IN_PROGRESS_LEN);
        assert_eq!(&encoded[..2], &[VERSION_1, IN_PROGRESS]);
        assert_eq!(&encoded[TOKEN_OFFSET..], token.as_bytes());
    }

    #[test]
    fn tokens_are_unique_within_and_across_threads() {
        let draw = || (0..1000).map(|_| ClaimToken::unique()).collect::<Vec<_>>();
        let other = std::thread::spawn(draw).join().unwrap();
        let mut seen = HashSet::new();
        for token in draw().into_iter().chain(other) {
            assert!(seen.insert(token), "{token:?} was handed out twice");
        }
        assert_eq!(seen.len(), 2000);
    }

    #[test]
    fn a_token_issued_at_a_reading_carries_the_wall_clock_of_that_reading() {
        let issued =
            |token: ClaimToken| u64::from_be_bytes(token.as_bytes()[..8].try_into().unwrap());
        let now = Instant::now();
        let age = ClaimToken::unique_at(now).age().expect("a plausible time");
        assert!(age < Duration::from_secs(2), "{age:?}");
        // Within a second of this thread's last reading of the system clock, the time
        // follows the monotonic one to the millisecond.
        let later = now + Duration::from_secs(100);
        let first = issued(ClaimToken::unique_at(later));
        let next = issued(ClaimToken::unique_at(later + Duration::from_millis(400)));
        assert_eq!(next - first, 400);
        // A second on, or before the last reading, the system clock is read again.
        let reread = issued(ClaimToken::unique_at(later + Duration::from_millis(1500)));
        assert!(reread.abs_diff(first) < 1000, "{first} then {reread}");
        let earlier = issued(ClaimToken::unique_at(now));
        assert!(earlier.abs_diff(first) < 1000, "{first} then {earlier}");
    }

    fn completed(body: &'static [u8]) -> Record {
        completed_with(body, None)
    }

    fn completed_with(body: &'static [u8], trailers: Option<HeaderMap>) -> Record {
        let mut headers = HeaderMap::new();
        headers.append("set-cookie", HeaderValue::from_static("a=1"));
        headers.append("set-cookie", HeaderValue::from_static("b=2"));
        headers.append("x-bin", HeaderValue::from_bytes(b"\xff\x80opaque").unwrap());
        Record::Completed {
            fingerprint: Fingerprint::from_bytes([7; 32]),
            response: StoredResponse {
                status: StatusCode::PAYMENT_REQUIRED,
                headers,
                body: Bytes::from_static(body),
                trailers: trailers.map(Box::new),
            },
        }
    }

    fn grpc_trailers() -> Option<HeaderMap> {
        let mut trailers = HeaderMap::new();
        trailers.append("grpc-status", HeaderValue::from_static("9"));
        trailers.append("grpc-message", HeaderValue::from_static("card_declined"));
        Some(trailers)
    }

    #[test]
    fn round_trips() {
        for record in [
            completed(b"\x00\xffbinary"),
            completed(b""),
            completed_with(b"\x00\x00\x00\x00\x02hi", grpc_trailers()),
            completed_with(b"", grpc_trailers()),
            Record::InProgress {
                fingerprint: Fingerprint::from_bytes([1; 32]),
                token: ClaimToken::unique(),
            },
        ] {
            assert_eq!(Record::decode(record.encode()).unwrap(), record);
        }
    }

    #[test]
    fn a_completed_record_has_one_layout_with_or_without_trailers() {
        let record = completed(b"ok");
        let encoded = record.encode();
        assert_eq!(&encoded[..2], &[VERSION_1, COMPLETED]);
        assert_eq!(
            &encoded[encoded.len() - 6..],
            b"\0\0\0\0ok",
            "no trailers: a count of 0"
        );
        assert_eq!(encoded.len(), completed_len(&response_of(&record)));
        let with = completed_with(b"ok", grpc_trailers());
        assert_eq!(&with.encode()[..2], &[VERSION_1, COMPLETED]);
        assert_eq!(with.encode().len(), completed_len(&response_of(&with)));
        // Empty trailers are no trailers.
        let empty = completed_with(b"ok", Some(HeaderMap::new()));
        assert_eq!(empty.encode(), encoded);
        assert_eq!(Record::decode(empty.encode()).unwrap(), record);
        // The kind that once marked trailers is no kind at all.
        let mut other_kind = encoded.to_vec();
        other_kind[1] = b'T';
        assert!(Record::decode(Bytes::from(other_kind)).is_err());
    }

    fn response_of(record: &Record) -> StoredResponse {
        match record {
            Record::Completed { response, .. } => response.clone(),
            Record::InProgress { .. } => unreachable!(),
        }
    }

    #[test]
    fn every_truncation_is_an_error() {
        let encoded = completed_with(b"", grpc_trailers()).encode();
        for len in 0..encoded.len() {
            assert!(
                Record::decode(encoded.slice(..len)).is_err(),
                "prefix of {len} bytes"
            );
        }
        let encoded = completed(b"").encode();
        for len in 0..encoded.len() {
            assert!(
                Record::decode(encoded.slice(..len)).is_err(),
                "prefix of {len} bytes"
            );
        }
        let mut other_version = encoded.to_vec();
        other_version[0] = 99;
        assert!(Record::decode(Bytes::from(other_version)).is_err());
    }

    /// A duration past what the clock counts is the far future, not a panic.
    #[test]
    fn an_expiry_past_what_the_clock_counts_is_the_far_future() {
        let now = Instant::now();
        assert_eq!(
            expiry(now, Duration::from_secs(60)),
            now + Duration::from_secs(60)
        );
        let for_ever = expiry(now, Duration::MAX);
        assert!(for_ever > now + Duration::from_secs(50 * 365 * 86_400));
        assert!(for_ever <= now + crate::LONGEST_DURATION);
    }

    /// The bytes of a completed record whose headers are `count` pairs of `header(i)`.
    fn completed_of_headers(count: u32, header: impl Fn(u32) -> (String, &'static str)) -> Bytes {
        let mut out = BytesMut::new();
        out.put_u8(VERSION_1);
        out.put_u8(COMPLETED);
        out.put_slice(&[0; 32]);
        out.put_u16(200);
        out.put_u32(count);
        for i in 0..count {
            let (name, value) = header(i);
            put_bytes(&mut out, name.as_bytes());
            put_bytes(&mut out, value.as_bytes());
        }
        out.put_u32(0);
        out.freeze()
    }

    /// Well-formed bytes of more headers than a map can be sized for: 30 000 values under
    /// one name are a record like any other; 30 000 names, more than a map holds, are no
    /// record, and say so.
    #[test]
    fn decoding_a_record_of_many_headers_is_an_error_not_a_panic() {
        let one_name = completed_of_headers(30_000, |_| ("x-item".into(), "1"));
        let Ok(Record::Completed { response, .. }) = Record::decode(one_name) else {
            panic!("30 000 values under one name are a record");
        };
        assert_eq!(response.headers.len(), 30_000);
        assert_eq!(response.headers.keys_len(), 1);
        let many_names = completed_of_headers(30_000, |i| (format!("x-{i}"), ""));
        assert_eq!(
            Record::decode(many_names),
            Err(DecodeError("more header names than a map holds"))
        );
        // As many names as a map holds leave no room for a replay's mark.
        let full = completed_of_headers(MOST_HEADER_NAMES as u32, |i| (format!("x-{i}"), ""));
        assert!(Record::decode(full).is_err());
        let fits = MOST_HEADER_NAMES - REPLAY_ROOM;
        let fits = completed_of_headers(fits as u32, |i| (format!("x-{i}"), ""));
        assert!(Record::decode(fits).is_ok());
    }

    /// A response with more header values than `HeaderMap::with_capacity` takes, as a
    /// handler may answer, is copied for replay with room for the replay's headers, and
    /// round-trips through its encoding.
    #[test]
    fn a_response_of_many_header_values_is_copied_to_replay_and_round_trips() {
        let mut headers = HeaderMap::new();
        for _ in 0..30_000 {
            headers.append("x-item", HeaderValue::from_static("1"));
        }
        let response = StoredResponse {
            status: StatusCode::OK,
            headers,
            body: Bytes::new(),
            trailers: None,
        };
        let copy = response.replayable_copy();
        assert_eq!(copy, response);
        assert!(copy.headers.capacity() >= copy.headers.keys_len() + REPLAY_ROOM);
        assert!(replay_holds(&response.headers));
        let record = Record::Completed {
            fingerprint: Fingerprint::from_bytes([0; 32]),
            response,
        };
        assert_eq!(Record::decode(record.encode()).unwrap(), record);
    }

    /// The most names a map holds is the http crate's limit, and a replay that leaves room
    /// for its headers holds at most that.
    #[test]
    fn the_most_header_names_is_what_a_map_holds() {
        assert!(HeaderMap::<HeaderValue>::try_with_capacity(MOST_HEADER_NAMES).is_ok());
        assert!(HeaderMap::<HeaderValue>::try_with_capacity(MOST_HEADER_NAMES + 1).is_err());
        let mut headers = HeaderMap::new();
        for i in 0..MOST_HEADER_NAMES {
            let name = HeaderName::try_from(format!("x-{i}")).unwrap();
            headers
                .try_append(name, HeaderValue::from_static(""))
                .unwrap();
            assert_eq!(
                replay_holds(&headers),
                i + 1 + REPLAY_ROOM <= MOST_HEADER_NAMES
            );
        }
        assert!(headers
            .try_append("x-one-more", HeaderValue::from_static(""))
            .is_err());
        // A copy of a full map is still made, without a panic.
        let full = StoredResponse {
            status: StatusCode::OK,
            headers,
            body: Bytes::new(),
            trailers: None,
        };
        assert_eq!(full.replayable_copy(), full);
    }
}
