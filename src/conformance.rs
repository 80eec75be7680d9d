//! The [`Store`] contract as test cases, so that a store written outside this crate (on
//! DynamoDB, etcd, …) proves itself against the same cases as the built-in stores.
//!
//! Each case is an async function that runs one promise of the contract against a store,
//! and panics, naming the case, the step and what the store answered, when the store breaks
//! it. A case works on scopes of its own, drawn at random: one store (and one backend,
//! shared with other tests and runs) serves every case, and cases run concurrently.
//!
//! Some cases wait out short leases and TTLs (a few hundred milliseconds) on Tokio's timer:
//! run them on a Tokio runtime. No case measures how fast the store is: a case that needs a
//! record to still be live checks it only when it could tell.
//!
//! [`store_conformance_tests!`](crate::store_conformance_tests) makes one test per case, so
//! that each passes or fails on its own in the test report; [`run_all`] runs every case.
//!
//! # Example
//!
//! In `tests/store_conformance.rs` (with `tokio`, features `macros` and `rt`, among the
//! crate's dev-dependencies):
//!
//! ```
//! use tower_idempotency::MemoryStore;
//!
//! // One test per case, `memory_store::claim_claims_a_free_key` and so on, each on a store
//! // the expression builds.
//! tower_idempotency::store_conformance_tests!(memory_store, async { MemoryStore::new() });
//! # fn main() {}
//! ```

