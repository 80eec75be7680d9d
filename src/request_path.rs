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
///
/// Bytes a URI may not hold raw, which `http` and hyper accept all the same (`é`, `{`,
/// `"`, `|`), are percent-encoded: a router decodes `/orders/café` and
/// `/orders/caf%C3%A9` to the same `café`, and a client library or proxy re-encoding a
/// retry's path must not make it a second execution.
#[inline]
fn normalized(text: &str) -> Cow<'_, str> {
    if text.bytes().all(|byte| KEPT_AS_SENT[usize::from(byte)]) {
        Cow::Borrowed(text)
    } else {
        Cow::Owned(rewritten(text))
    }
}

/// The bytes a path or a query holds as they are (RFC 3986 §3.3, §3.4): unreserved
/// characters, sub-delimiters, `:`, `@`, `/` and `?`. Not `%`, which starts a
/// percent-encoding to normalize.
const KEPT_AS_SENT: [bool; 256] = {
    let mut kept = [false; 256];
    let allowed = b"-._~!$&'()*+,;=:@/?";
    let mut i = 0;
    while i < allowed.len() {
        kept[allowed[i] as usize] = true;
        i += 1;
    }
    let mut byte = 0;
    while byte < 128 {
        if (byte as u8).is_ascii_alphanumeric() {
            kept[byte] = true;
        }
        byte += 1;
    }
    kept
};

/// [`normalized`] for text with a `%` or a byte to encode in it: out of line, as most
/// paths have neither.
#[cold]
#[inline(never)]
fn rewritten(text: &str) -> String {
    let hex = |digit: Option<&u8>| (*digit? as char).to_digit(16);
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    while let Some(&byte) = bytes.get(at) {
        at += 1;
        if byte != b'%' {
            if KEPT_AS_SENT[usize::from(byte)] {
                out.push(byte as char);
            } else {
                encode(&mut out, byte);
            }
            continue;
        }
        let (Some(high), Some(low)) = (hex(bytes.get(at)), hex(bytes.get(at + 1))) else {
            encode(&mut out, b'%');
            continue;
        };
        let decoded = (high << 4 | low) as u8;
        if decoded.is_ascii_alphanumeric() || b"-._~".contains(&decoded) {
            out.push(decoded as char);
        } else {
            encode(&mut out, decoded);
        }
        at += 2;
    }
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
            // Bytes a URI may not hold raw, as a client re-encoding them would send them.
            ("/orders/caf\u{e9}", "/orders/caf%C3%A9"),
            ("/orders/a{b}", "/orders/a%7Bb%7D"),
            ("/a\"b|c^d\\e`f<g>h", "/a%22b%7Cc%5Ed%5Ce%60f%3Cg%3Eh"),
            ("/100% {", "/100%25%20%7B"),
            ("q=caf\u{e9}&r=[1]", "q=caf%C3%A9&r=%5B1%5D"),
            ("/a:b@c!$&'()*+,;=/?", "/a:b@c!$&'()*+,;=/?"),
        ] {
            assert_eq!(normalized(sent), normal, "{sent}");
        }
        assert_ne!(normalized("/a%2Fb"), normalized("/a/b"));
        assert!(matches!(normalized("/v1/payments"), Cow::Borrowed(_)));
        assert!(matches!(
            normalized("/a:b@c!$&'()*+,;=/?~"),
            Cow::Borrowed(_)
        ));
    }
}
