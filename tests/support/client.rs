//! The crate's client over hyper-util's client and over reqwest, for tests of the client
//! half: one payment call, and what it came to.

use bytes::Bytes;
use http::{header, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::TokioExecutor,
};
use serde_json::Value;
use tower::{Layer, ServiceExt};
use tower_idempotency::client::{
    IdempotentCall, IdempotentClient, IdempotentClientLayer, IdempotentMiddleware,
};

/// The HTTP client under the idempotent client.
#[derive(Clone, Copy, Debug)]
pub enum Http {
    Hyper,
    Reqwest,
}

/// A whole answer, and the call that got it.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub body: Bytes,
    pub call: IdempotentCall,
}

/// Both clients, made from one layer.
#[derive(Clone)]
pub struct Clients {
    hyper: IdempotentClient<Client<HttpConnector, Full<Bytes>>>,
    reqwest: reqwest_middleware::ClientWithMiddleware,
}

impl Clients {
    pub fn new(layer: IdempotentClientLayer) -> Self {
        let hyper = Client::builder(TokioExecutor::new()).build_http();
        let reqwest = reqwest::Client::builder()
            .no_proxy()
            .build()
            .expect("reqwest");
        Self {
            hyper: layer.layer(hyper),
            reqwest: reqwest_middleware::ClientBuilder::new(reqwest)
                .with(IdempotentMiddleware::from(layer))
                .build(),
        }
    }

    /// The reqwest client.
    pub fn reqwest(&self) -> &reqwest_middleware::ClientWithMiddleware {
        &self.reqwest
    }

    /// `POST url` of JSON `body` as `user` (and with `key`, if given) through `http`; fails
    /// the test if the call gets no answer.
    pub async fn post(
        &self,
        http: Http,
        url: &str,
        key: Option<&str>,
        user: &str,
        body: &Value,
    ) -> Answer {
        let body = body.to_string();
        let (status, call, body) = match http {
            Http::Hyper => {
                let mut request = Request::post(url)
                    .header(header::CONTENT_TYPE, "application/json")
                    .header(header::AUTHORIZATION, format!("Bearer {user}"));
                if let Some(key) = key {
                    request = request.header("idempotency-key", key);
                }
                let request = request
                    .body(Full::new(Bytes::from(body)))
                    .expect("a request");
                let response = self
                    .hyper
                    .clone()
                    .oneshot(request)
                    .await
                    .expect("an answer");
                let call = response.extensions().get::<IdempotentCall>().cloned();
                let status = response.status();
                let body = response.into_body().collect().await.expect("a body");
                (status, call, body.to_bytes())
            }
            Http::Reqwest => {
                let mut request = self
                    .reqwest
                    .post(url)
                    .header(header::CONTENT_TYPE, "application/json")
                    .bearer_auth(user);
                if let Some(key) = key {
                    request = request.header("idempotency-key", key);
                }
                let response = request.body(body).send().await.expect("an answer");
                let call = response.extensions().get::<IdempotentCall>().cloned();
                let status = response.status();
                (status, call, response.bytes().await.expect("a body"))
            }
        };
        Answer {
            status,
            body,
            call: call.expect("an IdempotentCall"),
        }
    }
}
