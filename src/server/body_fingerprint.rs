//! How a keyed request's body counts in its fingerprint: its bytes, or its JSON by value.

use std::{fmt, sync::Arc};

use http::{request::Parts, HeaderName};

use super::{
    canonical_json::{self, Parsed},
    json_pointer,
};
use crate::{request_path::RequestPath, Fingerprint};

/// How a layer fingerprints the body of a keyed request, set with
/// [`IdempotencyLayer::fingerprint`](crate::IdempotencyLayer::fingerprint). A retry matches
/// its key's record only when its fingerprint is the same; otherwise it gets
/// `409 idempotency_key_reused_with_different_params`.
///
/// - [`raw`](Self::raw) (the default): the body's bytes. A client must resend exactly what
///   it sent.
/// - [`json`](Self::json): the body as canonical JSON (RFC 8785, JCS). Object member order
///   and insignificant whitespace do not matter, and numbers and strings compare by value
///   (`1.0` is `1`, `"\u0041"` is `"A"`). Numbers are compared as IEEE 754 doubles, as JCS
///   defines, except integers that fit in 64 bits, which compare exactly past 2^53 too
///   (two 64-bit ids that round to the same double are two requests). A body that is
///   not valid JSON, or names a member of an object twice (which JCS has no canonical form
///   for, and which consumers read differently), is fingerprinted raw.
/// - [`json_ignoring`](Self::json_ignoring): the same, with fields left out by JSON
///   pointer: a client-side timestamp or trace id that each retry sends anew.
/// - [`custom`](Self::custom): the bytes a function of the request's parts and body
///   returns, for anything else.
///
/// The method, path, query and the [fingerprinted
/// headers](crate::IdempotencyLayer::fingerprint_header) count under every option. Bodies
/// are read up to the layer's `max_request_body` under every option too: a JSON option
/// parses what was read into a tree of its own (about 32 bytes a value, so up to some 16
/// times the body for a body of small values: keep `max_request_body` to what the route
/// takes).
///
/// # Changing it on a live service
///
/// Each option (with its ignored pointers, or a custom option's name) fingerprints in a
/// space of its own: a record written under one never matches a request fingerprinted
/// under another (except where both fingerprint the same bytes raw: a body that is not
/// JSON). So changing the option is a deploy-time change: until the records written before
/// it expire (the layer's `ttl`), a retry of one of their keys gets
/// `409 idempotency_key_reused_with_different_params` instead of its replay. Nothing runs
/// twice; the client is told its key is spent.
///
/// # Example
///
/// ```
/// use tower_idempotency::{BodyFingerprint, IdempotencyLayer, MemoryStore};
///
/// // A retry may re-serialize its JSON, and stamps it with its own send time.
/// let layer = IdempotencyLayer::new(MemoryStore::new())
///     .fingerprint(BodyFingerprint::json_ignoring(["/sent_at", "/trace/id"]));
/// ```
#[derive(Clone)]
pub struct BodyFingerprint(Kind);

#[derive(Clone)]
enum Kind {
    Raw,
    Json {
        /// The option's tag: the ignored pointers, sorted, length-prefixed.
        tag: Arc<[u8]>,
        ignored: Arc<[Box<str>]>,
    },
    Custom {
        tag: Arc<[u8]>,
        material: Arc<Material>,
    },
}

/// The function a [`BodyFingerprint::custom`] option runs.
type Material = dyn Fn(&Parts, &[u8]) -> Vec<u8> + Send + Sync;

impl BodyFingerprint {
    /// The body's bytes, exactly as sent: the default.
    pub fn raw() -> Self {
        Self(Kind::Raw)
    }

    /// The body as canonical JSON (RFC 8785); raw when it is not valid JSON.
    pub fn json() -> Self {
        Self::json_ignoring(std::iter::empty::<&str>())
    }

    /// The body as canonical JSON without the values at `pointers` (RFC 6901 JSON
    /// pointers, such as `/client_ts` or `/metadata/trace_id`): an object member there is
    /// left out, an array element there counts as `null`. Raw when the body is not valid
    /// JSON.
    ///
    /// # Panics
    ///
    /// When a pointer is not one to a field: it must start with `/`, and `~` only in `~0`
    /// or `~1`.
    pub fn json_ignoring<P: AsRef<str>>(pointers: impl IntoIterator<Item = P>) -> Self {
        let mut ignored: Vec<Box<str>> = pointers
            .into_iter()
            .map(|p| json_pointer::checked(p.as_ref(), "BodyFingerprint::json_ignoring"))
            .collect();
        ignored.sort_unstable();
        ignored.dedup();
        let mut tag = b"\0json".to_vec();
        for pointer in &ignored {
            tag.extend_from_slice(&(pointer.len() as u64).to_be_bytes());
            tag.extend_from_slice(pointer.as_bytes());
        }
        Self(Kind::Json {
            tag: tag.into(),
            ignored: ignored.into(),
        })
    }

