//! Keys read from the request body rather than a header: a webhook's event id.

use std::{fmt, sync::Arc};

use super::{
    canonical_json::{Node, Parsed, Repeated},
    json_pointer,
};
use crate::{IdempotencyKey, InvalidKey};
use http::request::Parts;

/// Where a route finds each request's key in its body, set with
/// [`key_from_json`](crate::IdempotencyLayer::key_from_json) or
/// [`key_from_body`](crate::IdempotencyLayer::key_from_body).
#[derive(Clone)]
pub(crate) enum BodyKey {
    /// A JSON string at this pointer.
    Json(Box<str>),
    /// What a function of the request returns.
    Custom(Arc<FindKey>),
}

/// The function a [`BodyKey::Custom`] runs.
pub(crate) type FindKey = dyn Fn(&Parts, &[u8]) -> Option<String> + Send + Sync;

impl BodyKey {
    pub(crate) fn json(pointer: &str) -> Self {
        Self::Json(json_pointer::checked(
            pointer,
            "IdempotencyLayer::key_from_json",
        ))
    }

    /// Where the key is, for people: `at /id`.
    pub(crate) fn place(&self) -> Arc<str> {
        match self {
            Self::Json(pointer) => format!("at {pointer}").into(),
            Self::Custom(_) => "where the route's own function finds it".into(),
        }
    }

    /// The request's key: `Ok(None)` when the body holds none (not JSON, or nothing at the
    /// pointer, or `null` there), an error when what it holds is no valid key, or when an
    /// object on the pointer's way names the member twice (senders' and consumers' readers
    /// differ on which one counts).
    pub(crate) fn find(
        &self,
        parts: &Parts,
        body: &mut Parsed<'_>,
    ) -> Result<Option<IdempotencyKey>, InvalidKey> {
        match self {
            Self::Json(pointer) => {
                let Some(document) = body.document() else {
                    return Ok(None);
                };
                match document.get(pointer) {
                    Ok(None | Some(Node::Null)) => Ok(None),
                    Ok(Some(Node::String(key))) => IdempotencyKey::from_text(key).map(Some),
                    Ok(Some(_)) => Err(InvalidKey::NotAString),
                    Err(Repeated) => Err(InvalidKey::RepeatedInBody),
                }
            }
            Self::Custom(find) => find(parts, body.body())
                .map(|key| IdempotencyKey::from_text(&key))
                .transpose(),
        }
    }
}

impl fmt::Debug for BodyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Json(pointer) => f.debug_tuple("Json").field(pointer).finish(),
            Self::Custom(_) => f.write_str("Custom"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts() -> Parts {
        http::Request::post("/v1/webhooks")
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    fn find(key: &BodyKey, body: &str) -> Result<Option<String>, InvalidKey> {
        key.find(&parts(), &mut Parsed::new(body.as_bytes()))
            .map(|key| key.map(|key| key.as_str().to_owned()))
    }

    #[test]
    fn a_string_at_the_pointer_is_the_key() {
        let id = BodyKey::json("/id");
        assert_eq!(
            find(&id, r#"{"id":"evt_1","type":"x"}"#),
            Ok(Some("evt_1".into()))
        );
        let nested = BodyKey::json("/data/object/id");
        assert_eq!(
            find(&nested, r#"{"data":{"object":{"id":"ch_1"}}}"#),
            Ok(Some("ch_1".into()))
        );
    }

    #[test]
    fn no_key_and_bad_keys_are_told_apart() {
        let id = BodyKey::json("/id");
        for none in [r#"{"type":"x"}"#, r#"{"id":null}"#, "not json", ""] {
            assert_eq!(find(&id, none), Ok(None), "{none}");
        }
        assert_eq!(find(&id, r#"{"id":42}"#), Err(InvalidKey::NotAString));
        assert_eq!(find(&id, r#"{"id":{"a":1}}"#), Err(InvalidKey::NotAString));
        assert_eq!(
            find(&id, r#"{"id":"evt_B","id":"evt_A"}"#),
            Err(InvalidKey::RepeatedInBody)
        );
        let nested = BodyKey::json("/data/id");
        assert_eq!(
            find(&nested, r#"{"data":{"id":"a"},"data":{"id":"b"}}"#),
            Err(InvalidKey::RepeatedInBody)
        );
        assert_eq!(find(&id, r#"{"id":""}"#), Err(InvalidKey::Empty));
        assert_eq!(
            find(&id, r#"{"id":"evt 1"}"#),
            Err(InvalidKey::InvalidCharacter)
        );
        let long = format!(r#"{{"id":"{}"}}"#, "a".repeat(256));
        assert_eq!(find(&id, &long), Err(InvalidKey::TooLong));
    }

    #[test]
    fn a_function_finds_the_key_anywhere() {
        let from_query = BodyKey::Custom(Arc::new(|parts: &Parts, _: &[u8]| {
            parts
                .uri
                .query()?
                .strip_prefix("delivery=")
                .map(str::to_owned)
        }));
        let parts = http::Request::post("/hook?delivery=d1")
            .body(())
            .unwrap()
            .into_parts()
            .0;
        let key = from_query
            .find(&parts, &mut Parsed::new(b""))
            .unwrap()
            .unwrap();
        assert_eq!(key.as_str(), "d1");
        let none = from_query.find(&self::parts(), &mut Parsed::new(b""));
        assert_eq!(none.unwrap(), None);
    }
}
