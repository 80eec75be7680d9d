//! Who a request is from, in the `payments` and `grpc_payments` examples.

use http::{header, request::Parts};
use tower_idempotency::{ExtractPrincipal, Principal};

/// `Authorization: Bearer <user>` names the user (the token is the user id: a demo's
/// stand-in for a verified token), whatever the scheme's case (RFC 9110 §11.1: `bearer
/// alice` is alice too); any other credential counts as its digest, so two credentials
/// never share records; no credential is anonymous.
#[derive(Clone, Copy, Debug, Default)]
pub struct BearerUser;

impl ExtractPrincipal for BearerUser {
    fn extract(&self, parts: &Parts) -> Option<Principal> {
        let credential = parts.headers.get(header::AUTHORIZATION)?;
        // The header's value has no surrounding whitespace (the parser drops it).
        let bearer = credential
            .to_str()
            .ok()
            .and_then(|value| value.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, user)| user.trim_start_matches(' '))
            .filter(|user| !user.is_empty());
        match bearer {
            Some(user) => Some(Principal::new(user)),
            None if credential.is_empty() => None,
            None => Some(Principal::from_credential(credential.as_bytes())),
        }
    }
}
