//! The layer in a tonic server (`Server::builder().layer(..)`), called by a real tonic
//! client over HTTP/2: keyed unary calls execute once and replay with their status and
//! message bytes; transient statuses release the key; the layer's own answers are gRPC
//! statuses.

use std::{
    convert::Infallible,
    future::Future,
    pin::Pin,
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    task::{Context, Poll},
    time::Duration,
};

use http::uri::PathAndQuery;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{
    body::Body,
    codegen::{http, Service},
    metadata::MetadataValue,
    server::{Grpc, NamedService, UnaryService},
    transport::{Channel, Server},
    Code, Request, Response, Status,
};
use tonic_prost::ProstCodec;
use tower_idempotency::{IdempotencyLayer, MemoryStore};

#[derive(Clone, PartialEq, prost::Message)]
struct ChargeRequest {
    #[prost(int64, tag = "1")]
    amount: i64,
    #[prost(string, tag = "2")]
    currency: String,
    #[prost(string, tag = "3")]
    simulate: String,
    #[prost(int64, tag = "4")]
    delay_ms: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Payment {
    #[prost(string, tag = "1")]
    id: String,
    #[prost(int64, tag = "2")]
    amount: i64,
    #[prost(string, tag = "3")]
    currency: String,
    #[prost(string, tag = "4")]
    status: String,
}

const CHARGE: &str = "/payments.v1.Payments/Charge";

/// `payments.v1.Payments`, written as tonic's generated code would be.
#[derive(Clone, Default)]
struct Payments {
    charges: Arc<AtomicUsize>,
}

impl NamedService for Payments {
    const NAME: &'static str = "payments.v1.Payments";
}

struct Charge(Payments);

impl UnaryService<ChargeRequest> for Charge {
    type Response = Payment;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Payment>, Status>> + Send>>;

    fn call(&mut self, request: Request<ChargeRequest>) -> Self::Future {
        let charges = self.0.charges.clone();
        Box::pin(async move {
            let charge = request.into_inner();
            if charge.delay_ms > 0 {
                tokio::time::sleep(Duration::from_millis(charge.delay_ms as u64)).await;
            }
            let n = charges.fetch_add(1, Ordering::SeqCst) + 1;
            match charge.simulate.as_str() {
                "decline" => Err(Status::failed_precondition("card_declined")),
                "error" => Err(Status::internal("processor failed")),
                _ => Ok(Response::new(Payment {
                    id: format!("pay_{n}"),
                    amount: charge.amount,
                    currency: charge.currency,
                    status: "succeeded".to_owned(),
                })),
            }
        })
    }
}

impl Service<http::Request<Body>> for Payments {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let payments = self.clone();
        Box::pin(async move {
            if request.uri().path() == CHARGE {
                let mut grpc = Grpc::new(ProstCodec::<Payment, ChargeRequest>::default());
                return Ok(grpc.unary(Charge(payments), request).await);
            }
            Ok(Status::unimplemented("no such method").into_http())
        })
    }
}

/// Serves the service behind the layer on a free port; returns a client channel.
async fn serve(payments: Payments) -> Channel {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let layer = IdempotencyLayer::new(MemoryStore::new()).required();
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

async fn charge(
    channel: &Channel,
    key: Option<&str>,
    charge: ChargeRequest,
) -> Result<Response<Payment>, Status> {
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await.unwrap();
    let mut request = Request::new(charge);
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("idempotency-key", MetadataValue::try_from(key).unwrap());
    }
    request
        .metadata_mut()
        .insert("authorization", MetadataValue::from_static("Bearer alice"));
    grpc.unary(
        request,
        PathAndQuery::from_static(CHARGE),
        ProstCodec::<ChargeRequest, Payment>::default(),
    )
    .await
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

#[tokio::test]
async fn a_charge_runs_once_and_replays_over_grpc() {
    let payments = Payments::default();
    let channel = serve(payments.clone()).await;
    let first = charge(&channel, Some("k1"), request(1000, "", 0))
        .await
        .unwrap();
    assert!(!replayed(&first));
    assert_eq!(first.get_ref().id, "pay_1");
    let retry = charge(&channel, Some("k1"), request(1000, "", 0))
        .await
        .unwrap();
    assert!(replayed(&retry), "the retry is marked as a replay");
    assert_eq!(retry.get_ref(), first.get_ref());
    assert_eq!(payments.charges.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_decline_is_a_result_and_an_internal_error_is_released() {
    let payments = Payments::default();
    let channel = serve(payments.clone()).await;
    for _ in 0..2 {
        let declined = charge(&channel, Some("d"), request(5, "decline", 0))
            .await
            .unwrap_err();
        assert_eq!(declined.code(), Code::FailedPrecondition);
        assert_eq!(declined.message(), "card_declined");
    }
    assert_eq!(
        payments.charges.load(Ordering::SeqCst),
        1,
        "the decline replays"
    );
    for _ in 0..2 {
        let failed = charge(&channel, Some("e"), request(5, "error", 0))
            .await
            .unwrap_err();
        assert_eq!(failed.code(), Code::Internal);
    }
    assert_eq!(
        payments.charges.load(Ordering::SeqCst),
        3,
        "INTERNAL released the key"
    );
}

#[tokio::test]
async fn the_layers_own_answers_are_grpc_statuses() {
    let payments = Payments::default();
    let channel = serve(payments.clone()).await;
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
    assert_eq!(payments.charges.load(Ordering::SeqCst), 1);
}
