//! The `Idempotency-Key` header: parsing and validation.

use std::fmt;

use http::header::{GetAll, HeaderValue};

/// The longest key accepted, in characters.
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key: 1 to 255 visible ASCII characters (spaces only where the
/// client sent the quoted form).
///
/// Both header forms name the same key: the RFC 8941 sf-string `"8e03"` used by the IETF
/// draft and the bare `8e03` used by Stripe.
///
/// # Example
///
/// ```
/// use http::HeaderValue;
/// use tower_idempotency::IdempotencyKey;
///
/// let quoted = IdempotencyKey::parse(&HeaderValue::from_static("\"8e03\"")).unwrap();
/// let bare = IdempotencyKey::parse(&HeaderValue::from_static("8e03")).unwrap();
/// assert_eq!(quoted, bare);
/// assert_eq!(quoted.as_str(), "8e03");
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

/// Why a request did not hold a valid key (in its header, or in its body where the route reads
/// it there). Every variant answers `400 invalid_idempotency_key`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidKey {
    /// The header was given more than once.
    #[error("the idempotency key header was given more than once")]
    Repeated,
    /// The key has no characters.
    #[error("the idempotency key is empty")]
    Empty,
    /// The key is longer than 255 characters.
    #[error("the idempotency key is longer than {MAX_KEY_LEN} characters")]
    TooLong,
    /// A character outside visible ASCII (or a space in the bare form).
    #[error("the idempotency key has a character outside visible ASCII")]
    InvalidCharacter,
    /// A quoted key that is not a well-formed RFC 8941 sf-string.
    #[error("the idempotency key is not a well-formed quoted string")]
    MalformedQuotedString,
    /// The value a route reads its key from in the body
    /// ([`key_from_json`](crate::IdempotencyLayer::key_from_json)) is not a JSON string.
    #[error("the idempotency key in the body is not a JSON string")]
    NotAString,
    /// An object on the way to the key in the body names the same member twice: which one
    /// is meant cannot be told.
    #[error("the body names the idempotency key's member more than once")]
    RepeatedInBody,
}

impl IdempotencyKey {
    /// Parses one header value, in the quoted (sf-string) or the bare form.
    pub fn parse(value: &HeaderValue) -> Result<Self, InvalidKey> {
        let raw = value.as_bytes();
        // A quoted 255-character key takes at most 2 + 2 * 255 bytes; anything longer is
        // rejected before any parsing work.
        if raw.len() > 2 * MAX_KEY_LEN + 2 {
            return Err(InvalidKey::TooLong);
        }
        let key = if raw.first() == Some(&b'"') {
            parse_quoted(raw)?
        } else {
            parse_bare(raw)?
        };
        Self::of_length(key)
    }

    /// `key`, if it has 1 to 255 characters.
    fn of_length(key: String) -> Result<Self, InvalidKey> {
        match key.len() {
            0 => Err(InvalidKey::Empty),
            n if n > MAX_KEY_LEN => Err(InvalidKey::TooLong),
            _ => Ok(Self(key)),
        }
    }

    /// Reads the key from every value of the header: `Ok(None)` when it is absent, an error
    /// when it is invalid or repeated.
    pub fn from_header_values(values: GetAll<'_, HeaderValue>) -> Result<Option<Self>, InvalidKey> {
        let mut values = values.iter();
        let Some(first) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(InvalidKey::Repeated);
        }
        Self::parse(first).map(Some)
    }

    /// A key read from somewhere other than a header (a request body): 1 to 255 visible
    /// ASCII characters, taken as they are (no quoted form).
    pub(crate) fn from_text(text: &str) -> Result<Self, InvalidKey> {
        if text.len() > MAX_KEY_LEN {
            return Err(InvalidKey::TooLong);
        }
        if !text.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
            return Err(InvalidKey::InvalidCharacter);
        }
        Self::of_length(text.to_owned())
    }

    /// The key's characters, unquoted and unescaped.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

fn parse_quoted(raw: &[u8]) -> Result<String, InvalidKey> {
    if raw.iter().any(|b| !(0x20..=0x7e).contains(b)) {
        return Err(InvalidKey::InvalidCharacter);
    }
    // Strict: nothing may follow the closing quote (sfv would skip trailing spaces).
    if raw.len() < 2 || raw.last() != Some(&b'"') {
        return Err(InvalidKey::MalformedQuotedString);
    }
    let item: sfv::Item = sfv::Parser::new(raw)
        .parse()
        .map_err(|_| InvalidKey::MalformedQuotedString)?;
    // Parameters (`"k";a=1`) are not part of the key and would let two spellings differ.
    if !item.params.is_empty() {
        return Err(InvalidKey::MalformedQuotedString);
    }
    item.bare_item
        .as_string()
        .map(|s| s.as_str().to_owned())
        .ok_or(InvalidKey::MalformedQuotedString)
}

