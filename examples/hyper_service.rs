//! The layer around a plain `service_fn`, served by hyper-util (no axum): the inner service
//! takes `RequestBody<Incoming>`, the caller's body unread or the bytes the layer read.
//!
//! ```sh
//! cargo run --example hyper_service --features hyper
//! curl -i localhost:3001/charge -H 'Idempotency-Key: k1' -d 'amount=10'
//! ```

use std::convert::Infallible;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::{
    rt::{TokioExecutor, TokioIo},
    server::conn::auto,
    service::TowerToHyperService,
};
use tower::ServiceBuilder;
use tower_idempotency::{IdempotencyLayer, MemoryStore, RequestBody};

async fn charge(
    request: Request<RequestBody<Incoming>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let body = request
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let answer = format!("charged: {}\n", String::from_utf8_lossy(&body));
    Ok(Response::new(Full::new(Bytes::from(answer))))
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let service = ServiceBuilder::new()
        .layer(IdempotencyLayer::new(MemoryStore::new()).allow_anonymous())
        .service_fn(charge);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3001").await?;
    loop {
        let (stream, _) = listener.accept().await?;
        let service = TowerToHyperService::new(service.clone());
        tokio::spawn(async move {
            // HTTP/1.1 and HTTP/2 (prior knowledge) on one port.
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}