    /// What `material` returns for a request, named `name`: two requests match when it
    /// returns the same bytes for both. Records written under another name never match.
    ///
    /// ```
    /// use tower_idempotency::{BodyFingerprint, IdempotencyLayer, MemoryStore};
    ///
    /// // Form bodies whose fields may come in any order.
    /// let sorted_fields = BodyFingerprint::custom("sorted-form-fields", |_parts, body| {
    ///     let mut fields: Vec<&[u8]> = body.split(|b| *b == b'&').collect();
    ///     fields.sort_unstable();
    ///     fields.join(&b'&')
    /// });
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).fingerprint(sorted_fields);
    /// ```
    pub fn custom<F>(name: &str, material: F) -> Self
    where
        F: Fn(&Parts, &[u8]) -> Vec<u8> + Send + Sync + 'static,
    {
        let mut tag = b"\0custom".to_vec();
        tag.extend_from_slice(name.as_bytes());
        let material: Arc<Material> = Arc::new(material);
        Self(Kind::Custom {
            tag: tag.into(),
            material,
        })
    }

    /// The fingerprint of a request whose body was read whole (and parsed, if the route's
    /// key was looked for in it).
    pub(crate) fn of(
        &self,
        parts: &Parts,
        sent: &RequestPath<'_>,
        headers: &[HeaderName],
        body: Parsed<'_>,
    ) -> Fingerprint {
        let bytes = body.body();
        let of = |tag: Option<&[u8]>, body: &[u8]| {
            Fingerprint::of_tagged(tag, parts, sent, headers, body)
        };
        match &self.0 {
            Kind::Raw => of(None, bytes),
            Kind::Json { tag, ignored } => match canonical(body, ignored) {
                Some(canonical) => of(Some(tag), &canonical),
                None => of(None, bytes),
            },
            Kind::Custom { tag, material } => of(Some(tag), &material(parts, bytes)),
        }
    }
}

/// `body` as RFC 8785 canonical JSON without the `ignored` values; `None` when it is not
/// JSON, or not JSON that RFC 8785 gives a canonical form (an object naming a member twice).
fn canonical(body: Parsed<'_>, ignored: &[Box<str>]) -> Option<Vec<u8>> {
    let capacity = body.body().len();
    let mut document = body.into_document()?;
    for pointer in ignored {
        document.remove(pointer);
    }
    let mut canonical = Vec::with_capacity(capacity);
    canonical_json::write(&document, &mut canonical).ok()?;
    Some(canonical)
}

impl Default for BodyFingerprint {
    fn default() -> Self {
        Self::raw()
    }
}

