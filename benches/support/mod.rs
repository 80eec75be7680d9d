//! What the in-process benchmarks share: the handler, the requests, and how a request is
//! driven through a service.

use std::convert::Infallible;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{Service, ServiceExt};

/// The handler: answers 201 with a body the size of the request's.
pub fn handler() -> impl Service<
    Request<Full<Bytes>>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl Send,
> + Clone
       + Send
       + 'static {
    tower::service_fn(|request: Request<Full<Bytes>>| async move {
        let body = request.into_body().collect().await.unwrap().to_bytes();
        let mut response = Response::new(Full::new(body));
        *response.status_mut() = StatusCode::CREATED;
        Ok::<_, Infallible>(response)
    })
}

pub fn request(method: &str, key: Option<&str>, body: &Bytes) -> Request<Full<Bytes>> {
    let mut builder = Request::builder().method(method).uri("/v1/payments");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder
        .header("authorization", "Bearer bench")
        .body(Full::new(body.clone()))
        .unwrap()
}

/// Calls `service` once and reads the whole response, as a server would.
pub async fn call<S, B>(service: &S, request: Request<Full<Bytes>>) -> Bytes
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
    B: http_body::Body,
    B::Error: std::fmt::Debug,
{
    let response = service.clone().oneshot(request).await.unwrap();
    response.into_body().collect().await.unwrap().to_bytes()
}

/// The Redis the benchmarks use (`REDIS_URL`, default 127.0.0.1:6379).
pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379/".into())
}
