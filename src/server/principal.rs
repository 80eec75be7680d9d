//! Who sent a request: the first part of every key's scope.
//!
//! Scope must come from a verified identity that stays the same across a client's retries:
//! the user or account an authentication layer established, set as a [`Principal`]
//! extension. The digest of the `Authorization` header that [`DefaultPrincipal`] falls back
//! on is right only for credentials a client sends unchanged on every retry (an API key,
//! HTTP Basic); a refreshed JWT or a per-request signature (AWS SigV4) changes between
//! retries, and a retry under a new scope executes again.

use std::{
    fmt,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
};

use hmac::{Hmac, Mac};
use http::request::Parts;
use sha2::{Digest, Sha256};

use super::scope::{digest_form, push_hex, DIGEST_PREFIX, MAX_SCOPE_PART_LEN};

/// Names the principal (user, account, API credential) a request acts for, so that two
/// principals never share idempotency records.
///
/// Implemented for closures `Fn(&Parts) -> Option<String>`, whose names mean the same as
/// [`Principal::new`] of them. `None` is no principal: the layer refuses such a request
/// unless the route opts in to one anonymous scope shared by every request without one
/// ([`allow_anonymous`](crate::IdempotencyLayer::allow_anonymous)).
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
    /// The principal of this request, or `None` when it names none.
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
/// or `\` is stored with one more `\` in front. A name longer than
/// [`MAX_SCOPE_PART_LEN`](crate::MAX_SCOPE_PART_LEN) bytes is stored as `sha256:` and the
/// 64 hex digits of its SHA-256 (so every store can index it), as is a name holding a NUL
/// byte (which PostgreSQL's text refuses), and a name that begins with `sha256:` is stored
/// with a `\` in front too.
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
/// assert!(Principal::new("x".repeat(2000)).as_str().starts_with("sha256:"));
/// assert_eq!(Principal::new("sha256:x").as_str(), "\\sha256:x");
/// assert!(Principal::from_credential(b"Bearer sk_live_1").as_str().starts_with("auth:"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Principal(String);

impl Principal {
    /// A principal named by an authentication layer or an extractor.
    pub fn new(name: impl Into<String>) -> Self {
        let name = name.into();
        // PostgreSQL's text refuses a NUL byte: such a name is kept as its digest too.
        if name.len() > MAX_SCOPE_PART_LEN || name.contains('\0') {
            Self(digest_form(&name))
        } else if name.starts_with(CREDENTIAL)
            || name.starts_with(DIGEST_PREFIX)
            || name.starts_with('\\')
        {
            Self(format!("\\{name}"))
        } else {
            Self(name)
        }
    }

    /// A principal known only by its credential (an `Authorization` value, an API key):
    /// 128 bits of its SHA-256 digest, which keep credentials apart without storing one.
    ///
    /// Unkeyed, the digest of a guessable credential can be reversed by trying guesses
    /// (it shows in the store's keys and columns): prefer
    /// [`from_credential_keyed`](Self::from_credential_keyed).
    pub fn from_credential(credential: &[u8]) -> Self {
        Self::credential_digest(&Sha256::digest(credential))
    }

    /// A principal known only by its credential, as [`from_credential`](Self::from_credential),
    /// digested with HMAC-SHA-256 under `secret`: without the secret, nobody who reads the
    /// store can test guesses of the credential against it. Give every instance that
    /// shares a store the same secret, or their scopes differ.
    ///
    /// ```
    /// use tower_idempotency::Principal;
    ///
    /// let secret = b"32 random bytes from the secret store!";
    /// let keyed = Principal::from_credential_keyed(secret, b"Basic YWxpY2U6aHVudGVyMg==");
    /// assert_ne!(keyed, Principal::from_credential(b"Basic YWxpY2U6aHVudGVyMg=="));
    /// assert!(keyed.as_str().starts_with("auth:"));
    /// ```
    pub fn from_credential_keyed(secret: &[u8], credential: &[u8]) -> Self {
        CredentialKey::new(secret).principal(credential)
    }

