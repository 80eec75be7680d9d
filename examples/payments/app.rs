//! The payments service: routes and handlers, shared by the example's `main` and the
//! contract tests.

use std::{
    future::Future,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use axum::{
    body::Bytes,
    extract::{FromRef, FromRequest, FromRequestParts, Request, State},
    http::{header, request::Parts, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, post},
    Form, Json, Router,
};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tower_idempotency::{
    BodyFingerprint, DerivedKeys, IdempotencyLayer, InFlight, ProblemDetails, Store,
};

// By path, so that the tests that include this file find it too.
#[path = "principal.rs"]
mod principal;
#[cfg(feature = "client")]
#[path = "processor.rs"]
mod processor;
use principal::BearerUser;
#[cfg(feature = "client")]
use processor::Processor;
#[cfg(feature = "client")]
pub use processor::ProcessorUrl;
#[cfg(feature = "postgres")]
#[path = "ledger.rs"]
pub mod ledger;
#[cfg(feature = "postgres")]
use ledger::{LayerTransaction, Ledger};
/// Without a ledger there is no transaction to take either.
#[cfg(not(feature = "postgres"))]
type LayerTransaction = ();

/// What the handlers share, behind one `Arc`: axum clones the state into every request
/// (several times over), and a clone is then a count, not a copy of the processor's client.
#[derive(Clone)]
struct App(Arc<Shared>);

/// The counters, the ledger payments are written to, and the processor they are charged at.
struct Shared {
    stats: Arc<Stats>,
    #[cfg(feature = "postgres")]
    ledger: Option<Ledger>,
    #[cfg(feature = "client")]
    processor: Option<Processor>,
}

/// Handler executions (never replays), and what makes ids unique across restarts and
/// instances.
#[derive(Debug)]
pub struct Stats {
    pub payments: AtomicU64,
    pub refunds: AtomicU64,
    pub tokens: AtomicU64,
    pub webhooks: AtomicU64,
    /// Random: two instances started in the same millisecond (one the other's processor,
    /// or two sharing a ledger) must not hand out the same ids.
    instance: u64,
    ids: AtomicU64,
    payments_only: AtomicBool,
    /// Executions still holding a key: what a graceful shutdown waits for.
    pub in_flight: InFlight,
}

impl Stats {
    fn new(in_flight: InFlight) -> Self {
        Self {
            payments: AtomicU64::new(0),
            refunds: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
            webhooks: AtomicU64::new(0),
            instance: rand::random(),
            ids: AtomicU64::new(0),
            payments_only: AtomicBool::new(false),
            in_flight,
        }
    }

    /// Makes `/v1/stats` answer `{"payments_executed":n}` alone, for load harnesses that
    /// read a single counter.
    pub fn report_payments_only(&self) {
        self.payments_only.store(true, Ordering::Relaxed);
    }

    fn next_id(&self, prefix: &str) -> String {
        let n = self.ids.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}_{:016x}{n:08x}", self.instance)
    }
}

/// The layer's settings the environment can change.
#[derive(Clone, Debug)]
pub struct Settings {
    /// How long completed responses are kept.
    pub ttl: Duration,
    /// How long a claim's lease runs.
    pub lease: Duration,
    /// `Some`: rejections as IETF problem details; `None`: the crate's JSON errors.
    pub problems: Option<ProblemDetails>,
    /// The largest response recorded; `None`: the layer's default.
    pub max_response_body: Option<usize>,
    /// How long a duplicate of a running payment waits for its outcome; `None`: no waiting.
    pub wait: Option<Duration>,
    /// Whether handlers run unprotected while the store is unreachable (else `503`).
    pub fail_open: bool,
    /// How the keyed routes fingerprint a body: raw bytes, or canonical JSON.
    pub fingerprint: BodyFingerprint,
    /// The base URL of a processor each payment also charges; `None`: no processor.
    #[cfg(feature = "client")]
    pub processor: Option<ProcessorUrl>,
    /// The ledger each payment is written to; `None`: no ledger.
    #[cfg(feature = "postgres")]
    pub ledger: Option<Ledger>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(24 * 3600),
            lease: Duration::from_secs(30),
            problems: None,
            max_response_body: None,
            wait: None,
            fail_open: false,
            fingerprint: BodyFingerprint::raw(),
            #[cfg(feature = "client")]
            processor: None,
            #[cfg(feature = "postgres")]
            ledger: None,
        }
    }
}

