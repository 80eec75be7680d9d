//! The gRPC payments example: `payments.v1.Payments` behind the idempotency layer in a
//! tonic server.
//!
//! ```sh
//! cargo run --example grpc_payments --features tonic                 # in-memory store
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run --example grpc_payments --features tonic
//! ```
//!
//! Listens on `GRPC_ADDR` (default `127.0.0.1:50051`); the store is chosen by the same
//! variables as the `payments` example. The key is the `idempotency-key` metadata entry,
//! the principal the user of `authorization: Bearer <user>`.
//!
//! Try it with `grpcurl` (the service registers no reflection: give it the message
//! shapes of `service.rs`), or through `tests/grpc_tonic.rs`, which drives it with a tonic
//! client: a `Charge` sent twice with one key runs once and answers the same `Payment`;
//! `simulate: "decline"` is replayed as `FAILED_PRECONDITION`, `"error"` is released.

mod service;
#[path = "../payments/store.rs"]
mod store;

use std::{
    convert::Infallible,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use tonic::{
    body::Body,
    codegen::{http, Service},
    server::NamedService,
    transport::Server,
};
use tower_idempotency::{Idempotency, IdempotencyLayer};
use tower_layer::Layer;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    store::init_logging();
    let mut layer = IdempotencyLayer::from_shared(store::from_env().await?)
        .required()
        .principal(service::principal::BearerUser)
        // A call without a bearer token is anonymous: a demo's choice.
        .allow_anonymous();
    if let Some(ttl) = store::env_secs("IDEMPOTENCY_TTL_SECS")? {
        layer = layer.ttl(ttl);
    }
    if let Some(lease) = store::env_secs("IDEMPOTENCY_LEASE_SECS")? {
        layer = layer.lease(lease);
    }
    // Shapes HTTP errors only: gRPC requests keep getting gRPC statuses.
    if let Some(problems) = store::problems_from_env()? {
        layer = layer.render_rejections(problems);
    }
    let in_flight = layer.in_flight();
    let payments = service::Payments::default();
    let service = ChargesKeyed {
        keyed: layer.layer(payments.clone()),
        plain: payments,
    };
    let addr = std::env::var("GRPC_ADDR").unwrap_or_else(|_| "127.0.0.1:50051".into());
    tracing::info!("grpc_payments listening on {addr}");
    Server::builder()
        .add_service(service)
        .serve_with_shutdown(addr.parse()?, store::shutdown())
        .await?;
    in_flight.settled(std::time::Duration::from_secs(30)).await;
    Ok(())
}

/// `Charge` behind the layer (its key required), `Stats` beside it: reading a counter is
/// not an operation to run once. A server whose every method is keyed would instead use
/// `Server::builder().layer(layer)`.
#[derive(Clone)]
struct ChargesKeyed {
    keyed: Idempotency<service::Payments>,
    plain: service::Payments,
}

impl NamedService for ChargesKeyed {
    const NAME: &'static str = <service::Payments as NamedService>::NAME;
}

impl Service<http::Request<Body>> for ChargesKeyed {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Both are always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        if request.uri().path() == service::STATS {
            return Box::pin(self.plain.call(request));
        }
        let answer = self.keyed.call(request);
        Box::pin(async move { Ok(answer.await?.map(Body::new)) })
    }
}
