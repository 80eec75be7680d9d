//! Keys for downstream calls, derived from the request's scope: a handler that charges a
//! payment provider (or calls a second service behind this layer) sends the same key on
//! every retry of its own request, so the provider executes once even when this process
//! dies after the provider answered.

use std::{fmt, sync::Arc};

use http::{request::Parts, HeaderValue};
use sha2::{Digest, Sha256};

use super::scope::Scope;

/// What derives the downstream keys of one keyed request: in the request extensions of
/// every request that executes behind a layer that
/// [derives keys](crate::IdempotencyLayer::derive_keys) (an axum handler takes it as an
/// extractor).
///
/// A key from [`key`](Self::key) is the same for every retry of the request, on every
/// instance (it depends only on the request's scope, principal, endpoint and key, and the
/// label), differs for another label or another scope, and reveals nothing of the client's
/// key: it is a SHA-256 digest, shaped as a UUID (version 8). Whoever receives it and
/// knows the principal and the endpoint could confirm a guess of the client's key, so
/// clients should send random keys (the crate's client sends UUID v4).
///
/// # Example
///
/// ```
/// use axum::{routing::post, Router};
/// use tower_idempotency::{DerivedKeys, IdempotencyLayer, MemoryStore};
///
/// async fn charge(keys: DerivedKeys) -> String {
///     // Sent as the `Idempotency-Key` of the call to the payment provider: the
///     // provider replays its first answer to every retry of this request.
///     let provider_key = keys.key("provider-charge");
///     format!("charged with {provider_key}")
/// }
///
/// let app: Router = Router::new()
///     .route("/v1/payments", post(charge))
///     .route_layer(IdempotencyLayer::new(MemoryStore::new()).allow_anonymous().derive_keys());
/// ```
#[derive(Clone)]
pub struct DerivedKeys {
    /// The request's storage key, which names its scope unambiguously.
    scope: Arc<str>,
}

impl DerivedKeys {
    pub(crate) fn of(scope: &Scope) -> Self {
        Self {
            scope: Arc::from(scope.storage_key()),
        }
    }

    /// The key for the downstream call named `label` (`"provider-charge"`,
    /// `"ledger-service"`): 36 characters, `xxxxxxxx-xxxx-8xxx-yxxx-xxxxxxxxxxxx`.
    pub fn key(&self, label: &str) -> String {
        let mut hasher = Sha256::new();
        hasher.update(b"tower-idempotency derived key v1");
        for part in [self.scope.as_bytes(), label.as_bytes()] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part);
        }
        let digest = hasher.finalize();
        let mut bytes: [u8; 16] = digest[..16].try_into().expect("16 of 32 bytes");
        bytes[6] = (bytes[6] & 0x0f) | 0x80; // version 8: custom
        bytes[8] = (bytes[8] & 0x3f) | 0x80; // the RFC 9562 variant
        let mut out = String::with_capacity(36);
        for (index, byte) in bytes.iter().enumerate() {
            if matches!(index, 4 | 6 | 8 | 10) {
                out.push('-');
            }
            out.push(char::from(HEX[usize::from(byte >> 4)]));
            out.push(char::from(HEX[usize::from(byte & 0x0f)]));
        }
        out
    }

    /// [`key`](Self::key) as a header value, for the outgoing request's
    /// `Idempotency-Key` (the crate's client keeps a key it finds there).
    pub fn header_value(&self, label: &str) -> HeaderValue {
        HeaderValue::try_from(self.key(label)).expect("hex and dashes are a valid header value")
    }

    /// The derived keys of a request the layer handed on, if it was keyed.
    pub fn from_parts(parts: &Parts) -> Option<&Self> {
        parts.extensions.get::<Self>()
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

impl fmt::Debug for DerivedKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The scope names the client's key: never shown.
        f.debug_struct("DerivedKeys").finish_non_exhaustive()
    }
}

/// A handler behind the layer takes the request's derived keys; a request without them (a
/// layer that does not [derive keys](crate::IdempotencyLayer::derive_keys), no
/// `Idempotency-Key` on an optional route, a method the layer lets through) is answered
/// `500`, as a handler mounted where it should not be. Take `Option<DerivedKeys>` where
/// they may be missing.
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl<S: Send + Sync> axum::extract::FromRequestParts<S> for DerivedKeys {
    type Rejection = (http::StatusCode, &'static str);

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<Self>().cloned().ok_or((
            http::StatusCode::INTERNAL_SERVER_ERROR,
            "no derived keys: the request did not execute behind an IdempotencyLayer with \
             derive_keys() and a key",
        ))
    }
}

/// `None` where the request carries no derived keys.
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
impl<S: Send + Sync> axum::extract::OptionalFromRequestParts<S> for DerivedKeys {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<Self>().cloned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::IdempotencyKey;

    fn keys(principal: Option<&str>, endpoint: &str, key: &str) -> DerivedKeys {
        let key = IdempotencyKey::parse(&HeaderValue::from_str(key).unwrap()).unwrap();
        DerivedKeys::of(&Scope::new(
            principal.map(str::to_owned),
            endpoint.to_owned(),
            key,
        ))
    }

    #[test]
    fn a_derived_key_is_stable_and_differs_per_label_and_scope() {
        let client_key = "8e03978e-40d5-43e8-bc93-6894a57f9324";
        let one = keys(Some("alice"), "POST /v1/payments", client_key);
        let again = keys(Some("alice"), "POST /v1/payments", client_key);
        let charge = one.key("charge");
        assert_eq!(
            charge,
            again.key("charge"),
            "stable: the scope and label alone"
        );
        assert_ne!(charge, one.key("refund"));
        for other in [
            keys(Some("bob"), "POST /v1/payments", client_key),
            keys(None, "POST /v1/payments", client_key),
            keys(Some("alice"), "POST /v1/refunds", client_key),
            keys(Some("alice"), "POST /v1/payments", "another"),
        ] {
            assert_ne!(other.key("charge"), charge);
        }
        // Shaped as a UUID, version 8, with nothing of the client's key in it.
        assert_eq!(charge.len(), 36);
        assert_eq!(&charge[14..15], "8");
        assert!(matches!(&charge[19..20], "8" | "9" | "a" | "b"));
        for piece in client_key.split('-') {
            assert!(!charge.contains(piece), "{charge} shows {piece}");
        }
        assert_eq!(one.header_value("charge"), charge.as_str());
        assert!(!format!("{one:?}").contains("alice"));
    }

    #[test]
    fn the_derivation_is_pinned() {
        // A change of derivation would make every retry in flight across a deploy call
        // its provider with a new key: a second charge. It must never change silently.
        let pinned = keys(Some("alice"), "POST /v1/payments", "k1").key("charge");
        assert_eq!(pinned, PINNED);
    }

    /// Computed apart from this code: SHA-256 of the domain, then the storage key
    /// `5:alice17:POST /v1/payments2:k1` and the label, each after its length (u64,
    /// big-endian), cut to 16 bytes and marked version 8.
    const PINNED: &str = "86f37de5-754c-8f72-8ec5-294ae9199d0a";
}
