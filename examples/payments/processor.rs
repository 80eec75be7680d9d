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

/// A processor's base URL, which may carry its credentials (`user:password@`): shown
/// without them, so that settings holding it can be logged.
#[derive(Clone)]
pub struct ProcessorUrl(pub String);

impl std::fmt::Debug for ProcessorUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let url = &self.0;
        let authority = url.find("://").map_or(0, |scheme| scheme + 3);
        let end = url[authority..]
            .find(['/', '?', '#'])
            .map_or(url.len(), |end| authority + end);
        match url[authority..end].rfind('@') {
            Some(at) => {
                let host = &url[authority + at + 1..];
                write!(f, "\"{}***@{host}\"", &url[..authority])
            }
            None => write!(f, "{url:?}"),
        }
    }
}

/// A processor at a base URL, and the client that charges it.
#[derive(Clone)]
pub struct Processor {
    charges: String,
    client: IdempotentClient<Client<HttpConnector, Full<Bytes>>>,
}

impl std::fmt::Debug for Processor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let charges = ProcessorUrl(self.charges.clone());
        f.debug_struct("Processor")
            .field("charges", &charges)
            .finish()
    }
}

impl Processor {
    /// A processor whose charges are `POST <base>/v1/payments`.
    pub fn new(base: &str) -> Self {
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
