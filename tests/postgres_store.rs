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
#[ignore = "needs PostgreSQL: scripts/test.sh"]
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
#[ignore = "needs PostgreSQL: scripts/test.sh"]
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

/// The transaction that last locked or deleted `key`'s row (`xmax`; `0` for none), and the
/// row's version (`ctid`).
async fn row_version(store: &PostgresStore, key: &str) -> (String, String) {
    let client = support::store_client(&support::database_url()).await;
    let sql = format!(
        "SELECT xmax::text, ctid::text FROM {} WHERE idempotency_key = $1",
        store.table_name()
    );
    let row = client.query_one(&sql, &[&key]).await.unwrap();
    (row.get(0), row.get(1))
}

/// A replay or a duplicate only reads: a claim that finds its key held (completed, or in
/// progress within its lease) neither locks nor rewrites the row, so it is no write for
/// the database to flush at commit.
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn claims_that_find_their_key_held_leave_the_row_untouched() {
    let store = support::postgres_store().await;
    let completed = scope("held-completed", None);
    complete(&store, &completed, Duration::from_secs(3600)).await;
    let in_progress = scope("held-in-progress", None);
    assert!(claims(&store, &in_progress, Duration::from_secs(30)).await);
    for (scope, key) in [
        (&completed, "held-completed"),
        (&in_progress, "held-in-progress"),
    ] {
        let before = row_version(&store, key).await;
        for _ in 0..3 {
            let claim = store.claim(scope, FINGERPRINT, Duration::from_secs(30));
            assert!(!matches!(claim.await.unwrap(), Claim::Claimed(_)), "{key}");
        }
        assert_eq!(row_version(&store, key).await, before, "{key}");
    }
}

/// A connection's first claim prepares the writes that follow it too: a completion never
/// waits for a preparation of its own on a connection that so far only claimed.
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn a_connections_first_claim_prepares_the_writes_after_it() {
    let migrated = support::postgres_store().await;
    let (schema, table) = migrated.table_name().split_once('.').unwrap();
    let config: tokio_postgres::Config = support::database_url().parse().unwrap();
    let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
    let pool = deadpool_postgres::Pool::builder(manager)
        .max_size(1)
        .build()
        .unwrap();
    let store = PostgresStore::new(pool.clone())
        .table(schema, table)
        .unwrap();
    assert!(claims(&store, &scope("prepared", None), Duration::from_secs(30)).await);
    let connection = pool.get().await.unwrap();
    // The claim, the completion, the release and the lease's extension.
    assert_eq!(connection.statement_cache.size(), 4);
}

