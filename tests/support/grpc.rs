//! A real tonic client for the `grpc_payments` service: its messages, and its two calls.

#[path = "../../examples/grpc_payments/service.rs"]
pub mod service;

use http::uri::PathAndQuery;
use tonic::{metadata::MetadataValue, transport::Channel, Request, Response, Status};
use tonic_prost::ProstCodec;

use service::{ChargeRequest, Payment, Stats, StatsRequest, CHARGE, STATS};

/// `Charge` as user `alice`, with `key` as its `idempotency-key` metadata when given.
pub async fn charge(
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

/// `Stats`: charges executed, never replays. Sent with a fresh key, so that a layer that
/// requires one lets it through (each call executes once, as it should).
pub async fn charges_executed(channel: &Channel) -> i64 {
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await.unwrap();
    let mut request = Request::new(StatsRequest {});
    request.metadata_mut().insert(
        "idempotency-key",
        MetadataValue::try_from(super::payments::fresh_key()).unwrap(),
    );
    let stats = grpc
        .unary(
            request,
            PathAndQuery::from_static(STATS),
            ProstCodec::<StatsRequest, Stats>::default(),
        )
        .await
        .unwrap();
    stats.into_inner().charges_executed
}
