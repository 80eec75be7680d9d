//! The channel on which the completions and releases of one key are announced.
//!
//! Anyone allowed to subscribe can list the channels in use (`PUBSUB CHANNELS`,
//! `PUBSUB SHARDCHANNELS`), whatever keys their ACL lets them read: a channel named as its
//! key would show every waited-on principal and idempotency key. So a channel is named by
//! 128 bits of the key's SHA-256 instead, which shows the key only to someone who can
//! guess it whole. In a cluster, a script may publish only on a shard channel of its key's
//! own slot: the name ends with a hash tag chosen to land there.

use std::{fmt::Write as _, sync::LazyLock};

use sha2::{Digest, Sha256};

use super::cluster::{slot, SLOTS};

/// What every announcement channel begins with.
const PREFIX: &str = "idempotency-ended:";

/// The channel of the Redis key `key`: [`PREFIX`], the hex of 16 bytes of its SHA-256, and
/// `{<tag>}`, a hash tag of the key's cluster slot.
pub(super) fn of(key: &str) -> String {
    let digest = Sha256::digest(key.as_bytes());
    let tag = &SLOT_TAGS[usize::from(slot(key.as_bytes()))];
    let mut channel = String::with_capacity(PREFIX.len() + 32 + 2 + tag.len());
    channel.push_str(PREFIX);
    for byte in &digest[..16] {
        // Writing to a `String` cannot fail.
        let _ = write!(channel, "{byte:02x}");
    }
    channel.push('{');
    channel.push_str(tag);
    channel.push('}');
    channel
}

/// For each cluster slot, the shortest string of digits and lowercase letters that hashes
/// to it (found once, in a few milliseconds: CRC16 spreads the short strings over every
/// slot).
static SLOT_TAGS: LazyLock<Vec<String>> = LazyLock::new(|| {
    const ALPHABET: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut tags = vec![String::new(); SLOTS];
    let mut left = SLOTS;
    let mut candidate = Vec::new();
    while left > 0 {
        // The next length: every string of it, in order.
        candidate = vec![0usize; candidate.len() + 1];
        loop {
            let tag: Vec<u8> = candidate.iter().map(|&i| ALPHABET[i]).collect();
            let slot = usize::from(slot(&tag));
            if tags[slot].is_empty() {
                tags[slot] = String::from_utf8(tag).unwrap_or_default();
                left -= 1;
                if left == 0 {
                    break;
                }
            }
            // Counts up in base `ALPHABET.len()`; past the last string of this length, on
            // to the next length.
            let Some(at) = candidate.iter().rposition(|&i| i + 1 < ALPHABET.len()) else {
                break;
            };
            candidate[at] += 1;
            candidate[at + 1..].fill(0);
        }
    }
    tags
});

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_slot_has_a_tag_of_its_own() {
        for (at, tag) in SLOT_TAGS.iter().enumerate() {
            assert!(!tag.is_empty(), "slot {at}");
            assert_eq!(usize::from(slot(tag.as_bytes())), at);
            assert!(tag.len() <= 4, "{tag}");
        }
    }

    #[test]
    fn a_channel_hides_its_key_and_lands_in_the_keys_slot() {
        let keys = [
            "idempotency:5:alice17:POST /v1/payments36:8e03978e-40d5-43e8-bc93-6894a57f9324",
            "idempotency:-17:POST /v1/payments1:k",
            // Hash tags of a prefix, or chosen by a client in its key.
            "{shop}:idem:5:alice17:POST /v1/payments1:k",
            "idempotency:5:alice17:POST /v1/payments5:{a}bc",
        ];
        for key in keys {
            let channel = of(key);
            assert_eq!(slot(channel.as_bytes()), slot(key.as_bytes()), "{key}");
            assert!(channel.starts_with(PREFIX));
            for part in ["alice", "payments", "8e03978e", "shop"] {
                assert!(!channel.contains(part), "{channel} shows {part}");
            }
            assert_eq!(of(key), channel, "the same on every instance");
        }
        assert_ne!(of(keys[0]), of(keys[1]));
    }
}