#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
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
#[ignore = "needs PostgreSQL: scripts/test.sh"]
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
#[ignore = "needs PostgreSQL: scripts/test.sh"]
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
        .layer(IdempotencyLayer::new(store).allow_anonymous());
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
async fn the_postgres_guide_shows_the_migration_sql() {
    let store = PostgresStore::connect(&support::database_url())
        .await
        .unwrap();
    let guide = include_str!("../src/guide/postgres.md");
    assert!(
        guide.contains(store.migration_sql().trim()),
        "the PostgreSQL guide page's SQL differs from migration_sql()"
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
#[ignore = "needs PostgreSQL: scripts/test.sh"]
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

/// The `resource_id`, `replay_count` and whether `last_replayed_at` is set, of `key`'s row.
async fn audit(store: &PostgresStore, key: &str) -> (Option<String>, i64, bool) {
    let client = support::store_client(&support::database_url()).await;
    let sql = format!(
        "SELECT resource_id, replay_count, last_replayed_at IS NOT NULL AND last_replayed_at >= completed_at
         FROM {} WHERE idempotency_key = $1",
        store.table_name()
    );
    let row = client.query_one(&sql, &[&key]).await.unwrap();
    (row.get(0), row.get(1), row.get(2))
}

/// A table name of the test schema no other test uses.
fn unique_table(prefix: &str) -> String {
    format!(
        "{}.{prefix}_{:016x}",
        support::TEST_SCHEMA,
        rand::random::<u64>()
    )
}

#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn resource_id_comes_from_location_or_the_chosen_extractor() {
    let store = support::postgres_store().await;
    complete_with(&store, &scope("by-location", None), &created("pay_1")).await;
    let mut no_location = created("pay_2");
    no_location.headers.remove("location");
    complete_with(&store, &scope("no-location", None), &no_location).await;
    assert_eq!(
        audit(&store, "by-location").await.0.as_deref(),
        Some("pay_1")
    );
    assert_eq!(audit(&store, "no-location").await.0, None);

    let by_body = store
        .clone()
        .resource_id(tower_idempotency::store::ResourceId::json_pointer("/id"));
    complete_with(&by_body, &scope("by-body", None), &no_location).await;
    assert_eq!(audit(&store, "by-body").await.0.as_deref(), Some("pay_2"));

    // Too long to be an id worth joining on: left NULL rather than cut.
    let too_long = store.clone().resource_id(|_: &StoredResponse| {
        Some("x".repeat(tower_idempotency::store::MAX_RESOURCE_ID_LEN + 1))
    });
    complete_with(&too_long, &scope("too-long", None), &created("pay_3")).await;
    assert_eq!(audit(&store, "too-long").await.0, None);
}

/// The reconciliation query the PostgreSQL guide page documents, on `keys` and the business
/// table `payments`, for the day of `now()`.
fn guide_reconciliation_query(keys: &str, payments: &str) -> String {
    let guide = include_str!("../src/guide/postgres.md");
    let start = guide
        .find("```sql\nSELECT p.id")
        .expect("the PostgreSQL guide page shows the reconciliation query")
        + "```sql\n".len();
    let end = start + guide[start..].find("```").unwrap();
    guide[start..end]
        .replace("FROM payments AS p", &format!("FROM {payments} AS p"))
        .replace("public.idempotency_keys", keys)
        .replace("DATE '2026-12-05'", "current_date")
}

#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn guide_reconciliation_query_joins_payments_to_their_requests() {
    let store = support::postgres_store().await.count_replays();
    let payments = unique_table("payments");
    let client = support::store_client(&support::database_url()).await;
    client
        .batch_execute(&format!(
            "CREATE TABLE {payments} (id TEXT PRIMARY KEY, amount BIGINT NOT NULL);
             INSERT INTO {payments} VALUES ('pay_a', 1000), ('pay_b', 2500), ('pay_manual', 99);"
        ))
        .await
        .unwrap();

    // pay_a retried twice, pay_b never; pay_manual was made without an idempotent request.
    for (key, id, retries) in [("key-a", "pay_a", 2), ("key-b", "pay_b", 0)] {
        let scope = scope(key, Some("alice"));
        complete_with(&store, &scope, &created(id)).await;
        for _ in 0..retries {
            let claim = store.claim(&scope, FINGERPRINT, Duration::from_secs(30));
            assert!(matches!(claim.await.unwrap(), Claim::Completed { .. }));
        }
    }

    let sql = guide_reconciliation_query(store.table_name(), &payments);
    let rows = client.query(&sql, &[]).await.unwrap();
    client
        .batch_execute(&format!("DROP TABLE {payments}"))
        .await
        .unwrap();
    let found: Vec<(String, i64, String, String, i64, bool)> = rows
        .iter()
        .map(|row| {
            let replayed_at: Option<std::time::SystemTime> = row.get("last_replayed_at");
            (
                row.get("id"),
                row.get("amount"),
                row.get("idempotency_key"),
                row.get("principal"),
                row.get("replay_count"),
                replayed_at.is_some(),
            )
        })
        .collect();
    let expected = [
        ("pay_a", 1000, "key-a", "alice", 2, true),
        ("pay_b", 2500, "key-b", "alice", 0, false),
    ];
    let expected: Vec<_> = expected
        .iter()
        .map(|&(id, amount, key, principal, replays, replayed)| {
            (
                id.to_owned(),
                amount,
                key.to_owned(),
                principal.to_owned(),
                replays,
                replayed,
            )
        })
        .collect();
    assert_eq!(found, expected);
}

