//! `IdempotencyLayer`: the builder of a layer's settings, and the `Layer` that applies them.

use std::{fmt, sync::Arc, time::Duration};

use http::{HeaderName, Method, StatusCode};
use tower_layer::Layer;

use super::{
    body_fingerprint::BodyFingerprint,
    body_key::{BodyKey, FindKey},
    config::Config,
    in_flight::InFlight,
    principal::{BoxedPrincipal, DefaultPrincipal, ExtractPrincipal, Unscoped},
    rejection::RenderRejection,
    release::ResponseHead,
    scope::Endpoint,
    service::Idempotency,
    state::{Shared, State},
    telemetry::SpanField,
};
use crate::store::Store;

/// The longest TTL, lease or wait the layer takes: 100 years (of 365 days). Every store
/// keeps a record that long; a longer one (a TTL meant as "forever") would overflow their
/// clocks, so the settings refuse it.
pub const LONGEST_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// `duration`, if it is at most [`LONGEST_DURATION`]; a panic naming `setting` otherwise.
fn within_longest(setting: &str, duration: Duration) -> Duration {
    assert!(
        duration <= LONGEST_DURATION,
        "an idempotency {setting} must be at most LONGEST_DURATION (100 years), not {duration:?}"
    );
    duration
}

/// Applies [`Idempotency`] to a service: requests carrying an `Idempotency-Key` execute once
/// and every retry gets the first response back.
///
/// Each layer has its own configuration, so routes can differ: apply one per route
/// (`post(handler).layer(..)`, `Router::route_layer`) or one to a whole router.
///
/// Cloning is cheap. A clone is the same layer, whatever settings it goes on to change:
/// it shares the store, the executions in flight ([`in_flight`](Self::in_flight)) and the
/// count of waiting requests ([`waiting`](Self::waiting), which each clone's
/// [`max_waiting`](Self::max_waiting) caps) with the layer it came from. A layer made with
/// [`new`](Self::new) or [`from_shared`](Self::from_shared) has its own.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use axum::{routing::post, Router};
/// use tower_idempotency::{IdempotencyLayer, MemoryStore};
///
/// let store = MemoryStore::new();
/// let app: Router = Router::new()
///     .route("/v1/payments", post(|| async { "charged" }))
///     .route_layer(IdempotencyLayer::new(store).required().ttl(Duration::from_secs(3600)));
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer {
    store: Arc<dyn Store>,
    config: Config,
    state: State,
}

impl IdempotencyLayer {
    /// A layer on `store` with the defaults: `POST` and `PATCH`, key optional, results kept
    /// 24 hours, a 30-second lease renewed while the handler runs, bodies up to 1 MiB,
    /// released on inner error, panic, 5xx, 408 or 429, fail closed, scoped by
    /// [`DefaultPrincipal`] and `"<METHOD> <path>"`, keyed requests without a principal
    /// refused, `Set-Cookie` not replayed.
    pub fn new(store: impl Store) -> Self {
        Self::from_shared(Arc::new(store))
    }