/// The whole service: `/v1/payments` and `/v1/tokens` require a key, `/v1/refunds` takes
/// one optionally, `/v1/webhooks` is keyed by its event's `/id`, `/v1/stats` is outside the
/// idempotency layer.
pub fn router(store: Arc<dyn Store>, settings: Settings) -> (Router, Arc<Stats>) {
    let mut layer = IdempotencyLayer::from_shared(store)
        .ttl(settings.ttl)
        .lease(settings.lease)
        .principal(BearerUser)
        // A request without a bearer token is anonymous: a demo's choice. A real service
        // would have its authentication layer refuse it, or set a `Principal`.
        .allow_anonymous()
        .fingerprint(settings.fingerprint);
    if let Some(problems) = settings.problems {
        layer = layer.render_rejections(problems);
    }
    if let Some(bytes) = settings.max_response_body {
        layer = layer.max_response_body(bytes);
    }
    if let Some(bound) = settings.wait {
        layer = layer.wait_for_original(bound);
    }
    if settings.fail_open {
        layer = layer.fail_open();
    }
    // The processor's charges are keyed by the payment's derived keys.
    #[cfg(feature = "client")]
    if settings.processor.is_some() {
        layer = layer.derive_keys();
    }
    let stats = Arc::new(Stats::new(layer.in_flight()));
    // Deliveries carry no `Idempotency-Key` (nor a bearer token: they share the anonymous
    // scope); the sender's event id is the key.
    let webhooks = layer.clone().key_from_json("/id").required();
    let state = App(Arc::new(Shared {
        stats: stats.clone(),
        #[cfg(feature = "postgres")]
        ledger: settings.ledger.clone(),
        #[cfg(feature = "client")]
        processor: settings.processor.as_ref().map(Processor::new),
    }));
    let app = Router::new()
        .route(
            "/v1/payments",
            post(create_payment).layer(layer.clone().required()),
        )
        .route("/v1/refunds", post(create_refund).layer(layer.clone()))
        .route("/v1/tokens", post(create_token).layer(layer.required()))
        .route("/v1/webhooks", post(receive_webhook).layer(webhooks))
        .route("/v1/stats", get(get_stats))
        .with_state(state);
    (app, stats)
}

#[derive(Deserialize)]
struct Charge {
    amount: i64,
    currency: String,
    simulate: Option<Simulate>,
    delay_ms: Option<u64>,
}

/// The request's `Authorization`, which a processor's charge carries on: the one header,
/// not a copy of the whole map (`HeaderMap` as an extractor clones every header, on every
/// payment).
struct Authorization(Option<HeaderValue>);

impl<S: Send + Sync> FromRequestParts<S> for Authorization {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        Ok(Self(parts.headers.get(header::AUTHORIZATION).cloned()))
    }
}

/// A charge as JSON (the default) or, as Stripe's API takes it, as
/// `application/x-www-form-urlencoded` (`amount=1999&currency=usd`).
struct ChargeBody(Charge);

impl<S: Send + Sync> FromRequest<S> for ChargeBody {
    type Rejection = Response;

