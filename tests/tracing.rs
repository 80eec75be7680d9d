//! The `idempotency` span of each keyed request: what it shows of the key and the
//! principal, its outcome, the levels of what is logged inside it, and that it follows an
//! execution whose client went away.

mod support;

use std::{sync::Arc, time::Duration};

use axum::http::StatusCode;
use sha2::{Digest, Sha256};
use support::{
    app::{layer, post, post_waiting, router, send, until_executing, Handler},
    logs::Logs,
};
use tower::ServiceExt;
use tower_idempotency::{IdempotencyLayer, MemoryStore, SpanField, Store};

/// The first 12 hex digits of `value`'s plain SHA-256: what anyone could compute from a
/// guess, which a digest in the logs must not be.
fn unkeyed_digest(value: &str) -> String {
    Sha256::digest(value.as_bytes())
        .iter()
        .take(6)
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// The values the captured logs show for `field`, each once.
fn shown(logs: &str, field: &str) -> Vec<String> {
    let mut values: Vec<String> = logs
        .split(&format!(" {field}=\""))
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .map(str::to_owned)
        .collect();
    values.sort();
    values.dedup();
    values
}

fn store() -> Arc<dyn Store> {
    Arc::new(MemoryStore::new())
}

/// The captured lines inside a span showing `key`.
fn lines_with<'a>(logs: &'a str, key: &str) -> Vec<&'a str> {
    logs.lines()
        .filter(|line| line.contains(&format!("key=\"{key}\"")))
        .collect()
}

#[tokio::test]
async fn key_and_principal_are_digests_by_default() {
    let (logs, _guard) = Logs::capture();
    let handler = Handler::default();
    let app = router(
        &handler,
        layer(&store()).principal(|_: &_| Some("alice".into())),
    );
    for _ in 0..2 {
        let answer = send(&app, post("/pay").key("order-42-secret")).await;
        assert_eq!(answer.status, StatusCode::CREATED);
    }
    let logs = logs.dump();
    assert!(!logs.contains("order-42-secret"), "the raw key: {logs}");
    assert!(!logs.contains("alice"), "the raw principal: {logs}");
    // One digest each, the same on every line: 12 hex digits, keyed (not the plain
    // SHA-256 that a guess of the value would give).
    let (keys, principals) = (shown(&logs, "key"), shown(&logs, "principal"));
    assert_eq!((keys.len(), principals.len()), (1, 1), "{logs}");
    for (shown, value) in [(&keys[0], "order-42-secret"), (&principals[0], "alice")] {
        assert_eq!(shown.len(), 12, "{shown}");
        assert!(
            shown.bytes().all(|digit| digit.is_ascii_hexdigit()),
            "{shown}"
        );
        assert_ne!(
            shown,
            &unkeyed_digest(value),
            "an unkeyed digest of {value}"
        );
    }
    let lines = lines_with(&logs, &keys[0]);
    let principal = format!("principal=\"{}\"", principals[0]);
    assert!(lines.iter().all(|line| line.contains(&principal)), "{logs}");
    assert!(lines
        .iter()
        .all(|line| line.contains("endpoint=\"POST /pay\"")));
    // The first executed, the second was replayed; routine outcomes are debug.
    let outcome = |outcome: &str| {
        lines
            .iter()
            .filter(|line| line.contains(&format!("outcome=\"{outcome}\"")))
            .filter(|line| line.contains("request answered"))
            .map(|line| line.split_whitespace().nth(1).unwrap_or_default())
            .collect::<Vec<_>>()
    };
    assert_eq!(outcome("executed"), ["DEBUG"], "{logs}");
    assert_eq!(outcome("replayed"), ["DEBUG"], "{logs}");
    // Store calls are debug events inside the span.
    assert!(
        lines
            .iter()
            .any(|line| line.contains("DEBUG") && line.contains("operation=\"claim\"")),
        "{logs}"
    );
    assert!(!logs.contains("WARN") && !logs.contains("ERROR"), "{logs}");
}