    /// A layer on a store shared with other layers (or chosen at run time).
    ///
    /// # Example
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, Store};
    ///
    /// let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    /// let payments = IdempotencyLayer::from_shared(store.clone()).required();
    /// let refunds = IdempotencyLayer::from_shared(store);
    /// ```
    pub fn from_shared(store: Arc<dyn Store>) -> Self {
        Self {
            state: State::new(store.name()),
            store,
            config: Config::default(),
        }
    }

    /// The executions of this layer that still hold a key (running, or recording their
    /// outcome): wait for them to settle in a graceful shutdown, after the server stops.
    /// Every clone of the layer, and every service it made, shares them.
    pub fn in_flight(&self) -> InFlight {
        self.state.in_flight.clone()
    }

    /// How each keyed request's `idempotency` span shows its idempotency key. Default:
    /// [`SpanField::Digest`], a short digest that follows one key through the logs without
    /// revealing it.
    ///
    /// # Example
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore, SpanField};
    /// // Keys are random UUIDs here, safe to log as they are.
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).span_key(SpanField::Plain);
    /// ```
    pub fn span_key(mut self, shown: SpanField) -> Self {
        self.config.span_key = shown;
        self
    }

    /// How each keyed request's `idempotency` span shows its principal. Default:
    /// [`SpanField::Digest`].
    pub fn span_principal(mut self, shown: SpanField) -> Self {
        self.config.span_principal = shown;
        self
    }

    /// The level of each keyed request's `idempotency` span (endpoint, key, principal and
    /// outcome; the store calls and outcomes logged inside it). Default: `DEBUG`, as
    /// tower-http's `TraceLayer` makes its spans: at a production level of `info` nobody
    /// pays for a span per request. `INFO` puts it in production logs, around the `info`
    /// lines of a client's mistakes and everything more severe, which otherwise carry their
    /// outcome but not the key's scope.
    ///
    /// # Example
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).span_level(tracing::Level::INFO);
    /// ```
    pub fn span_level(mut self, level: tracing::Level) -> Self {
        self.config.span_level = level;
        self
    }

    /// How many requests of this layer (every clone, every service it made) wait for their
    /// originals now (see [`wait_for_original`](Self::wait_for_original)).
    pub fn waiting(&self) -> usize {
        self.state.waiters.count()
    }

    /// The methods handled; every other request passes straight through, unbuffered.
    /// Default: `POST`, `PATCH`.
    ///
    /// # Panics
    ///
    /// If `methods` is empty: the layer would protect nothing, `required()` routes included.
    ///
    /// # Example
    ///
    /// ```
    /// use http::Method;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).methods([Method::POST, Method::PUT]);
    /// ```
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        assert!(
            !self.config.methods.is_empty(),
            "IdempotencyLayer::methods needs at least one method: with none, nothing is protected"
        );
        self
    }

    /// The key's header. Default: `Idempotency-Key`. (It replaces a
    /// [`key_from_json`](Self::key_from_json) or [`key_from_body`](Self::key_from_body)
    /// set before it.)
    ///
    /// Webhook senders that put a delivery id in a header of their own are keyed by it this
    /// way: GitHub's `X-GitHub-Delivery`, say. A redelivery is answered with the recorded
    /// response.
    ///
    /// # Example
    ///
    /// ```
    /// use http::HeaderName;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .header_name(HeaderName::from_static("x-idempotency-key"));
    /// let github = IdempotencyLayer::new(MemoryStore::new())
    ///     .header_name(HeaderName::from_static("x-github-delivery"))
    ///     .unscoped();
    /// ```
    pub fn header_name(mut self, name: HeaderName) -> Self {
        self.config.header_name = name;
        self.config.body_key = None;
        self
    }

    /// Reads each request's key from its JSON body, at `pointer` (RFC 6901, such as `/id`),
    /// instead of a header: for webhooks, whose senders (Stripe, Shopify) retry a delivery
    /// with the same event id and no `Idempotency-Key`.
    ///
    /// The key must be a JSON string of 1 to 255 visible ASCII characters. A body whose
    /// pointer holds anything else (a number, an object), or whose objects on the way name
    /// the member twice, gets `400 invalid_idempotency_key`. A body with nothing there (or
    /// `null`, or a body that is not JSON) gets `400 idempotency_key_required` on a
    /// [`required`](Self::required) route and passes through unprotected otherwise.
    ///
    /// The body is read before the key is known, so every request of the route is read
    /// whole, keyed or not, and one over [`max_request_body`](Self::max_request_body) (or
    /// one that fails mid-read) is refused even where a request without a key would pass
    /// through. Not for streaming routes (gRPC streams among them).
    ///
    /// Verify the sender's signature before this layer, in a layer outside it: a forged
    /// delivery that reached it with a real event's id would be executed first and
    /// recorded (a `401` from the handler is a result, and replays), and the genuine
    /// delivery would then be answered from that record.
    ///
    /// A delivery of an event already handled gets the recorded response; one that comes
    /// while the first still runs gets `409 request_in_progress` with `Retry-After`, which
    /// senders retry, or waits for it ([`wait_for_original`](Self::wait_for_original)).
    ///
    /// # Panics
    ///
    /// When `pointer` is not a JSON pointer to a field: it must start with `/`, and `~` only
    /// in `~0` or `~1`.
    ///
    /// # Example
    ///
    /// ```
    /// use axum::{
    ///     extract::Request, http::StatusCode, middleware::{from_fn, Next}, response::Response,
    ///     routing::post, Router,
    /// };
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// // Refuses deliveries whose signature does not check, before they reach the layer.
    /// async fn verify_signature(request: Request, next: Next) -> Result<Response, StatusCode> {
    ///     if !request.headers().contains_key("stripe-signature") {
    ///         return Err(StatusCode::UNAUTHORIZED); // and check it against the body
    ///     }
    ///     Ok(next.run(request).await)
    /// }
    ///
    /// // Stripe events: `{"id": "evt_…", "type": "charge.succeeded", …}`, with no bearer
    /// // token: keyed by event id and endpoint alone.
    /// let webhooks = IdempotencyLayer::new(MemoryStore::new())
    ///     .key_from_json("/id")
    ///     .required()
    ///     .unscoped();
    /// let app: Router = Router::new().route(
    ///     "/webhooks/stripe",
    ///     post(|| async { "ok" }).layer(webhooks).layer(from_fn(verify_signature)),
    /// );
    /// ```
    pub fn key_from_json(mut self, pointer: &str) -> Self {
        self.config.body_key = Some(BodyKey::json(pointer));
        self
    }

    /// Reads each request's key with `find`, from its parts and its body read whole, for
    /// keys [`key_from_json`](Self::key_from_json) cannot reach: `None` is no key (refused
    /// on a [`required`](Self::required) route, passed through otherwise). The key found
    /// must be 1 to 255 visible ASCII characters, or the request gets `400
    /// invalid_idempotency_key`. As with [`key_from_json`](Self::key_from_json), every
    /// request of the route is read whole first, and its sender's signature is best
    /// verified outside the layer.
    ///
    /// # Example
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore};
    ///
    /// // A form-encoded delivery whose id is its `event_id` field.
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).key_from_body(|_parts, body| {
    ///     let body = std::str::from_utf8(body).ok()?;
    ///     body.split('&')
    ///         .find_map(|field| field.strip_prefix("event_id="))
    ///         .map(str::to_owned)
    /// });
    /// ```
    pub fn key_from_body<F>(mut self, find: F) -> Self
    where
        F: Fn(&http::request::Parts, &[u8]) -> Option<String> + Send + Sync + 'static,
    {
        let find: Arc<FindKey> = Arc::new(find);
        self.config.body_key = Some(BodyKey::Custom(find));
        self
    }

    /// Handled requests without a key get `400 idempotency_key_required` instead of passing
    /// through unprotected.
    ///
    /// # Example
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).required();
    /// ```
    pub fn required(mut self) -> Self {
        self.config.required = true;
        self
    }

    /// How long a completed response is replayed. Default: 24 hours.
    ///
    /// Keep it longer than clients retry for: a retry that comes after it executes again.
    /// The `Retry-After` of a `409 request_in_progress` never says to come back later than
    /// half of it (in whole seconds, at least one), so that a duplicate back when told finds
    /// the record even if the holder completed right after telling it, unless the TTL is
    /// under two seconds.
    ///
    /// # Panics
    ///
    /// If `ttl` is zero (nothing would be replayed) or longer than [`LONGEST_DURATION`].
    ///
    /// # Example
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).ttl(Duration::from_secs(7 * 86_400));
    /// ```
    pub fn ttl(mut self, ttl: Duration) -> Self {
        assert!(
            !ttl.is_zero(),
            "an idempotency ttl must be more than zero: nothing would be replayed"
        );
        self.config.ttl = within_longest("ttl", ttl);
        self
    }

    /// The in-progress lease: how long a key stays claimed after its holder stops renewing
    /// it (a crashed process). Renewed every third of it while the handler runs.
    /// Default: 30 seconds.
    ///
    /// # Panics
    ///
    /// If `lease` is under 3 milliseconds, too short to renew, or longer than
    /// [`LONGEST_DURATION`].
    ///
    /// # Example
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).lease(Duration::from_secs(10));
    /// ```
    pub fn lease(mut self, lease: Duration) -> Self {
        assert!(
            lease >= Duration::from_millis(3),
            "an idempotency lease must be at least 3 ms"
        );
        self.config.lease = within_longest("lease", lease);
        self
    }

    /// The largest request body buffered; larger ones get `413 request_body_too_large` and
    /// nothing is claimed. Default: 1 MiB.
    ///
    /// # Example
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).max_request_body(64 * 1024);
    /// ```
    pub fn max_request_body(mut self, bytes: usize) -> Self {
        self.config.max_request_body = bytes;
        self
    }

    /// The largest response body recorded. A larger response still reaches its client in
    /// full (streamed, never buffered past this size), and the key is recorded as executed
    /// but not replayable: retries get `409 response_not_replayable` with the original
    /// status, never a second execution. Default: 1 MiB.
    ///
    /// # Example
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).max_response_body(4 * 1024 * 1024);
    /// ```
    pub fn max_response_body(mut self, bytes: usize) -> Self {
        self.config.max_response_body = bytes;
        self
    }

    /// Which response statuses release the key instead of recording the response, so that a
    /// retry executes again. Inner errors and panics always release. Default: 5xx,
    /// `408 Request Timeout` and `429 Too Many Requests`, which say the operation was not
    /// done (a timeout or rate-limit layer inside this one answered instead of the handler).
    ///
    /// # Example
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// // A handler that answers 503 only before it touches anything, and 504 when a
    /// // downstream call timed out: the 504 may have charged, so it is kept and replayed.
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).release_on(|status| {
    ///     matches!(status.as_u16(), 408 | 429 | 500..=503 | 505..)
    /// });
    /// ```
    pub fn release_on(
        mut self,
        release: impl Fn(StatusCode) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.config.release.on_status(release);
        self
    }

    /// Which whole responses release the key, judged once the body is buffered, with the
    /// headers and trailers in view: for statuses that live beyond the HTTP status line.
    /// Checked after [`release_on`](Self::release_on), for responses it lets through.
    /// Default: the transient gRPC statuses
    /// ([`ResponseHead::is_transient_grpc_status`]), on gRPC requests; a replacement, which
    /// judges every response, calls it too to keep them. A released response still reaches
    /// its client. A response larger than [`max_response_body`](Self::max_response_body)
    /// is not buffered, so it is never judged here: it is recorded as not replayable once
    /// the limit is passed, before its trailers arrive, and never executed again (a
    /// transient gRPC status in those trailers included).
    ///
    /// # Example
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore, ResponseHead};
    /// // An API that reports a failed charge as 200 with `x-charge-state: unknown`.
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).release_when(|head: &ResponseHead| {
    ///     head.is_transient_grpc_status()
    ///         || head.headers.get("x-charge-state").is_some_and(|v| v == "unknown")
    /// });
    /// ```
    pub fn release_when(
        mut self,
        release: impl Fn(&ResponseHead<'_>) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.config.release.when(release);
        self
    }

    /// When the store cannot be reached, execute requests without protection (and log each
    /// one at error level) instead of answering `503 idempotency_store_unavailable`.
    /// Default: fail closed.
    ///
    /// A duplicate that waited for the original ([`wait_for_original`]) is never executed
    /// so: the store said another request holds its key, and a failure after that answers
    /// `503` rather than run it a second time.
    ///
    /// [`wait_for_original`]: Self::wait_for_original
    ///
    /// # Example
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).fail_open();
    /// ```
    pub fn fail_open(mut self) -> Self {
        self.config.fail_open = true;
        self
    }

    /// How a request names its principal. Default: [`DefaultPrincipal`].
    ///
    /// The principal must be a verified identity that stays the same across a client's
    /// retries: what the authentication layer established (a user id, an account, the
    /// `sub` of a verified JWT, the access key id of a verified signature), never an
    /// unverified header a client could set to another user's name, and never a credential
    /// that changes between retries (a refreshed token, a per-request signature), under
    /// which a retry would execute again. An empty name counts as none: the request is
    /// anonymous, refused unless the route [allows that](Self::allow_anonymous).
    ///
    /// # Example
    ///
    /// ```
    /// use http::request::Parts;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// #[derive(Clone)]
    /// struct Session { user_id: String } // set by the session layer, once verified
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).principal(|parts: &Parts| {
    ///     parts.extensions.get::<Session>().map(|session| session.user_id.clone())
    /// });
    /// ```
    pub fn principal(mut self, extractor: impl ExtractPrincipal) -> Self {
        self.config.principal = BoxedPrincipal(Arc::new(extractor));
        self.config.unscoped = false;
        self
    }

    /// Keys the digest that [`DefaultPrincipal`] makes of the `Authorization` header
    /// with `secret` (HMAC-SHA-256), so that nobody who can read the store can test
    /// guessed credentials against it. Give every instance that shares a store the same
    /// secret (at least 32 random bytes, from wherever the application keeps its
    /// secrets); changing it starts every scope afresh, like a new store. Without it, the
    /// first digest made logs a warning. Replaces the principal extractor with
    /// [`DefaultPrincipal::keyed`].
    ///
    /// # Example
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// # let secret_from_vault = [7u8; 32];
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).credential_secret(secret_from_vault);
    /// ```
    pub fn credential_secret(self, secret: impl AsRef<[u8]>) -> Self {
        self.principal(DefaultPrincipal::keyed(secret))
    }

    /// Keyed requests that name no principal share one anonymous scope: any client that
    /// sends the same key and body gets the same response. By default the layer refuses
    /// them (`500 idempotency_principal_missing`, nothing executed, an error logged that
    /// names this fix), so that a route behind cookie sessions or mutual TLS, where the
    /// `Authorization` header is absent, never shares one client's records with another
    /// by accident. Choose this for routes where anonymous callers are expected and their
    /// keys are unguessable (random UUIDs from the client); better, name the principal from
    /// the session or the client certificate ([`principal`](Self::principal)).
    ///
    /// # Example
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// // Guest checkout: signed-in users are scoped by their Principal, guests share one
    /// // scope and are kept apart by their random keys.
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).allow_anonymous();
    /// ```
    pub fn allow_anonymous(mut self) -> Self {
        self.config.anonymous = true;
        self
    }

    /// Every caller shares one key space. Only for services with one caller, or keys that
    /// are globally unique by construction. A [`Principal`](crate::Principal) extension
    /// that a layer before this one set (naming a webhook's sender once its signature is
    /// checked, say) still scopes the request's key.
    ///
    /// # Example
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).unscoped();
    /// ```
    pub fn unscoped(self) -> Self {
        let mut layer = self.principal(Unscoped);
        layer.config.unscoped = true;
        layer
    }

    /// Record and replay `Set-Cookie` with the rest of a response. By default it is left
    /// out of the record: the first response still carries it to its client, but a
    /// replay never hands one client's session cookie to whoever sends the same key
    /// again. Turn it on where a replayed response must set the cookie again and the
    /// scope guarantees that only the same client can replay it.
    ///
    /// # Example
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).replay_set_cookie();
    /// ```
    pub fn replay_set_cookie(mut self) -> Self {
        self.config.replay_set_cookie = true;
        self
    }

    /// Name the endpoint by Axum's route template (`POST /v1/orders/{id}`) instead of the
    /// request path. Falls back to the path where no route matched yet (a layer applied
    /// with `Router::layer` runs before routing; use `route_layer` or a per-route layer).
    ///
    /// # Example
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).endpoint_from_matched_path();
    /// ```
    #[cfg(feature = "axum")]
    #[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
    pub fn endpoint_from_matched_path(mut self) -> Self {
        self.config.endpoint = Endpoint::MatchedPath;
        self
    }

    /// Give every request through this layer one endpoint name, so that a key is shared
    /// across paths (for example `/v1/orders` and `/v2/orders`).
    ///
    /// # Example
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).endpoint_name("create-order");
    /// ```
    ///
    /// # Panics
    ///
    /// If `name` is longer than [`MAX_SCOPE_PART_LEN`](crate::MAX_SCOPE_PART_LEN) bytes, or
    /// holds a NUL byte.
    pub fn endpoint_name(mut self, name: impl Into<String>) -> Self {
        let name = name.into();
        assert!(
            name.len() <= crate::MAX_SCOPE_PART_LEN,
            "an idempotency endpoint_name must be at most MAX_SCOPE_PART_LEN (1024) bytes, not {}",
            name.len()
        );
        assert!(
            !name.contains('\0'),
            "an idempotency endpoint_name must hold no NUL byte (PostgreSQL's text refuses one)"
        );
        self.config.endpoint = Endpoint::Fixed(name.into());
        self
    }

    /// Include a request header in the fingerprint, so that the same key and body sent with
    /// another value of it is a reuse with different parameters.
    ///
    /// # Example
    ///
    /// ```
    /// use http::HeaderName;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .fingerprint_header(HeaderName::from_static("x-account"));
    /// ```
    pub fn fingerprint_header(mut self, name: HeaderName) -> Self {
        self.config.fingerprint_headers.push(name);
        self
    }

    /// How the body counts in the fingerprint: its bytes ([`BodyFingerprint::raw`], the
    /// default), its canonical JSON ([`BodyFingerprint::json`]), the same without some
    /// fields ([`BodyFingerprint::json_ignoring`]), or a function's
    /// ([`BodyFingerprint::custom`]). Changing it on a live service turns retries of keys
    /// recorded before into mismatches until those records expire: see
    /// [`BodyFingerprint`].
    ///
    /// # Example
    ///
    /// ```
    /// use tower_idempotency::{BodyFingerprint, IdempotencyLayer, MemoryStore};
    ///
    /// // Clients that rebuild their JSON on a retry, key order and spacing included.
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).fingerprint(BodyFingerprint::json());
    /// ```
    pub fn fingerprint(mut self, body: BodyFingerprint) -> Self {
        self.config.fingerprint = body;
        self
    }

    /// Let a duplicate that finds its key in progress (same request, same fingerprint) wait
    /// up to `bound` for the original's outcome instead of answering
    /// `409 request_in_progress` at once: when the original completes it gets the replay;
    /// when the original is released (5xx, error, panic) or its holder crashed (the lease ran
    /// out), it claims the key and executes, since the outcome was unknown; past `bound` it
    /// gets the `409` with `Retry-After`. A key reused with other parameters never waits.
    ///
    /// Waiters are woken by the store's announcements ([`Store::watch`]), whichever
    /// instance ran the original: the memory store in process, Redis by pub/sub (with
    #[cfg_attr(
        feature = "redis",
        doc = "[`RedisStore::announce_outcomes`](crate::RedisStore::announce_outcomes)"
    )]
    #[cfg_attr(not(feature = "redis"), doc = "`RedisStore::announce_outcomes`")]
    /// on every instance), PostgreSQL by `LISTEN`/`NOTIFY` (with
    #[cfg_attr(
        feature = "postgres",
        doc = "[`PostgresStore::announce_outcomes`](crate::PostgresStore::announce_outcomes));"
    )]
    #[cfg_attr(
        not(feature = "postgres"),
        doc = "`PostgresStore::announce_outcomes`);"
    )]
    /// the waiters one announcement wakes read the key once between them, or none reads it
    /// on the original's instance, where they are handed the record it wrote. An
    /// announcement from the store carries no record (whoever can publish or notify could
    /// have sent it, so it only makes the waiters read), unless Redis instances sign their
    /// records with a shared secret
    #[cfg_attr(
        feature = "redis",
        doc = "([`RedisStore::announce_signed_records`](crate::RedisStore::announce_signed_records))."
    )]
    #[cfg_attr(
        not(feature = "redis"),
        doc = "(`RedisStore::announce_signed_records`)."
    )]
    /// A store that announces nothing (one made from a bare
    /// connection or pool, or a store of one's own) is read again every 20 ms, doubling up
    /// to 200 ms.
    /// Every waiter also reads its key again when the holder's lease would run out.
    /// At most [`max_waiting`](Self::max_waiting) requests wait at once; a waiter whose
    /// client goes away leaves nothing behind. Default: no waiting.
    ///
    /// # Panics
    ///
    /// If `bound` is longer than [`LONGEST_DURATION`].
    ///
    /// # Example
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// // A double-tapped "Pay" gets the payment, not an error to retry.
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .wait_for_original(Duration::from_secs(5));
    /// ```
    pub fn wait_for_original(mut self, bound: Duration) -> Self {
        self.config.wait = Some(within_longest("wait for the original", bound));
        self
    }

    /// How many requests may wait for their originals at once (see
    /// [`wait_for_original`](Self::wait_for_original)); beyond it, duplicates get the `409`
    /// at once. Default: 10 000.
    ///
    /// # Example
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .wait_for_original(Duration::from_secs(5))
    ///     .max_waiting(500);
    /// ```
    pub fn max_waiting(mut self, waiters: usize) -> Self {
        self.config.max_waiting = waiters;
        self
    }

    /// Hand each request that executes its [`DerivedKeys`](crate::DerivedKeys), in its
    /// extensions (an axum handler takes them as an extractor): keys for the handler's calls
    /// to other services that honour `Idempotency-Key`, the same on every retry of the
    /// request, so that a retry after a crash is a replay there rather than a second
    /// charge. Off by default: each execution then pays nothing for them.
    ///
    /// # Example
    ///
    /// ```
    /// # use tower_idempotency::{IdempotencyLayer, MemoryStore};
    /// let layer = IdempotencyLayer::new(MemoryStore::new()).derive_keys();
    /// ```
    pub fn derive_keys(mut self) -> Self {
        self.config.derive_keys = true;
        self
    }

    /// Render the layer's rejections of HTTP requests (a missing key, a key in progress,
    /// ...) as the application's API renders its errors, or as the IETF draft does with
    /// [`ProblemDetails`](crate::ProblemDetails). gRPC requests keep getting gRPC statuses.
    /// Default: JSON `{"error":"<code>"}` ([`Rejection::json_response`](crate::Rejection::json_response)).
    ///
    /// A response too large to replay is recorded as its rejection, rendered when it is
    /// recorded: retries get that rendering until the record expires.
    ///
    /// # Example
    ///
    /// ```
    /// use tower_idempotency::{IdempotencyLayer, MemoryStore, ProblemDetails};
    ///
    /// let layer = IdempotencyLayer::new(MemoryStore::new())
    ///     .render_rejections(ProblemDetails::new("https://developer.example.com/idempotency"));
    /// ```
    ///
    /// See [`RenderRejection`] for a renderer of one's own.
    pub fn render_rejections(mut self, renderer: impl RenderRejection) -> Self {
        self.config.render_rejections = Some(Arc::new(renderer));
        self
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        let shared = Shared {
            store: Arc::clone(&self.store),
            config: self.config.clone(),
            state: self.state.clone(),
        };
        Idempotency::new(inner, Arc::new(shared))
    }
}

