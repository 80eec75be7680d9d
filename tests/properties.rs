//! Properties that must hold for every input, not only the examples the other tests pick.

use std::collections::HashMap;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use proptest::prelude::*;
use tower_idempotency::{
    ClaimToken, Fingerprint, IdempotencyKey, Record, Scope, StoredResponse, MAX_KEY_LEN,
};

/// The valid set, written independently of the parser: a bare key of 1–255 visible ASCII
/// characters without `"`, or an sf-string whose unescaped content is 1–255 characters.
fn oracle(raw: &[u8]) -> Option<String> {
    let key = if raw.first() == Some(&b'"') {
        let inner = raw.strip_prefix(b"\"")?.strip_suffix(b"\"")?;
        let mut key = Vec::new();
        let mut bytes = inner.iter();
        while let Some(&b) = bytes.next() {
            match b {
                b'\\' => match bytes.next() {
                    Some(&escaped @ (b'"' | b'\\')) => key.push(escaped),
                    _ => return None,
                },
                b'"' => return None,
                0x20..=0x7e => key.push(b),
                _ => return None,
            }
        }
        key
    } else {
        if !raw.iter().all(|b| (0x21..=0x7e).contains(b) && *b != b'"') {
            return None;
        }
        raw.to_vec()
    };
    ((1..=MAX_KEY_LEN).contains(&key.len())).then(|| String::from_utf8(key).unwrap())
}

/// Header values made of the characters that matter to the grammar, plus bytes beyond it.
fn header_bytes() -> impl Strategy<Value = Vec<u8>> {
    let interesting = prop_oneof![
        4 => prop::sample::select(b"aZ09-_:\"\\ ".to_vec()),
        1 => prop::sample::select(vec![b'\t', 0x80, 0xc3, 0xff, b'~', b'!', b';', b'=']),
    ];
    prop_oneof![
        prop::collection::vec(interesting.clone(), 0..12),
        // Quoted forms, to reach the sf-string branch often, some with something after
        // the closing quote.
        (
            prop::collection::vec(interesting, 0..12),
            prop::sample::select(vec!["", "", " ", "  ", ";a=1", "\"", "x"]),
        )
            .prop_map(|(mut v, suffix)| {
                v.insert(0, b'"');
                v.push(b'"');
                v.extend_from_slice(suffix.as_bytes());
                v
            }),
        // Around the length limit.
        (250usize..260, any::<bool>()).prop_map(|(n, quoted)| {
            let key = vec![b'k'; n];
            if quoted {
                [b"\"".as_slice(), &key, b"\""].concat()
            } else {
                key
            }
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn key_parser_accepts_exactly_the_valid_set(raw in header_bytes()) {
        let Ok(value) = HeaderValue::from_bytes(&raw) else {
            // Bytes no HTTP header can carry never reach the parser.
            return Ok(());
        };
        let parsed = IdempotencyKey::parse(&value).ok().map(|k| k.as_str().to_owned());
        prop_assert_eq!(parsed, oracle(&raw));
    }

    #[test]
    fn key_parser_never_panics_on_any_bytes(raw in prop::collection::vec(any::<u8>(), 0..600)) {
        if let Ok(value) = HeaderValue::from_bytes(&raw) {
            let _ = IdempotencyKey::parse(&value);
        }
    }

    #[test]
    fn records_round_trip(
        status in 100u16..1000,
        headers in prop::collection::vec(("[a-z][a-z0-9-]{0,20}", prop::collection::vec(0x20u8..0xff, 0..40)), 0..8),
        body in prop::collection::vec(any::<u8>(), 0..2048),
        trailers in prop::collection::vec(("[a-z][a-z0-9-]{0,20}", prop::collection::vec(0x20u8..0xff, 0..40)), 0..4),
        fingerprint in any::<[u8; 32]>(),
        token in any::<[u8; 16]>(),
    ) {
        let map_of = |pairs: &[(String, Vec<u8>)]| {
            let mut map = HeaderMap::new();
            for (name, value) in pairs {
                if let Ok(value) = HeaderValue::from_bytes(value) {
                    map.append(HeaderName::from_bytes(name.as_bytes()).unwrap(), value);
                }
            }
            map
        };
        let fingerprint = Fingerprint::from_bytes(fingerprint);
        let response = StoredResponse {
            status: StatusCode::from_u16(status).unwrap(),
            headers: map_of(&headers),
            body: Bytes::from(body),
            trailers: Some(Box::new(map_of(&trailers))).filter(|t| !t.is_empty()),
        };
        let completed = Record::Completed { fingerprint, response };
        prop_assert_eq!(Record::decode(completed.encode()).unwrap(), completed);
        let in_progress = Record::InProgress { fingerprint, token: ClaimToken::from_bytes(token) };
        prop_assert_eq!(Record::decode(in_progress.encode()).unwrap(), in_progress);
    }

    #[test]
    fn decoding_arbitrary_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = Record::decode(Bytes::from(bytes));
    }

    #[test]
    fn decoding_mutated_records_never_panics(
        body in prop::collection::vec(any::<u8>(), 0..64),
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut headers = HeaderMap::new();
        headers.insert("content-type", HeaderValue::from_static("application/json"));
        let record = Record::Completed {
            fingerprint: Fingerprint::from_bytes([1; 32]),
            response: StoredResponse { status: StatusCode::OK, headers, body: Bytes::from(body), trailers: None },
        };
        let mut bytes = record.encode().to_vec();
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        bytes.truncate(cut.index(bytes.len() + 1));
        let _ = Record::decode(Bytes::from(bytes));
    }

    #[test]
    fn distinct_scopes_never_share_a_storage_key(
        triples in prop::collection::vec(
            (
                prop::option::of("[a:1-]{0,6}"),
                "[a:1/ ]{0,6}",
                "[a:1-]{1,6}",
            ),
            2..40,
        )
    ) {
        let mut seen: HashMap<String, (Option<String>, String, String)> = HashMap::new();
        for (principal, endpoint, key) in triples {
            // An empty principal is the anonymous one.
            let principal = principal.filter(|p| !p.is_empty());
            let parsed = IdempotencyKey::parse(&HeaderValue::from_str(&key).unwrap()).unwrap();
            let scope = Scope::new(principal.clone(), endpoint.clone(), parsed);
            let triple = (principal, endpoint, key);
            if let Some(other) = seen.insert(scope.storage_key().to_owned(), triple.clone()) {
                prop_assert_eq!(other, triple, "two scopes share a storage key");
            }
        }
    }
}
