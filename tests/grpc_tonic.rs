//! The layer in a tonic server (`Server::builder().layer(..)`), called by a real tonic
//! client over HTTP/2: keyed unary calls execute once and replay with their status and
//! message bytes; transient statuses release the key; the layer's own answers are gRPC
//! statuses.

#[macro_use]
mod support;

use std::{sync::Arc, time::Duration};

use support::grpc::{
    charge, charges_executed,
    service::{self, ChargeRequest, Payments},
};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{
    transport::{Channel, Server},
    Code, Response,
};
use tower_idempotency::{IdempotencyLayer, Store};

for_each_store!(
    a_charge_runs_once_and_replays_over_grpc,
    a_decline_is_a_result_and_an_internal_error_is_released,
    the_layers_own_answers_are_grpc_statuses,
);

/// Serves the service behind the layer on a free port; returns a client channel.
async fn serve(store: Arc<dyn Store>, payments: Payments) -> Channel {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let layer = IdempotencyLayer::from_shared(store)
        .allow_anonymous()
        .required()
        .principal(service::principal::BearerUser);
    tokio::spawn(async move {
        Server::builder()
            .layer(layer)
            .add_service(payments)
            .serve_with_incoming(TcpListenerStream::new(listener))
            .await
            .unwrap();
    });
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

fn request(amount: i64, simulate: &str, delay_ms: i64) -> ChargeRequest {
    ChargeRequest {
        amount,
        currency: "usd".to_owned(),
        simulate: simulate.to_owned(),
        delay_ms,
    }
}

fn replayed<T>(response: &Response<T>) -> bool {
    response.metadata().get("idempotent-replayed").is_some()
}

async fn a_charge_runs_once_and_replays_over_grpc(store: Arc<dyn Store>) {
    let payments = Payments::default();
    let channel = serve(store, payments.clone()).await;
    let first = charge(&channel, Some("k1"), request(1000, "", 0))
        .await
        .unwrap();
    assert!(!replayed(&first));
    assert!(first.get_ref().id.starts_with("pay_"));
    let retry = charge(&channel, Some("k1"), request(1000, "", 0))
        .await
        .unwrap();
    assert!(replayed(&retry), "the retry is marked as a replay");
    assert_eq!(retry.get_ref(), first.get_ref());
    assert_eq!(payments.charges_executed(), 1);
    assert_eq!(charges_executed(&channel).await, 1);
}

async fn a_decline_is_a_result_and_an_internal_error_is_released(store: Arc<dyn Store>) {
    let payments = Payments::default();
    let channel = serve(store, payments.clone()).await;
    for _ in 0..2 {
        let declined = charge(&channel, Some("d"), request(5, "decline", 0))
            .await
            .unwrap_err();
        assert_eq!(declined.code(), Code::FailedPrecondition);
        assert_eq!(declined.message(), "card_declined");
    }
    assert_eq!(payments.charges_executed(), 1, "the decline replays");
    for _ in 0..2 {
        let failed = charge(&channel, Some("e"), request(5, "error", 0))
            .await
            .unwrap_err();
        assert_eq!(failed.code(), Code::Internal);
    }
    assert_eq!(payments.charges_executed(), 3, "INTERNAL released the key");
}

async fn the_layers_own_answers_are_grpc_statuses(store: Arc<dyn Store>) {
    let payments = Payments::default();
    let channel = serve(store, payments.clone()).await;
    let missing = charge(&channel, None, request(1, "", 0)).await.unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument);
    assert!(missing.message().starts_with("idempotency_key_required"));

    let slow = tokio::spawn({
        let channel = channel.clone();
        async move { charge(&channel, Some("slow"), request(1, "slow", 500)).await }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let busy = charge(&channel, Some("slow"), request(1, "slow", 500))
        .await
        .unwrap_err();
    assert_eq!(busy.code(), Code::Aborted);
    assert!(busy.message().starts_with("request_in_progress"));
    assert!(busy.metadata().get("retry-after").is_some());
    slow.await.unwrap().unwrap();

    let reused = charge(&channel, Some("slow"), request(2, "slow", 500))
        .await
        .unwrap_err();
    assert_eq!(reused.code(), Code::FailedPrecondition);
    assert!(reused
        .message()
        .starts_with("idempotency_key_reused_with_different_params"));
    assert_eq!(payments.charges_executed(), 1);
}

/// The `grpc_payments` example as a process of its own, on the shared Redis: a charge runs
/// once across two instances, `Stats` needs no key, and a call without a key is refused.
#[tokio::test]
#[ignore = "needs Redis: scripts/test.sh"]
async fn the_grpc_payments_example_keeps_its_contract() {
    let binary = support::payments::build_example("grpc_payments");
    // One prefix for both instances, under the `test:` keys the test script removes.
    let prefix = support::unique_prefix("grpc_payments_example");
    let redis = [
        ("REDIS_URL", support::redis_url()),
        ("IDEMPOTENCY_PREFIX", prefix),
    ];
    let (a, b) = (free_port(), free_port());
    let _first = start_example(&binary, a, &redis);
    let _second = start_example(&binary, b, &redis);
    let (one, two) = (connect(a).await, connect(b).await);
    let key = support::payments::fresh_key();
    let first = charge(&one, Some(&key), request(700, "", 0)).await.unwrap();
    let retry = charge(&two, Some(&key), request(700, "", 0)).await.unwrap();
    assert!(replayed(&retry));
    assert_eq!(retry.get_ref(), first.get_ref());
    let missing = charge(&one, None, request(1, "", 0)).await.unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument);
    assert_eq!(
        charges_executed(&one).await + charges_executed(&two).await,
        1
    );
}

/// SIGTERM (how a process manager stops a service) lets the `grpc_payments` example finish
/// the charge it is running, answer it, and exit cleanly, as `payments` does: it stopped
/// only on Ctrl-C, so SIGTERM killed it mid-charge.
#[tokio::test]
async fn the_grpc_payments_example_finishes_its_charges_on_sigterm() {
    let binary = support::payments::build_example("grpc_payments");
    let port = free_port();
    let mut example = start_example(&binary, port, &[]);
    let channel = connect(port).await;
    let running = tokio::spawn({
        let channel = channel.clone();
        async move { charge(&channel, Some("on-sigterm"), request(900, "slow", 800)).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let pid = example.0.id().to_string();
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status();
    assert!(sent.unwrap().success());
    let answered = running.await.unwrap();
    assert!(answered.is_ok(), "the running charge was cut: {answered:?}");
    let status = tokio::task::spawn_blocking(move || example.0.wait())
        .await
        .unwrap();
    assert!(
        status.unwrap().success(),
        "the example did not exit cleanly"
    );
}

/// The `grpc_payments` example on `port`, with `env` (in memory without any).
fn start_example(binary: &std::path::Path, port: u16, env: &[(&str, String)]) -> KillOnDrop {
    let child = std::process::Command::new(binary)
        .env("GRPC_ADDR", format!("127.0.0.1:{port}"))
        .env_remove("REDIS_URL")
        .env_remove("REDIS_CLUSTER_URLS")
        .env_remove("REDIS_SENTINEL_URLS")
        .env_remove("DATABASE_URL")
        .envs(env.iter().map(|(name, value)| (name, value)))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start the grpc_payments example");
    KillOnDrop(child)
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// A channel to the example on `port`, once it answers.
async fn connect(port: u16) -> Channel {
    for _ in 0..200 {
        let endpoint = Channel::from_shared(format!("http://127.0.0.1:{port}")).unwrap();
        if let Ok(channel) = endpoint.connect().await {
            return channel;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("grpc_payments on port {port} never answered");
}

struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
