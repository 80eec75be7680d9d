//! The request fingerprint: a key reused with other parameters is an error, not a replay.

use std::fmt;

use http::{header::VARY, request::Parts, HeaderMap, HeaderName, HeaderValue};
use sha2::{Digest, Sha256};

use crate::request_path::RequestPath;

/// SHA-256 over the method, path, query, configured headers and body of a request (the
/// path and query normalized: percent-encoded unreserved characters decoded).
///
/// Every part is length-prefixed, so moving bytes between parts changes the fingerprint.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of a buffered request.
    pub fn of(parts: &Parts, headers: &[HeaderName], body: &[u8]) -> Self {
        Self::of_tagged(None, parts, &RequestPath::of(parts), headers, body)
    }

    /// [`of`](Self::of), with `body` standing for the request's body as a
    /// [`BodyFingerprint`](crate::BodyFingerprint) other than the raw bytes sees it, and
    /// `tag` naming that option. The tag goes first and begins with a zero byte, which no
    /// method has: no fingerprint of one option equals one of another.
    pub(crate) fn of_tagged(
        tag: Option<&[u8]>,
        parts: &Parts,
        sent: &RequestPath<'_>,
        headers: &[HeaderName],
        body: &[u8],
    ) -> Self {
        let mut hasher = Sha256::new();
        let mut part = |bytes: &[u8]| {
            hasher.update((bytes.len() as u64).to_be_bytes());
            hasher.update(bytes);
        };
        if let Some(tag) = tag {
            debug_assert_eq!(tag.first(), Some(&0));
            part(tag);
        }
        part(parts.method.as_str().as_bytes());
        // As the scope reads them: as sent, in one spelling.
        part(sent.path.as_bytes());
        part(sent.query.as_bytes());
        for name in headers {
            part(name.as_str().as_bytes());
            // Counted, so that a value cannot pass for the next header's name.
            let values = parts.headers.get_all(name);
            part(&(values.iter().count() as u64).to_be_bytes());
            for value in values {
                part(value.as_bytes());
            }
        }
        part(body);
        Self(hasher.finalize().into())
    }

    /// The fingerprint a completed record keeps: when the response names request headers
    /// in `Vary` (it was negotiated: compressed because the request accepted gzip, say),
    /// this fingerprint together with the request's values of those headers, so that only a
    /// retry asking for the same representation matches it. Otherwise this fingerprint.
    ///
    /// Header values count as sent, byte for byte, in order; `Vary: *` names none.
    pub fn varied(self, response: &HeaderMap, request: &HeaderMap) -> Self {
        self.varied_by(response, |name| {
            let values = request.get_all(name).iter();
            values.map(HeaderValue::as_bytes).collect()
        })
    }

    /// [`varied`](Self::varied) by the headers a request was sent with.
    pub(crate) fn varied_by_sent(self, response: &HeaderMap, request: &SentHeaders) -> Self {
        self.varied_by(response, |name| request.values(name))
    }

    fn varied_by<'r>(self, response: &HeaderMap, values: impl Fn(&str) -> Vec<&'r [u8]>) -> Self {
        let Some(names) = vary_names(response) else {
            return self;
        };
        let mut hasher = Sha256::new();
        hasher.update(b"vary");
        hasher.update(self.0);
        let mut part = |bytes: &[u8]| {
            hasher.update((bytes.len() as u64).to_be_bytes());
            hasher.update(bytes);
        };
        for name in &names {
            part(name.as_bytes());
            let values = values(name);
            part(&(values.len() as u64).to_be_bytes());
            for value in values {
                part(value);
            }
        }
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

/// A request's headers as sent, kept while its handler runs in case the response turns out
/// to be negotiated on them, and read only when a response has `Vary`. Copied into one
/// buffer, each name and value after its length: cloning every name and value instead
/// would touch a shared count twice per header, on every execution.
pub(crate) struct SentHeaders(Vec<u8>);

impl SentHeaders {
    pub(crate) fn of(headers: &HeaderMap) -> Self {
        // Room for the lengths, the values and a name of up to 24 bytes each: enough for
        // nearly every header section without a second pass to measure the names (a
        // standard name's text is a table lookup, which misses the cache).
        const ALLOWANCE: usize = 2 * size_of::<u32>() + 24;
        let size = headers
            .iter()
            .map(|(_, value)| ALLOWANCE + value.as_bytes().len());
        let mut bytes = Vec::with_capacity(size.sum());
        for (name, value) in headers {
            for part in [name.as_str().as_bytes(), value.as_bytes()] {
                // A header section is far below 4 GiB: hyper refuses one past a few hundred KiB.
                bytes.extend_from_slice(&(part.len() as u32).to_ne_bytes());
                bytes.extend_from_slice(part);
            }
        }
        Self(bytes)
    }

    /// The values sent under `name` (lower-case), in order.
    fn values(&self, name: &str) -> Vec<&[u8]> {
        let mut rest = self.0.as_slice();
        let mut next_part = || {
            let (length, after) = rest.split_first_chunk::<4>()?;
            let (part, after) = after.split_at(u32::from_ne_bytes(*length) as usize);
            rest = after;
            Some(part)
        };
        let mut values = Vec::new();
        while let (Some(sent), Some(value)) = (next_part(), next_part()) {
            if sent == name.as_bytes() {
                values.push(value);
            }
        }
        values
    }
}

/// The request headers a response's `Vary` names, lower-cased, sorted and without
/// repeats; `None` when it names none.
fn vary_names(response: &HeaderMap) -> Option<Vec<String>> {
    let mut names: Vec<String> = response
        .get_all(VARY)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .filter(|name| !name.is_empty() && name != "*")
        .collect();
    if names.is_empty() {
        return None;
    }
    names.sort_unstable();
    names.dedup();
    Some(names)
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
    fn spellings_of_one_path_and_query_share_a_fingerprint() {
        let of = |uri| Fingerprint::of(&parts(uri, None), &[], b"body");
        assert_eq!(of("/orders/1?a=b"), of("/orders/%31?%61=b"));
        assert_eq!(of("/a%2fb"), of("/a%2Fb"));
        assert_ne!(of("/a%2Fb"), of("/a/b"));
        assert_ne!(of("/a?b=%2B"), of("/a?b=+"));
    }

    #[test]
    fn a_header_value_cannot_pass_for_the_next_configured_header() {
        let names = [
            HeaderName::from_static("x-account"),
            HeaderName::from_static("x-currency"),
        ];
        let of = |pairs: &[(&str, &str)]| {
            let mut request = http::Request::post("/pay").body(()).unwrap();
            *request.headers_mut() = headers(pairs);
            Fingerprint::of(&request.into_parts().0, &names, b"{}")
        };
        // Without counts, both hash as x-account, x-currency, x-currency.
        assert_ne!(
            of(&[("x-account", "x-currency")]),
            of(&[("x-currency", "x-currency")])
        );
        assert_ne!(of(&[("x-account", "")]), of(&[]));
        assert_ne!(
            of(&[("x-account", "a"), ("x-account", "b")]),
            of(&[("x-account", "a"), ("x-currency", "b")])
        );
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
        }
        map
    }

    #[test]
    fn the_headers_a_response_varies_on_take_part() {
        let base = Fingerprint::of(&parts("/a", None), &[], b"body");
        let gzip = headers(&[("accept-encoding", "gzip"), ("x-other", "1")]);
        // No Vary, or `Vary: *`: the fingerprint itself.
        assert_eq!(base.varied(&HeaderMap::new(), &gzip), base);
        assert_eq!(base.varied(&headers(&[("vary", "*")]), &gzip), base);
        let vary = headers(&[("vary", "Accept-Encoding")]);
        let varied = base.varied(&vary, &gzip);
        assert_ne!(varied, base);
        // Only the named headers count, however the name is spelled or repeated.
        let same = headers(&[("accept-encoding", "gzip"), ("x-other", "2")]);
        assert_eq!(base.varied(&vary, &same), varied);
        let spelled = headers(&[
            ("vary", "origin, ACCEPT-ENCODING"),
            ("vary", "accept-encoding"),
        ]);
        let spelled_alone = headers(&[("vary", "Origin,Accept-Encoding")]);
        assert_eq!(
            base.varied(&spelled, &gzip),
            base.varied(&spelled_alone, &gzip)
        );
        // Another value, no value, or one more value: another representation.
        for request in [
            headers(&[("accept-encoding", "identity")]),
            HeaderMap::new(),
            headers(&[("accept-encoding", "gzip"), ("accept-encoding", "br")]),
        ] {
            assert_ne!(base.varied(&vary, &request), varied, "{request:?}");
        }
        // A value cannot pass for the next header's name.
        let two = headers(&[("vary", "a, b")]);
        assert_ne!(
            base.varied(&two, &headers(&[("a", "b")])),
            base.varied(&two, &headers(&[("b", "")]))
        );
    }

    #[test]
    fn the_headers_kept_while_a_handler_runs_vary_it_as_the_request_would() {
        let base = Fingerprint::of(&parts("/a", None), &[], b"body");
        let sent = headers(&[
            ("accept-encoding", "gzip"),
            ("x-other", "1"),
            ("accept-encoding", "br"),
            ("accept", ""),
            ("origin", "https://a.example"),
        ]);
        let kept = SentHeaders::of(&sent);
        for vary in [
            "accept-encoding",
            "Origin, Accept",
            "x-missing",
            "*",
            "x-other, origin",
        ] {
            let response = headers(&[("vary", vary)]);
            assert_eq!(
                base.varied_by_sent(&response, &kept),
                base.varied(&response, &sent),
                "{vary}"
            );
        }
        let none = SentHeaders::of(&HeaderMap::new());
        let response = headers(&[("vary", "accept")]);
        assert_eq!(
            base.varied_by_sent(&response, &none),
            base.varied(&response, &HeaderMap::new())
        );
        assert_eq!(kept.values("accept-encoding"), [&b"gzip"[..], b"br"]);
        assert_eq!(kept.values("accept"), [&b""[..]]);
    }

    #[test]
    fn bytes_cannot_move_between_parts() {
        assert_ne!(
            Fingerprint::of(&parts("/a?", None), &[], b"b"),
            Fingerprint::of(&parts("/a?b", None), &[], b"")
        );
    }
}
