//! The transactional PostgreSQL mode, on both drivers.

#[macro_use]
mod support;

use support::Driver;

/// The conformance cases that apply to a transactional store, one test per case and driver:
/// all but the three whose holder's lease runs out (`in_progress_record_lives_for_its_lease`,
/// `writes_after_the_lease_are_lost`, `expired_holder_is_fenced_out`). A transaction holds
/// its key while it is open, whatever its lease; a dead holder's connection rolls it back
/// (below).
macro_rules! conformance {
    ($($case:ident),* $(,)?) => {
        mod postgres_conformance {
            $(#[tokio::test]
            async fn $case() {
                let store = super::Driver::TokioPostgres.transactional().await;
                tower_idempotency::conformance::$case(&store).await;
            })*
        }
        mod sqlx_conformance {
            $(#[tokio::test]
            async fn $case() {
                let store = super::Driver::Sqlx.transactional().await;
                tower_idempotency::conformance::$case(&store).await;
            })*
        }
    };
}

conformance!(
    claim_claims_a_free_key,
    second_claim_sees_in_progress,
    completed_response_is_returned_byte_exact,
    complete_resent_by_holder_is_applied,
    release_frees_the_key,
    extend_renews_the_lease,
    strangers_are_fenced_out,
    completed_record_is_final,
    completed_record_lives_for_its_ttl,
    completion_resent_after_expiry_is_lost,
    claim_resent_by_holder_keeps_the_claim,
    scopes_never_interfere,
    concurrent_claims_have_one_winner,
    watches_wake_on_completion_and_release,
);
