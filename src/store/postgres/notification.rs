//! What a table's notifications say: on which channel, about which key, and for a small
//! completion, the record itself, sealed.
//!
//! A notification names its key by a digest ([`key_of`]) and the ended claim by its token
//! ([`end_of`]); a completion whose record is small carries it too ([`completion_of`]), so
//! that the waiters of another instance answer without reading the key. PostgreSQL checks
//! no privilege for `LISTEN` or `NOTIFY`: any role that can connect to the database hears
//! the channel, and can notify on it. The record is therefore sealed (ChaCha20-Poly1305)
//! with a key derived from the table and the scope's storage key ([`Seal`]), which such a
//! role never sees (it holds the client's idempotency key), bound to the claim it ends and
//! taken only within a minute of its sealing: the role can neither read a record (short of
//! guessing the idempotency key) nor make one that a waiter takes. A notification that does
//! not open is the end of a claim, no more: the waiters read the key.

use std::{
    fmt::Write as _,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use base64::{engine::general_purpose::STANDARD, Engine as _};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use chacha20poly1305::{
    aead::{Aead, KeyInit, Payload},
    ChaCha20Poly1305, Key, Nonce,
};
use sha2::{Digest, Sha256};

use crate::{
    record::{completed_len, put_completed, Record, StoredResponse},
    store::Claim,
    ClaimToken, Fingerprint, Scope,
};

/// The largest completed record a completion's notification carries (before it is sealed):
/// the waiters of another instance take it from there rather than one of them reading the
/// key. A larger one is left to that read: every notification goes through one queue in
/// the server (each under 8000 bytes), and the commits that add to it are serialized, so
/// copying a large record there would cost every announced completion, listened to or not.
pub(super) const NOTIFIED_RECORD_MAX: usize = 1024;
/// How far apart (by the clocks of the instance that notified and the one that hears) a
/// record may be sealed and opened: far longer than a notification takes, far shorter than
/// a record is kept. A record heard later is not taken (the waiters read the key): a
/// notification heard again, sent by a role that captured it, cannot pass an earlier
/// claim's record off as the outcome of a later claim on the same key, which must wait for
/// the record to expire (unless the row is deleted early).
const FRESH_MS: u64 = 60_000;
/// The length of what names a key and the claim on it that ended: a digest, then a token,
/// both in hex.
const NAMED_LEN: usize = 64 + 32;
const NONCE_LEN: usize = 12;

/// The channel of `table`'s notifications (its schema-qualified name): a plain identifier,
/// well within PostgreSQL's 63 bytes, the same in every instance.
pub(super) fn channel(table: &str) -> String {
    let mut channel = String::from("idempotency_");
    push_hex(&mut channel, &Sha256::digest(table.as_bytes())[..16]);
    channel
}

/// How notifications name `scope`, and the key its watches are made on: the hex SHA-256 of
/// its storage key, 64 bytes however long the scope.
pub(super) fn key_of(scope: &Scope) -> String {
    let mut key = String::with_capacity(64);
    push_hex(&mut key, &Sha256::digest(scope.storage_key().as_bytes()));
    key
}

/// What the notification of the end of the claim `token` on `key` (a [`key_of`]) carries:
/// the key, then the token in hex.
pub(super) fn end_of(key: &str, token: ClaimToken) -> String {
    let mut payload = String::with_capacity(NAMED_LEN);
    payload.push_str(key);
    push_hex(&mut payload, token.as_bytes());
    payload
}

/// What the notification of the completion of the claim `token` on `key` (a [`key_of`])
/// carries: its [`end_of`], followed by the record when it is small
/// ([`NOTIFIED_RECORD_MAX`]), sealed with `seal` and in base64.
pub(super) fn completion_of(
    key: &str,
    token: ClaimToken,
    seal: &Seal,
    completed: (&Fingerprint, &StoredResponse),
    ttl: Duration,
) -> String {
    completion_at(unix_millis(), key, token, seal, completed, ttl)
}

/// [`completion_of`], sealed at `now` (Unix milliseconds): the record follows the time it
/// was sealed and the milliseconds it is kept for.
fn completion_at(
    now: u64,
    key: &str,
    token: ClaimToken,
    seal: &Seal,
    (fingerprint, response): (&Fingerprint, &StoredResponse),
    ttl: Duration,
) -> String {
    let mut payload = end_of(key, token);
    let record_len = completed_len(response);
    if record_len <= NOTIFIED_RECORD_MAX {
        let mut record = BytesMut::with_capacity(16 + record_len);
        record.put_u64(now);
        record.put_u64(ttl.as_millis().try_into().unwrap_or(u64::MAX));
        put_completed(&mut record, fingerprint, response);
        seal.close(&mut payload, &record);
    }
    payload
}

/// What a notification's payload tells.
#[derive(Debug, PartialEq)]
pub(super) enum Heard<'a> {
    /// A change to `key`, from an instance of an earlier version that names no claim.
    Changed(&'a str),
    /// The end of the claim `token` on `key`, with the sealed record when it carries one.
    Ended {
        key: &'a str,
        token: ClaimToken,
        record: Option<Sealed<'a>>,
    },
}

/// A record as a notification carries it, to be opened with the [`Seal`] of its key.
#[derive(Debug, PartialEq)]
pub(super) struct Sealed<'a> {
    /// What names the key and the claim: bound to the record, so that a record cannot be
    /// passed off as another claim's.
    named: &'a str,
    sealed: &'a str,
}