#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn replays_are_counted_in_the_statement_that_reads_them() {
    let plain = support::postgres_store().await;
    let counting = plain.clone().count_replays();
    let counted = scope("counted", None);
    complete_with(&counting, &counted, &created("pay_c")).await;
    for _ in 0..3 {
        let claim = counting.claim(&counted, FINGERPRINT, Duration::from_secs(30));
        match claim.await.unwrap() {
            Claim::Completed {
                response,
                expires_in,
                ..
            } => {
                assert_eq!(response, created("pay_c"));
                assert_eq!(expires_in, None, "no cache may keep a counted record");
            }
            other => panic!("expected the completed record, got {other:?}"),
        }
    }
    assert_eq!(
        audit(&plain, "counted").await,
        (Some("pay_c".to_owned()), 3, true)
    );

    // A duplicate of a request still running is no replay: its next retry is.
    let running = scope("running", None);
    assert!(claims(&counting, &running, Duration::from_secs(30)).await);
    let duplicate = counting.claim(&running, FINGERPRINT, Duration::from_secs(30));
    assert!(matches!(duplicate.await.unwrap(), Claim::InProgress { .. }));
    let client = support::store_client(&support::database_url()).await;
    let sql = format!(
        "SELECT replay_count, last_replayed_at IS NULL FROM {} WHERE idempotency_key = 'running'",
        plain.table_name()
    );
    let row = client.query_one(&sql, &[]).await.unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, bool>(1)), (0, true));

    // Without count_replays, replays leave the row as it is, and report their expiry.
    let uncounted = scope("uncounted", None);
    complete_with(&plain, &uncounted, &created("pay_u")).await;
    for _ in 0..2 {
        let claim = plain.claim(&uncounted, FINGERPRINT, Duration::from_secs(30));
        assert!(matches!(
            claim.await.unwrap(),
            Claim::Completed {
                expires_in: Some(_),
                ..
            }
        ));
    }
    assert_eq!(
        audit(&plain, "uncounted").await,
        (Some("pay_u".to_owned()), 0, false)
    );
}

/// A payments route behind `layer`: each execution creates `pay_<n>`, `201` with its
/// `Location`. Returns the router and the count of executions.
fn payments_app(layer: IdempotencyLayer) -> (Router, Arc<std::sync::atomic::AtomicU64>) {
    let executed = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let handler = {
        let executed = executed.clone();
        move || async move {
            let n = executed.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            let location = format!("/v1/payments/pay_{n}");
            (StatusCode::CREATED, [(http::header::LOCATION, location)])
        }
    };
    let app = Router::new()
        .route("/v1/payments", post(handler))
        .layer(layer);
    (app, executed)
}

async fn pay(app: &Router, key: &str, body: &'static str) -> http::Response<Body> {
    let request = Request::post("/v1/payments")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap();
    app.clone().oneshot(request).await.unwrap()
}

