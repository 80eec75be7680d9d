//! A gateway charging a processor, both the `payments` example as processes of their own
//! (the gateway with `PAYMENTS_PROCESSOR_URL`): killed with SIGKILL after its processor
//! answered and before it answered its client, the gateway runs the payment again on the
//! client's retry, and the processor, given the same derived key, replays its charge.
//!
//! Both run on the in-memory store: no server is needed.

mod support;

use http::StatusCode;
use serde_json::json;
use support::payments::{fresh_key, ExampleProcess};

#[tokio::test]
async fn a_gateway_killed_after_its_processor_answered_charges_once() {
    let processor = ExampleProcess::start(&[]).await;
    let url = format!("http://{}", processor.addr());
    let mut gateway = ExampleProcess::start(&[("PAYMENTS_PROCESSOR_URL", &url)]).await;
    // The processor's charge first, then three seconds before the gateway answers.
    let charge = json!({
        "amount": 1999, "currency": "usd", "simulate": "slow_after", "delay_ms": 3000
    });
    let key = fresh_key();
    let first = gateway.api().pay_in_background(&key, "alice", &charge);
    processor.api().wait_for_payments(1).await;
    gateway.kill();
    assert!(first.await.is_err(), "the killed gateway never answered");

    // The gateway is back (its in-memory records died with it) and the client retries.
    let gateway = gateway.start_another().await;
    let retry = gateway.api().pay(&key, "alice", &charge).await;
    retry.assert_payment(1999, "usd");
    assert_eq!(gateway.api().stats().await.payments_executed, 1);
    assert_eq!(
        processor.api().stats().await.payments_executed,
        1,
        "the processor charged once: the gateway's second run was a replay there"
    );
    let processor_id = retry.json()["processor_id"].as_str().unwrap().to_owned();
    assert!(processor_id.starts_with("pay_"), "{processor_id}");

    // Another payment (another key) is another charge, under another derived key.
    let other = gateway.api().pay(&fresh_key(), "alice", &charge).await;
    other.assert_payment(1999, "usd");
    assert_ne!(other.json()["processor_id"], retry.json()["processor_id"]);
    assert_eq!(processor.api().stats().await.payments_executed, 2);
}

#[tokio::test]
async fn a_processor_that_does_not_charge_is_a_502_that_releases_the_payment() {
    // Nothing listens there: every attempt of the client is refused.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let gateway = ExampleProcess::start(&[("PAYMENTS_PROCESSOR_URL", &url)]).await;
    let charge = json!({ "amount": 500, "currency": "usd" });
    let key = fresh_key();
    let first = gateway.api().pay(&key, "bob", &charge).await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY, "{first:?}");
    assert_eq!(first.error_code().as_deref(), Some("processor_unavailable"));
    // Released: the retry runs the payment again, rather than replaying the 502.
    let retry = gateway.api().pay(&key, "bob", &charge).await;
    assert_eq!(retry.status, StatusCode::BAD_GATEWAY);
    assert!(!retry.replayed());
    assert_eq!(gateway.api().stats().await.payments_executed, 2);
}

/// The gateway sends the processor no credentials of its own, so a processor URL carrying
/// some (`user:password@`, a password with a `/` in it too) is refused at start, and the
/// refusal never echoes it; the URL it runs with is logged as given.
#[tokio::test]
async fn a_processor_url_with_credentials_is_refused_and_never_logged() {
    for url in [
        "http://gateway:hunter2-secret@127.0.0.1:9",
        "http://gateway:ab/cd+hunter2==@127.0.0.1:9",
        "gateway:hunter2@127.0.0.1:9/next?to=http://x",
    ] {
        let output = std::process::Command::new(support::payments::example_binary())
            .env("PAYMENTS_PROCESSOR_URL", url)
            .env("PAYMENTS_ADDR", "127.0.0.1:0")
            .env_remove("REDIS_URL")
            .env_remove("DATABASE_URL")
            .output()
            .expect("run the payments example");
        let said = String::from_utf8_lossy(&output.stderr).into_owned()
            + &String::from_utf8_lossy(&output.stdout);
        assert!(!output.status.success(), "{url} refused: {said}");
        assert!(said.contains("PAYMENTS_PROCESSOR_URL"), "{said}");
        assert!(!said.contains("hunter2"), "{said}");
    }
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let gateway = ExampleProcess::start(&[("PAYMENTS_PROCESSOR_URL", &url)]).await;
    let log = gateway.log_text();
    assert!(
        log.contains(&format!("processor: Some(ProcessorUrl({url:?}))")),
        "{log}"
    );
}
