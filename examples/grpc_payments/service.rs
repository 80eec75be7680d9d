//! `payments.v1.Payments`, written as tonic's generated code would be (no `protoc`
//! needed): `Charge(ChargeRequest) returns (Payment)` and `Stats(StatsRequest) returns
//! (Stats)`. Shared by the example's `main` and the tests.

// A test that serves both examples loads it twice: once here, once with the payments app.
#[allow(clippy::duplicate_mod)]
#[path = "../payments/principal.rs"]
pub mod principal;

use std::{
    convert::Infallible,
    future::Future,
    pin::Pin,
    sync::{
        atomic::{AtomicI64, Ordering},
        Arc,
    },
    task::{Context, Poll},
    time::Duration,
};

use tonic::{
    body::Body,
    codegen::{http, Service},
    server::{Grpc, NamedService, UnaryService},
    Request, Response, Status,
};
use tonic_prost::ProstCodec;

/// A charge to make.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ChargeRequest {
    #[prost(int64, tag = "1")]
    pub amount: i64,
    #[prost(string, tag = "2")]
    pub currency: String,
    /// `decline` (FAILED_PRECONDITION, a result), `error` (INTERNAL, released), `slow`.
    #[prost(string, tag = "3")]
    pub simulate: String,
    /// How long a `slow` charge sleeps first.
    #[prost(int64, tag = "4")]
    pub delay_ms: i64,
}

/// A charge made.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Payment {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(int64, tag = "2")]
    pub amount: i64,
    #[prost(string, tag = "3")]
    pub currency: String,
    #[prost(string, tag = "4")]
    pub status: String,
}

/// No fields.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StatsRequest {}

/// Handler executions, never replays.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Stats {
    #[prost(int64, tag = "1")]
    pub charges_executed: i64,
}

/// The full path of `Charge`.
pub const CHARGE: &str = "/payments.v1.Payments/Charge";
/// The full path of `Stats`.
pub const STATS: &str = "/payments.v1.Payments/Stats";

/// The service, counting executions; clones share the count.
#[derive(Clone)]
pub struct Payments {
    charges: Arc<AtomicI64>,
    /// Random, so that two instances never hand out the same ids.
    instance: u64,
}

impl Default for Payments {
    fn default() -> Self {
        Self {
            charges: Arc::default(),
            instance: rand::random(),
        }
    }
}

impl Payments {
    /// Charges executed so far.
    pub fn charges_executed(&self) -> i64 {
        self.charges.load(Ordering::SeqCst)
    }
}

impl NamedService for Payments {
    const NAME: &'static str = "payments.v1.Payments";
}

struct Charge(Payments);

impl UnaryService<ChargeRequest> for Charge {
    type Response = Payment;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Payment>, Status>> + Send>>;

    fn call(&mut self, request: Request<ChargeRequest>) -> Self::Future {
        let payments = self.0.clone();
        Box::pin(async move {
            let charge = request.into_inner();
            if charge.simulate == "slow" && charge.delay_ms > 0 {
                tokio::time::sleep(Duration::from_millis(charge.delay_ms as u64)).await;
            }
            let n = payments.charges.fetch_add(1, Ordering::SeqCst) + 1;
            match charge.simulate.as_str() {
                "decline" => Err(Status::failed_precondition("card_declined")),
                "error" => Err(Status::internal("processor failed")),
                _ => Ok(Response::new(Payment {
                    id: format!("pay_{:016x}{n:08x}", payments.instance),
                    amount: charge.amount,
                    currency: charge.currency,
                    status: "succeeded".to_owned(),
                })),
            }
        })
    }
}

struct StatsMethod(Payments);

impl UnaryService<StatsRequest> for StatsMethod {
    type Response = Stats;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Stats>, Status>> + Send>>;

    fn call(&mut self, _: Request<StatsRequest>) -> Self::Future {
        let charges_executed = self.0.charges_executed();
        Box::pin(async move { Ok(Response::new(Stats { charges_executed })) })
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
            Ok(match request.uri().path() {
                CHARGE => {
                    let mut grpc = Grpc::new(ProstCodec::<Payment, ChargeRequest>::default());
                    grpc.unary(Charge(payments), request).await
                }
                STATS => {
                    let mut grpc = Grpc::new(ProstCodec::<Stats, StatsRequest>::default());
                    grpc.unary(StatsMethod(payments), request).await
                }
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}
