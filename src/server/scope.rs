//! Where a key means something: `(principal, endpoint, key)`, its storage key, and how a
//! request's scope is built (the principal is `principal.rs`'s to name).

use std::{borrow::Cow, ops::Range, sync::Arc};

use http::request::Parts;
use sha2::{Digest, Sha256};

use super::principal::Principal;
use crate::{request_path::RequestPath, IdempotencyKey};

/// The longest principal, and the longest path of an endpoint, that a scope keeps as
/// written (a principal escaped with a `\` keeps one byte more): a longer one is kept as
/// `sha256:` and the 64 hex digits of its SHA-256. Every
/// store's scope stays bounded (with a key's 255 bytes, well within the 2 704 bytes of a
/// PostgreSQL index entry), and two long ones stay apart.
pub const MAX_SCOPE_PART_LEN: usize = 1024;

/// What a scope part kept as a digest begins with. A path that begins so is kept as its
/// own digest, and a principal named so with a `\` in front (see [`Principal`]).
pub(crate) const DIGEST_PREFIX: &str = "sha256:";

/// `text` as a scope keeps a part longer than [`MAX_SCOPE_PART_LEN`].
pub(crate) fn digest_form(text: &str) -> String {
    let mut kept = String::with_capacity(DIGEST_PREFIX.len() + 64);
    kept.push_str(DIGEST_PREFIX);
    push_hex(&mut kept, &Sha256::digest(text.as_bytes()));
    kept
}

/// `bytes` in lower-case hex, after `out`: how a scope's digests are written.
pub(crate) fn push_hex(out: &mut String, bytes: &[u8]) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for byte in bytes {
        out.push(char::from(HEX[usize::from(byte >> 4)]));
        out.push(char::from(HEX[usize::from(byte & 0xf)]));
    }
}

/// How a request names its endpoint, the middle part of a key's scope.
#[derive(Clone, Debug)]
pub(crate) enum Endpoint {
    MethodAndPath,
    #[cfg(feature = "axum")]
    MatchedPath,
    Fixed(Arc<str>),
}

/// The scope of a keyed request, sent to `sent`'s path; the endpoint goes into the storage
/// key in pieces, never assembled on its own.
pub(crate) fn of_request(
    endpoint: &Endpoint,
    parts: &Parts,
    sent: &RequestPath<'_>,
    principal: Option<&Principal>,
    key: IdempotencyKey,
) -> Scope {
    let (method, space, path) = endpoint_pieces(endpoint, parts, &sent.path);
    Scope::from_parts(
        principal.map(Principal::as_str),
        &[method, space, &kept(path)],
        key,
    )
}

/// The endpoint a request is scoped to, whole: for the layer's answers to requests it
/// refuses before their scope is built.
pub(crate) fn endpoint_of(endpoint: &Endpoint, parts: &Parts) -> String {
    let sent = RequestPath::of(parts);
    let (method, space, path) = endpoint_pieces(endpoint, parts, &sent.path);
    [method, space, &kept(path)].concat()
}

/// A path as its scope keeps it: as written, or as its digest when longer than
/// [`MAX_SCOPE_PART_LEN`], or when written as one: a request's path begins with `/`, but
/// that is the HTTP library's rule, not this crate's, and a path written as another's digest
/// must not share its scope.
fn kept(path: &str) -> Cow<'_, str> {
    if path.len() > MAX_SCOPE_PART_LEN || path.starts_with(DIGEST_PREFIX) {
        Cow::Owned(digest_form(path))
    } else {
        Cow::Borrowed(path)
    }
}

/// The endpoint part of a request's scope, in pieces: the layer's endpoint name, or
/// `"<METHOD> <path>"` (the route template with `endpoint_from_matched_path`), `path` as
/// [`RequestPath`] reads it.
fn endpoint_pieces<'a>(
    endpoint: &'a Endpoint,
    parts: &'a Parts,
    path: &'a str,
) -> (&'a str, &'a str, &'a str) {
    let path = match endpoint {
        Endpoint::Fixed(name) => return (name, "", ""),
        #[cfg(feature = "axum")]
        Endpoint::MatchedPath => parts
            .extensions
            .get::<axum::extract::MatchedPath>()
            .map_or(path, |matched| matched.as_str()),
        Endpoint::MethodAndPath => path,
    };
    (parts.method.as_str(), " ", path)
}

/// The scope of one idempotency key: the same key sent by two principals, or to two
/// endpoints, names two different operations.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Scope {
    /// Built once: every store operation on the request names the record by it. The
    /// principal and the endpoint are read back out of it rather than kept twice.
    storage_key: String,
    principal: Option<Range<usize>>,
    endpoint: Range<usize>,
    key: IdempotencyKey,
}

impl Scope {
    /// A scope from its three parts, as stored; `None` (or an empty name, which a store
    /// with a text column cannot tell from it) is the anonymous principal.
    ///
    /// The layer keeps a principal or a path longer than [`MAX_SCOPE_PART_LEN`] as its
    /// digest; a scope made here with longer parts may be refused by a store (PostgreSQL
    /// indexes at most 2 704 bytes of one).
    pub fn new(principal: Option<String>, endpoint: String, key: IdempotencyKey) -> Self {
        Self::from_parts(principal.as_deref(), &[&endpoint], key)
    }

