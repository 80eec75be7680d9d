//! Who sent a request: the first part of every key's scope.

use std::fmt;

use http::request::Parts;
use sha2::{Digest, Sha256};

/// Names the principal (user, account, API credential) a request acts for, so that two
/// principals never share idempotency records.
///
/// Implemented for closures `Fn(&Parts) -> Option<String>`; `None` is the anonymous
/// principal, shared by every request without one.
///
/// # Example
///
/// ```
/// use http::request::Parts;
/// use tower_idempotency::{IdempotencyLayer, MemoryStore};
///
/// // Trust a header set by an authenticating proxy in front of the service.
/// let layer = IdempotencyLayer::new(MemoryStore::new()).principal(|parts: &Parts| {
///     parts.headers.get("x-user-id")?.to_str().ok().map(str::to_owned)
/// });
/// ```
pub trait ExtractPrincipal: Send + Sync + 'static {
    /// The principal of this request, or `None` when it is anonymous.
    fn extract(&self, parts: &Parts) -> Option<String>;
}

impl<F> ExtractPrincipal for F
where
    F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
{
    fn extract(&self, parts: &Parts) -> Option<String> {
        self(parts)
    }
}

/// A request extension naming the principal, for an authentication layer that runs before
/// the idempotency layer to insert.
///
/// The default extractor uses it when present.
///
/// # Example
///
/// ```
/// use tower_idempotency::Principal;
///
/// let mut request = http::Request::new(());
/// // ...in the authentication middleware, once the caller is known:
/// request.extensions_mut().insert(Principal::new("user_42"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Principal(String);

impl Principal {
    /// A principal named by an authentication layer.
    pub fn new(name: impl Into<String>) -> Self {
        Self(name.into())
    }

    /// The principal's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The secure default: the [`Principal`] extension when an authentication layer set one,
/// else a SHA-256 digest of the `Authorization` header (so two credentials never share
/// records, and no credential is ever stored), else anonymous.
#[derive(Clone, Copy, Debug, Default)]
pub struct DefaultPrincipal;

impl ExtractPrincipal for DefaultPrincipal {
    fn extract(&self, parts: &Parts) -> Option<String> {
        if let Some(principal) = parts.extensions.get::<Principal>() {
            return Some(format!("p:{}", principal.0));
        }
        let authorization = parts.headers.get(http::header::AUTHORIZATION)?;
        let digest = Sha256::digest(authorization.as_bytes());
        let mut name = String::with_capacity(5 + 32);
        name.push_str("auth:");
        // 128 bits of the digest keep credentials apart; the rest would only cost storage.
        for byte in &digest[..16] {
            name.push(char::from(HEX[usize::from(byte >> 4)]));
            name.push(char::from(HEX[usize::from(byte & 0xf)]));
        }
        Some(name)
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Every request is anonymous: keys are shared by all callers. Only for services with one
/// caller, or whose keys are globally unique by construction.
#[derive(Clone, Copy, Debug, Default)]
pub struct Unscoped;

impl ExtractPrincipal for Unscoped {
    fn extract(&self, _parts: &Parts) -> Option<String> {
        None
    }
}

/// A type-erased extractor, so the layer's type does not change with it.
#[derive(Clone)]
pub(crate) struct BoxedPrincipal(pub(crate) std::sync::Arc<dyn ExtractPrincipal>);

impl fmt::Debug for BoxedPrincipal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ExtractPrincipal")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(authorization: Option<&str>) -> Parts {
        let mut builder = http::Request::builder();
        if let Some(value) = authorization {
            builder = builder.header(http::header::AUTHORIZATION, value);
        }
        builder.body(()).unwrap().into_parts().0
    }

    #[test]
    fn default_digests_authorization_and_never_stores_it() {
        let alice = DefaultPrincipal
            .extract(&parts(Some("Bearer alice")))
            .unwrap();
        let bob = DefaultPrincipal
            .extract(&parts(Some("Bearer bob")))
            .unwrap();
        assert_ne!(alice, bob);
        assert!(!alice.contains("alice"));
        assert_eq!(alice.len(), 5 + 32);
        assert_eq!(DefaultPrincipal.extract(&parts(None)), None);
    }

    #[test]
    fn extension_wins_over_authorization() {
        let mut parts = parts(Some("Bearer alice"));
        parts.extensions.insert(Principal::new("u1"));
        assert_eq!(DefaultPrincipal.extract(&parts).as_deref(), Some("p:u1"));
    }
}
