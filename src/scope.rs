//! Where a key means something: `(principal, endpoint, key)`, and its storage key.

use crate::IdempotencyKey;

/// The scope of one idempotency key: the same key sent by two principals, or to two
/// endpoints, names two different operations.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Scope {
    principal: Option<String>,
    endpoint: String,
    key: IdempotencyKey,
    /// Built once: every store operation on the request names the record by it.
    storage_key: String,
}

impl Scope {
    /// A scope from its three parts; `None` (or an empty name, which a store with a text
    /// column cannot tell from it) is the anonymous principal.
    pub fn new(principal: Option<String>, endpoint: String, key: IdempotencyKey) -> Self {
        let principal = principal.filter(|name| !name.is_empty());
        let storage_key = storage_key(principal.as_deref(), &endpoint, key.as_str());
        Self {
            principal,
            endpoint,
            key,
            storage_key,
        }
    }

    /// Who sent the request, as the principal extractor named it; `None` when anonymous.
    pub fn principal(&self) -> Option<&str> {
        self.principal.as_deref()
    }

    /// The endpoint, by default `"<METHOD> <path>"`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
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

fn storage_key(principal: Option<&str>, endpoint: &str, key: &str) -> String {
    let principal_len = principal.map_or(1, |p| p.len() + 4);
    let mut out = String::with_capacity(principal_len + endpoint.len() + key.len() + 8);
    match principal {
        Some(p) => push_part(&mut out, p),
        None => out.push('-'),
    }
    push_part(&mut out, endpoint);
    push_part(&mut out, key);
    out
}

/// `<byte length>:<part>`, without the formatting machinery: this runs on every request.
fn push_part(out: &mut String, part: &str) {
    let mut digits = [0u8; 20];
    let mut start = digits.len();
    let mut len = part.len();
    loop {
        start -= 1;
        digits[start] = b'0' + (len % 10) as u8;
        len /= 10;
        if len == 0 {
            break;
        }
    }
    for &digit in &digits[start..] {
        out.push(char::from(digit));
    }
    out.push(':');
    out.push_str(part);
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
    fn splicing_parts_never_collides() {
        let a = scope(Some("alice"), "/v1/payments", "x:/v1/payments:k");
        let b = scope(Some("alice:/v1/payments:x"), "/v1/payments", "k");
        assert_ne!(a.storage_key(), b.storage_key());
        let c = scope(Some("a"), "b1:c", "d");
        let d = scope(Some("a1:b"), "c", "d");
        assert_ne!(c.storage_key(), d.storage_key());
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