    fn credential_digest(digest: &[u8]) -> Self {
        let mut stored = String::with_capacity(CREDENTIAL.len() + 32);
        stored.push_str(CREDENTIAL);
        push_hex(&mut stored, &digest[..16]);
        Self(stored)
    }

    /// The principal as its scope stores it (see above).
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// What stored credential digests begin with, and stored names never do.
const CREDENTIAL: &str = "auth:";

/// A secret for credential digests, prepared once: HMAC-SHA-256 under it.
#[derive(Clone)]
struct CredentialKey(Hmac<Sha256>);

impl CredentialKey {
    fn new(secret: &[u8]) -> Self {
        // HMAC takes a key of any length.
        Self(Hmac::new_from_slice(secret).unwrap_or_else(|_| unreachable!()))
    }

    fn principal(&self, credential: &[u8]) -> Principal {
        let mut mac = self.0.clone();
        mac.update(credential);
        Principal::credential_digest(&mac.finalize().into_bytes())
    }
}

/// The default: the [`Principal`] extension when an authentication layer set one, else a
/// digest of the `Authorization` header (so two credentials never share records, and no
/// credential is ever stored), else none (which the layer refuses unless the route
/// [allows anonymous requests](crate::IdempotencyLayer::allow_anonymous)).
///
/// The digest is keyed with a secret ([`keyed`](Self::keyed), or the layer's
/// [`credential_secret`](crate::IdempotencyLayer::credential_secret)) when one is given;
/// without one it is a plain SHA-256, which anyone who reads the store can test guesses
/// against (a Basic-auth password, say), and the first such digest logs a warning.
///
/// A digest of the header is the right scope only for a credential sent unchanged on
/// every retry (an API key, Basic auth). For a JWT that is refreshed, or a request signed
/// anew each time (AWS SigV4, HTTP message signatures), a retry would get a new scope and
/// execute again: have the authentication layer set the verified subject as a
/// [`Principal`] (the JWT's `sub`, the signer's access key id) instead.
///
/// # Example
///
/// ```
/// use tower_idempotency::Principal;
///
/// # struct Claims { sub: String }
/// # struct Signature { access_key_id: String }
/// # let mut request = http::Request::new(());
/// # let (claims, signature) = (
/// #     Claims { sub: "user_42".into() },
/// #     Signature { access_key_id: "AKIDEXAMPLE".into() },
/// # );
/// // In the authentication layer, once a bearer JWT is verified: its subject stays the
/// // same when the client refreshes the token between retries.
/// request.extensions_mut().insert(Principal::new(claims.sub));
/// // Once an AWS SigV4 signature is verified: the key that signed, not the signature,
/// // which changes with every attempt.
/// request.extensions_mut().insert(Principal::new(signature.access_key_id));
/// ```
#[derive(Clone, Default)]
pub struct DefaultPrincipal {
    key: Option<CredentialKey>,
    warned: Arc<AtomicBool>,
}

impl DefaultPrincipal {
    /// Credential digests unkeyed (a warning is logged at the first).
    pub fn new() -> Self {
        Self::default()
    }

