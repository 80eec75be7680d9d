//! The path and query a keyed request is known by, in its scope and its fingerprint: as
//! its client sent them, whatever router stripped from them on the way, and in one spelling
//! for every way of percent-encoding them that means the same.

use std::borrow::Cow;

use http::{request::Parts, Uri};

/// A request's path and query (empty without one), as [`sent`] and [`normalized`]: read
/// once per request, for its scope and its fingerprint both.
pub(crate) struct RequestPath<'a> {
    pub(crate) path: Cow<'a, str>,
    pub(crate) query: Cow<'a, str>,
}

impl<'a> RequestPath<'a> {
    pub(crate) fn of(parts: &'a Parts) -> Self {
        let uri = sent(parts);
        Self {
            path: normalized(uri.path()),
            query: normalized(uri.query().unwrap_or("")),
        }
    }
}

/// The URI the client sent. A router that nests routes (axum's `nest`) strips the prefix it
/// matched before the nested routes' layers see the request, keeping the whole URI as
/// `OriginalUri`: read from the stripped one, `/accounts/A/charges` and
/// `/accounts/B/charges` nested at `/accounts/{account}` would both be `/charges`, and one
/// account's retry would be answered with the other's record.
fn sent(parts: &Parts) -> &Uri {
    #[cfg(feature = "axum")]
    if let Some(original) = parts.extensions.get::<axum::extract::OriginalUri>() {
        return &original.0;
    }
    &parts.uri
}

/// `text` (a path or a query) as RFC 3986 (§6.2.2) normalizes it: percent-encoded
/// unreserved characters decoded, the other percent-encodings' hex digits upper-cased, and
/// a `%` that starts no percent-encoding read as the character itself (`%25`), as lenient
/// parsers read it.
/// A client, or a proxy on the way, may spell a retry's path differently (`/orders/%31`
/// for `/orders/1`, which a router hands the same handler): every spelling of one path
/// names one scope and one fingerprint, so such a retry replays instead of executing
/// again. Reserved characters stay encoded: `%2F` is not `/`.
#[inline]
fn normalized(text: &str) -> Cow<'_, str> {
    if text.as_bytes().contains(&b'%') {
        Cow::Owned(rewritten(text))
    } else {
        Cow::Borrowed(text)
    }
}

/// [`normalized`] for text with a `%` in it: out of line, as most paths have none.
#[cold]
#[inline(never)]
fn rewritten(text: &str) -> String {
    let hex = |digit: Option<&u8>| (*digit? as char).to_digit(16);
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('%') {
        out.push_str(&rest[..at]);
        let encoded = &rest.as_bytes()[at..];
        let (Some(high), Some(low)) = (hex(encoded.get(1)), hex(encoded.get(2))) else {
            encode(&mut out, b'%');
            rest = &rest[at + 1..];
            continue;
        };
        let byte = (high << 4 | low) as u8;
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(byte as char);
        } else {
            encode(&mut out, byte);
        }
        rest = &rest[at + 3..];
    }
    out.push_str(rest);
    out
}

fn encode(out: &mut String, byte: u8) {
    const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
    out.push('%');
    out.push(DIGITS[usize::from(byte >> 4)] as char);
    out.push(DIGITS[usize::from(byte & 0xf)] as char);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_normalized_as_rfc_3986_does() {
        for (sent, normal) in [
            ("/v1/payments", "/v1/payments"),
            ("/v1/%70ayments", "/v1/payments"),
            ("/orders/%31/refunds", "/orders/1/refunds"),
            ("/%7e%2D%2e%5F", "/~-._"),
            ("/a%2fb", "/a%2Fb"),
            ("/a%2Fb%3a", "/a%2Fb%3A"),
            ("/caf%C3%A9", "/caf%C3%A9"),
            ("/100%", "/100%25"),
            ("/%zz/%4", "/%25zz/%254"),
            ("/%%41", "/%25A"),
            ("/%25A", "/%25A"),
            ("q=%61&r=%2b", "q=a&r=%2B"),
        ] {
            assert_eq!(normalized(sent), normal, "{sent}");
        }
        assert_ne!(normalized("/a%2Fb"), normalized("/a/b"));
        assert!(matches!(normalized("/v1/payments"), Cow::Borrowed(_)));
    }
}
