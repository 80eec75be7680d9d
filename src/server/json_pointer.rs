//! JSON pointers (RFC 6901), as the layer's settings name parts of a request body: the
//! fields a fingerprint leaves out, and where a key is read from.

use serde_json::Value;

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

/// Takes the value at `pointer` out of `document`: an object's member is removed, an
/// array's element becomes `null` (so that the positions of the others still count). A
/// pointer to nothing leaves the document as it is.
pub(crate) fn remove(document: &mut Value, pointer: &str) {
    let Some((parent, last)) = pointer.rsplit_once('/') else {
        return;
    };
    let Some(parent) = document.pointer_mut(parent) else {
        return;
    };
    let last = unescape(last);
    match parent {
        Value::Object(members) => {
            members.remove(last.as_str());
        }
        Value::Array(elements) => {
            if let Some(element) = index(&last).and_then(|i| elements.get_mut(i)) {
                *element = Value::Null;
            }
        }
        _ => {}
    }
}

/// A reference token's text: `~1` is `/`, `~0` is `~`.
fn unescape(token: &str) -> String {
    token.replace("~1", "/").replace("~0", "~")
}

/// An array index as RFC 6901 spells one: digits, without leading zeros.
fn index(token: &str) -> Option<usize> {
    let well_formed = token == "0" || (!token.starts_with('0') && !token.is_empty());
    well_formed
        .then(|| token.bytes().all(|b| b.is_ascii_digit()))
        .filter(|digits| *digits)
        .and_then(|_| token.parse().ok())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn members_are_removed_and_elements_nulled() {
        let mut document = json!({
            "a": 1, "b": {"c": 2, "d/e": 3, "f~g": 4}, "list": [1, 2, 3], "keep": true
        });
        for pointer in [
            "/a",
            "/b/d~1e",
            "/b/f~0g",
            "/list/1",
            "/list/01",
            "/missing/x",
        ] {
            remove(&mut document, pointer);
        }
        assert_eq!(
            document,
            json!({"b": {"c": 2}, "list": [1, null, 3], "keep": true})
        );
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
