//! The server half: [`IdempotencyLayer`] and the [`Idempotency`] service it makes.
//!
//! One request, start to end, and the one file for each step:
//!
//! | step | file |
//! |---|---|
//! | the layer and its settings | `layer.rs` (builder), `config.rs` (settings), `state.rs` (the live state its clones share; store, settings and state, shared by its services) |
//! | requests let through or refused before their body is read | `service.rs` (its future: `future.rs`) |
//! | the story of one keyed request | `execute.rs` |
//! | reading the request body, and the body handed to the inner service | `request_body.rs` |
//! | scoping a key: principal, endpoint, key | `scope.rs` (with `principal.rs`, who the caller is) |
//! | what of the body the fingerprint covers | `body_fingerprint.rs` (with `canonical_json.rs`, `json_pointer.rs`) |
//! | keys read from the body (webhooks) | `body_key.rs` |
//! | a claimed key: lease renewal, write retries, drop safety | `lease.rs` |
//! | recording a response | `capture.rs` |
//! | which outcomes release the key instead | `release.rs` |
//! | duplicates waiting for their original | `wait.rs` |
//! | replaying a record | `replay.rs` |
//! | the response body the layer returns | `body.rs` |
//! | keys for the handler's downstream calls | `derived_key.rs` |
//! | the layer's own answers and how they are rendered | `rejection/` |
//! | gRPC requests | `grpc.rs` |
//! | metrics and spans | `telemetry.rs` |
//! | graceful shutdown | `in_flight.rs` |
//!
//! The record's byte layout is the stores' (`store/record.rs`); a new store implements
//! [`Store`](crate::Store) (`store/mod.rs`) and runs the conformance suite.

mod body;
mod body_fingerprint;
mod body_key;
mod canonical_json;
mod capture;
mod config;
mod derived_key;
mod execute;
mod future;
mod grpc;
mod in_flight;
mod json_pointer;
mod layer;
mod lease;
mod principal;
mod rejection;
mod release;
mod replay;
mod request_body;
mod scope;
mod service;
mod state;
mod telemetry;
mod wait;

pub use body::ResponseBody;
pub use body_fingerprint::BodyFingerprint;
pub use derived_key::DerivedKeys;
pub use future::ResponseFuture;
pub use in_flight::InFlight;
pub use layer::{IdempotencyLayer, LONGEST_DURATION};
pub use principal::{DefaultPrincipal, ExtractPrincipal, Principal, Unscoped};
pub use rejection::{
    problem::{ProblemDetails, PROBLEM_JSON},
    Rejection, RejectionKind, RenderRejection,
};
pub use release::ResponseHead;
pub use replay::REPLAYED_HEADER;
pub use request_body::{HandOnBody, RequestBody};
pub use scope::{Scope, MAX_SCOPE_PART_LEN};
pub use service::Idempotency;
#[cfg(feature = "client")]
pub(crate) use telemetry::short_digest;
pub use telemetry::SpanField;