#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn a_cache_in_front_of_a_counting_store_lets_every_replay_be_counted() {
    let store = support::postgres_store().await.count_replays();
    let cached = tower_idempotency::store::CachedStore::new(store.clone(), 1000);
    let (app, executed) = payments_app(IdempotencyLayer::new(cached).allow_anonymous());

    let first = pay(&app, "cached", r#"{"amount":1000}"#).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    for _ in 0..4 {
        let replay = pay(&app, "cached", r#"{"amount":1000}"#).await;
        assert_eq!(replay.status(), StatusCode::CREATED);
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        assert_eq!(replay.headers()["location"], "/v1/payments/pay_1");
    }
    assert_eq!(executed.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(
        audit(&store, "cached").await,
        (Some("pay_1".to_owned()), 4, true)
    );

    // A retry reusing the key for another request is refused, and counted as documented.
    let reused = pay(&app, "cached", r#"{"amount":9999}"#).await;
    assert_eq!(reused.status(), StatusCode::CONFLICT);
    assert_eq!(audit(&store, "cached").await.1, 5);
    assert_eq!(executed.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// Drops `table` (a qualified name).
async fn drop_table(table: &str) {
    let client = support::store_client(&support::database_url()).await;
    client
        .batch_execute(&format!("DROP TABLE IF EXISTS {table}"))
        .await
        .unwrap();
}

/// Another session that read `table` and keeps its transaction open.
async fn reading(table: &str) -> tokio_postgres::Client {
    let reader = support::store_client(&support::database_url()).await;
    let sql = format!("BEGIN; SELECT count(*) FROM {table}");
    reader.batch_execute(&sql).await.unwrap();
    reader
}

#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn migrate_on_an_up_to_date_table_waits_for_no_open_reader() {
    let store = support::postgres_store().await;
    let table = store.table_name().to_owned();
    let reader = reading(&table).await;

    // An instance starts and migrates; requests keep being claimed meanwhile. (The
    // timeouts only bound a failure: a lock queued behind the reader never ends.)
    let migrate = tokio::spawn({
        let store = store.clone();
        async move { store.migrate().await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let during = scope("during", None);
    let claim = claims(&store, &during, Duration::from_secs(30));
    let claimed = tokio::time::timeout(Duration::from_secs(4), claim).await;
    assert!(
        claimed.expect("a claim queued behind the migration"),
        "the key was free"
    );
    let migrated = tokio::time::timeout(Duration::from_secs(4), migrate).await;
    migrated
        .expect("migrate waited for the reader")
        .unwrap()
        .unwrap();
    reader.batch_execute("ROLLBACK").await.unwrap();
    drop_table(&table).await;
}

#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn a_migration_blocked_by_an_open_writer_gives_up_and_changes_nothing() {
    support::postgres_store().await; // the test schema
    let table = unique_table("blocked");
    let (schema, name) = table.split_once('.').unwrap();
    let store = PostgresStore::connect(&support::database_url())
        .await
        .unwrap()
        .table(schema, name)
        .unwrap();
    store.migrate().await.unwrap();
    // A table missing one index (someone dropped it), and a transaction writing to it:
    // building the index must wait for that writer.
    let client = support::store_client(&support::database_url()).await;
    let resource_index = format!("{}_resource_id", table.replace('.', "_"));
    let drop_index = format!("DROP INDEX {schema}.{resource_index}");
    client.batch_execute(&drop_index).await.unwrap();
    let writer = support::store_client(&support::database_url()).await;
    let lock = format!("BEGIN; LOCK TABLE {table} IN ROW EXCLUSIVE MODE");
    writer.batch_execute(&lock).await.unwrap();
    let index_exists = || async {
        let sql = "SELECT to_regclass($1) IS NOT NULL";
        let qualified = format!("{schema}.{resource_index}");
        let row = client.query_one(sql, &[&qualified]).await.unwrap();
        row.get::<_, bool>(0)
    };

    let migrated = tokio::time::timeout(Duration::from_secs(20), store.migrate()).await;
    let error = migrated.expect("migrate gives up by its lock timeout");
    assert!(
        matches!(error, Err(PostgresStoreError::MigrationBlocked { .. })),
        "{error:?}"
    );
    assert!(!index_exists().await, "a blocked migration changes nothing");
    writer.batch_execute("ROLLBACK").await.unwrap();
    store.migrate().await.unwrap();
    assert!(index_exists().await);
    drop_table(&table).await;
}

#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn concurrent_migrations_of_a_fresh_table_all_succeed() {
    support::postgres_store().await; // the test schema
    let table = unique_table("fresh");
    let name = table.split_once('.').unwrap().1.to_owned();
    let mut migrations = Vec::new();
    for _ in 0..6 {
        let store = PostgresStore::connect(&support::database_url())
            .await
            .unwrap()
            .table(support::TEST_SCHEMA, &name)
            .unwrap();
        migrations.push(tokio::spawn(async move { store.migrate().await }));
    }
    let mut failures = Vec::new();
    for migration in migrations {
        if let Err(error) = migration.await.unwrap() {
            failures.push(error.to_string());
        }
    }
    drop_table(&table).await;
    assert!(failures.is_empty(), "{failures:?}");
}

#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn long_schema_and_table_names_get_all_their_indexes() {
    let schema = format!("idempotency_tests_long_{:016x}_s", rand::random::<u64>());
    let name = format!("long_table_{:016x}_ttt", rand::random::<u64>());
    assert_eq!((schema.len(), name.len()), (41, 31));
    let client = support::store_client(&support::database_url()).await;
    client
        .batch_execute(&format!("CREATE SCHEMA {schema}"))
        .await
        .unwrap();
    let store = PostgresStore::connect(&support::database_url())
        .await
        .unwrap()
        .table(&schema, &name)
        .unwrap();
    store.migrate().await.unwrap();
    store.migrate().await.unwrap();
    let indexes = client
        .query(
            "SELECT indexname FROM pg_indexes WHERE schemaname = $1 AND tablename = $2",
            &[&schema, &name],
        )
        .await
        .unwrap();
    let mut indexes: Vec<String> = indexes.iter().map(|r| r.get(0)).collect();
    indexes.sort_unstable();
    let claimed = claims(&store, &scope("long", None), Duration::from_secs(30)).await;
    client
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
        .unwrap();
    assert_eq!(indexes.len(), 3, "{indexes:?}");
    for (index, suffix) in indexes
        .iter()
        .zip(["_expires_at", "_resource_id", "_scope"])
    {
        assert!(index.len() <= 63 && index.ends_with(suffix), "{indexes:?}");
    }
    assert!(claimed);
}

#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn a_purge_never_deletes_a_row_a_concurrent_claim_took() {
    let store = support::postgres_store().await.purge_batch(3);
    let table = store.table_name().to_owned();
    let n = 240;
    expired_rows(&store, "race", n).await;

    // Four claimers take the expired keys over while purges delete in small batches.
    let claimers: Vec<_> = (0..4)
        .map(|c| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut taken = Vec::new();
                for i in (c..n).step_by(4) {
                    let key = format!("race-{i}");
                    let lease = Duration::from_secs(60);
                    let scope = scope(&key, None);
                    let claim = store.claim(&scope, FINGERPRINT, lease);
                    if let Claim::Claimed(token) = claim.await.unwrap() {
                        taken.push((key, token));
                    }
                }
                taken
            })
        })
        .collect();
    let purges: Vec<_> = (0..2)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                let mut purged = 0;
                for _ in 0..20 {
                    purged += store.purge_expired().await.unwrap();
                }
                purged
            })
        })
        .collect();
    let mut taken = Vec::new();
    for claimer in claimers {
        taken.extend(claimer.await.unwrap());
    }
    for purge in purges {
        purge.await.unwrap();
    }
    assert_eq!(taken.len(), n, "every expired key is free to claim");

    // Each key taken is still held, by its claimer.
    let client = support::store_client(&support::database_url()).await;
    let sql = format!(
        "SELECT idempotency_key, claim_token FROM {table}
         WHERE status = 'in_progress' AND locked_until > now()"
    );
    let rows = client.query(&sql, &[]).await.unwrap();
    let held: std::collections::HashMap<String, Vec<u8>> =
        rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let lost: Vec<&String> = taken
        .iter()
        .filter(|(key, token)| {
            held.get(key).map(Vec::as_slice) != Some(token.as_bytes().as_slice())
        })
        .map(|(key, _)| key)
        .collect();
    drop_table(&table).await;
    assert!(lost.is_empty(), "claims purged: {lost:?}");
}

