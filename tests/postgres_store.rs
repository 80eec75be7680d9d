//! What only the PostgreSQL store does: its table, expiry purge, audit trail, and outages.

mod support;

use std::{sync::Arc, time::Duration};

use axum::{body::Body, http::StatusCode, routing::post, Router};
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::{
    store::{Claim, Fenced, PostgresStoreError},
    Fingerprint, IdempotencyKey, IdempotencyLayer, PostgresStore, Scope, Store, StoredResponse,
};

fn scope(key: &str, principal: Option<&str>) -> Scope {
    let key = IdempotencyKey::parse(&HeaderValue::from_str(key).unwrap()).unwrap();
    Scope::new(
        principal.map(str::to_owned),
        "POST /v1/payments".to_owned(),
        key,
    )
}

const FINGERPRINT: Fingerprint = Fingerprint::from_bytes([3; 32]);

fn response(body: &'static [u8]) -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.append("set-cookie", HeaderValue::from_static("a=1"));
    headers.append("x-opaque", HeaderValue::from_bytes(b"\x80\xff").unwrap());
    headers.append("set-cookie", HeaderValue::from_static("b=2"));
    StoredResponse {
        status: StatusCode::PAYMENT_REQUIRED,
        headers,
        body: Bytes::from_static(body),
        trailers: None,
    }
}

async fn complete(store: &PostgresStore, scope: &Scope, ttl: Duration) -> StoredResponse {
    let stored = response(b"\x00\x01\xfe\xff not utf-8 \xc3");
    complete_for(store, scope, &stored, ttl).await;
    stored
}

/// Claims `scope` and completes it with `response`, kept for `ttl`.
async fn complete_for(store: &dyn Store, scope: &Scope, response: &StoredResponse, ttl: Duration) {
    let Claim::Claimed(token) = store
        .claim(scope, FINGERPRINT, Duration::from_secs(30))
        .await
        .unwrap()
    else {
        panic!("expected a free key")
    };
    let completed = store.complete(scope, token, FINGERPRINT, response, ttl);
    assert_eq!(completed.await.unwrap(), Fenced::Applied);
}

/// Claims `scope` with `lease` and returns whether the key was free.
async fn claims(store: &PostgresStore, scope: &Scope, lease: Duration) -> bool {
    let claim = store.claim(scope, FINGERPRINT, lease).await.unwrap();
    matches!(claim, Claim::Claimed(_))
}