fn parse_bare(raw: &[u8]) -> Result<String, InvalidKey> {
    for &b in raw {
        match b {
            // A stray quote is a malformed sf-string, not part of a bare key.
            b'"' => return Err(InvalidKey::MalformedQuotedString),
            0x21..=0x7e => {}
            _ => return Err(InvalidKey::InvalidCharacter),
        }
    }
    // Every byte is ASCII, so this cannot fail.
    String::from_utf8(raw.to_vec()).map_err(|_| InvalidKey::InvalidCharacter)
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey").field(&self.0).finish()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;

    fn parse(raw: &[u8]) -> Result<String, InvalidKey> {
        let value = HeaderValue::from_bytes(raw).expect("header value");
        IdempotencyKey::parse(&value).map(|k| k.0)
    }

    #[test]
    fn both_forms_name_the_same_key() {
        assert_eq!(parse(b"abc").unwrap(), "abc");
        assert_eq!(parse(b"\"abc\"").unwrap(), "abc");
        assert_eq!(
            parse(b"8e03978e-40d5-43e8-bc93-6894a57f9324").unwrap(),
            "8e03978e-40d5-43e8-bc93-6894a57f9324"
        );
    }

    #[test]
    fn quoted_form_unescapes_and_allows_spaces() {
        assert_eq!(parse(br#""a \"b\" \\c""#).unwrap(), r#"a "b" \c"#);
        assert_eq!(parse(b"\"a b\"").unwrap(), "a b");
    }

    #[test]
    fn length_limits() {
        let ok = "k".repeat(MAX_KEY_LEN);
        assert_eq!(parse(ok.as_bytes()).unwrap(), ok);
        assert_eq!(parse(format!("\"{ok}\"").as_bytes()).unwrap(), ok);
        let long = "k".repeat(MAX_KEY_LEN + 1);
        assert_eq!(parse(long.as_bytes()), Err(InvalidKey::TooLong));
        assert_eq!(
            parse(format!("\"{long}\"").as_bytes()),
            Err(InvalidKey::TooLong)
        );
        assert_eq!(parse(b""), Err(InvalidKey::Empty));
        assert_eq!(parse(b"\"\""), Err(InvalidKey::Empty));
    }

    #[test]
    fn rejects_bad_characters_and_malformed_quotes() {
        assert_eq!(parse(b"a b"), Err(InvalidKey::InvalidCharacter));
        assert_eq!(parse(b"a\tb"), Err(InvalidKey::InvalidCharacter));
        assert_eq!(
            parse("caf\u{e9}".as_bytes()),
            Err(InvalidKey::InvalidCharacter)
        );
        assert_eq!(parse(b"\"caf\xc3\xa9\""), Err(InvalidKey::InvalidCharacter));
        assert_eq!(parse(b"\"abc"), Err(InvalidKey::MalformedQuotedString));
        assert_eq!(parse(b"abc\""), Err(InvalidKey::MalformedQuotedString));
        assert_eq!(parse(b"\"a\"b\""), Err(InvalidKey::MalformedQuotedString));
        assert_eq!(parse(b"\"a\\x\""), Err(InvalidKey::MalformedQuotedString));
        assert_eq!(
            parse(b"\"abc\";p=1"),
            Err(InvalidKey::MalformedQuotedString)
        );
    }

    #[test]
    fn repeated_header_is_invalid() {
        let mut headers = HeaderMap::new();
        let name = http::HeaderName::from_static("idempotency-key");
        assert_eq!(
            IdempotencyKey::from_header_values(headers.get_all(&name)),
            Ok(None)
        );
        headers.append(&name, HeaderValue::from_static("a"));
        assert!(IdempotencyKey::from_header_values(headers.get_all(&name))
            .unwrap()
            .is_some());
        headers.append(&name, HeaderValue::from_static("a"));
        assert_eq!(
            IdempotencyKey::from_header_values(headers.get_all(&name)),
            Err(InvalidKey::Repeated)
        );
    }
}