/// Settings the pool and the purge cannot take are refused or bounded when configured,
/// never turned into a panic later: a zero purge interval would end the purging task
/// unseen; a pool sized past PostgreSQL's own limit is held to it (it reserves room for
/// every connection up front) and still serves.
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn pool_and_purge_settings_are_checked_when_configured() {
    let store = support::postgres_store().await;
    let message = support::refusal("a zero purge interval", || {
        store.spawn_purge(Duration::ZERO)
    });
    assert!(message.contains("spawn_purge"), "{message}");
    let store = store.max_connections(usize::MAX);
    let scope = scope("huge-pool", Some("alice"));
    let claimed = store
        .claim(
            &scope,
            Fingerprint::from_bytes([0; 32]),
            Duration::from_secs(5),
        )
        .await
        .unwrap();
    assert!(matches!(claimed, Claim::Claimed(_)), "{claimed:?}");
}

/// A second store on `store`'s table, with a pool of its own: another instance.
async fn instance_on(store: &PostgresStore) -> PostgresStore {
    let (schema, table) = store.table_name().split_once('.').unwrap();
    PostgresStore::connect(&support::database_url())
        .await
        .unwrap()
        .table(schema, table)
        .unwrap()
}

/// A claim whose statement waits on a lock for longer than its lease (here a purge batch
/// still deleting the key's expired row; the same happens behind `CREATE INDEX`, or an
/// operator's `SELECT … FOR UPDATE`) is not answered `Claimed` with a lease already
/// spent, which a retry right after would take over: the claim fails (the layer answers
/// `503`, nothing runs), its row is gone, and the retry takes the key alone.
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn a_claim_that_waited_on_a_lock_is_not_handed_a_spent_lease() {
    let a = support::postgres_store().await;
    let b = instance_on(&a).await;
    let lease = Duration::from_millis(500);
    let key = scope("blocked-by-purge", Some("alice"));
    // A's connection warmed (its statements prepared), and an expired row of the key.
    assert!(claims(&a, &key, Duration::from_millis(50)).await);
    tokio::time::sleep(Duration::from_millis(100)).await;
    // A purge batch that takes a while (a big batch, a slow disk) holds the expired row.
    let purger = support::store_client(&support::database_url()).await;
    let name = a.table_name();
    purger
        .batch_execute(&format!(
            "BEGIN; DELETE FROM {name} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {name} \
             WHERE expires_at <= now() LIMIT 1000 FOR UPDATE SKIP LOCKED)) AND expires_at <= now()"
        ))
        .await
        .unwrap();
    let first = {
        let (a, key) = (a.clone(), key.clone());
        tokio::spawn(async move { a.claim(&key, FINGERPRINT, lease).await })
    };
    tokio::time::sleep(lease + Duration::from_millis(300)).await;
    purger.batch_execute("COMMIT").await.unwrap();
    let first = first.await.unwrap();
    // A retry of the same request, on another instance, just after.
    let second = b.claim(&key, FINGERPRINT, lease).await.unwrap();
    if let (Ok(Claim::Claimed(token)), Claim::Claimed(_)) = (&first, &second) {
        let extended = a.extend(&key, *token, lease).await;
        panic!("both instances took the key: the first claim's lease was spent when it was answered (its extend: {extended:?})");
    }
    assert!(
        first.is_err(),
        "a claim answered after its lease: {first:?}"
    );
    assert!(matches!(second, Claim::Claimed(_)), "{second:?}");
}