/// Claims `abandoned` for 100 ms and waits until it (and anything as short) has expired.
async fn abandon_a_claim_and_let_it_expire(store: &PostgresStore) {
    let lease = Duration::from_millis(100);
    assert!(claims(store, &scope("abandoned", None), lease).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
}

async fn row_count(store: &PostgresStore) -> i64 {
    let client = support::store_client(&support::database_url()).await;
    let sql = format!("SELECT count(*) FROM {}", store.table_name());
    client.query_one(&sql, &[]).await.unwrap().get(0)
}

#[tokio::test]
async fn migrate_is_idempotent_and_names_are_validated() {
    let store = support::postgres_store().await;
    store.migrate().await.unwrap();
    store.migrate().await.unwrap();
    assert!(store.migration_sql().contains(&format!(
        "CREATE TABLE IF NOT EXISTS {}",
        store.table_name()
    )));
    assert!(store
        .migration_sql()
        .contains("UNIQUE (idempotency_key, endpoint, principal)"));
    for (schema, table) in [
        ("public", "keys; DROP TABLE x"),
        ("Public", "keys"),
        ("public", ""),
    ] {
        let store = PostgresStore::connect(&support::database_url())
            .await
            .unwrap();
        assert!(matches!(
            store.table(schema, table),
            Err(PostgresStoreError::InvalidIdentifier(_))
        ));
    }
}

#[tokio::test]
async fn rows_hold_the_scope_and_the_response_byte_exact() {
    let store = support::postgres_store().await;
    let scope = scope("k-1", Some("alice"));
    let stored = complete(&store, &scope, Duration::from_secs(3600)).await;

    let client = support::store_client(&support::database_url()).await;
    let sql = format!(
        "SELECT idempotency_key, endpoint, principal, status, status_code, response_body, request_hash,
                expires_at > now() + interval '59 minutes' AND expires_at <= now() + interval '1 hour'
         FROM {}",
        store.table_name()
    );
    let rows = client.query(&sql, &[]).await.unwrap();
    assert_eq!(rows.len(), 1);
    let row = &rows[0];
    assert_eq!(row.get::<_, &str>(0), "k-1");
    assert_eq!(row.get::<_, &str>(1), "POST /v1/payments");
    assert_eq!(row.get::<_, &str>(2), "alice");
    assert_eq!(row.get::<_, &str>(3), "completed");
    assert_eq!(row.get::<_, i16>(4), 402);
    assert_eq!(row.get::<_, &[u8]>(5), &stored.body[..]);
    assert_eq!(row.get::<_, &[u8]>(6), FINGERPRINT.as_bytes());
    assert!(row.get::<_, bool>(7), "expires_at is the TTL from now");

    match store
        .claim(&scope, FINGERPRINT, Duration::from_secs(30))
        .await
        .unwrap()
    {
        Claim::Completed {
            response,
            fingerprint,
            expires_in,
        } => {
            assert_eq!(response, stored);
            assert_eq!(fingerprint, FINGERPRINT);
            // What is left of the row's hour, by the database's clock.
            let left = expires_in.expect("the row's expiry");
            assert!(
                Duration::from_secs(59 * 60) < left && left <= Duration::from_secs(3600),
                "expires in {left:?}"
            );
        }
        other => panic!("expected the completed record, got {other:?}"),
    }
    // The anonymous principal is a row of its own.
    assert!(claims(&store, &self::scope("k-1", None), Duration::from_secs(30)).await);
}

#[tokio::test]
async fn expired_rows_are_never_replayed_and_are_purged() {
    let store = support::postgres_store().await;
    complete(&store, &scope("old", None), Duration::from_millis(100)).await;
    complete(&store, &scope("live", None), Duration::from_secs(3600)).await;
    abandon_a_claim_and_let_it_expire(&store).await;

    assert_eq!(store.purge_expired().await.unwrap(), 2);
    assert_eq!(row_count(&store).await, 1);
    assert!(claims(&store, &scope("old", None), Duration::from_secs(30)).await);
}

#[tokio::test]
async fn keep_completed_leaves_an_audit_trail_that_is_never_replayed() {
    let store = support::postgres_store().await.keep_completed();
    complete(&store, &scope("audited", None), Duration::from_millis(100)).await;
    abandon_a_claim_and_let_it_expire(&store).await;

    assert_eq!(
        store.purge_expired().await.unwrap(),
        1,
        "only the abandoned claim goes"
    );
    let client = support::store_client(&support::database_url()).await;
    let sql = format!("SELECT idempotency_key, status FROM {}", store.table_name());
    let rows = client.query(&sql, &[]).await.unwrap();
    let kept: Vec<(&str, &str)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(kept, [("audited", "completed")]);
    // Expired, so the key is free again rather than replayed.
    assert!(claims(&store, &scope("audited", None), Duration::from_secs(30)).await);
}

#[tokio::test]
async fn background_purge_runs_periodically() {
    let store = support::postgres_store().await;
    let purge = store.spawn_purge(Duration::from_millis(100));
    complete(&store, &scope("a", None), Duration::from_millis(50)).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while row_count(&store).await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the purge task never removed the row"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    purge.abort();
}

#[tokio::test]
async fn unreachable_database_fails_closed() {
    // A port nothing listens on: every connection attempt is refused.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let store = PostgresStore::connect(&format!("postgres://postgres@127.0.0.1:{port}/postgres"))
        .await
        .unwrap();
    assert!(store
        .claim(&scope("k", None), FINGERPRINT, Duration::from_secs(1))
        .await
        .is_err());

    let executed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let handler = {
        let executed = executed.clone();
        move || async move {
            executed.store(true, std::sync::atomic::Ordering::SeqCst);
            StatusCode::CREATED
        }
    };
    let app = Router::new()
        .route("/v1/payments", post(handler))
        .layer(IdempotencyLayer::new(store));
    let request = Request::post("/v1/payments")
        .header("idempotency-key", "k")
        .body(Body::empty())
        .unwrap();
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(response.headers().contains_key("retry-after"));
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body, r#"{"error":"idempotency_store_unavailable"}"#);
    assert!(!executed.load(std::sync::atomic::Ordering::SeqCst));
}

#[tokio::test]
async fn readme_shows_the_migration_sql() {
    let store = PostgresStore::connect(&support::database_url())
        .await
        .unwrap();
    let readme = include_str!("../README.md");
    assert!(
        readme.contains(store.migration_sql().trim()),
        "README's SQL differs from migration_sql()"
    );
}

/// A `201 Created` of payment `id`, as the payments example answers it.
fn created(id: &str) -> StoredResponse {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    let location = format!("/v1/payments/{id}");
    headers.insert("location", HeaderValue::from_str(&location).unwrap());
    StoredResponse {
        status: StatusCode::CREATED,
        headers,
        body: Bytes::from(format!(r#"{{"id":"{id}","amount":1000}}"#)),
        trailers: None,
    }
}

/// Claims and completes `scope` with `response`, kept for an hour.
async fn complete_with(store: &dyn Store, scope: &Scope, response: &StoredResponse) {
    complete_for(store, scope, response, Duration::from_secs(3600)).await;
}

/// Expires `n` completed rows named `prefix-<i>` at once, by hand.
async fn expired_rows(store: &PostgresStore, prefix: &str, n: usize) {
    for i in 0..n {
        complete_with(
            store,
            &scope(&format!("{prefix}-{i}"), None),
            &created("pay"),
        )
        .await;
    }
    let client = support::store_client(&support::database_url()).await;
    let sql = format!(
        "UPDATE {} SET expires_at = now() - interval '1 second' WHERE idempotency_key LIKE $1",
        store.table_name()
    );
    client
        .execute(&sql, &[&format!("{prefix}-%")])
        .await
        .unwrap();
}

#[tokio::test]
async fn purge_deletes_in_bounded_batches_and_skips_locked_rows() {
    let store = support::postgres_store().await.purge_batch(2);
    expired_rows(&store, "expired", 5).await;
    complete_with(&store, &scope("live", None), &created("pay_live")).await;

    // Each DELETE statement logs its transaction and how many rows it deleted.
    let table = store.table_name();
    let log = format!("{table}_purge_log");
    let function = format!("{table}_log_purge");
    let client = support::store_client(&support::database_url()).await;
    client
        .batch_execute(&format!(
            "CREATE TABLE {log} (xid BIGINT, deleted BIGINT);
             CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 INSERT INTO {log} SELECT txid_current(), count(*) FROM gone;
                 RETURN NULL;
             END $$;
             CREATE TRIGGER log_purge AFTER DELETE ON {table}
                 REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION {function}();"
        ))
        .await
        .unwrap();

    assert_eq!(store.purge_expired().await.unwrap(), 5);
    let rows = client
        .query(&format!("SELECT xid, deleted FROM {log}"), &[])
        .await
        .unwrap();
    let mut batches: Vec<i64> = rows.iter().map(|r| r.get(1)).collect();
    batches.sort_unstable();
    assert_eq!(batches, [1, 2, 2], "batches of at most 2 rows");
    let transactions: std::collections::HashSet<i64> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(transactions.len(), 3, "each batch its own transaction");
    assert_eq!(row_count(&store).await, 1);

    // A row another transaction holds locked (a claim taking it) is skipped, not waited for.
    expired_rows(&store, "locked", 3).await;
    let mut holder = support::store_client(&support::database_url()).await;
    let transaction = holder.transaction().await.unwrap();
    let sql = format!("SELECT 1 FROM {table} WHERE idempotency_key = 'locked-0' FOR UPDATE");
    transaction.execute(&sql, &[]).await.unwrap();
    let purged = tokio::time::timeout(Duration::from_secs(30), store.purge_expired()).await;
    assert_eq!(purged.expect("the purge waited for a lock").unwrap(), 2);
    transaction.rollback().await.unwrap();
    assert_eq!(store.purge_expired().await.unwrap(), 1);
    assert_eq!(row_count(&store).await, 1);
    client
        .batch_execute(&format!(
            "DROP TRIGGER log_purge ON {table}; DROP FUNCTION {function}(); DROP TABLE {log};"
        ))
        .await
        .unwrap();
}