    /// Credential digests keyed with `secret` (HMAC-SHA-256,
    /// [`Principal::from_credential_keyed`]): the same secret on every instance that
    /// shares a store, at least 32 random bytes, kept like any other secret.
    pub fn keyed(secret: impl AsRef<[u8]>) -> Self {
        Self {
            key: Some(CredentialKey::new(secret.as_ref())),
            warned: Arc::default(),
        }
    }
}

impl ExtractPrincipal for DefaultPrincipal {
    fn extract(&self, parts: &Parts) -> Option<Principal> {
        if let Some(principal) = parts.extensions.get::<Principal>() {
            return Some(principal.clone());
        }
        // A blank header is no credential: its digest would be one principal shared by
        // every client that sends the header blank.
        let authorization = parts
            .headers
            .get(http::header::AUTHORIZATION)
            .filter(|value| !value.as_bytes().trim_ascii().is_empty())?;
        Some(match &self.key {
            Some(key) => key.principal(authorization.as_bytes()),
            None => {
                if !self.warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        "idempotency scopes hold unkeyed SHA-256 digests of the Authorization \
                         header, which can be tested against guessed credentials: give the \
                         layer a secret (IdempotencyLayer::credential_secret), or set a \
                         Principal extension in the authentication layer"
                    );
                }
                Principal::from_credential(authorization.as_bytes())
            }
        })
    }
}

impl fmt::Debug for DefaultPrincipal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DefaultPrincipal")
            .field("keyed", &self.key.is_some())
            .finish()
    }
}

/// Requests are anonymous, keys shared by all callers, unless a layer before this one named
/// the caller with a [`Principal`] extension: only for services with one caller, or whose
/// keys are globally unique by construction
/// ([`unscoped`](crate::IdempotencyLayer::unscoped)). A `Principal` set on purpose still
/// counts, so that a webhook route can scope each sender's event ids to that sender once its
/// signature is checked.
#[derive(Clone, Copy, Debug, Default)]
pub struct Unscoped;

impl ExtractPrincipal for Unscoped {
    fn extract(&self, parts: &Parts) -> Option<Principal> {
        parts.extensions.get::<Principal>().cloned()
    }
}

/// A type-erased extractor, so the layer's type does not change with it.
#[derive(Clone)]
pub(crate) struct BoxedPrincipal(pub(crate) Arc<dyn ExtractPrincipal>);

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
        let default = DefaultPrincipal::new();
        let alice = default.extract(&parts(Some("Bearer alice"))).unwrap();
        let bob = default.extract(&parts(Some("Bearer bob"))).unwrap();
        assert_ne!(alice, bob);
        assert!(!alice.as_str().contains("alice"));
        assert_eq!(alice.as_str().len(), 5 + 32);
        assert_eq!(alice, Principal::from_credential(b"Bearer alice"));
        assert_eq!(default.extract(&parts(None)), None);
    }

    #[test]
    fn extension_wins_over_authorization_and_is_stored_as_named() {
        let mut parts = parts(Some("Bearer alice"));
        parts.extensions.insert(Principal::new("u1"));
        let extracted = DefaultPrincipal::new().extract(&parts).unwrap();
        let keyed = DefaultPrincipal::keyed(b"secret").extract(&parts).unwrap();
        assert_eq!(keyed, extracted, "a named principal is never digested");
        assert_eq!(extracted.as_str(), "u1");
        let by_closure = |_: &Parts| Some("u1".to_owned());
        assert_eq!(by_closure.extract(&parts), Some(extracted));
    }

    #[test]
    fn a_keyed_digest_is_hmac_under_the_secret_and_the_same_on_every_instance() {
        let (one, other) = (
            DefaultPrincipal::keyed(b"s1"),
            DefaultPrincipal::keyed(b"s1"),
        );
        let alice = parts(Some("Basic YWxpY2U6aHVudGVyMg=="));
        let keyed = one.extract(&alice).unwrap();
        assert_eq!(other.extract(&alice), Some(keyed.clone()));
        assert_ne!(
            DefaultPrincipal::keyed(b"s2").extract(&alice),
            Some(keyed.clone())
        );
        assert_ne!(DefaultPrincipal::new().extract(&alice), Some(keyed.clone()));
        // RFC 4231, test case 2: HMAC-SHA-256 of "what do ya want for nothing?" under "Jefe".
        let expected = "auth:5bdcc146bf60754e6a042426089575c7";
        let case = Principal::from_credential_keyed(b"Jefe", b"what do ya want for nothing?");
        assert_eq!(case.as_str(), expected);
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