#[tokio::test]
async fn spans_show_what_the_layer_is_told_to() {
    let (logs, _guard) = Logs::capture();
    let handler = Handler::default();
    let layer = layer(&store())
        .principal(|_: &_| Some("alice".into()))
        .span_key(SpanField::Plain)
        .span_principal(SpanField::Omitted);
    let app = router(&handler, layer);
    send(&app, post("/pay").key("k1").body("{}")).await;
    // A reused key is the client's mistake: info, not a warning.
    let answer = send(&app, post("/pay").key("k1").body("{\"other\":1}")).await;
    assert_eq!(answer.status, StatusCode::CONFLICT);
    let logs = logs.dump();
    let lines = lines_with(&logs, "k1");
    assert!(!lines.is_empty(), "{logs}");
    assert!(lines.iter().all(|line| !line.contains("principal=")));
    assert!(!logs.contains("alice"), "{logs}");
    assert!(
        lines
            .iter()
            .any(|line| line.contains(" INFO ") && line.contains("outcome=\"mismatch\"")),
        "{logs}"
    );
}

#[tokio::test]
async fn the_span_follows_an_execution_whose_client_went_away() {
    let (logs, _guard) = Logs::capture();
    let handler = Handler::default();
    let app = router(&handler, layer(&store()).span_key(SpanField::Plain));
    let request = post_waiting("gone").build();
    let call = tokio::spawn(app.clone().oneshot(request));
    until_executing(&handler, 1).await;
    // The client goes away while the handler runs: the execution goes on in a task of its
    // own, and records its outcome there.
    call.abort();
    let _ = call.await;
    handler.gate.add_permits(1);
    let recorded = |logs: &str| {
        lines_with(logs, "gone")
            .iter()
            .any(|line| line.contains("outcome=\"executed\"") && line.contains("idempotency{"))
    };
    for _ in 0..200 {
        if recorded(&logs.dump()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let logs = logs.dump();
    assert!(recorded(&logs), "{logs}");
    assert_eq!(handler.executions(), 1);
}

/// The lines of `logs` at `level` that contain `text`.
fn logged<'a>(logs: &'a str, level: &str, text: &str) -> Vec<&'a str> {
    logs.lines()
        .filter(|line| line.contains(level) && line.contains(text))
        .collect()
}

/// Scoping by an unkeyed digest of the `Authorization` header warns once per layer, naming
/// the fix; a layer with a secret does not warn.
#[tokio::test]
async fn an_unkeyed_credential_digest_is_warned_of_once() {
    let (logs, _guard) = Logs::capture();
    let handler = Handler::default();
    let as_alice = |key: &str| {
        post("/pay")
            .key(key)
            .header("authorization", "Basic YWxpY2U=")
    };
    let unkeyed = router(&handler, IdempotencyLayer::from_shared(store()));
    for key in ["one", "two"] {
        send(&unkeyed, as_alice(key)).await.assert_executed();
    }
    let keyed = IdempotencyLayer::from_shared(store()).credential_secret([7; 32]);
    let keyed = router(&handler, keyed);
    send(&keyed, as_alice("three")).await.assert_executed();
    let logs = logs.dump();
    assert_eq!(
        logged(&logs, "WARN", "credential_secret").len(),
        1,
        "{logs}"
    );
}

/// A keyed request that names no principal is refused, and the first refusal logs an error
/// that names the ways to fix it.
#[tokio::test]
async fn a_request_without_a_principal_logs_the_fix_once() {
    let (logs, _guard) = Logs::capture();
    let handler = Handler::default();
    let app = router(&handler, IdempotencyLayer::from_shared(store()));
    for key in ["one", "two"] {
        let answer = send(&app, post("/pay").key(key)).await;
        assert_eq!(answer.error(), "idempotency_principal_missing");
    }
    assert_eq!(handler.executions(), 0);
    let logs = logs.dump();
    let errors = logged(&logs, "ERROR", "allow_anonymous");
    assert_eq!(errors.len(), 1, "{logs}");
    for fix in [
        "Principal extension",
        "IdempotencyLayer::principal",
        "unscoped",
    ] {
        assert!(errors[0].contains(fix), "{logs}");
    }
}