use std::{
    fmt::Display,
    future::Future,
    pin::Pin,
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

use crate::{
    store::{Claim, Fenced},
    ClaimToken, Fingerprint, IdempotencyKey, Scope, Store, StoredResponse,
};

/// A lease or TTL that no case outlives.
const LONG: Duration = Duration::from_secs(60);
/// A lease or TTL that a case waits out.
const SHORT: Duration = Duration::from_millis(300);
/// How long past a short lease or TTL a case waits before counting it run out, and how far
/// before its end a case stops counting it live: room for the store's clock granularity.
const MARGIN: Duration = Duration::from_millis(150);
/// How far below the time really left a store may round the lease or TTL it reports.
const ROUNDING: Duration = Duration::from_secs(1);
/// How many requests race for one key.
const RACERS: u8 = 16;

/// The fingerprint of the request that claims a key first.
const HOLDER: Fingerprint = Fingerprint::from_bytes([1; 32]);
/// The fingerprint of a request that claims the key once the holder lost it.
const OTHER: Fingerprint = Fingerprint::from_bytes([2; 32]);
/// The fingerprint of a request that only looks: it finds the key taken.
const BYSTANDER: Fingerprint = Fingerprint::from_bytes([3; 32]);

/// Expands into the list of cases for `$mode`: `tests ({attributes} $store)` one
/// `#[tokio::test]` per case, each with the attributes in braces, `futures ($store)` a `Vec`
/// of each case's future. Not public API: the one list of cases behind
/// [`store_conformance_tests!`] and [`conformance::run_all`].
///
/// [`conformance::run_all`]: crate::conformance::run_all
#[doc(hidden)]
#[macro_export]
macro_rules! __store_conformance_cases {
    // The attributes travel as one token tree: a list repeated once per case cannot be
    // spelled out inside the repetition over the cases.
    (@each tests ($attributes:tt $store:expr) [$($case:ident)*]) => {
        $(
            $crate::__store_conformance_cases!(@test $attributes $case ($store));
        )*
    };
    (@test {$(#[$attribute:meta])*} $case:ident ($store:expr)) => {
        #[::tokio::test]
        $(#[$attribute])*
        async fn $case() {
            let store = ($store).await;
            $crate::conformance::$case(&store).await;
        }
    };
    (@each futures ($store:expr) [$($case:ident)*]) => {
        ::std::vec![$(
            ::std::boxed::Box::pin($crate::conformance::$case($store))
                as $crate::conformance::CaseFuture<'_>
        ),*]
    };
    ($mode:ident $args:tt) => {
        $crate::__store_conformance_cases! {
            @each $mode $args [
                claim_claims_a_free_key
                second_claim_sees_in_progress
                completed_response_is_returned_byte_exact
                complete_resent_by_holder_is_applied
                different_completion_by_holder_leaves_the_first
                release_frees_the_key
                extend_renews_the_lease
                in_progress_record_lives_for_its_lease
                writes_after_the_lease_are_lost
                expired_holder_is_fenced_out
                strangers_are_fenced_out
                completed_record_is_final
                completed_record_lives_for_its_ttl
                completion_resent_after_expiry_is_lost
                claim_resent_by_holder_keeps_the_claim
                scopes_never_interfere
                concurrent_claims_have_one_winner
                watches_wake_on_completion_and_release
            ]
        }
    };
}

/// Expands, in a module named by the first argument, into one `#[tokio::test]` per case of
/// [`conformance`](crate::conformance), each running its case on a store built by the
/// second argument: an expression whose value is a future of the store (an `async` block,
/// or a call of an `async fn`), evaluated once per test. The store may be any [`Store`],
/// an `Arc<dyn Store>` included. The module imports everything of the module around it.
///
/// The tests are Tokio tests: the crate that uses the macro needs `tokio` with the features
/// `macros` and `rt` among its dev-dependencies.
///
/// Attributes written before the module's name go on every test. `#[ignore = "…"]` keeps
/// the cases of a store that needs a server out of a plain `cargo test`, which then passes
/// where that server is missing and reports them as ignored, with the reason given;
/// `cargo test -- --include-ignored` runs them where the server is.
///
/// # Example
///
/// ```
/// use std::sync::Arc;
///
/// use tower_idempotency::{store::CachedStore, MemoryStore, Store};
///
/// tower_idempotency::store_conformance_tests!(memory, async { MemoryStore::new() });
///
/// async fn cached() -> Arc<dyn Store> {
///     Arc::new(CachedStore::new(MemoryStore::new(), 1_000))
/// }
/// tower_idempotency::store_conformance_tests!(cached_memory, cached());
/// # fn main() {}
/// ```
///
/// A store on a server, its tests ignored unless asked for:
///
/// ```
/// use tower_idempotency::MemoryStore;
///
/// // Stands in for a store that connects to its server.
/// async fn connect() -> MemoryStore {
///     MemoryStore::new()
/// }
///
/// tower_idempotency::store_conformance_tests!(
///     #[ignore = "needs the store's server: cargo test -- --include-ignored"]
///     on_the_server,
///     connect()
/// );
/// # fn main() {}
/// ```
#[macro_export]
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
macro_rules! store_conformance_tests {
    ($(#[$attribute:meta])* $module:ident, $store:expr $(,)?) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;

            $crate::__store_conformance_cases!(tests({$(#[$attribute])*} $store));
        }
    };
}

/// The future of one case, as [`run_all`] holds it.
#[doc(hidden)]
pub type CaseFuture<'a> = Pin<Box<dyn Future<Output = ()> + 'a>>;

/// Runs every case against `store`, concurrently; panics as the first case that fails.
pub async fn run_all(store: &dyn Store) {
    let cases: Vec<CaseFuture<'_>> = crate::__store_conformance_cases!(futures(store));
    futures_util::future::join_all(cases).await;
}

/// A claim of a free key answers [`Claim::Claimed`] with the caller's token, which then
/// holds the key; so does [`Store::claim`], with a token of its own.
pub async fn claim_claims_a_free_key(store: &dyn Store) {
    let case = Case::new("claim_claims_a_free_key", store);
    let scope = case.scope("with-token");
    let since = Instant::now();
    let holder = case
        .claimed("claim_with_token of a free key", &scope, HOLDER, LONG)
        .await;
    holder
        .seen_in_progress("a claim after it", LONG, since)
        .await;
    holder
        .extend("the holder's extend", LONG, Fenced::Applied)
        .await;

    let scope = case.scope("fresh-token");
    let step = "Store::claim of a free key";
    let token = match store.claim(&scope, HOLDER, LONG).await {
        Ok(Claim::Claimed(token)) => token,
        Ok(other) => case.fail(
            step,
            format_args!("expected Claimed, got {}", summary(&other)),
        ),
        Err(error) => case.fail(step, format_args!("the claim failed: {error}")),
    };
    let holder = case.writer(&scope, token, HOLDER);
    let step = "the complete by the holder of that claim";
    holder
        .complete(step, &small_response(), LONG, Fenced::Applied)
        .await;
}

/// A claim of a held key answers [`Claim::InProgress`] with the holder's fingerprint (not
/// the caller's) and the time left of the holder's lease, and takes nothing from the
/// holder: not even a claim with the holder's own fingerprint (a retry of the same request)
/// under another token.
pub async fn second_claim_sees_in_progress(store: &dyn Store) {
    let case = Case::new("second_claim_sees_in_progress", store);
    let scope = case.scope("held");
    let since = Instant::now();
    let holder = case.claimed("the first claim", &scope, HOLDER, LONG).await;
    let step = "a claim with another fingerprint";
    holder.seen_in_progress(step, LONG, since).await;
    let step = "a claim with the holder's fingerprint and another token";
    let got = case
        .claim(step, &scope, HOLDER, ClaimToken::unique(), LONG)
        .await;
    case.expect_in_progress(step, got, (HOLDER, HOLDER), LONG, since);
    let step = "the holder's complete after both";
    holder
        .complete(step, &small_response(), LONG, Fenced::Applied)
        .await;
}

/// A completed record is returned exactly as completed, by every later claim: its status,
/// its headers (a repeated header's values in order, values that are not UTF-8), its body
/// byte for byte (not UTF-8, empty, large), its trailers or their absence, and the
/// fingerprint the holder completed it with; with the time left of its TTL, where the store
/// tells it.
pub async fn completed_response_is_returned_byte_exact(store: &dyn Store) {
    let case = Case::new("completed_response_is_returned_byte_exact", store);
    let responses = [
        ("binary", binary_response()),
        ("trailers", trailers_response()),
        ("empty", empty_response()),
        ("large", large_response()),
    ];
    for (label, response) in responses {
        let scope = case.scope(label);
        let holder = case.claimed("the claim", &scope, HOLDER, LONG).await;
        let since = Instant::now();
        let step = format!("the holder's complete of the {label} response");
        holder
            .complete(&step, &response, LONG, Fenced::Applied)
            .await;
        for claim in ["a claim", "a second claim"] {
            let step = format!("{claim} after the {label} response was completed");
            holder.seen_completed(&step, &response, LONG, since).await;
        }
    }
}

/// A completion sent again by its holder (whose first reply was lost) answers
/// [`Fenced::Applied`] again, and the record stays the one completed.
pub async fn complete_resent_by_holder_is_applied(store: &dyn Store) {
    let case = Case::new("complete_resent_by_holder_is_applied", store);
    let scope = case.scope("resent");
    let response = binary_response();
    let holder = case.claimed("the claim", &scope, HOLDER, LONG).await;
    let since = Instant::now();
    let step = "the holder's complete";
    holder
        .complete(step, &response, LONG, Fenced::Applied)
        .await;
    let step = "the same complete sent again by the holder";
    holder
        .complete(step, &response, LONG, Fenced::Applied)
        .await;
    let step = "a claim after both completions";
    holder.seen_completed(step, &response, LONG, since).await;
}

/// A different completion sent by the holder after its first was applied (the first's reply
/// lost, the layer then recording a refusal to replay instead) answers [`Fenced::Lost`]
/// and leaves the first as it was, its TTL included: waiters and replays may have read it
/// already.
pub async fn different_completion_by_holder_leaves_the_first(store: &dyn Store) {
    let case = Case::new("different_completion_by_holder_leaves_the_first", store);
    let scope = case.scope("different");
    let first = binary_response();
    let holder = case.claimed("the claim", &scope, HOLDER, LONG).await;
    let since = Instant::now();
    let step = "the holder's complete";
    holder.complete(step, &first, LONG, Fenced::Applied).await;
    let step = "a different complete by the holder, with another fingerprint and a short TTL";
    let other = Writer {
        fingerprint: OTHER,
        ..holder
    };
    other
        .complete(step, &trailers_response(), SHORT, Fenced::Lost)
        .await;
    let step = "the same response completed again by the holder with another fingerprint";
    other.complete(step, &first, SHORT, Fenced::Lost).await;
    let step = "another response completed again by the holder with its fingerprint";
    holder
        .complete(step, &trailers_response(), SHORT, Fenced::Lost)
        .await;
    let step = "a claim after both completions";
    holder.seen_completed(step, &first, LONG, since).await;
}

/// A release by the holder frees the key: the next claim claims it. The released token is
/// then a stranger's: its release, complete and extend answer [`Fenced::Lost`].
pub async fn release_frees_the_key(store: &dyn Store) {
    let case = Case::new("release_frees_the_key", store);
    let scope = case.scope("released");
    let holder = case.claimed("the first claim", &scope, HOLDER, LONG).await;
    holder
        .release("the holder's release", Fenced::Applied)
        .await;
    holder.writes_lost("the released holder's writes").await;
    let since = Instant::now();
    let next = case
        .claimed("a claim after the release", &scope, OTHER, LONG)
        .await;
    next.seen_in_progress("a claim after that one", LONG, since)
        .await;
}

/// An extend by the holder renews its lease from now: a claim after the first lease ran
/// out, within the new one, still finds the key in progress, and the holder's writes still
/// apply.
pub async fn extend_renews_the_lease(store: &dyn Store) {
    let case = Case::new("extend_renews_the_lease", store);
    // The extend must reach the store within the first, short lease: should the machine
    // stall past it, the case starts again on a new key.
    for attempt in 0..3 {
        let scope = case.scope(&format!("extended-{attempt}"));
        let sent = Instant::now();
        let holder = case.claimed("the claim", &scope, HOLDER, SHORT).await;
        let claimed = Instant::now();
        let step = "the holder's extend within its lease";
        let got = holder.try_extend(step, LONG).await;
        if got == Fenced::Lost && !surely_within(sent, SHORT) {
            continue;
        }
        case.expect(step, got, Fenced::Applied);
        sleep_until(claimed + SHORT + MARGIN).await;
        let step = "a claim after the first lease ran out, within the renewed one";
        holder.seen_in_progress(step, LONG, claimed).await;
        let step = "the holder's complete after its first lease ran out, within the renewed one";
        holder
            .complete(step, &small_response(), LONG, Fenced::Applied)
            .await;
        return;
    }
    case.fail(
        "the holder's extend",
        format_args!("three extends in a row came after the {SHORT:?} lease they were to renew"),
    );
}

/// An in-progress record lives for its lease, no longer: once the lease ran out, with no
/// extend, the next claim claims the key.
pub async fn in_progress_record_lives_for_its_lease(store: &dyn Store) {
    let case = Case::new("in_progress_record_lives_for_its_lease", store);
    let scope = case.scope("lapsing");
    let sent = Instant::now();
    case.claimed("the first claim", &scope, HOLDER, SHORT).await;
    let claimed = Instant::now();
    let step = "a claim within the first claim's lease";
    // Short, in case the machine stalled past the first lease and this claim took the key.
    let got = case
        .claim(step, &scope, BYSTANDER, ClaimToken::unique(), SHORT)
        .await;
    let looked = Instant::now();
    if surely_within(sent, SHORT) {
        case.expect_in_progress(step, got, (HOLDER, BYSTANDER), SHORT, sent);
    }
    sleep_until(looked.max(claimed) + SHORT + MARGIN).await;
    case.claimed("a claim after the lease ran out", &scope, OTHER, LONG)
        .await;
}

/// A holder whose lease ran out, with no one else claiming the key, has lost it: its
/// complete, release and extend answer [`Fenced::Lost`] and write nothing (the next claim
/// claims the key).
pub async fn writes_after_the_lease_are_lost(store: &dyn Store) {
    let case = Case::new("writes_after_the_lease_are_lost", store);
    let writes = ["complete", "release", "extend"];
    let scopes = writes.map(|write| case.scope(write));
    let mut holders = Vec::new();
    for scope in &scopes {
        holders.push(case.claimed("a claim", scope, HOLDER, SHORT).await);
    }
    sleep_until(Instant::now() + SHORT + MARGIN).await;
    let step = "the holder's complete after its lease ran out";
    holders[0]
        .complete(step, &small_response(), LONG, Fenced::Lost)
        .await;
    let step = "the holder's release after its lease ran out";
    holders[1].release(step, Fenced::Lost).await;
    let step = "the holder's extend after its lease ran out";
    holders[2].extend(step, LONG, Fenced::Lost).await;
    for (scope, write) in scopes.iter().zip(writes) {
        let step = format!("a claim after the holder's late {write}");
        case.claimed(&step, scope, OTHER, LONG).await;
    }
}

/// Fencing: once a holder's lease ran out and another request claimed the key, the old
/// holder's complete, release and extend answer [`Fenced::Lost`] and leave the new claim
/// as it was; the new holder's completion stands.
pub async fn expired_holder_is_fenced_out(store: &dyn Store) {
    let case = Case::new("expired_holder_is_fenced_out", store);
    let scope = case.scope("taken-over");
    let old = case.claimed("the first claim", &scope, HOLDER, SHORT).await;
    sleep_until(Instant::now() + SHORT + MARGIN).await;
    let since = Instant::now();
    let new = case
        .claimed("a claim after the first lease ran out", &scope, OTHER, LONG)
        .await;
    old.writes_lost("the old holder's writes").await;
    let step = "a claim after the old holder's writes";
    new.seen_in_progress(step, LONG, since).await;
    let response = binary_response();
    let since = Instant::now();
    let step = "the new holder's complete";
    new.complete(step, &response, LONG, Fenced::Applied).await;
    old.writes_lost("the old holder's writes after the new holder's completion")
        .await;
    let step = "a claim after both holders' writes";
    new.seen_completed(step, &response, LONG, since).await;
}

/// A token that never claimed the key is a stranger's: its complete, release and extend
/// answer [`Fenced::Lost`] and change nothing, whether the key is free, held or completed.
pub async fn strangers_are_fenced_out(store: &dyn Store) {
    let case = Case::new("strangers_are_fenced_out", store);
    let free = case.scope("free");
    case.stranger(&free)
        .writes_lost("a stranger's writes to a free key")
        .await;
    let step = "a claim after a stranger's writes to the free key";
    case.claimed(step, &free, HOLDER, LONG).await;

    let scope = case.scope("held");
    let since = Instant::now();
    let holder = case
        .claimed("the holder's claim", &scope, HOLDER, LONG)
        .await;
    case.stranger(&scope)
        .writes_lost("a stranger's writes to a held key")
        .await;
    let step = "a claim after a stranger's writes to the held key";
    holder.seen_in_progress(step, LONG, since).await;
    let response = binary_response();
    let since = Instant::now();
    let step = "the holder's complete after a stranger's writes";
    holder
        .complete(step, &response, LONG, Fenced::Applied)
        .await;
    case.stranger(&scope)
        .writes_lost("a stranger's writes to a completed key")
        .await;
    let step = "a claim after a stranger's writes to the completed key";
    holder.seen_completed(step, &response, LONG, since).await;
}

/// A completed record is final: its holder's release and extend answer [`Fenced::Lost`]
/// (there is no claim left to release or renew) and change nothing.
pub async fn completed_record_is_final(store: &dyn Store) {
    let case = Case::new("completed_record_is_final", store);
    let scope = case.scope("final");
    let response = trailers_response();
    let holder = case.claimed("the claim", &scope, HOLDER, LONG).await;
    let since = Instant::now();
    let step = "the holder's complete";
    holder
        .complete(step, &response, LONG, Fenced::Applied)
        .await;
    let step = "the holder's release after completing";
    holder.release(step, Fenced::Lost).await;
    let step = "the holder's extend after completing";
    holder.extend(step, LONG, Fenced::Lost).await;
    let step = "a claim after the holder's release and extend";
    holder.seen_completed(step, &response, LONG, since).await;
}

/// A completed record lives for its TTL, no longer: once it ran out, the next claim claims
/// the key.
pub async fn completed_record_lives_for_its_ttl(store: &dyn Store) {
    let case = Case::new("completed_record_lives_for_its_ttl", store);
    let scope = case.scope("expiring");
    let response = binary_response();
    let holder = case.claimed("the claim", &scope, HOLDER, LONG).await;
    let sent = Instant::now();
    let step = "the holder's complete with a short TTL";
    holder
        .complete(step, &response, SHORT, Fenced::Applied)
        .await;
    let completed = Instant::now();
    let step = "a claim within the TTL";
    // Short, in case the machine stalled past the TTL and this claim took the key.
    let got = case
        .claim(step, &scope, BYSTANDER, ClaimToken::unique(), SHORT)
        .await;
    let looked = Instant::now();
    if surely_within(sent, SHORT) {
        case.expect_completed(step, got, HOLDER, &response, SHORT, sent);
    }
    sleep_until(looked.max(completed) + SHORT + MARGIN).await;
    case.claimed("a claim after the TTL ran out", &scope, OTHER, LONG)
        .await;
}

/// A completion sent again by its holder after the completed record's TTL ran out finds no
/// record (an expired record is none): it answers [`Fenced::Lost`] and writes nothing, so
/// the next claim claims the key.
pub async fn completion_resent_after_expiry_is_lost(store: &dyn Store) {
    let case = Case::new("completion_resent_after_expiry_is_lost", store);
    let scope = case.scope("expired");
    let response = binary_response();
    let holder = case.claimed("the claim", &scope, HOLDER, LONG).await;
    let step = "the holder's complete with a short TTL";
    holder
        .complete(step, &response, SHORT, Fenced::Applied)
        .await;
    sleep_until(Instant::now() + SHORT + MARGIN).await;
    let step = "the same complete sent again after the TTL ran out";
    holder.complete(step, &response, SHORT, Fenced::Lost).await;
    case.claimed("a claim after the late completion", &scope, OTHER, LONG)
        .await;
}

/// A claim sent again by its holder, with its token (a retry of a claim whose reply was
/// lost), leaves the claim the holder's: the store may answer [`Claim::Claimed`] with the
/// token or [`Claim::InProgress`] with the holder's fingerprint, and the holder's writes
/// still apply.
pub async fn claim_resent_by_holder_keeps_the_claim(store: &dyn Store) {
    let case = Case::new("claim_resent_by_holder_keeps_the_claim", store);
    let scope = case.scope("resent");
    let since = Instant::now();
    let holder = case.claimed("the claim", &scope, HOLDER, LONG).await;
    let step = "the same claim sent again";
    match case.claim(step, &scope, HOLDER, holder.token, LONG).await {
        Claim::Claimed(got) if got == holder.token => {}
        Claim::InProgress { fingerprint, .. } if fingerprint == HOLDER => {}
        other => case.fail(
            step,
            format_args!(
                "expected Claimed with the holder's token or InProgress with the holder's \
                 fingerprint, got {}",
                summary(&other)
            ),
        ),
    }
    let step = "a claim after the resent one";
    holder.seen_in_progress(step, LONG, since).await;
    let response = small_response();
    let since = Instant::now();
    let step = "the holder's complete after its claim was resent";
    holder
        .complete(step, &response, LONG, Fenced::Applied)
        .await;
    let step = "a claim after the completion";
    holder.seen_completed(step, &response, LONG, since).await;
}

/// Scopes that differ in the principal (the anonymous one included), the endpoint or the
/// key name different records, even where a naive concatenation of the parts would name
/// them alike: claiming, releasing or completing one leaves every other as it was, and a
/// token that holds one scope is a stranger's under the others.
pub async fn scopes_never_interfere(store: &dyn Store) {
    let case = Case::new("scopes_never_interfere", store);
    let run = format!("{:016x}", case.run);
    let (principal, endpoint, key) = (format!("p{run}"), format!("/e{run}"), format!("k{run}"));
    let p = || Some(principal.clone());
    let parts = [
        ("the first scope", p(), endpoint.clone(), key.clone()),
        (
            "another principal",
            Some(format!("q{run}")),
            endpoint.clone(),
            key.clone(),
        ),
        (
            "the anonymous principal",
            None,
            endpoint.clone(),
            key.clone(),
        ),
        ("another endpoint", p(), format!("/f{run}"), key.clone()),
        ("another key", p(), endpoint.clone(), format!("l{run}")),
        // `principal:endpoint:key` names the next two alike, and the two after them.
        (
            "a principal ending with `:<endpoint>:a`, key `b`",
            Some(format!("{principal}:{endpoint}:a")),
            endpoint.clone(),
            "b".to_owned(),
        ),
        (
            "key `a:<endpoint>:b`",
            p(),
            endpoint.clone(),
            format!("a:{endpoint}:b"),
        ),
        (
            "an endpoint ending with `:x`, key `y`",
            p(),
            format!("{endpoint}:x"),
            "y".to_owned(),
        ),
        ("key `x:y`", p(), endpoint.clone(), "x:y".to_owned()),
    ];
    let scopes = parts.map(|(label, principal, endpoint, key)| {
        (label, case.scope_of(principal.as_deref(), &endpoint, &key))
    });

    let since = Instant::now();
    let mut holders = Vec::new();
    for ((label, scope), n) in scopes.iter().zip(16u8..) {
        let step = format!("a claim of {label}, after the scopes before it");
        let fingerprint = Fingerprint::from_bytes([n; 32]);
        holders.push(case.claimed(&step, scope, fingerprint, LONG).await);
    }
    for (i, (label, scope)) in scopes.iter().enumerate() {
        let (other, _) = scopes[(i + 1) % scopes.len()];
        let theirs = holders[(i + 1) % scopes.len()];
        let misplaced = case.writer(scope, theirs.token, theirs.fingerprint);
        misplaced
            .writes_lost(&format!("writes to {label} with the token of {other}"))
            .await;
    }

    let (first, first_scope) = &scopes[0];
    let step = format!("the release of {first}");
    holders[0].release(&step, Fenced::Applied).await;
    for ((label, _), holder) in scopes.iter().zip(&holders).skip(1) {
        let step = format!("a claim of {label} after {first} was released");
        holder.seen_in_progress(&step, LONG, since).await;
    }
    let step = format!("a claim of {first} after its release");
    let fingerprint = holders[0].fingerprint;
    holders[0] = case.claimed(&step, first_scope, fingerprint, LONG).await;

    let since = Instant::now();
    let responses: Vec<StoredResponse> = (0..scopes.len()).map(labelled_response).collect();
    for ((label, _), (holder, response)) in scopes.iter().zip(holders.iter().zip(&responses)) {
        let step = format!("the complete of {label}");
        holder
            .complete(&step, response, LONG, Fenced::Applied)
            .await;
    }
    for ((label, _), (holder, response)) in scopes.iter().zip(holders.iter().zip(&responses)) {
        let step = format!("a claim of {label} after every scope was completed");
        holder.seen_completed(&step, response, LONG, since).await;
    }
}

/// Of many concurrent claims of one key, exactly one answers [`Claim::Claimed`] and every
/// other [`Claim::InProgress`] with the winner's fingerprint: for a free key, and (except
/// for a transactional store, whose claims hold while their transaction is open) for a key
/// whose holder's lease ran out.
pub async fn concurrent_claims_have_one_winner(store: &dyn Store) {
    let case = Case::new("concurrent_claims_have_one_winner", store);
    let scope = case.scope("free");
    let step = format!("{RACERS} concurrent claims of a free key");
    case.race(&step, &scope).await;
    if store.commits_handler_writes() {
        // A transaction holds its key while open, whatever its lease: none lapses.
        return;
    }
    let scope = case.scope("lapsed");
    case.claimed("the first claim", &scope, HOLDER, SHORT).await;
    sleep_until(Instant::now() + SHORT + MARGIN).await;
    let step = format!("{RACERS} concurrent claims of a key whose holder's lease ran out");
    case.race(&step, &scope).await;
}

/// Where the store announces ([`Store::watch`] returns a watch), a watch made on a key
/// wakes when its holder completes it, and a watch on another key when its holder releases
/// it. A store that announces nothing (its waiters poll) passes.
pub async fn watches_wake_on_completion_and_release(store: &dyn Store) {
    let case = Case::new("watches_wake_on_completion_and_release", store);
    for (label, completes) in [("completed", true), ("released", false)] {
        let scope = case.scope(label);
        let watch = store.watch(&scope).await;
        let watch = watch.unwrap_or_else(|error| case.fail("the watch", error));
        let Some(mut watch) = watch else {
            return;
        };
        let holder = case.claimed("the claim", &scope, HOLDER, LONG).await;
        if completes {
            let response = small_response();
            holder
                .complete("the completion", &response, LONG, Fenced::Applied)
                .await;
        } else {
            holder.release("the release", Fenced::Applied).await;
        }
        if tokio::time::timeout(LONG, watch.changed()).await.is_err() {
            case.fail(label, "the watch was not woken");
        }
    }
}

/// One case's run: its name for failures, the store, and what tells its scopes apart from
/// every other case's and run's.
struct Case<'s> {
    name: &'static str,
    store: &'s dyn Store,
    run: u64,
}

impl<'s> Case<'s> {
    fn new(name: &'static str, store: &'s dyn Store) -> Self {
        Self {
            name,
            store,
            run: rand::random(),
        }
    }

    fn fail(&self, step: &str, what: impl Display) -> ! {
        panic!(
            "store conformance case `{}` failed at {step}: {what}",
            self.name
        )
    }

    fn expect(&self, step: &str, got: Fenced, want: Fenced) {
        if got != want {
            self.fail(step, format_args!("expected {want:?}, got {got:?}"));
        }
    }

    /// A scope of this case's own; `label` tells its scopes apart.
    fn scope(&self, label: &str) -> Scope {
        self.scope_of(
            Some(&format!("conformance-{:016x}", self.run)),
            &format!("POST /conformance/{}", self.name),
            &format!("{label}-{:016x}", self.run),
        )
    }

    fn scope_of(&self, principal: Option<&str>, endpoint: &str, key: &str) -> Scope {
        let key = HeaderValue::from_str(key)
            .ok()
            .and_then(|value| IdempotencyKey::parse(&value).ok())
            .unwrap_or_else(|| panic!("conformance case `{}`: invalid key {key:?}", self.name));
        Scope::new(principal.map(str::to_owned), endpoint.to_owned(), key)
    }

    /// The writes of the request that claimed `scope` with `token` and `fingerprint`.
    fn writer<'a>(
        &'a self,
        scope: &'a Scope,
        token: ClaimToken,
        fingerprint: Fingerprint,
    ) -> Writer<'a> {
        Writer {
            case: self,
            scope,
            token,
            fingerprint,
        }
    }

    /// The writes of a request that never claimed `scope`.
    fn stranger<'a>(&'a self, scope: &'a Scope) -> Writer<'a> {
        self.writer(scope, ClaimToken::unique(), OTHER)
    }

    async fn claim(
        &self,
        step: &str,
        scope: &Scope,
        fingerprint: Fingerprint,
        token: ClaimToken,
        lease: Duration,
    ) -> Claim {
        self.store
            .claim_with_token(scope, fingerprint, token, lease)
            .await
            .unwrap_or_else(|error| self.fail(step, format_args!("the claim failed: {error}")))
    }

    /// Claims `scope` with a new token, which the store must answer [`Claim::Claimed`] with.
    async fn claimed<'a>(
        &'a self,
        step: &str,
        scope: &'a Scope,
        fingerprint: Fingerprint,
        lease: Duration,
    ) -> Writer<'a> {
        let token = ClaimToken::unique();
        match self.claim(step, scope, fingerprint, token, lease).await {
            Claim::Claimed(got) if got == token => self.writer(scope, token, fingerprint),
            Claim::Claimed(got) => self.fail(
                step,
                format_args!("Claimed with {got:?}, not the token it was given ({token:?})"),
            ),
            other => self.fail(
                step,
                format_args!("expected Claimed, got {}", summary(&other)),
            ),
        }
    }

    /// Checks that `got`, the answer to a claim by the request with `caller`, is the
    /// in-progress record of the request with `holder`, whose lease of `lease` began no
    /// earlier than `since`.
    fn expect_in_progress(
        &self,
        step: &str,
        got: Claim,
        (holder, caller): (Fingerprint, Fingerprint),
        lease: Duration,
        since: Instant,
    ) {
        match got {
            Claim::InProgress {
                fingerprint,
                lease_remaining,
                ..
            } => {
                if !self.holder_told(fingerprint, holder, caller) {
                    self.fail(
                        step,
                        format_args!(
                            "InProgress with fingerprint {fingerprint:?}, not the holder's \
                             ({holder:?})"
                        ),
                    );
                }
                self.time_left(step, "lease_remaining", lease_remaining, lease, since);
            }
            other => self.fail(
                step,
                format_args!(
                    "expected InProgress with the holder's fingerprint, got {}",
                    summary(&other)
                ),
            ),
        }
    }

    /// Checks that `got` is `response`, completed by the request with `fingerprint` and
    /// kept for `ttl` from no earlier than `since`.
    fn expect_completed(
        &self,
        step: &str,
        got: Claim,
        fingerprint: Fingerprint,
        response: &StoredResponse,
        ttl: Duration,
        since: Instant,
    ) {
        match got {
            Claim::Completed {
                fingerprint: stored_fingerprint,
                response: stored,
                expires_in,
            } => {
                if stored_fingerprint != fingerprint {
                    self.fail(
                        step,
                        format_args!(
                            "Completed with fingerprint {stored_fingerprint:?}, not the one \
                             completed ({fingerprint:?})"
                        ),
                    );
                }
                if stored != *response {
                    self.fail(
                        step,
                        format_args!(
                            "the response differs from the one completed: {}",
                            difference(response, &stored)
                        ),
                    );
                }
                if let Some(left) = expires_in {
                    self.time_left(step, "expires_in", left, ttl, since);
                }
            }
            other => self.fail(
                step,
                format_args!(
                    "expected Completed with the completed response, got {}",
                    summary(&other)
                ),
            ),
        }
    }

    /// Checks the time left of a lease or TTL of `duration` that began no earlier than
    /// `since`: no more than `duration`, no less than what can have elapsed of it allows.
    fn time_left(
        &self,
        step: &str,
        what: &str,
        left: Duration,
        duration: Duration,
        since: Instant,
    ) {
        if left > duration {
            self.fail(
                step,
                format_args!("{what} is {left:?}, more than the {duration:?} given"),
            );
        }
        let elapsed = since.elapsed();
        if left + elapsed + ROUNDING < duration {
            self.fail(
                step,
                format_args!(
                    "{what} is {left:?}, though at most {elapsed:?} of the {duration:?} given \
                     has run"
                ),
            );
        }
    }

    /// Sends [`RACERS`] claims of `scope` at once: exactly one may claim it.
    /// Whether `reported`, the fingerprint a claim by `caller` found holding the key, tells
    /// of `holder`: it is the holder's; or, for a store whose running records cannot be read
    /// ([`Store::commits_handler_writes`]), it is the caller's exactly when the holder's is.
    fn holder_told(&self, reported: Fingerprint, holder: Fingerprint, caller: Fingerprint) -> bool {
        if self.store.commits_handler_writes() {
            (reported == caller) == (holder == caller)
        } else {
            reported == holder
        }
    }

    async fn race(&self, step: &str, scope: &Scope) {
        let claims = (0..RACERS).map(|n| async move {
            let fingerprint = Fingerprint::from_bytes([100 + n; 32]);
            let token = ClaimToken::unique();
            let got = self.claim(step, scope, fingerprint, token, LONG).await;
            (fingerprint, token, got)
        });
        let claims = futures_util::future::join_all(claims).await;
        let winners: Vec<_> = claims
            .iter()
            .filter(|(_, _, got)| matches!(got, Claim::Claimed(_)))
            .collect();
        let [(winner, token, Claim::Claimed(got))] = winners[..] else {
            self.fail(
                step,
                format_args!("{} claims answered Claimed, not exactly one", winners.len()),
            );
        };
        if got != token {
            self.fail(
                step,
                format_args!("Claimed with {got:?}, not the token it was given ({token:?})"),
            );
        }
        for (loser, _, got) in &claims {
            match got {
                Claim::Claimed(_) => {}
                Claim::InProgress { fingerprint, .. }
                    if self.holder_told(*fingerprint, *winner, *loser) => {}
                other => self.fail(
                    step,
                    format_args!(
                        "a losing claim got {}, not InProgress with the winner's fingerprint \
                         ({winner:?})",
                        summary(other)
                    ),
                ),
            }
        }
    }
}

/// What a request that claimed a scope (or a stranger to it) sends after its claim.
#[derive(Clone, Copy)]
struct Writer<'a> {
    case: &'a Case<'a>,
    scope: &'a Scope,
    token: ClaimToken,
    fingerprint: Fingerprint,
}

impl Writer<'_> {
    /// Completes the scope with `response` for `ttl`; the store must answer `want`.
    async fn complete(&self, step: &str, response: &StoredResponse, ttl: Duration, want: Fenced) {
        let got = self
            .case
            .store
            .complete(self.scope, self.token, self.fingerprint, response, ttl)
            .await
            .unwrap_or_else(|error| {
                self.case
                    .fail(step, format_args!("the complete failed: {error}"))
            });
        self.case.expect(step, got, want);
    }

    /// Releases the scope; the store must answer `want`.
    async fn release(&self, step: &str, want: Fenced) {
        let got = self
            .case
            .store
            .release(self.scope, self.token)
            .await
            .unwrap_or_else(|error| {
                self.case
                    .fail(step, format_args!("the release failed: {error}"))
            });
        self.case.expect(step, got, want);
    }

    /// Renews the lease to `lease`; the store must answer `want`.
    async fn extend(&self, step: &str, lease: Duration, want: Fenced) {
        let got = self.try_extend(step, lease).await;
        self.case.expect(step, got, want);
    }

    async fn try_extend(&self, step: &str, lease: Duration) -> Fenced {
        self.case
            .store
            .extend(self.scope, self.token, lease)
            .await
            .unwrap_or_else(|error| {
                self.case
                    .fail(step, format_args!("the extend failed: {error}"))
            })
    }

    /// Sends a complete, a release and an extend, which must all answer [`Fenced::Lost`]:
    /// `what` says whose writes to what they are.
    async fn writes_lost(&self, what: &str) {
        let step = format!("{what}: complete");
        self.complete(&step, &small_response(), LONG, Fenced::Lost)
            .await;
        let step = format!("{what}: release");
        self.release(&step, Fenced::Lost).await;
        let step = format!("{what}: extend");
        self.extend(&step, LONG, Fenced::Lost).await;
    }

    /// Claims the scope as a bystander, which must find this writer's in-progress record,
    /// its lease of `lease` begun no earlier than `since`.
    async fn seen_in_progress(&self, step: &str, lease: Duration, since: Instant) {
        let got = self
            .case
            .claim(step, self.scope, BYSTANDER, ClaimToken::unique(), LONG)
            .await;
        self.case
            .expect_in_progress(step, got, (self.fingerprint, BYSTANDER), lease, since);
    }

    /// Claims the scope as a bystander, which must find `response` completed by this
    /// writer, kept for `ttl` from no earlier than `since`.
    async fn seen_completed(
        &self,
        step: &str,
        response: &StoredResponse,
        ttl: Duration,
        since: Instant,
    ) {
        let got = self
            .case
            .claim(step, self.scope, BYSTANDER, ClaimToken::unique(), LONG)
            .await;
        self.case
            .expect_completed(step, got, self.fingerprint, response, ttl, since);
    }
}

/// Whether a lease or TTL of `duration` that began no earlier than `since` surely still
/// runs: a record it kept must still be live.
fn surely_within(since: Instant, duration: Duration) -> bool {
    since.elapsed() + MARGIN < duration
}

async fn sleep_until(deadline: Instant) {
    tokio::time::sleep_until(deadline.into()).await;
}

/// A claim's answer, without a response's bytes.
fn summary(claim: &Claim) -> String {
    match claim {
        Claim::Claimed(token) => format!("Claimed({token:?})"),
        Claim::InProgress {
            fingerprint,
            lease_remaining,
            ..
        } => format!(
            "InProgress {{ fingerprint: {fingerprint:?}, lease_remaining: {lease_remaining:?} }}"
        ),
        Claim::Completed {
            fingerprint,
            response,
            expires_in,
        } => format!(
            "Completed {{ fingerprint: {fingerprint:?}, status: {}, {} headers, a body of {} \
             bytes, expires_in: {expires_in:?} }}",
            response.status,
            response.headers.len(),
            response.body.len()
        ),
    }
}

/// The first way in which `got` differs from `want`.
fn difference(want: &StoredResponse, got: &StoredResponse) -> String {
    if got.status != want.status {
        return format!("status {} instead of {}", got.status, want.status);
    }
    if got.headers != want.headers {
        return format!("headers {:?} instead of {:?}", got.headers, want.headers);
    }
    if got.body != want.body {
        let at = got
            .body
            .iter()
            .zip(want.body.iter())
            .position(|(a, b)| a != b)
            .unwrap_or(got.body.len().min(want.body.len()));
        return format!(
            "a body of {} bytes instead of {}, first differing at byte {at}",
            got.body.len(),
            want.body.len()
        );
    }
    format!("trailers {:?} instead of {:?}", got.trailers, want.trailers)
}

fn header(name: &str, value: &[u8]) -> (HeaderName, HeaderValue) {
    (
        HeaderName::from_bytes(name.as_bytes()).expect("a valid header name"),
        HeaderValue::from_bytes(value).expect("a valid header value"),
    )
}

fn headers(pairs: &[(&str, &[u8])]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        let (name, value) = header(name, value);
        map.append(name, value);
    }
    map
}