/// A claim that takes over an expired row after waiting on that row's lock (an
/// operator's `SELECT … FOR UPDATE`) for longer than its lease gets a whole lease, counted
/// from when it wrote the row: a retry right after finds the key held.
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn a_claim_that_waited_on_a_row_lock_gets_a_whole_lease() {
    let a = support::postgres_store().await;
    let b = instance_on(&a).await;
    let lease = Duration::from_millis(500);
    let key = scope("blocked-by-reader", Some("alice"));
    assert!(claims(&a, &key, Duration::from_millis(50)).await);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let reader = support::store_client(&support::database_url()).await;
    let name = a.table_name();
    reader
        .batch_execute(&format!(
            "BEGIN; SELECT * FROM {name} WHERE idempotency_key = 'blocked-by-reader' FOR UPDATE"
        ))
        .await
        .unwrap();
    let first = {
        let (a, key) = (a.clone(), key.clone());
        tokio::spawn(async move { a.claim(&key, FINGERPRINT, lease).await })
    };
    tokio::time::sleep(lease + Duration::from_millis(300)).await;
    reader.batch_execute("COMMIT").await.unwrap();
    let first = first.await.unwrap();
    let second = b.claim(&key, FINGERPRINT, lease).await.unwrap();
    let Ok(Claim::Claimed(token)) = first else {
        panic!("the first claim took no key: {first:?}");
    };
    let Claim::InProgress {
        lease_remaining, ..
    } = second
    else {
        panic!("the retry found no claim in progress: {second:?}");
    };
    assert!(
        lease_remaining > lease / 2 && lease_remaining <= lease,
        "{lease_remaining:?}"
    );
    assert_eq!(a.extend(&key, token, lease).await.unwrap(), Fenced::Applied);
}

