//! The manual: one page per topic, documentation only (these modules hold no items).
//!
//! Setting up and choosing:
//!
//! - [Stores](stores): which store for what, and a store of your own proven against the
//!   contract.
//! - [The transactional mode](transactional): the handler's writes commit with the record,
//!   or roll back with the claim.
//! - [PostgreSQL](postgres): the table, its migration, and the reconciliation query.
//! - [Deployment](deployment): Redis on one server, behind Sentinel or as a Cluster, the
//!   durability option, and what each topology guarantees against executing twice.
//! - [Composition](composition): the layer around hyper and tonic services, and where it
//!   goes among authentication, compression, CORS, tracing, timeouts and limits.
//! - [Configuration](configuration): every setter of the layer, and its default.
//!
//! What it does:
//!
//! - [What a client sees, and error profiles](error_profiles): the layer's own answers, and
//!   rendering them as your API renders its errors (the IETF profile, your own).
//! - [Details that matter in production](production): keys, scope, fingerprint, outcomes,
//!   leases, fencing, and what survives a store that fails.
//! - [Fingerprints and webhooks](fingerprints): canonical JSON, ignored fields, and keys
//!   read from the body, for clients that do not resend identical bytes.
//! - [Waiting for the original](waiting): duplicates that wait for the outcome instead of
//!   answering `409`.
//! - [Threat model](threat_model): who can see or change what, on each store.
//! - [The client](client): the other half, for callers, and keys for downstream calls.
//!
//! Running it:
//!
//! - [Operating it](operations): metrics, spans, log levels, and what to alert on.
//! - [Performance](performance): throughput side by side, what limits it, how costs grow.
//! - [Where things live](internals): a map of the source, for changing the crate.
//!
//! Every Rust snippet on these pages is compiled as a doctest; those that need a feature
//! beyond the defaults compile to nothing without it.

/// A guide page: an empty module whose documentation is the markdown file beside this one.
/// Each link to an item behind a feature goes to the item when the feature is on, and to
/// its page on docs.rs (built with every feature) when it is off.
macro_rules! page {
    (
        $(#[$attribute:meta])*
        pub mod $name:ident = $file:literal;
        $($feature:literal $label:literal => $path:literal | $docs_rs:literal;)*
    ) => {
        $(#[$attribute])*
        #[doc = include_str!($file)]
        #[doc = ""]
        $(
            #[cfg_attr(feature = $feature, doc = concat!("[", $label, "]: ", $path))]
            #[cfg_attr(
                not(feature = $feature),
                doc = concat!(
                    "[", $label, "]: https://docs.rs/tower-idempotency/latest/tower_idempotency/",
                    $docs_rs
                )
            )]
        )*
        pub mod $name {}
    };
}

page! {
    pub mod stores = "stores.md";
    "postgres" "`PostgresStore`" => "crate::PostgresStore" | "store/struct.PostgresStore.html";
    "conformance" "`store_conformance_tests!`" => "crate::store_conformance_tests"
        | "macro.store_conformance_tests.html";
}

page! {
    pub mod transactional = "transactional.md";
    "postgres" "`PostgresStore`" => "crate::PostgresStore" | "store/struct.PostgresStore.html";
    "postgres" "`transactional()`" => "crate::PostgresStore::transactional"
        | "store/struct.PostgresStore.html#method.transactional";
    "postgres" "`PostgresTransaction`" => "crate::transaction::PostgresTransaction"
        | "transaction/type.PostgresTransaction.html";
    "postgres" "`InTransaction<…>`" => "crate::transaction::InTransaction"
        | "transaction/struct.InTransaction.html";
    "postgres" "`lock()`" => "crate::transaction::InTransaction::lock"
        | "transaction/struct.InTransaction.html#method.lock";
    "postgres" "`max_connections(n)`" => "crate::PostgresStore::max_connections"
        | "store/struct.PostgresStore.html#method.max_connections";
    "sqlx" "`transactional_sqlx(pool)`" => "crate::PostgresStore::transactional_sqlx"
        | "store/struct.PostgresStore.html#method.transactional_sqlx";
    "sqlx" "`SqlxTransaction`" => "crate::transaction::SqlxTransaction"
        | "transaction/type.SqlxTransaction.html";
}

page! {
    pub mod postgres = "postgres.md";
    "postgres" "`PostgresStore::migrate()`" => "crate::PostgresStore::migrate"
        | "store/struct.PostgresStore.html#method.migrate";
    "postgres" "`migration_sql()`" => "crate::PostgresStore::migration_sql"
        | "store/struct.PostgresStore.html#method.migration_sql";
    "postgres" "`table(schema, name)`" => "crate::PostgresStore::table"
        | "store/struct.PostgresStore.html#method.table";
    "postgres" "`PostgresStoreError::MigrationBlocked`"
        => "crate::store::PostgresStoreError::MigrationBlocked"
        | "store/enum.PostgresStoreError.html#variant.MigrationBlocked";
    "postgres" "`purge_expired()`" => "crate::PostgresStore::purge_expired"
        | "store/struct.PostgresStore.html#method.purge_expired";
    "postgres" "`spawn_purge(interval)`" => "crate::PostgresStore::spawn_purge"
        | "store/struct.PostgresStore.html#method.spawn_purge";
    "postgres" "`purge_batch(rows)`" => "crate::PostgresStore::purge_batch"
        | "store/struct.PostgresStore.html#method.purge_batch";
    "postgres" "`keep_completed()`" => "crate::PostgresStore::keep_completed"
        | "store/struct.PostgresStore.html#method.keep_completed";
    "postgres" "resource_id" => "crate::PostgresStore::resource_id"
        | "store/struct.PostgresStore.html#method.resource_id";
    "postgres" "`count_replays()`" => "crate::PostgresStore::count_replays"
        | "store/struct.PostgresStore.html#method.count_replays";
    "postgres" "`PostgresStoreError::LeaseSpent`"
        => "crate::store::PostgresStoreError::LeaseSpent"
        | "store/enum.PostgresStoreError.html#variant.LeaseSpent";
    "postgres" "`timeout(duration)`" => "crate::PostgresStore::timeout"
        | "store/struct.PostgresStore.html#method.timeout";
}

page! {
    pub mod deployment = "deployment.md";
}

page! {
    pub mod composition = "composition.md";
}

page! {
    pub mod configuration = "configuration.md";
}

page! {
    pub mod error_profiles = "error_profiles.md";
}

page! {
    pub mod production = "production.md";
    "postgres" "`PostgresStore`" => "crate::PostgresStore" | "store/struct.PostgresStore.html";
    "postgres" "`PostgresStore::timeout`" => "crate::PostgresStore::timeout"
        | "store/struct.PostgresStore.html#method.timeout";
    "postgres" "`PostgresStore::connect`" => "crate::PostgresStore::connect"
        | "store/struct.PostgresStore.html#method.connect";
}

page! {
    pub mod fingerprints = "fingerprints.md";
}

page! {
    pub mod waiting = "waiting.md";
    "postgres" "`PostgresStore::announce_outcomes()`" => "crate::PostgresStore::announce_outcomes"
        | "store/struct.PostgresStore.html#method.announce_outcomes";
}

page! {
    pub mod threat_model = "threat_model.md";
}

page! {
    pub mod client = "client.md";
    "reqwest" "IdempotentMiddleware" => "crate::client::IdempotentMiddleware"
        | "client/struct.IdempotentMiddleware.html";
}

page! {
    pub mod operations = "operations.md";
}

page! {
    pub mod performance = "performance.md";
}

page! {
    pub mod internals = "internals.md";
}
