//! Idempotency keys for Tower and Axum: make non-idempotent requests (a card charge, an
//! order) safe to retry.
//!
//! A client sends `Idempotency-Key: <uuid>` with a `POST`; [`IdempotencyLayer`] claims the
//! key atomically in a [`Store`], runs the request once, records the response, and replays
//! it byte for byte (marked `Idempotent-Replayed: true`) to every retry.
//!
//! ```no_run
//! use axum::{routing::post, Router};
//! use tower_idempotency::{IdempotencyLayer, MemoryStore};
//!
//! # async fn run() {
//! let app = Router::new()
//!     .route("/v1/payments", post(|body: String| async move { format!("charged {body}") }))
//!     .route_layer(IdempotencyLayer::new(MemoryStore::new()).required());
//!
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await.unwrap();
//! axum::serve(listener, app).await.unwrap();
//! # }
//! ```
//!
//! What a client sees:
//!
//! | situation | answer |
//! |---|---|
//! | first request with a key | the handler's response, recorded |
//! | retry, same body | the recorded response, `Idempotent-Replayed: true` |
//! | retry while the first still runs | `409 {"error":"request_in_progress","retry_after":s}`, `Retry-After: s` |
//! | same key, different body | `409 {"error":"idempotency_key_reused_with_different_params"}` |
//! | missing key on a [`required`](IdempotencyLayer::required) route | `400 {"error":"idempotency_key_required"}` |
//! | malformed or repeated key | `400 {"error":"invalid_idempotency_key"}` |
//! | body over the limit | `413 {"error":"request_body_too_large","limit":n}` |
//! | store unreachable | `503 {"error":"idempotency_store_unavailable"}`, `Retry-After: 1` |
//!
//! The handler's errors, panics and 5xx, `408` and `429` answers release the key, so a
//! retry executes again.
//!
//! The client half, for callers of such an API, is the `client` module (feature
//! `client`): one key per call, reused by every retry, with backoff, jitter and a deadline.
//!
//! # Guide
//!
//! The [`guide`] is the manual, one page per topic:
//!
//! - [Stores](guide::stores): which store for what, and a store of your own.
//! - [The transactional mode](guide::transactional): the handler's writes commit with the
//!   record.
//! - [PostgreSQL](guide::postgres): the schema, its migration, and reconciliation.
//! - [Deployment](guide::deployment): Redis topologies, the durability option, and what
//!   each guarantees against executing twice.
//! - [Composition](guide::composition): hyper and tonic services, and where the layer goes
//!   among the others.
//! - [Configuration](guide::configuration): every setter, and its default.
//! - [What a client sees, and error profiles](guide::error_profiles).
//! - [Details that matter in production](guide::production): keys, scope, fingerprint,
//!   outcomes, leases, store failures.
//! - [Waiting for the original](guide::waiting), instead of answering `409`.
//! - [Threat model](guide::threat_model): who can see or change what.
//! - [The client](guide::client), and keys for downstream calls.
//! - [Operating it](guide::operations): metrics, spans, alerts.
//! - [Performance](guide::performance): throughput side by side, and how costs grow.
//! - [Where things live](guide::internals): a map of the source.

#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]
#![deny(missing_docs, missing_debug_implementations)]

#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client;
#[cfg(feature = "conformance")]
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
pub mod conformance;
mod fingerprint;
pub mod guide;
mod key;
mod request_path;
mod server;
pub mod store;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod transaction;

/// The Redis driver the store is built on, so applications use a matching version.
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use ::redis;
/// The attribute that [`Store`] implementations are written with:
/// `#[tower_idempotency::async_trait]` on the `impl Store for …` block, so that a store
/// needs no `async-trait` dependency of its own (see [`Store`] for an example).
pub use async_trait::async_trait;
/// The PostgreSQL pool the store is built on, so applications use a matching version.
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use deadpool_postgres;
pub use fingerprint::Fingerprint;
pub use key::{IdempotencyKey, InvalidKey, MAX_KEY_LEN};
pub use server::{
    BodyFingerprint, DefaultPrincipal, DerivedKeys, ExtractPrincipal, HandOnBody, Idempotency,
    IdempotencyLayer, InFlight, Principal, ProblemDetails, Rejection, RejectionKind,
    RenderRejection, RequestBody, ResponseBody, ResponseFuture, ResponseHead, Scope, SpanField,
    Unscoped, LONGEST_DURATION, MAX_SCOPE_PART_LEN, PROBLEM_JSON, REPLAYED_HEADER,
};
/// The sqlx version the transactional mode's `SqlxTransaction` is built on.
#[cfg(feature = "sqlx")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlx")))]
pub use sqlx;
pub use store::record::{ClaimToken, DecodeError, Record, StoredResponse};
#[cfg(feature = "memory")]
#[cfg_attr(docsrs, doc(cfg(feature = "memory")))]
pub use store::MemoryStore;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use store::PostgresStore;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use store::RedisStore;
pub use store::Store;