/// A repeated header, header values and a body that are not UTF-8; no trailers.
fn binary_response() -> StoredResponse {
    StoredResponse {
        status: StatusCode::PAYMENT_REQUIRED,
        headers: headers(&[
            ("content-type", b"application/octet-stream"),
            ("set-cookie", b"a=1; Path=/"),
            ("x-opaque", b"\x80\xfe\xff obs-text \xc3\x28"),
            ("set-cookie", b"b=2"),
            ("set-cookie", b"a=1; Path=/"),
        ]),
        body: Bytes::from_static(b"\x00\xff\xfe\xc3\x28 not UTF-8 \x00\x80\r\n"),
        trailers: None,
    }
}

/// A gRPC-style response: a binary body, then trailers, one of them repeated and one not
/// UTF-8.
fn trailers_response() -> StoredResponse {
    StoredResponse {
        status: StatusCode::OK,
        headers: headers(&[("content-type", b"application/grpc")]),
        body: Bytes::from_static(b"\x00\x00\x00\x00\x05\xff\x00\x80\x7f\x01"),
        trailers: Some(Box::new(headers(&[
            ("grpc-status", b"9"),
            ("grpc-message", b"card_declined"),
            ("x-trailer", b"one"),
            ("x-trailer", b"\xff\x80two"),
        ]))),
    }
}