/// What `payload` tells: a key, then the claim that ended and the record where it names
/// them.
pub(super) fn heard(payload: &str) -> Heard<'_> {
    let split = payload
        .split_at_checked(NAMED_LEN)
        .filter(|(named, _)| named.bytes().all(|byte| byte.is_ascii_hexdigit()));
    let Some((named, sealed)) = split else {
        return Heard::Changed(payload);
    };
    let (key, token) = named.split_at(64);
    match u128::from_str_radix(token, 16) {
        Ok(token) => Heard::Ended {
            key,
            token: ClaimToken::from_bytes(token.to_be_bytes()),
            record: (!sealed.is_empty()).then_some(Sealed { named, sealed }),
        },
        Err(_) => Heard::Changed(payload),
    }
}

/// The key that seals the records of one scope's completions in the notifications of one
/// channel (one table), derived from both: only requests of that scope know its storage
/// key, and a record sealed for one table does not open when sent on another's channel.
#[derive(Clone)]
pub(super) struct Seal(ChaCha20Poly1305);

impl Seal {
    pub(super) fn of(channel: &str, scope: &Scope) -> Self {
        let mut derived = Sha256::new();
        derived.update(b"tower-idempotency notified record\0");
        derived.update(channel.as_bytes());
        derived.update(b"\0");
        derived.update(scope.storage_key().as_bytes());
        let key: [u8; 32] = derived.finalize().into();
        Self(ChaCha20Poly1305::new(Key::from_slice(&key)))
    }

    /// Appends `record`, sealed and bound to `payload` so far (what names its key and
    /// claim), to `payload`, in base64.
    fn close(&self, payload: &mut String, record: &[u8]) {
        let nonce: [u8; NONCE_LEN] = rand::random();
        let aad = payload.as_bytes();
        let Ok(sealed) = self
            .0
            .encrypt(Nonce::from_slice(&nonce), Payload { msg: record, aad })
        else {
            // Sealing fails only for lengths far beyond any record carried: none then.
            return;
        };
        let mut out = Vec::with_capacity(NONCE_LEN + sealed.len());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        STANDARD.encode_string(&out, payload);
    }

    /// The completed record `sealed` carries, if it opens with this seal, was sealed
    /// within [`FRESH_MS`] of now and has not expired; `None` for anything else.
    pub(super) fn open(&self, sealed: &Sealed<'_>) -> Option<Claim> {
        self.open_at(unix_millis(), sealed)
    }

    /// [`open`](Self::open) at `now` (Unix milliseconds).
    fn open_at(&self, now: u64, sealed: &Sealed<'_>) -> Option<Claim> {
        let bytes = STANDARD.decode(sealed.sealed).ok()?;
        let (nonce, msg) = bytes.split_at_checked(NONCE_LEN)?;
        let aad = sealed.named.as_bytes();
        let opened = self
            .0
            .decrypt(Nonce::from_slice(nonce), Payload { msg, aad })
            .ok()?;
        let mut record = Bytes::from(opened);
        if record.len() < 16 {
            return None;
        }
        let (sealed_at, ttl) = (record.get_u64(), record.get_u64());
        if sealed_at.abs_diff(now) > FRESH_MS {
            return None;
        }
        let left = ttl
            .checked_sub(now.saturating_sub(sealed_at))
            .filter(|&left| left > 0)?;
        let left = Duration::from_millis(left);
        Claim::announced(Record::decode(record).ok()?, Some(left))
    }
}

fn unix_millis() -> u64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    since.as_millis().try_into().unwrap_or(u64::MAX)
}