    // Every payment's future holds this one, and axum boxes it, copying all of it. Hence
    // a `fn` returning an `async move` block (an `async fn` keeps the request twice), and
    // for the common `application/json`, the body read as bytes and parsed as `Json` parses
    // them (axum's `Json` extractor keeps the request twice more). Anything else (a form,
    // a `+json` type, no type) goes through axum's own extractor, boxed.
    #[allow(clippy::manual_async_fn)]
    fn from_request(
        request: Request,
        state: &S,
    ) -> impl Future<Output = Result<Self, Self::Rejection>> + Send {
        async move {
            let content_type = request
                .headers()
                .get(header::CONTENT_TYPE)
                .and_then(|value| value.to_str().ok());
            let form = |value: &str| value.starts_with("application/x-www-form-urlencoded");
            let charge = if content_type.is_some_and(plain_json) {
                let bytes = Bytes::from_request(request, state)
                    .await
                    .map_err(IntoResponse::into_response)?;
                Json::<Charge>::from_bytes(&bytes)
                    .map_err(IntoResponse::into_response)?
                    .0
            } else if content_type.is_some_and(form) {
                Box::pin(Form::<Charge>::from_request(request, state))
                    .await
                    .map_err(IntoResponse::into_response)?
                    .0
            } else {
                Box::pin(Json::<Charge>::from_request(request, state))
                    .await
                    .map_err(IntoResponse::into_response)?
                    .0
            };
            Ok(Self(charge))
        }
    }
}