/// Nothing but a status.
fn empty_response() -> StoredResponse {
    StoredResponse {
        status: StatusCode::NO_CONTENT,
        headers: HeaderMap::new(),
        body: Bytes::new(),
        trailers: None,
    }
}

/// Many headers and a body of 256 KiB holding every byte value.
fn large_response() -> StoredResponse {
    let mut headers = HeaderMap::new();
    for n in 0..64 {
        let (name, value) = header(&format!("x-header-{n}"), format!("value {n}").as_bytes());
        headers.append(name, value);
        let (name, value) = header("x-repeated", format!("{n}").as_bytes());
        headers.append(name, value);
    }
    let body: Vec<u8> = (0..256 * 1024u32)
        .map(|n| (n.wrapping_mul(31) ^ (n >> 8)) as u8)
        .collect();
    StoredResponse {
        status: StatusCode::CREATED,
        headers,
        body: Bytes::from(body),
        trailers: None,
    }
}

fn small_response() -> StoredResponse {
    labelled_response(0)
}

/// A small response that `n` tells apart from the others.
fn labelled_response(n: usize) -> StoredResponse {
    StoredResponse {
        status: StatusCode::CREATED,
        headers: headers(&[("x-response", format!("{n}").as_bytes())]),
        body: Bytes::from(format!("response {n}")),
        trailers: None,
    }
}
