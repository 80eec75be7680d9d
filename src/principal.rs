//! Who sent a request: the first part of every key's scope.

use std::fmt;

use http::request::Parts;
use sha2::{Digest, Sha256};

/// Names the principal (user, account, API credential) a request acts for, so that two
/// principals never share idempotency records.
///
/// Implemented for closures `Fn(&Parts) -> Option<String>`, whose names mean the same as
/// [`Principal::new`] of them; `None` is the anonymous principal, shared by every request
/// without one.
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
    fn extract(&self, parts: &Parts) -> Option<Principal>;
}

impl<F> ExtractPrincipal for F
where
    F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
{
    fn extract(&self, parts: &Parts) -> Option<Principal> {
        self(parts).map(Principal::new)
    }
}

/// A principal, in the one form stored in every key's scope whichever way it was named.
///
/// A name (user `carol`, given as this request extension by an authentication layer, or
/// returned by a [`principal`](crate::IdempotencyLayer::principal) closure) is stored as
/// the name itself: switching from one to the other between deploys keeps every record.
/// A digest of a credential ([`Principal::from_credential`]) is stored as `auth:` and 32
/// hex digits, and a name is never stored in that form: a name that begins with `auth:`
/// or `\` is stored with one more `\` in front.
///
/// # Example
///
/// ```
/// use tower_idempotency::Principal;
///
/// let mut request = http::Request::new(());
/// // ...in the authentication middleware, once the caller is known:
/// request.extensions_mut().insert(Principal::new("user_42"));
///
/// assert_eq!(Principal::new("user_42").as_str(), "user_42");
/// assert_eq!(Principal::new("auth:x").as_str(), "\\auth:x");
/// assert!(Principal::from_credential(b"Bearer sk_live_1").as_str().starts_with("auth:"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Principal(String);

impl Principal {
    /// A principal named by an authentication layer or an extractor.
    pub fn new(name: impl Into<String>) -> Self {
        let name = name.into();
        if name.starts_with(CREDENTIAL) || name.starts_with('\\') {
            Self(format!("\\{name}"))
        } else {
            Self(name)
        }
    }

    /// A principal known only by its credential (an `Authorization` value, an API key):
    /// 128 bits of its SHA-256 digest, which keep credentials apart without storing one.
    pub fn from_credential(credential: &[u8]) -> Self {
        let digest = Sha256::digest(credential);
        let mut stored = String::with_capacity(CREDENTIAL.len() + 32);
        stored.push_str(CREDENTIAL);
        for byte in &digest[..16] {
            stored.push(char::from(HEX[usize::from(byte >> 4)]));
            stored.push(char::from(HEX[usize::from(byte & 0xf)]));
        }
        Self(stored)
    }

    /// The principal as its scope stores it (see above).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// What stored credential digests begin with, and stored names never do.
const CREDENTIAL: &str = "auth:";

/// The secure default: the [`Principal`] extension when an authentication layer set one,
/// else [`Principal::from_credential`] of the `Authorization` header (so two credentials
/// never share records, and no credential is ever stored), else anonymous.
#[derive(Clone, Copy, Debug, Default)]
pub struct DefaultPrincipal;

impl ExtractPrincipal for DefaultPrincipal {
    fn extract(&self, parts: &Parts) -> Option<Principal> {
        if let Some(principal) = parts.extensions.get::<Principal>() {
            return Some(principal.clone());
        }
        let authorization = parts.headers.get(http::header::AUTHORIZATION)?;
        Some(Principal::from_credential(authorization.as_bytes()))
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Every request is anonymous: keys are shared by all callers. Only for services with one
/// caller, or whose keys are globally unique by construction.
#[derive(Clone, Copy, Debug, Default)]
pub struct Unscoped;

impl ExtractPrincipal for Unscoped {
    fn extract(&self, _parts: &Parts) -> Option<Principal> {
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
        assert!(!alice.as_str().contains("alice"));
        assert_eq!(alice.as_str().len(), 5 + 32);
        assert_eq!(DefaultPrincipal.extract(&parts(None)), None);
    }

    #[test]
    fn extension_wins_over_authorization_and_is_stored_as_named() {
        let mut parts = parts(Some("Bearer alice"));
        parts.extensions.insert(Principal::new("u1"));
        let extracted = DefaultPrincipal.extract(&parts).unwrap();
        assert_eq!(extracted.as_str(), "u1");
        let by_closure = |_: &Parts| Some("u1".to_owned());
        assert_eq!(by_closure.extract(&parts), Some(extracted));
    }

    #[test]
    fn no_name_is_stored_as_a_credential_digest() {
        let digest = Principal::from_credential(b"Bearer alice");
        // A name chosen to look exactly like a digest stays apart from it.
        assert_ne!(Principal::new(digest.as_str()), digest);
        assert_eq!(
            Principal::new(digest.as_str()).as_str(),
            format!("\\{}", digest.as_str())
        );
        // Escaping is one-to-one: `\auth:x` and `\\auth:x` stay apart too.
        let escaped = Principal::new("\\auth:x");
        assert_ne!(escaped, Principal::new("auth:x"));
        assert_eq!(escaped.as_str(), "\\\\auth:x");
        assert_eq!(Principal::new("authors").as_str(), "authors");
    }
}
