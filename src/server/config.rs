//! A layer's settings: what its builder chose, and nothing that changes while it serves
//! (that is the layer's [`State`](super::state::State)).

use std::{fmt, sync::Arc, time::Duration};

use http::{request::Parts, HeaderName, Method, Response};

use super::{
    body::ResponseBody,
    body_fingerprint::BodyFingerprint,
    body_key::BodyKey,
    grpc::Protocol,
    principal::{BoxedPrincipal, DefaultPrincipal},
    rejection::{Reason, Rejection, RenderRejection},
    release::ReleasePolicy,
    scope::{self, Endpoint},
    telemetry::SpanField,
};

/// How many requests of one layer may wait for their originals at once, by default.
const DEFAULT_MAX_WAITING: usize = 10_000;

/// What a layer does, as its builder set it.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) methods: Vec<Method>,
    pub(crate) header_name: HeaderName,
    /// `Some`: the key is read from the body, not the header.
    pub(crate) body_key: Option<BodyKey>,
    pub(crate) required: bool,
    pub(crate) ttl: Duration,
    pub(crate) lease: Duration,
    pub(crate) max_request_body: usize,
    pub(crate) max_response_body: usize,
    pub(crate) release: ReleasePolicy,
    pub(crate) fail_open: bool,
    pub(crate) principal: BoxedPrincipal,
    /// Whether keyed requests that name no principal share one anonymous scope, rather
    /// than being refused: chosen with `allow_anonymous`, or by `unscoped` until another
    /// principal extractor replaces `Unscoped`.
    pub(crate) anonymous: bool,
    pub(crate) unscoped: bool,
    /// Whether `Set-Cookie` is recorded and replayed with the rest of a response.
    pub(crate) replay_set_cookie: bool,
    pub(crate) endpoint: Endpoint,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    pub(crate) fingerprint: BodyFingerprint,
    /// `Some`: duplicates of a key in progress wait up to this long for its outcome.
    pub(crate) wait: Option<Duration>,
    pub(crate) max_waiting: usize,
    /// `None`: the default JSON errors, [`Rejection::json_response`](crate::Rejection::json_response).
    pub(crate) render_rejections: Option<Arc<dyn RenderRejection>>,
    pub(crate) span_key: SpanField,
    pub(crate) span_principal: SpanField,
    pub(crate) span_level: tracing::Level,
    /// Whether executed requests carry their [`DerivedKeys`](crate::DerivedKeys).
    pub(crate) derive_keys: bool,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            methods: vec![Method::POST, Method::PATCH],
            header_name: HeaderName::from_static("idempotency-key"),
            body_key: None,
            required: false,
            ttl: Duration::from_secs(24 * 60 * 60),
            lease: Duration::from_secs(30),
            max_request_body: 1024 * 1024,
            max_response_body: 1024 * 1024,
            release: ReleasePolicy::default(),
            fail_open: false,
            principal: BoxedPrincipal(Arc::new(DefaultPrincipal::new())),
            anonymous: false,
            unscoped: false,
            replay_set_cookie: false,
            endpoint: Endpoint::MethodAndPath,
            fingerprint_headers: Vec::new(),
            fingerprint: BodyFingerprint::raw(),
            render_rejections: None,
            wait: None,
            max_waiting: DEFAULT_MAX_WAITING,
            span_key: SpanField::default(),
            span_principal: SpanField::default(),
            span_level: tracing::Level::DEBUG,
            derive_keys: false,
        }
    }
}

impl Config {
    /// The layer's answer to a request it refuses before its scope is built: for its key,
    /// its principal or its body.
    #[cold]
    pub(crate) fn refuse<B>(&self, reason: Reason, parts: &Parts) -> Response<ResponseBody<B>> {
        self.refuse_at(reason, parts, scope::endpoint_of(&self.endpoint, parts))
    }

    /// [`refuse`](Self::refuse) with the request's endpoint already named.
    #[cold]
    pub(crate) fn refuse_at<B>(
        &self,
        reason: Reason,
        parts: &Parts,
        endpoint: String,
    ) -> Response<ResponseBody<B>> {
        let renderer = self.render_rejections.as_deref();
        Rejection::new(reason, endpoint)
            .with_key_in_body(self.body_key.as_ref().map(BodyKey::place))
            .into_response(Protocol::of(&parts.headers), renderer)
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("methods", &self.methods)
            .field("header_name", &self.header_name)
            .field("body_key", &self.body_key)
            .field("required", &self.required)
            .field("ttl", &self.ttl)
            .field("lease", &self.lease)
            .field("max_request_body", &self.max_request_body)
            .field("max_response_body", &self.max_response_body)
            .field("fail_open", &self.fail_open)
            .field("anonymous", &self.anonymous)
            .field("replay_set_cookie", &self.replay_set_cookie)
            .field("endpoint", &self.endpoint)
            .field("fingerprint_headers", &self.fingerprint_headers)
            .field("fingerprint", &self.fingerprint)
            .field("custom_rejections", &self.render_rejections.is_some())
            .field("wait", &self.wait)
            .field("max_waiting", &self.max_waiting)
            .field("derive_keys", &self.derive_keys)
            .finish_non_exhaustive()
    }
}
