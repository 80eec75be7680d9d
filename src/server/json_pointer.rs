//! JSON pointers (RFC 6901), as the layer's settings name parts of a request body: the
//! fields a fingerprint leaves out, and where a key is read from.

use std::borrow::Cow;

/// A pointer checked when the layer is built: `""` (the whole document) is refused, since
/// no setting means it, and any other must start with `/`.
///
/// # Panics
///
/// On a malformed pointer, naming `what` it was meant for: a configuration error, found
/// when the layer is built rather than on a request.
pub(crate) fn checked(pointer: &str, what: &str) -> Box<str> {
    assert!(
        pointer.starts_with('/'),
        "{what}: {pointer:?} is not a JSON pointer to a field (RFC 6901: \"/id\", \"/data/object/id\")"
    );
    let mut chars = pointer.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '~' {
            assert!(
                matches!(chars.peek(), Some('0' | '1')),
                "{what}: {pointer:?} has a `~` that is neither `~0` nor `~1` (RFC 6901)"
            );
        }
    }
    pointer.into()
}

/// The reference tokens of a checked pointer, unescaped (`~1` is `/`, `~0` is `~`).
pub(crate) fn tokens(pointer: &str) -> impl Iterator<Item = Cow<'_, str>> {
    pointer.split('/').skip(1).map(|token| {
        if token.contains('~') {
            Cow::Owned(token.replace("~1", "/").replace("~0", "~"))
        } else {
            Cow::Borrowed(token)
        }
    })
}

/// An array index as RFC 6901 spells one: digits, without leading zeros.
pub(crate) fn index(token: &str) -> Option<usize> {
    let digits = !token.is_empty() && token.bytes().all(|b| b.is_ascii_digit());
    let canonical = token == "0" || !token.starts_with('0');
    (digits && canonical).then(|| token.parse().ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_unescaped_and_indexes_strict() {
        let tokens: Vec<_> = tokens("/a~1b/c~0d/~01/0").collect();
        assert_eq!(tokens, ["a/b", "c~d", "~1", "0"]);
        assert_eq!(index("0"), Some(0));
        assert_eq!(index("12"), Some(12));
        for bad in ["", "01", "-1", "1a", "+1"] {
            assert_eq!(index(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn malformed_pointers_are_refused_when_configured() {
        assert_eq!(&*checked("/data/id", "key"), "/data/id");
        assert_eq!(&*checked("/a~0b~1c", "key"), "/a~0b~1c");
        for bad in ["", "id", "/a~2", "/a~"] {
            let refused = std::panic::catch_unwind(|| checked(bad, "key"));
            assert!(refused.is_err(), "{bad:?} was accepted");
        }
    }
}
