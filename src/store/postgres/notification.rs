//! What a table's notifications say: on which channel, and which claim on which key ended.
//!
//! A notification names its key by a digest ([`key_of`]) and the ended claim by its token
//! ([`end_of`]), and carries nothing else. PostgreSQL checks no privilege for `LISTEN` or
//! `NOTIFY`: any role that can connect to the database hears the channel and can notify
//! on it, and a listener cannot tell who did. So a notification is only ever a reason to
//! read the key: the waiters it wakes take what the table holds for their own key, and a
//! made-up one costs them a read, nothing more.

use std::fmt::Write as _;

use sha2::{Digest, Sha256};

use crate::{ClaimToken, Scope};

/// The length of what names a key and the claim on it that ended: a digest, then a token,
/// both in hex.
const NAMED_LEN: usize = 64 + 32;

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

/// The key and the ended claim that `payload` names, if it is an [`end_of`]: a store never
/// notifies anything else, so anything else is ignored.
pub(super) fn heard(payload: &str) -> Option<(&str, ClaimToken)> {
    if payload.len() != NAMED_LEN || !payload.bytes().all(|byte| byte.is_ascii_hexdigit()) {
        return None;
    }
    let (key, token) = payload.split_at(64);
    let token = u128::from_str_radix(token, 16).ok()?;
    Some((key, ClaimToken::from_bytes(token.to_be_bytes())))
}

fn push_hex(out: &mut String, bytes: &[u8]) {
    for byte in bytes {
        // Writing to a `String` cannot fail.
        let _ = write!(out, "{byte:02x}");
    }
}

#[cfg(test)]
pub(super) mod tests {
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
    fn a_notification_names_the_key_and_the_claim_that_ended_and_nothing_else() {
        let key = "ab".repeat(32);
        let token = ClaimToken::unique();
        let payload = end_of(&key, token);
        assert_eq!(heard(&payload), Some((key.as_str(), token)));
        // The key alone, a claim named otherwise, or anything after the claim (a record,
        // say): not a store's, so nobody is woken.
        let odd = format!("{key}{}", "g".repeat(32));
        let longer = format!("{payload}AAAA");
        for ignored in [key.as_str(), &odd, &longer, "", "é"] {
            assert_eq!(heard(ignored), None, "{ignored:?}");
        }
    }
}
