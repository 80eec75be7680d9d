//! Records that completions' announcements carry, signed, for instances that share a secret
//! ([`RedisStore::announce_signed_records`](super::RedisStore::announce_signed_records)).
//!
//! Anyone allowed to publish can send a message on a key's channel, and Redis tells a
//! subscriber nothing of who did. So a record in a message is taken only with a signature
//! that proves a store holding the secret wrote it: HMAC-SHA-256 under the secret, over the
//! database (Redis relays messages across its databases: one deployment's records must not
//! verify for another's on the same server), the channel (so the key: a message moved to
//! another key's channel does not verify), the token of the claim that ended, the value as
//! stored (the record and its expiry) and the time of signing. A waiter takes it only within a minute of that time, by its own clock,
//! and before the record expires; anything else only wakes it to read the key.

use std::time::{SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::ClaimToken;

/// What follows the value in a signed message: the time of signing (Unix milliseconds,
/// big-endian), then the signature.
pub(super) const SIGNATURE_LEN: usize = 8 + 32;
/// How far apart, by the clocks of the instance that signed and the one that verifies, a
/// record may be signed and taken: far longer than a message takes, far shorter than a
/// record is kept. A message captured and published again later is not taken: it cannot
/// pass an earlier claim's record off as the outcome of a later claim on the same key.
const FRESH_MS: u64 = 60_000;
/// Sets these signatures apart from any other use of the secret.
const LABEL: &[u8] = b"tower-idempotency announced record\0";

/// The secret, prepared once, for the keys of one database.
pub(super) struct Signer {
    mac: Hmac<Sha256>,
    database: i64,
}

impl Signer {
    pub(super) fn new(secret: &[u8], database: i64) -> Self {
        Self {
            // HMAC takes a key of any length.
            mac: Hmac::new_from_slice(secret).unwrap_or_else(|_| unreachable!()),
            database,
        }
    }

    /// What a completion's message carries after the token and the value, signed now.
    pub(super) fn sign(&self, channel: &str, token: ClaimToken, value: &[u8]) -> Vec<u8> {
        self.sign_at(unix_millis(), channel, token, value)
    }

    fn sign_at(&self, now: u64, channel: &str, token: ClaimToken, value: &[u8]) -> Vec<u8> {
        let mac = self.mac(channel, token, value, now).finalize().into_bytes();
        let mut signature = Vec::with_capacity(SIGNATURE_LEN);
        signature.extend_from_slice(&now.to_be_bytes());
        signature.extend_from_slice(&mac);
        signature
    }

    /// The value that `signed` (a message's payload after the token: value, time,
    /// signature) carries on `channel` for the claim `token`, if this secret signed it
    /// within [`FRESH_MS`] of now; `None` for anything else.
    pub(super) fn open<'a>(
        &self,
        channel: &str,
        token: ClaimToken,
        signed: &'a [u8],
    ) -> Option<&'a [u8]> {
        self.open_at(unix_millis(), channel, token, signed)
    }

    fn open_at<'a>(
        &self,
        now: u64,
        channel: &str,
        token: ClaimToken,
        signed: &'a [u8],
    ) -> Option<&'a [u8]> {
        let at = signed.len().checked_sub(SIGNATURE_LEN)?;
        let (value, signature) = signed.split_at(at);
        let (signed_at, mac) = signature.split_first_chunk::<8>()?;
        let signed_at = u64::from_be_bytes(*signed_at);
        if signed_at.abs_diff(now) > FRESH_MS {
            return None;
        }
        let check = self.mac(channel, token, value, signed_at);
        check.verify_slice(mac).ok()?;
        Some(value)
    }

    fn mac(&self, channel: &str, token: ClaimToken, value: &[u8], signed_at: u64) -> Hmac<Sha256> {
        let mut mac = self.mac.clone();
        mac.update(LABEL);
        mac.update(&self.database.to_be_bytes());
        mac.update(&(channel.len() as u64).to_be_bytes());
        mac.update(channel.as_bytes());
        mac.update(token.as_bytes());
        mac.update(&signed_at.to_be_bytes());
        mac.update(value);
        mac
    }
}

fn unix_millis() -> u64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    since.as_millis().try_into().unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHANNEL: &str = "idempotency-ended:00{a}";

    fn signed(signer: &Signer, now: u64, token: ClaimToken, value: &[u8]) -> Vec<u8> {
        let mut signed = value.to_vec();
        signed.extend_from_slice(&signer.sign_at(now, CHANNEL, token, value));
        signed
    }

    #[test]
    fn a_record_signed_with_the_secret_opens_on_its_channel_for_its_claim() {
        let signer = Signer::new(b"secret", 0);
        let (token, now) = (ClaimToken::unique(), unix_millis());
        let message = signed(&signer, now, token, b"the value");
        assert_eq!(message.len(), 9 + SIGNATURE_LEN);
        let open = |signer: &Signer, channel: &str, token: ClaimToken, message: &[u8]| {
            signer
                .open_at(now, channel, token, message)
                .map(<[u8]>::to_vec)
        };
        assert_eq!(
            open(&signer, CHANNEL, token, &message),
            Some(b"the value".to_vec())
        );
        // Another instance with the same secret verifies it too.
        let same = Signer::new(b"secret", 0);
        assert!(open(&same, CHANNEL, token, &message).is_some());
        // Another secret, another key's channel, another claim: refused.
        assert!(open(&Signer::new(b"other", 0), CHANNEL, token, &message).is_none());
        // The same secret for the keys of another database, on the same server's channels.
        assert!(open(&Signer::new(b"secret", 1), CHANNEL, token, &message).is_none());
        assert!(open(&signer, "idempotency-ended:01{a}", token, &message).is_none());
        assert!(open(&signer, CHANNEL, ClaimToken::unique(), &message).is_none());
    }

    #[test]
    fn a_changed_or_short_message_is_refused() {
        let signer = Signer::new(b"secret", 0);
        let (token, now) = (ClaimToken::unique(), unix_millis());
        let message = signed(&signer, now, token, b"the value");
        for at in 0..message.len() {
            let mut changed = message.clone();
            changed[at] ^= 1;
            assert!(
                signer.open_at(now, CHANNEL, token, &changed).is_none(),
                "{at}"
            );
        }
        for len in 0..message.len() {
            let cut = &message[..len];
            assert!(signer.open_at(now, CHANNEL, token, cut).is_none(), "{len}");
        }
        // A value taken from one message and a signature from another.
        let other = signed(&signer, now, token, b"another value");
        let mut spliced = b"another value".to_vec();
        spliced.extend_from_slice(&message[9..]);
        assert!(signer.open_at(now, CHANNEL, token, &spliced).is_none());
        assert!(signer.open_at(now, CHANNEL, token, &other).is_some());
    }

    #[test]
    fn a_record_opens_only_while_fresh() {
        let signer = Signer::new(b"secret", 0);
        let (token, now) = (ClaimToken::unique(), unix_millis());
        let at = |signed_at: u64| {
            let message = signed(&signer, signed_at, token, b"v");
            signer.open_at(now, CHANNEL, token, &message).is_some()
        };
        assert!(at(now - FRESH_MS));
        assert!(at(now + FRESH_MS));
        // Published again later (a captured message), or from a clock far off: refused.
        assert!(!at(now - FRESH_MS - 1));
        assert!(!at(now + FRESH_MS + 1));
    }
}