impl fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("store", &self.store)
            .field("config", &self.config)
            .finish()
    }
}

#[cfg(all(test, feature = "memory"))]
mod tests {
    use std::{convert::Infallible, sync::Arc, time::Duration};

    use bytes::Bytes;
    use http::Request;
    use http_body_util::Full;
    use tokio::sync::Semaphore;
    use tower::{service_fn, ServiceExt};

    use super::*;
    use crate::MemoryStore;

    /// Starts a keyed request through `layer` whose handler holds its key until `done`.
    fn start(layer: &IdempotencyLayer, key: &str, done: &Arc<Semaphore>) {
        let done = Arc::clone(done);
        let handler = service_fn(move |_: Request<Full<Bytes>>| {
            let done = Arc::clone(&done);
            async move {
                let _ = done.acquire().await;
                Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::new())))
            }
        });
        let request = Request::post("/pay")
            .header("idempotency-key", key)
            .body(Full::new(Bytes::new()))
            .unwrap();
        tokio::spawn(layer.layer(handler).oneshot(request));
    }

    #[tokio::test]
    async fn a_clone_shares_its_layers_state_and_a_new_layer_does_not() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let base = IdempotencyLayer::from_shared(Arc::clone(&store)).allow_anonymous();
        let clone = base.clone().required().ttl(Duration::from_secs(60));
        let apart = IdempotencyLayer::from_shared(store).allow_anonymous();
        let done = Arc::new(Semaphore::new(0));
        start(&clone, "k1", &done);
        start(&apart, "k2", &done);
        start(&apart, "k3", &done);
        let settled = |layer: &IdempotencyLayer, count| {
            let in_flight = layer.in_flight();
            async move {
                for _ in 0..200 {
                    if in_flight.count() == count {
                        return true;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                false
            }
        };
        assert!(settled(&apart, 2).await);
        assert!(
            settled(&base, 1).await,
            "the clone's execution is the base's too"
        );
        assert_eq!(clone.in_flight().count(), 1);
        done.add_permits(3);
        assert!(settled(&base, 0).await && settled(&apart, 0).await);
    }
}
