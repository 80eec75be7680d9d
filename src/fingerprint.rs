//! The request fingerprint: a key reused with other parameters is an error, not a replay.

use std::fmt;

use http::{request::Parts, HeaderName};
use sha2::{Digest, Sha256};

/// SHA-256 over the method, path, query, configured headers and body of a request.
///
/// Every part is length-prefixed, so moving bytes between parts changes the fingerprint.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of a buffered request.
    pub fn of(parts: &Parts, headers: &[HeaderName], body: &[u8]) -> Self {
        let mut hasher = Sha256::new();
        let mut part = |bytes: &[u8]| {
            hasher.update((bytes.len() as u64).to_be_bytes());
            hasher.update(bytes);
        };
        part(parts.method.as_str().as_bytes());
        part(parts.uri.path().as_bytes());
        part(parts.uri.query().unwrap_or("").as_bytes());
        for name in headers {
            part(name.as_str().as_bytes());
            for value in parts.headers.get_all(name) {
                part(value.as_bytes());
            }
        }
        part(body);
        Self(hasher.finalize().into())
    }

    /// A fingerprint from its stored bytes.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The digest's bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Fingerprint(")?;
        for byte in &self.0[..8] {
            write!(f, "{byte:02x}")?;
        }
        f.write_str("…)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(uri: &str, header: Option<&str>) -> Parts {
        let mut builder = http::Request::post(uri);
        if let Some(value) = header {
            builder = builder.header("x-tenant", value);
        }
        builder.body(()).unwrap().into_parts().0
    }

    #[test]
    fn every_part_counts() {
        let tenant = [HeaderName::from_static("x-tenant")];
        let base = Fingerprint::of(&parts("/a?q=1", Some("t")), &tenant, b"body");
        assert_eq!(
            base,
            Fingerprint::of(&parts("/a?q=1", Some("t")), &tenant, b"body")
        );
        assert_ne!(
            base,
            Fingerprint::of(&parts("/b?q=1", Some("t")), &tenant, b"body")
        );
        assert_ne!(
            base,
            Fingerprint::of(&parts("/a?q=2", Some("t")), &tenant, b"body")
        );
        assert_ne!(
            base,
            Fingerprint::of(&parts("/a?q=1", Some("u")), &tenant, b"body")
        );
        assert_ne!(
            base,
            Fingerprint::of(&parts("/a?q=1", Some("t")), &tenant, b"bodY")
        );
        // Headers count only when configured.
        assert_eq!(
            Fingerprint::of(&parts("/a", Some("t")), &[], b""),
            Fingerprint::of(&parts("/a", Some("u")), &[], b"")
        );
    }

    #[test]
    fn bytes_cannot_move_between_parts() {
        assert_ne!(
            Fingerprint::of(&parts("/a?", None), &[], b"b"),
            Fingerprint::of(&parts("/a?b", None), &[], b"")
        );
    }
}