    /// A scope whose endpoint is the concatenation of `endpoint`'s pieces (`["POST", " ",
    /// path]`): the layer builds it without assembling the endpoint on its own first.
    pub(crate) fn from_parts(
        principal: Option<&str>,
        endpoint: &[&str],
        key: IdempotencyKey,
    ) -> Self {
        let principal = principal.filter(|name| !name.is_empty());
        let endpoint_len: usize = endpoint.iter().map(|piece| piece.len()).sum();
        let mut storage_key = String::with_capacity(
            principal.map_or(1, |p| p.len() + 4) + endpoint_len + key.as_str().len() + 8,
        );
        let principal = match principal {
            Some(name) => Some(push_part(&mut storage_key, &[name])),
            None => {
                storage_key.push('-');
                None
            }
        };
        let endpoint = push_part(&mut storage_key, endpoint);
        push_part(&mut storage_key, &[key.as_str()]);
        Self {
            storage_key,
            principal,
            endpoint,
            key,
        }
    }

    /// Who sent the request, as the principal extractor named it; `None` when anonymous.
    pub fn principal(&self) -> Option<&str> {
        self.principal.clone().map(|range| &self.storage_key[range])
    }

    /// The endpoint, by default `"<METHOD> <path>"`.
    pub fn endpoint(&self) -> &str {
        &self.storage_key[self.endpoint.clone()]
    }

    /// The client's key.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// One string naming this scope, for stores with a single key column.
    ///
    /// Each part is length-prefixed (`<bytes>:<text>`, `-` for the anonymous principal), so
    /// no choice of principal, endpoint or key can splice into another scope's name: user
    /// `alice` with key `x:/v1/payments:k` and user `alice:/v1/payments:x` with key `k`
    /// never share a record.
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyKey, Scope};
    /// # use http::HeaderValue;
    /// let key = IdempotencyKey::parse(&HeaderValue::from_static("k")).unwrap();
    /// let scope = Scope::new(Some("alice".into()), "POST /v1/payments".into(), key);
    /// assert_eq!(scope.storage_key(), "5:alice17:POST /v1/payments1:k");
    /// ```
    pub fn storage_key(&self) -> &str {
        &self.storage_key
    }
}

/// Appends `<byte length>:<pieces>` and returns where the pieces landed.
fn push_part(out: &mut String, pieces: &[&str]) -> Range<usize> {
    let len: usize = pieces.iter().map(|piece| piece.len()).sum();
    out.push_str(itoa::Buffer::new().format(len));
    out.push(':');
    let start = out.len();
    for piece in pieces {
        out.push_str(piece);
    }
    start..out.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn scope(principal: Option<&str>, endpoint: &str, key: &str) -> Scope {
        let key = IdempotencyKey::parse(&HeaderValue::from_str(key).unwrap()).unwrap();
        Scope::new(principal.map(str::to_owned), endpoint.to_owned(), key)
    }

    #[test]
    fn a_path_past_the_longest_is_kept_as_its_digest_in_scopes_and_answers() {
        let scope_of = |path: &str| {
            let request = http::Request::post(path).body(()).unwrap();
            let (parts, ()) = request.into_parts();
            let key = IdempotencyKey::parse(&HeaderValue::from_static("k")).unwrap();
            let sent = RequestPath::of(&parts);
            let scope = of_request(&Endpoint::MethodAndPath, &parts, &sent, None, key);
            assert_eq!(
                endpoint_of(&Endpoint::MethodAndPath, &parts),
                scope.endpoint()
            );
            scope
        };
        let longest = format!("/{}", "a".repeat(MAX_SCOPE_PART_LEN - 1));
        assert_eq!(scope_of(&longest).endpoint(), format!("POST {longest}"));
        let past = format!("{longest}b");
        let digest = digest_form(&past);
        assert_eq!(scope_of(&past).endpoint(), format!("POST {digest}"));
        assert_eq!(digest.len(), "sha256:".len() + 64);
    }

    #[test]
    fn a_path_written_as_a_digest_is_kept_as_its_own_digest() {
        let long = format!("/{}", "a".repeat(MAX_SCOPE_PART_LEN));
        let digest = digest_form(&long);
        assert_eq!(kept(&long), digest);
        assert_ne!(kept(&digest), digest);
        assert_eq!(kept(&digest), digest_form(&digest));
        assert_eq!(kept("/sha256:x"), "/sha256:x");
    }

    #[test]
    fn splicing_parts_never_collides() {
        let a = scope(Some("alice"), "/v1/payments", "x:/v1/payments:k");
        let b = scope(Some("alice:/v1/payments:x"), "/v1/payments", "k");
        assert_ne!(a.storage_key(), b.storage_key());
        let c = scope(Some("a"), "b1:c", "d");
        let d = scope(Some("a1:b"), "c", "d");
        assert_ne!(c.storage_key(), d.storage_key());
    }

    #[test]
    fn parts_read_back_from_the_storage_key() {
        let named = scope(Some("alice"), "POST /v1/payments", "k1");
        assert_eq!(named.principal(), Some("alice"));
        assert_eq!(named.endpoint(), "POST /v1/payments");
        assert_eq!(named.key().as_str(), "k1");
        let key = IdempotencyKey::parse(&HeaderValue::from_static("k1")).unwrap();
        let pieced = Scope::from_parts(Some("alice"), &["POST", " ", "/v1/payments"], key);
        assert_eq!(pieced, named);
        let anonymous = scope(None, "e", "k");
        assert_eq!(anonymous.principal(), None);
        assert_eq!(anonymous.endpoint(), "e");
        let long = "p".repeat(1234);
        assert_eq!(
            scope(Some(&long), "e", "k").storage_key(),
            format!("1234:{long}1:e1:k")
        );
    }

    #[test]
    fn anonymous_differs_from_every_named_principal_and_equals_empty() {
        let anonymous = scope(None, "e", "k");
        let empty = scope(Some(""), "e", "k");
        assert_eq!(anonymous.storage_key(), empty.storage_key());
        assert_eq!(empty.principal(), None);
        assert_ne!(
            anonymous.storage_key(),
            scope(Some("-"), "e", "k").storage_key()
        );
    }
}