fn push_hex(out: &mut String, bytes: &[u8]) {
    for byte in bytes {
        // Writing to a `String` cannot fail.
        let _ = write!(out, "{byte:02x}");
    }
}

#[cfg(test)]
pub(super) mod tests {
    use http::{HeaderMap, StatusCode};

    use super::*;

    /// A scope of `POST /` with the idempotency key `key`.
    pub(in crate::store::postgres) fn scope(key: &str) -> Scope {
        let key = http::HeaderValue::from_str(key).unwrap();
        let key = crate::IdempotencyKey::parse(&key).unwrap();
        Scope::new(None, "POST /".into(), key)
    }

    #[test]
    fn channels_are_plain_identifiers_within_63_bytes() {
        let long = format!("{}.{}", "s".repeat(63), "t".repeat(63));
        for table in ["public.idempotency_keys", long.as_str()] {
            let channel = channel(table);
            assert!(channel.len() <= 63, "{channel}");
            assert!(channel
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'));
        }
        assert_ne!(channel("a.b"), channel("a.c"));
        assert_eq!(channel("a.b"), channel("a.b"));
    }

    #[test]
    fn keys_are_fixed_size_and_tell_scopes_apart() {
        let (a, b) = (key_of(&scope("a")), key_of(&scope(&"b".repeat(255))));
        assert_eq!((a.len(), b.len()), (64, 64));
        assert_ne!(a, b);
        assert_eq!(a, key_of(&scope("a")));
    }

    #[test]
    fn a_notification_names_the_key_and_the_claim_that_ended() {
        let key = "ab".repeat(32);
        let token = ClaimToken::unique();
        let ended = Heard::Ended {
            key: &key,
            token,
            record: None,
        };
        assert_eq!(heard(&end_of(&key, token)), ended);
        // From an instance that names no claim, or names it otherwise: the key alone.
        assert_eq!(heard(&key), Heard::Changed(&key));
        let odd = format!("{key}{}", "g".repeat(32));
        assert_eq!(heard(&odd), Heard::Changed(&odd));
    }

    const CHANNEL: &str = "idempotency_test";

    fn seal(scope: &Scope) -> Seal {
        Seal::of(CHANNEL, scope)
    }

    fn response(body_len: usize, trailers: Option<HeaderMap>) -> StoredResponse {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", "application/grpc".parse().unwrap());
        headers.append("x-many", "1".parse().unwrap());
        headers.append("x-many", "2".parse().unwrap());
        StoredResponse {
            status: StatusCode::CREATED,
            headers,
            body: Bytes::from(vec![b'x'; body_len]),
            trailers,
        }
    }

    /// A notification of `sent`'s completion, sealed for `scope` at `sealed_at`, and the
    /// record it hands the waiters that open it with `seal` at `opened_at` (and its time
    /// left).
    fn notified_at(
        (scope, sealed_at): (&Scope, u64),
        sent: &StoredResponse,
        (seal, opened_at): (&Seal, u64),
    ) -> (String, Option<(StoredResponse, Option<Duration>)>) {
        let (key, token) = (key_of(scope), ClaimToken::unique());
        let fingerprint = Fingerprint::from_bytes([7; 32]);
        let ttl = Duration::from_secs(60);
        let closing = (&self::seal(scope), (&fingerprint, sent));
        let payload = completion_at(sealed_at, &key, token, closing.0, closing.1, ttl);
        let Heard::Ended {
            key: heard_key,
            token: heard_token,
            record,
        } = heard(&payload)
        else {
            panic!("no end in {payload:?}");
        };
        assert_eq!((heard_key, heard_token), (key.as_str(), token));
        let opened = record.and_then(|record| match seal.open_at(opened_at, &record)? {
            Claim::Completed {
                fingerprint: got,
                response,
                expires_in,
            } => {
                assert_eq!(got, fingerprint);
                Some((response, expires_in))
            }
            other => panic!("{other:?}"),
        });
        (payload, opened)
    }

    /// [`notified_at`] now, both ways.
    fn notified(
        scope: &Scope,
        sent: &StoredResponse,
        seal: &Seal,
    ) -> (String, Option<(StoredResponse, Option<Duration>)>) {
        let now = unix_millis();
        notified_at((scope, now), sent, (seal, now))
    }

    #[test]
    fn a_small_completion_carries_its_record_sealed() {
        let scope = scope("small");
        let trailers: HeaderMap = [(
            http::HeaderName::from_static("grpc-status"),
            http::HeaderValue::from_static("0"),
        )]
        .into_iter()
        .collect();
        for sent in [response(300, None), response(300, Some(trailers))] {
            let (payload, opened) = notified(&scope, &sent, &seal(&scope));
            let (got, expires_in) = opened.expect("the record");
            assert_eq!(got, sent);
            let left = expires_in.unwrap();
            assert!(left > Duration::from_secs(59) && left <= Duration::from_secs(60));
            // Nothing of the record shows, even decoded.
            let carried = STANDARD.decode(&payload[NAMED_LEN..]).unwrap();
            let shows = |text: &[u8]| carried.windows(text.len()).any(|at| at == text);
            assert!(!shows(b"application/grpc") && !shows(&[b'x'; 16]));
        }
    }

    #[test]
    fn records_up_to_a_kib_are_carried() {
        let scope = scope("sizes");
        let seal = seal(&scope);
        let overhead = completed_len(&response(0, None));
        let at_most = response(NOTIFIED_RECORD_MAX - overhead, None);
        assert_eq!(completed_len(&at_most), NOTIFIED_RECORD_MAX);
        let (payload, opened) = notified(&scope, &at_most, &seal);
        assert!(opened.is_some());
        // PostgreSQL refuses payloads of 8000 bytes and more.
        assert!(payload.len() < 8000, "{}", payload.len());
        let over = response(NOTIFIED_RECORD_MAX - overhead + 1, None);
        let (payload, opened) = notified(&scope, &over, &seal);
        assert_eq!((payload.len(), opened), (NAMED_LEN, None));
    }

    #[test]
    fn a_record_opens_only_with_its_scopes_seal_on_its_channel() {
        let (mine, other) = (scope("mine"), scope("another"));
        let sent = response(10, None);
        assert!(notified(&mine, &sent, &seal(&mine)).1.is_some());
        let others = [seal(&other), Seal::of("idempotency_elsewhere", &mine)];
        for seal in &others {
            assert!(notified(&mine, &sent, seal).1.is_none());
        }
    }

    #[test]
    fn a_record_opens_only_for_its_claim() {
        let scope = scope("mine");
        let (payload, _) = notified(&scope, &response(10, None), &seal(&scope));
        let Heard::Ended {
            record: Some(record),
            ..
        } = heard(&payload)
        else {
            panic!("no record");
        };
        // The same record passed off as another claim's.
        let moved = format!(
            "{}{}",
            end_of(&key_of(&scope), ClaimToken::unique()),
            record.sealed
        );
        let Heard::Ended {
            record: Some(moved),
            ..
        } = heard(&moved)
        else {
            panic!("no record");
        };
        assert!(seal(&scope).open(&moved).is_none());
        assert!(seal(&scope).open(&record).is_some());
    }

    #[test]
    fn a_record_opens_only_while_fresh_and_kept() {
        let scope = scope("times");
        let (sent, seal) = (response(10, None), seal(&scope));
        let now = unix_millis();
        // The time left of a record kept `ttl`, sealed at `sealed_at` and opened now.
        let left = |sealed_at: u64, ttl: Duration| {
            let completed = (&Fingerprint::from_bytes([7; 32]), &sent);
            let (key, token) = (key_of(&scope), ClaimToken::unique());
            let payload = completion_at(sealed_at, &key, token, &seal, completed, ttl);
            let Heard::Ended {
                record: Some(record),
                ..
            } = heard(&payload)
            else {
                panic!("no record");
            };
            match seal.open_at(now, &record)? {
                Claim::Completed { expires_in, .. } => expires_in,
                other => panic!("{other:?}"),
            }
        };
        let (minute, day) = (Duration::from_secs(60), Duration::from_secs(86_400));
        assert_eq!(left(now - 20_000, minute), Some(Duration::from_secs(40)));
        // Heard again later (a captured notification sent anew), or from a clock far
        // ahead: refused, however long the record is kept.
        assert!(left(now - 20_000, day).is_some());
        assert!(left(now - FRESH_MS - 1, day).is_none());
        assert!(left(now + FRESH_MS + 1, day).is_none());
        // Fresh, but expired by now.
        assert!(left(now - 1_000, Duration::from_millis(1_000)).is_none());
        assert!(left(now - 1_000, Duration::from_millis(1_001)).is_some());
    }

    #[test]
    fn what_does_not_open_is_no_record() {
        let seal = seal(&scope("k"));
        let named = "ab".repeat(48);
        for sealed in [
            "not base64!",
            &STANDARD.encode([0u8; 4]),
            &STANDARD.encode([0u8; 60]),
        ] {
            assert!(seal
                .open(&Sealed {
                    named: &named,
                    sealed
                })
                .is_none());
        }
    }
}
