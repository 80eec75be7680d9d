//! The client half end to end: payments through a proxy that loses a third of the
//! exchanges (resets connections before the request arrives, drops responses after the
//! server handled the request), against the `payments` example on the in-memory store and
//! on Redis. Every payment must be executed exactly once (the server's counter) and every
//! call must return the payment's original `201`, byte for byte. And the `charge` example,
//! the same client as a command, keeps its contract through the same proxy.

#[macro_use]
mod support;

use std::{collections::HashSet, time::Duration};

use futures_util::{stream, StreamExt};
use http::StatusCode;
use serde_json::Value;
use support::{
    client::{Answer, Clients, Http},
    lossy_proxy::{Counts, LossyProxy},
    payments::{build_example, charge, ExampleProcess},
};
use tower_idempotency::client::{Backoff, IdempotentClientLayer};

/// Shares of requests whose connection is reset before they arrive, and whose response is
/// dropped after the server handled them.
const RESET: f64 = 0.1;
const DROP: f64 = 0.3;
const CONCURRENCY: usize = 8;
const USER: &str = "client-e2e";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hyper_client_pays_once_through_loss_on_memory() {
    exactly_once_through_loss(&[], Http::Hyper, 200).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Redis: scripts/test.sh"]
async fn hyper_client_pays_once_through_loss_on_redis() {
    let url = support::redis_url();
    exactly_once_through_loss(&[("REDIS_URL", &url)], Http::Hyper, 200).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reqwest_client_pays_once_through_loss_on_memory() {
    exactly_once_through_loss(&[], Http::Reqwest, 200).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Redis: scripts/test.sh"]
async fn reqwest_client_pays_once_through_loss_on_redis() {
    let url = support::redis_url();
    exactly_once_through_loss(&[("REDIS_URL", &url)], Http::Reqwest, 200).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn charge_example_pays_once_through_loss_and_prints_its_contract_line() {
    const COUNT: u64 = 40;
    let server = ExampleProcess::start(&[]).await;
    // Lighter losses: the example makes at most 10 attempts per payment.
    let proxy = LossyProxy::start(server.addr(), 0.1, 0.2).await;
    let output = tokio::process::Command::new(build_example("charge"))
        .args(["--url", &format!("http://{}", proxy.addr())])
        .args(["--count", &COUNT.to_string(), "--concurrency", "8"])
        .args(["--user", "charge-example"])
        .output()
        .await
        .expect("run the charge example");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{}: {stderr}", output.status);
    let stdout = String::from_utf8(output.stdout).expect("UTF-8 output");
    let last = stdout.lines().last().expect("a last line");

    let counts = proxy.counts();
    assert_losses_happened(counts, COUNT as usize);
    let expected = format!(
        r#"{{"succeeded":{COUNT},"failed":0,"attempts":{},"distinct_ids":{COUNT}}}"#,
        counts.requests
    );
    assert_eq!(last, expected, "{stderr}");
    assert!(counts.requests > COUNT, "{counts:?}");
    assert_eq!(server.api().stats().await.payments_executed, COUNT);
}

/// Retries fast, and enough times that a payment loses every attempt (40 % each) with a
/// probability of about 1e-8.
fn clients() -> Clients {
    Clients::new(
        IdempotentClientLayer::new()
            .backoff(Backoff::new(
                Duration::from_millis(5),
                Duration::from_millis(100),
            ))
            .max_attempts(20)
            .deadline(Duration::from_secs(60))
            .attempt_timeout(Duration::from_secs(10)),
    )
}

async fn exactly_once_through_loss(env: &[(&str, &str)], http: Http, payments: usize) {
    let server = ExampleProcess::start(env).await;
    let proxy = LossyProxy::start(server.addr(), RESET, DROP).await;
    let url = format!("http://{}/v1/payments", proxy.addr());
    let clients = clients();

    let paid: Vec<(i64, Answer)> = stream::iter(0..payments)
        .map(|i| {
            let amount = 1000 + i as i64;
            let clients = clients.clone();
            let url = url.clone();
            async move {
                let body = charge(amount);
                (amount, clients.post(http, &url, None, USER, &body).await)
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;

    let counts = proxy.counts();
    let attempts: u64 = paid.iter().map(|(_, p)| u64::from(p.call.attempts)).sum();
    let replayed = paid.iter().filter(|(_, p)| p.call.replayed).count();
    eprintln!("{http:?}, {payments} payments: {attempts} attempts, {replayed} answered by a replay, proxy {counts:?}");
    assert_losses_happened(counts, payments);
    assert!(attempts > payments as u64, "{attempts} attempts");
    assert!(replayed > 0, "no call was answered by a replay");
    let executed = server.api().stats().await.payments_executed;
    assert_eq!(executed, payments as u64, "payments executed");

    let mut ids = HashSet::new();
    for (amount, p) in &paid {
        assert_eq!(
            p.status,
            StatusCode::CREATED,
            "{}",
            String::from_utf8_lossy(&p.body)
        );
        let body: Value = serde_json::from_slice(&p.body).expect("a JSON payment");
        assert_eq!(body["amount"], *amount);
        assert!(ids.insert(body["id"].as_str().expect("an id").to_owned()));
        // What the server recorded for the key, asked directly, is what the call returned.
        let recorded = server.api().pay(&p.call.key, USER, &charge(*amount)).await;
        assert!(recorded.replayed(), "{recorded:?}");
        assert_eq!(
            recorded.body, p.body,
            "the original answer for {}",
            p.call.key
        );
    }
    assert_eq!(ids.len(), payments);
    assert_eq!(
        server.api().stats().await.payments_executed,
        payments as u64
    );
}

/// The proxy lost exchanges of both kinds, so the run tested something, and lost nothing
/// by failing itself (what it could not relay is on stderr).
fn assert_losses_happened(counts: Counts, payments: usize) {
    assert_eq!(counts.broken, 0, "the proxy failed to relay: {counts:?}");
    assert!(counts.resets > 0, "{counts:?}");
    assert!(counts.dropped > 0, "{counts:?}");
    assert!(counts.requests >= payments as u64, "{counts:?}");
}

/// What the proxy cannot relay is counted as its own failure, not as a loss.
#[tokio::test]
async fn the_proxy_counts_what_it_cannot_relay_apart_from_losses() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    // A server that answers chunked, which the proxy does not read.
    let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = server.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut socket, _) = server.accept().await.unwrap();
        let mut request = [0; 1024];
        let _ = socket.read(&mut request).await;
        let chunked = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n";
        let _ = socket.write_all(chunked.as_bytes()).await;
    });
    let proxy = LossyProxy::start(upstream, 0.0, 0.0).await;
    let mut client = tokio::net::TcpStream::connect(proxy.addr()).await.unwrap();
    let request = "POST /v1/payments HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n";
    client.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let _ = client.read_to_end(&mut answer).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while proxy.counts().broken == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let counts = proxy.counts();
    assert!(answer.is_empty(), "{}", String::from_utf8_lossy(&answer));
    assert_eq!(
        (counts.requests, counts.broken, counts.delivered),
        (1, 1, 0),
        "{counts:?}"
    );
}
