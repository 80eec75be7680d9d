//! The payment processor the example charges when `PAYMENTS_PROCESSOR_URL` names one (a
//! second `payments` instance serves): through the crate's client, with the key derived
//! from the payment's own scope, so that a payment run again after a crash is a replay at
//! the processor, not a second charge.

use bytes::Bytes;
use http::{header, HeaderValue, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{connect::HttpConnector, Client},
    rt::TokioExecutor,
};
use tower::{Layer, ServiceExt};
use tower_idempotency::{
    client::{IdempotentClient, IdempotentClientLayer},
    DerivedKeys,
};

/// The label of the processor's key among the payment's derived keys.
const KEY_LABEL: &str = "processor";

/// A processor's base URL: `http://host[:port][/path]`. The example sends no credentials
/// of its own to the processor, so a URL carrying some (`user:password@`) is refused, and
/// one refused is never echoed: what is kept can be logged.
#[derive(Clone, Debug)]
pub struct ProcessorUrl(String);

impl ProcessorUrl {
    /// `url`, if it is an absolute `http` URL with no credentials.
    pub fn new(url: String) -> Result<Self, &'static str> {
        if url.contains('@') {
            return Err("PAYMENTS_PROCESSOR_URL carries credentials (`user:password@`), which the example would not send: give the processor's URL without them");
        }
        let uri: http::Uri = url
            .parse()
            .map_err(|_| "PAYMENTS_PROCESSOR_URL is not a URL")?;
        if uri.scheme_str() != Some("http") || uri.authority().is_none() {
            return Err("PAYMENTS_PROCESSOR_URL must be an absolute http URL: http://host[:port]");
        }
        Ok(Self(url))
    }
}

/// A processor at a base URL, and the client that charges it.
#[derive(Clone, Debug)]
pub struct Processor {
    charges: String,
    client: IdempotentClient<Client<HttpConnector, Full<Bytes>>>,
}

impl Processor {
    /// A processor whose charges are `POST <base>/v1/payments`.
    pub fn new(base: &ProcessorUrl) -> Self {
        let base = &base.0;
        let http = Client::builder(TokioExecutor::new()).build_http();
        Self {
            charges: format!("{}/v1/payments", base.trim_end_matches('/')),
            client: IdempotentClientLayer::new().layer(http),
        }
    }

    /// Charges `amount` in `currency` for the payment whose keys are `keys`, on behalf of
    /// `authorization`; the processor's payment id, or why there is none (its last answer
    /// was not `201`, or none came within the client's retries).
    pub async fn charge(
        &self,
        keys: &DerivedKeys,
        authorization: Option<&HeaderValue>,
        amount: i64,
        currency: &str,
    ) -> Result<String, String> {
        let body = serde_json::json!({ "amount": amount, "currency": currency });
        let mut request = Request::post(&self.charges)
            .header(header::CONTENT_TYPE, "application/json")
            .header("idempotency-key", keys.header_value(KEY_LABEL))
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|error| error.to_string())?;
        if let Some(authorization) = authorization {
            let headers = request.headers_mut();
            headers.insert(header::AUTHORIZATION, authorization.clone());
        }
        // The failure alone: the client's error also names the key, kept out of the logs.
        let response = self
            .client
            .clone()
            .oneshot(request)
            .await
            .map_err(|error| error.failure().to_string())?;
        let status = response.status();
        let body = response.into_body().collect().await;
        let body = body.map_err(|error| error.to_string())?.to_bytes();
        if status != StatusCode::CREATED {
            return Err(format!("the processor answered {status}"));
        }
        let payment: serde_json::Value =
            serde_json::from_slice(&body).map_err(|error| error.to_string())?;
        match payment.get("id").and_then(|id| id.as_str()) {
            Some(id) => Ok(id.to_owned()),
            None => Err("the processor's payment has no id".to_owned()),
        }
    }
}