impl fmt::Debug for BodyFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            Kind::Raw => f.write_str("BodyFingerprint::raw"),
            Kind::Json { ignored, .. } => f
                .debug_struct("BodyFingerprint::json")
                .field("ignored", ignored)
                .finish(),
            Kind::Custom { tag, .. } => f
                .debug_struct("BodyFingerprint::custom")
                .field("name", &String::from_utf8_lossy(&tag[b"\0custom".len()..]))
                .finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts() -> Parts {
        http::Request::post("/v1/payments")
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    fn of(option: &BodyFingerprint, body: &str) -> Fingerprint {
        let parts = parts();
        option.of(
            &parts,
            &RequestPath::of(&parts),
            &[],
            Parsed::new(body.as_bytes()),
        )
    }

    #[test]
    fn raw_is_the_bytes_as_before() {
        let raw = BodyFingerprint::raw();
        let body = r#"{"amount":1000,"currency":"usd"}"#;
        assert_eq!(
            of(&raw, body),
            Fingerprint::of(&parts(), &[], body.as_bytes())
        );
        assert_ne!(
            of(&raw, body),
            of(&raw, r#"{"currency":"usd","amount":1000}"#)
        );
    }

    #[test]
    fn canonical_json_ignores_order_whitespace_and_spelling() {
        let json = BodyFingerprint::json();
        let first = of(
            &json,
            r#"{"amount":1000,"currency":"usd","meta":{"a":[1,2]}}"#,
        );
        for same in [
            r#"{"currency":"usd","amount":1000,"meta":{"a":[1,2]}}"#,
            "{ \"amount\" : 1000,\n  \"currency\" : \"usd\", \"meta\": {\"a\": [1, 2]} }",
            r#"{"amount":1000.0,"currency":"\u0075sd","meta":{"a":[1e0,2]}}"#,
        ] {
            assert_eq!(of(&json, same), first, "{same}");
        }
        for different in [
            r#"{"amount":1001,"currency":"usd","meta":{"a":[1,2]}}"#,
            r#"{"amount":1000,"currency":"usd","meta":{"a":[2,1]}}"#,
            r#"{"amount":"1000","currency":"usd","meta":{"a":[1,2]}}"#,
            r#"{"amount":1000,"currency":"usd","meta":{"a":[1,2]},"x":null}"#,
        ] {
            assert_ne!(of(&json, different), first, "{different}");
        }
    }

    #[test]
    fn ignored_fields_do_not_count_and_the_rest_does() {
        let ignoring = BodyFingerprint::json_ignoring(["/sent_at", "/trace/id"]);
        let first = of(
            &ignoring,
            r#"{"amount":1000,"sent_at":1,"trace":{"id":"a","span":1}}"#,
        );
        assert_eq!(
            of(
                &ignoring,
                r#"{"trace":{"span":1,"id":"b"},"amount":1000,"sent_at":2}"#
            ),
            first
        );
        assert_eq!(
            of(&ignoring, r#"{"amount":1000,"trace":{"span":1}}"#),
            first
        );
        assert_ne!(
            of(
                &ignoring,
                r#"{"amount":2000,"sent_at":1,"trace":{"id":"a","span":1}}"#
            ),
            first
        );
        assert_ne!(
            of(
                &ignoring,
                r#"{"amount":1000,"sent_at":1,"trace":{"id":"a","span":2}}"#
            ),
            first
        );
    }

    #[test]
    fn invalid_json_is_fingerprinted_raw() {
        let body = r#"{"amount":1000,"#;
        let raw = of(&BodyFingerprint::raw(), body);
        assert_eq!(of(&BodyFingerprint::json(), body), raw);
        assert_eq!(of(&BodyFingerprint::json_ignoring(["/a"]), body), raw);
        assert_ne!(
            of(&BodyFingerprint::json(), "amount=1000"),
            of(&BodyFingerprint::json(), "amount=1001")
        );
    }

    #[test]
    fn a_member_named_twice_is_fingerprinted_raw() {
        // Which of the two a consumer reads differs: never the same as either alone.
        let json = BodyFingerprint::json();
        let twice = r#"{"amount":100,"amount":1000}"#;
        assert_eq!(of(&json, twice), of(&BodyFingerprint::raw(), twice));
        assert_ne!(of(&json, twice), of(&json, r#"{"amount":1000}"#));
        assert_ne!(of(&json, twice), of(&json, r#"{"amount":100}"#));
        // Unless the repeated member is one left out.
        let ignoring = BodyFingerprint::json_ignoring(["/note"]);
        assert_eq!(
            of(&ignoring, r#"{"amount":1,"note":"a","note":"b"}"#),
            of(&ignoring, r#"{"amount":1}"#)
        );
    }

    #[test]
    fn each_option_fingerprints_in_a_space_of_its_own() {
        // The canonical form of this body is the body itself: only the option's tag differs.
        let body = r#"{"a":1}"#;
        let options = [
            BodyFingerprint::raw(),
            BodyFingerprint::json(),
            BodyFingerprint::json_ignoring(["/b"]),
            BodyFingerprint::json_ignoring(["/c"]),
            BodyFingerprint::custom("as-is", |_, body| body.to_vec()),
            BodyFingerprint::custom("as-sent", |_, body| body.to_vec()),
        ];
        let fingerprints: Vec<Fingerprint> = options.iter().map(|o| of(o, body)).collect();
        for (i, a) in fingerprints.iter().enumerate() {
            for b in &fingerprints[i + 1..] {
                assert_ne!(a, b, "{options:?}");
            }
        }
        // The same ignored pointers, in any order or repeated, are the same option.
        assert_eq!(
            of(&BodyFingerprint::json_ignoring(["/b", "/c", "/b"]), body),
            of(&BodyFingerprint::json_ignoring(["/c", "/b"]), body)
        );
    }

    #[test]
    fn a_custom_option_matches_on_what_it_returns() {
        let amount_only = BodyFingerprint::custom("amount", |_, body| {
            let value: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
            value["amount"].to_string().into_bytes()
        });
        assert_eq!(
            of(&amount_only, r#"{"amount":5,"note":"a"}"#),
            of(&amount_only, r#"{"note":"b","amount":5}"#)
        );
        assert_ne!(
            of(&amount_only, r#"{"amount":5}"#),
            of(&amount_only, r#"{"amount":6}"#)
        );
    }
}