/// `application/json` as clients send it, a type axum's `Json` takes too.
fn plain_json(content_type: &str) -> bool {
    ["application/json", "application/json; charset=utf-8"]
        .iter()
        .any(|plain| content_type.eq_ignore_ascii_case(plain))
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum Simulate {
    Decline,
    Error,
    Slow,
    /// The payment's work first (its ledger row, the processor's charge), then `delay_ms`
    /// of sleep.
    #[serde(rename = "slow_after")]
    SlowAfter,
}

async fn create_payment(
    State(app): State<App>,
    keys: Option<DerivedKeys>,
    Authorization(authorization): Authorization,
    mut transaction: LayerTransaction,
    ChargeBody(charge): ChargeBody,
) -> Response {
    let stats = &app.stats;
    stats.payments.fetch_add(1, Ordering::Relaxed);
    let id = stats.next_id("pay");
    match charge.simulate {
        Some(Simulate::Error) => {
            // With a ledger, the row first: a failure after the payment's own writes.
            if let Err(failed) = app.record(&mut transaction, &id, &charge).await {
                return failed;
            }
            return (
                StatusCode::INTERNAL_SERVER_ERROR,
                Json(json!({ "error": "internal" })),
            )
                .into_response();
        }
        Some(Simulate::Decline) => {
            if let Err(failed) = app.record(&mut transaction, &id, &charge).await {
                return failed;
            }
            return (
                StatusCode::PAYMENT_REQUIRED,
                Json(json!({ "error": "card_declined", "id": id })),
            )
                .into_response();
        }
        Some(Simulate::Slow) => {
            tokio::time::sleep(Duration::from_millis(charge.delay_ms.unwrap_or(0))).await;
        }
        Some(Simulate::SlowAfter) | None => {}
    }
    if let Err(failed) = app.record(&mut transaction, &id, &charge).await {
        return failed;
    }
    #[cfg(feature = "client")]
    let processor_id = match &app.processor {
        Some(processor) => {
            let keys = keys.expect("the layer derives keys wherever a processor is set");
            // Boxed: kept in place, the client's call would make every payment's future
            // (which axum boxes, copying all of it) four times the size.
            let charged = Box::pin(processor.charge(
                &keys,
                authorization.as_ref(),
                charge.amount,
                &charge.currency,
            ))
            .await;
            match charged {
                Ok(id) => Some(id),
                Err(error) => {
                    tracing::warn!(%error, "the processor did not charge the payment");
                    let body = Json(json!({ "error": "processor_unavailable" }));
                    return (StatusCode::BAD_GATEWAY, body).into_response();
                }
            }
        }
        None => None,
    };
    #[cfg(not(feature = "client"))]
    let (processor_id, _) = (None::<String>, (keys, authorization));
    if charge.simulate == Some(Simulate::SlowAfter) {
        tokio::time::sleep(Duration::from_millis(charge.delay_ms.unwrap_or(0))).await;
    }
    created(id, "/v1/payments", charge, processor_id.as_deref())
}

impl std::ops::Deref for App {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

impl FromRef<App> for Arc<Stats> {
    fn from_ref(app: &App) -> Self {
        app.stats.clone()
    }
}

impl Shared {
    /// Writes payment `id` to the ledger, if there is one; a failure is the answer.
    async fn record(
        &self,
        transaction: &mut LayerTransaction,
        id: &str,
        charge: &Charge,
    ) -> Result<(), Response> {
        #[cfg(feature = "postgres")]
        if let Some(ledger) = &self.ledger {
            let recorded = ledger
                .record(transaction, id, charge.amount, &charge.currency)
                .await;
            if let Err(error) = recorded {
                tracing::error!(%error, "could not write the payment to the ledger");
                let body = Json(json!({ "error": "ledger_unavailable" }));
                return Err((StatusCode::INTERNAL_SERVER_ERROR, body).into_response());
            }
        }
        #[cfg(not(feature = "postgres"))]
        let _ = (transaction, id, charge);
        Ok(())
    }
}

async fn create_refund(
    State(stats): State<Arc<Stats>>,
    ChargeBody(charge): ChargeBody,
) -> Response {
    stats.refunds.fetch_add(1, Ordering::Relaxed);
    created(stats.next_id("re"), "/v1/refunds", charge, None)
}

/// A created payment or refund. A typed body, not a `json!` map: the map allocates an entry
/// per field and sorts them, two to three times the work of writing the struct.
#[derive(Serialize)]
struct Created<'a> {
    id: &'a str,
    amount: i64,
    currency: &'a str,
    status: &'static str,
    created: u64,
    /// The processor's id of the charge, where a processor charged it.
    #[serde(skip_serializing_if = "Option::is_none")]
    processor_id: Option<&'a str>,
}

fn created(id: String, collection: &str, charge: Charge, processor_id: Option<&str>) -> Response {
    let location = format!("{collection}/{id}");
    let body = Created {
        id: &id,
        amount: charge.amount,
        currency: &charge.currency,
        status: "succeeded",
        created: now_ms() as u64,
        processor_id,
    };
    (
        StatusCode::CREATED,
        [(header::LOCATION, location)],
        Json(body),
    )
        .into_response()
}

async fn create_token(State(stats): State<Arc<Stats>>) -> Response {
    stats.tokens.fetch_add(1, Ordering::Relaxed);
    let bytes: [u8; 64] = rand::random();
    (
        StatusCode::CREATED,
        [(header::CONTENT_TYPE, "application/octet-stream")],
        bytes.to_vec(),
    )
        .into_response()
}

/// A webhook delivery: `{"id": "evt_…", "type": "…", "data": …}`. The layer has checked
/// that `/id` is a string key.
#[derive(Deserialize)]
struct Event {
    id: String,
    #[serde(rename = "type")]
    _kind: String,
}

async fn receive_webhook(State(stats): State<Arc<Stats>>, body: axum::body::Bytes) -> Response {
    let event: Event = match serde_json::from_slice(&body) {
        Ok(event) => event,
        Err(error) => {
            let body = json!({ "error": "invalid_event", "message": error.to_string() });
            return (StatusCode::BAD_REQUEST, Json(body)).into_response();
        }
    };
    stats.webhooks.fetch_add(1, Ordering::Relaxed);
    let handled = json!({ "received": event.id, "handled_at": now_ms() as u64 });
    (StatusCode::OK, Json(handled)).into_response()
}

async fn get_stats(State(stats): State<Arc<Stats>>) -> Json<serde_json::Value> {
    if stats.payments_only.load(Ordering::Relaxed) {
        return Json(json!({ "payments_executed": stats.payments.load(Ordering::Relaxed) }));
    }
    Json(json!({
        "payments_executed": stats.payments.load(Ordering::Relaxed),
        "refunds_executed": stats.refunds.load(Ordering::Relaxed),
        "tokens_executed": stats.tokens.load(Ordering::Relaxed),
        "webhooks_executed": stats.webhooks.load(Ordering::Relaxed),
    }))
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}