/// A proxy to the test database whose connections can be frozen, and the URL of the
/// database through it.
async fn freezing_proxy() -> (support::freezing_proxy::FreezingProxy, String) {
    let config: tokio_postgres::Config = support::database_url().parse().unwrap();
    let host = match &config.get_hosts()[0] {
        tokio_postgres::config::Host::Tcp(host) => host.clone(),
        #[allow(unreachable_patterns)]
        other => panic!("a TCP host: {other:?}"),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let upstream = tokio::net::lookup_host((host.as_str(), port))
        .await
        .unwrap()
        .next()
        .unwrap();
    let proxy = support::freezing_proxy::FreezingProxy::start(upstream).await;
    let user = config.get_user().unwrap_or("postgres");
    let password = config
        .get_password()
        .map(|p| format!(":{}", String::from_utf8_lossy(p)))
        .unwrap_or_default();
    let db = config.get_dbname().unwrap_or(user);
    let url = format!("postgres://{user}{password}@{}/{db}", proxy.addr());
    (proxy, url)
}

/// A store on a table of its own whose connections go through `url`, on a pool of one
/// connection with no time limits of its own: a connection that was given up on and
/// pooled again would be the one every later operation gets.
async fn store_through(url: &str, timeout: Duration) -> PostgresStore {
    use tower_idempotency::deadpool_postgres::{Manager, Pool};
    let migrated = support::postgres_store().await;
    let (schema, table) = migrated.table_name().split_once('.').unwrap();
    let manager = Manager::new(url.parse().unwrap(), tokio_postgres::NoTls);
    let pool = Pool::builder(manager).max_size(1).build().unwrap();
    PostgresStore::new(pool)
        .table(schema, table)
        .unwrap()
        .timeout(timeout)
}

/// Runs `operation` and checks that it failed within about `timeout` with the error that
/// says it may or may not have been applied.
async fn times_out<T: std::fmt::Debug>(
    timeout: Duration,
    operation: impl std::future::Future<Output = Result<T, tower_idempotency::store::Error>>,
) {
    let started = tokio::time::Instant::now();
    let answer = tokio::time::timeout(timeout * 5, operation)
        .await
        .expect("an operation on a frozen connection hangs");
    let took = started.elapsed();
    assert!(
        took >= timeout - Duration::from_millis(50) && took < timeout * 2,
        "answered after {took:?}"
    );
    match answer {
        Err(tower_idempotency::store::Error::Backend(error)) => {
            let error = error.downcast_ref::<PostgresStoreError>();
            assert!(
                matches!(error, Some(PostgresStoreError::Timeout(t)) if *t == timeout),
                "{error:?}"
            );
        }
        other => panic!("expected a timeout, may or may not have been applied: {other:?}"),
    }
}

/// A connection that stops answering without a reset (a failover, a NAT that dropped its
/// state) fails each kind of statement sent on it within the store's timeout, rather than
/// hanging it for ever, and is never pooled again: the next operation opens a new
/// connection, and works.
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn statements_on_a_frozen_connection_time_out_and_it_is_replaced() {
    let (proxy, url) = freezing_proxy().await;
    let timeout = Duration::from_millis(400);
    let store = store_through(&url, timeout).await;
    let lease = Duration::from_secs(30);
    let key = scope("frozen", Some("alice"));
    let Claim::Claimed(token) = store.claim(&key, FINGERPRINT, lease).await.unwrap() else {
        panic!("a free key");
    };

    // A renewal of the lease.
    proxy.freeze_open_connections();
    times_out(timeout, store.extend(&key, token, lease)).await;
    assert_eq!(
        store.extend(&key, token, lease).await.unwrap(),
        Fenced::Applied
    );

    // A completion.
    proxy.freeze_open_connections();
    let stored = response(b"charged");
    let ttl = Duration::from_secs(60);
    times_out(
        timeout,
        store.complete(&key, token, FINGERPRINT, &stored, ttl),
    )
    .await;
    let completed = store.complete(&key, token, FINGERPRINT, &stored, ttl);
    assert_eq!(completed.await.unwrap(), Fenced::Applied);

    // A claim, and a release.
    let other = scope("frozen-2", Some("alice"));
    proxy.freeze_open_connections();
    times_out(timeout, store.claim(&other, FINGERPRINT, lease)).await;
    let Claim::Claimed(token) = store.claim(&other, FINGERPRINT, lease).await.unwrap() else {
        panic!("the frozen claim never reached the database");
    };
    proxy.freeze_open_connections();
    times_out(timeout, store.release(&other, token)).await;
    assert_eq!(store.release(&other, token).await.unwrap(), Fenced::Applied);

    // A replay.
    proxy.freeze_open_connections();
    times_out(timeout, store.claim(&key, FINGERPRINT, lease)).await;
    let replay = store.claim(&key, FINGERPRINT, lease).await.unwrap();
    assert!(matches!(replay, Claim::Completed { .. }), "{replay:?}");
}

/// An operation dropped while its statement is in flight (a caller's own time limit) does
/// not leave its connection in the pool: a renewal given up on a frozen connection is
/// followed by one that works.
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn a_connection_whose_statement_was_dropped_is_not_pooled_again() {
    let (proxy, url) = freezing_proxy().await;
    let store = store_through(&url, Duration::from_secs(30)).await;
    let lease = Duration::from_secs(30);
    let key = scope("dropped", None);
    let Claim::Claimed(token) = store.claim(&key, FINGERPRINT, lease).await.unwrap() else {
        panic!("a free key");
    };
    proxy.freeze_open_connections();
    let renewal = store.extend(&key, token, lease);
    let given_up = tokio::time::timeout(Duration::from_millis(200), renewal).await;
    assert!(given_up.is_err(), "{given_up:?}");
    let renewal = tokio::time::timeout(Duration::from_secs(2), store.extend(&key, token, lease));
    let renewed = renewal
        .await
        .expect("the frozen connection was pooled again");
    assert_eq!(renewed.unwrap(), Fenced::Applied);
}

/// A wait for a pooled connection counts against the timeout, and one that gets none in
/// time sent nothing: the store says so (`Unavailable`, and the layer releases nothing).
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn a_wait_for_a_connection_past_the_timeout_sent_nothing() {
    let (proxy, url) = freezing_proxy().await;
    let store = store_through(&url, Duration::from_secs(2)).await;
    let lease = Duration::from_secs(30);
    let key = scope("busy", None);
    let Claim::Claimed(token) = store.claim(&key, FINGERPRINT, lease).await.unwrap() else {
        panic!("a free key");
    };
    proxy.freeze_open_connections();
    // The pool's only connection, stuck for 2 s.
    let stuck = {
        let (store, key) = (store.clone(), key.clone());
        tokio::spawn(async move { store.extend(&key, token, lease).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let impatient = store.clone().timeout(Duration::from_millis(300));
    let other = scope("waiting-for-a-connection", None);
    let started = tokio::time::Instant::now();
    let claim = impatient.claim(&other, FINGERPRINT, lease).await;
    assert!(started.elapsed() < Duration::from_secs(1));
    match claim {
        Err(tower_idempotency::store::Error::Unavailable(error)) => {
            let error = error.downcast_ref::<PostgresStoreError>();
            assert!(
                matches!(error, Some(PostgresStoreError::Pool(_))),
                "{error:?}"
            );
        }
        other => panic!("expected no connection: {other:?}"),
    }
    assert!(stuck.await.unwrap().is_err());
    // The key is free: the claim was never sent.
    assert!(claims(&store, &other, lease).await);
}

/// A statement that times out waiting on a lock is cancelled: it does not apply once the
/// lock is released, long after the caller was told it failed.
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn a_statement_that_timed_out_on_a_lock_is_cancelled() {
    let timeout = Duration::from_millis(300);
    let store = support::postgres_store().await.timeout(timeout);
    let lease = Duration::from_secs(30);
    let key = scope("locked", None);
    let Claim::Claimed(token) = store.claim(&key, FINGERPRINT, lease).await.unwrap() else {
        panic!("a free key");
    };
    let name = store.table_name().to_owned();
    let locked_until = || async {
        let client = support::store_client(&support::database_url()).await;
        let sql = format!("SELECT locked_until::text FROM {name} WHERE idempotency_key = 'locked'");
        client
            .query_one(&sql, &[])
            .await
            .unwrap()
            .get::<_, String>(0)
    };
    let before = locked_until().await;
    let locker = support::store_client(&support::database_url()).await;
    locker
        .batch_execute(&format!(
            "BEGIN; SELECT * FROM {name} WHERE idempotency_key = 'locked' FOR UPDATE"
        ))
        .await
        .unwrap();
    times_out(timeout, store.extend(&key, token, lease)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    locker.batch_execute("COMMIT").await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        locked_until().await,
        before,
        "the renewal applied after all"
    );
    assert_eq!(
        store.extend(&key, token, lease).await.unwrap(),
        Fenced::Applied
    );
}

/// Through the layer: the connection a handler's claim used goes dead without a reset while
/// the handler runs (a failover, a NAT that dropped its state). The renewal sent on it hangs;
/// the next ones, sent when due all the same, go on new connections: the lease holds,
/// and a retry on another instance is told the payment is in progress. The renewals were
/// awaited one after another, the first hung for good, the lease ran out under the handler,
/// and the retry executed again.
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn renewals_on_a_connection_gone_dead_keep_the_lease() {
    let (proxy, url) = freezing_proxy().await;
    let proxy = Arc::new(proxy);
    let direct = support::postgres_store().await;
    let (schema, table) = direct.table_name().split_once('.').unwrap();
    let through_proxy = {
        use tower_idempotency::deadpool_postgres::{Manager, Pool};
        let manager = Manager::new(url.parse().unwrap(), tokio_postgres::NoTls);
        let pool = Pool::builder(manager).max_size(4).build().unwrap();
        PostgresStore::new(pool).table(schema, table).unwrap()
    };
    let lease = Duration::from_millis(1500);
    let executed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let app = |store: PostgresStore,
               freeze: Option<Arc<support::freezing_proxy::FreezingProxy>>| {
        let executed = executed.clone();
        let charge = move || async move {
            executed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(200)).await;
            if let Some(proxy) = &freeze {
                proxy.freeze_open_connections();
            }
            // A long charge, well within what renewals are for.
            tokio::time::sleep(Duration::from_secs(4)).await;
            (StatusCode::CREATED, "charged")
        };
        let layer = IdempotencyLayer::new(store).allow_anonymous().lease(lease);
        Router::new().route("/v1/payments", post(charge).layer(layer))
    };
    let first_instance = app(through_proxy, Some(proxy.clone()));
    let other_instance = app(direct, None);
    let pay = |app: Router| async move {
        let request = Request::post("/v1/payments")
            .header("idempotency-key", "renewed-on-a-dead-connection")
            .body(Body::from("{\"amount\":1}"))
            .unwrap();
        app.oneshot(request).await.unwrap().status()
    };
    let first = tokio::spawn(pay(first_instance));
    tokio::time::sleep(lease + Duration::from_secs(1)).await;
    let retry = pay(other_instance).await;
    assert_eq!(retry, StatusCode::CONFLICT);
    assert_eq!(executed.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(first.await.unwrap(), StatusCode::CREATED);
    assert!(proxy.opened() >= 2, "the renewals went on a new connection");
}
