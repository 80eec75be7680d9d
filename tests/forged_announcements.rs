//! Announcements as an attacker with less access than the application would use them.
//!
//! PostgreSQL checks no privilege for `LISTEN` or `NOTIFY`, and Redis tells a subscriber
//! nothing of who published: whoever can connect can send what the stores send. Each case
//! here has a duplicate waiting on one instance for an original running on another, an
//! attacker sends what it can, and the duplicate must answer its own original's response
//! (or read its key), never what the attacker made or moved.
//!
//! The PostgreSQL cases forge a record sealed as this crate's notifications once carried
//! them: the seal's key was derived from the table and the scope alone, which a role that
//! can read the table (or guess a scope) can derive too. The Redis case moves a genuine
//! announcement of one key to the channel of another.

mod support;

use std::{sync::Arc, time::Duration};

use axum::http::StatusCode;
use futures_util::StreamExt;
use sha2::{Digest, Sha256};
use tower_idempotency::{
    redis::{
        self,
        sentinel::{SentinelClient, SentinelNodeConnectionInfo, SentinelServerType},
    },
    Fingerprint, IdempotencyKey, IdempotencyLayer, PostgresStore, Record, RedisStore, Scope, Store,
    StoredResponse,
};

use support::{app::*, redis_server::RedisServer};

const BOUND: Duration = Duration::from_secs(10);
/// How long a waiter is given to (wrongly) answer after the attacker sent its message.
const TAKEN_WITHIN: Duration = Duration::from_millis(500);

/// The attacker's response, were a waiter to take it.
const FORGED_BODY: &str = r#"{"id":"pay_FORGED"}"#;

/// Two apps on two instances of one store, both waiting for originals.
fn apps(a: Arc<dyn Store>, b: Arc<dyn Store>, handler: &Handler) -> (axum::Router, axum::Router) {
    let app = |store| router(handler, layer(&store).wait_for_original(BOUND));
    (app(a), app(b))
}

/// The original is still running and `duplicate` still waits for it once the attacker is
/// done: then the original answers, and the duplicate gets exactly its response; the
/// handler ran `executions` times in all.
async fn the_duplicate_answers_its_own_original(
    handler: &Handler,
    (original, duplicate): (
        tokio::task::JoinHandle<Answer>,
        tokio::task::JoinHandle<Answer>,
    ),
    executions: usize,
) {
    tokio::time::sleep(TAKEN_WITHIN).await;
    if duplicate.is_finished() {
        let taken = duplicate.await.unwrap();
        panic!(
            "the duplicate answered before its original, with {} {:?} {:?}",
            taken.status,
            taken.headers,
            String::from_utf8_lossy(&taken.body)
        );
    }
    handler.gate.add_permits(1);
    let original = original.await.unwrap();
    assert_eq!(original.status, StatusCode::CREATED);
    let duplicate = tokio::time::timeout(BOUND / 2, duplicate)
        .await
        .expect("woken by its original")
        .unwrap();
    assert!(duplicate.replayed());
    assert_eq!(
        (duplicate.status, &duplicate.body),
        (original.status, &original.body)
    );
    assert!(duplicate.headers.get("location").is_none());
    assert_eq!(handler.executions(), executions);
}

// ---------------------------------------------------------------------------------------
// PostgreSQL.

/// A role of the attacker's, made by the administrator with `grants` (each with `{role}`
/// for its name), and dropped at the end of the test.
struct Role {
    name: String,
    config: tokio_postgres::Config,
    admin: tokio_postgres::Client,
}

impl Role {
    async fn create(grants: &[String]) -> Self {
        let url = support::database_url();
        let admin = support::store_client(&url).await;
        let name = format!("idempotency_test_attacker_{:016x}", rand::random::<u64>());
        let password = format!("{:032x}", rand::random::<u128>());
        let create = format!("CREATE ROLE {name} LOGIN PASSWORD '{password}'");
        admin.batch_execute(&create).await.unwrap();
        for grant in grants {
            let grant = grant.replace("{role}", &name);
            admin.batch_execute(&grant).await.unwrap();
        }
        let mut config: tokio_postgres::Config = url.parse().unwrap();
        config.user(&name).password(password);
        Self {
            name,
            config,
            admin,
        }
    }

    async fn connect(&self) -> tokio_postgres::Client {
        let (client, connection) = self.config.connect(tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(connection);
        client
    }

    async fn drop_role(self) {
        let drop = format!("DROP OWNED BY {0}; DROP ROLE {0}", self.name);
        self.admin.batch_execute(&drop).await.unwrap();
    }
}

/// An original running on one instance of a PostgreSQL store (its own table) and its
/// duplicate waiting on another, both made by `request`, through layers that `configure`
/// finishes.
struct Waiting {
    handler: Handler,
    original: tokio::task::JoinHandle<Answer>,
    duplicate: tokio::task::JoinHandle<Answer>,
    /// The table's qualified name, and the channel of its notifications.
    table: String,
    channel: String,
}

async fn postgres_waiting(
    configure: impl Fn(IdempotencyLayer) -> IdempotencyLayer,
    request: impl Fn() -> Req,
) -> Waiting {
    let a = support::postgres_store().await.announce_outcomes();
    let (schema, table) = a.table_name().split_once('.').unwrap();
    let b = PostgresStore::connect(&support::database_url())
        .await
        .unwrap()
        .table(schema, table)
        .unwrap()
        .announce_outcomes();
    let (table, channel) = (
        a.table_name().to_owned(),
        b.notification_channel().to_owned(),
    );
    let handler = Handler::default();
    let app = |store: Arc<dyn Store>| {
        let layer = configure(layer(&store).wait_for_original(BOUND));
        router(&handler, layer)
    };
    let (app_a, app_b) = (app(Arc::new(a)), app(Arc::new(b)));
    let original = spawn_send(&app_a, request().header("x-wait", "1"));
    until_executing(&handler, 1).await;
    let duplicate = spawn_send(&app_b, request());
    still_waiting(&duplicate).await;
    Waiting {
        handler,
        original,
        duplicate,
        table,
        channel,
    }
}

impl Waiting {
    /// The duplicate answers its own original's response, though `role` notified
    /// `payloads` on the table's channel.
    async fn not_taken_in_by(self, role: Role, payloads: &[&str]) {
        let attacker = role.connect().await;
        for payload in payloads {
            let notify = "SELECT pg_notify($1, $2)";
            let sent = attacker.execute(notify, &[&self.channel, payload]).await;
            sent.expect("any role that connects may notify");
        }
        let waiting = (self.original, self.duplicate);
        the_duplicate_answers_its_own_original(&self.handler, waiting, 1).await;
        role.drop_role().await;
    }
}

/// What a completion's notification carried when it carried a record: the hex SHA-256
/// of the scope's storage key, the hex of a claim token, then in base64 a nonce and the
/// ChaCha20-Poly1305 sealing (bound to what precedes it) of the time of sealing, the TTL
/// and the record, under a key that SHA-256 derives from a label, the channel and the
/// storage key: all of which a role that reads the table, or guesses a scope, has.
fn forged_completion(channel: &str, scope: &Scope, token: [u8; 16], record: &Record) -> String {
    use base64::Engine as _;
    use chacha20poly1305::{aead::Aead, aead::KeyInit, aead::Payload, ChaCha20Poly1305};
    let hex = |bytes: &[u8]| -> String { bytes.iter().map(|b| format!("{b:02x}")).collect() };
    let storage_key = scope.storage_key().as_bytes();
    let mut named = hex(&Sha256::digest(storage_key));
    named.push_str(&hex(&token));
    let mut derived = Sha256::new();
    derived.update(b"tower-idempotency notified record\0");
    derived.update(channel.as_bytes());
    derived.update(b"\0");
    derived.update(storage_key);
    let cipher = ChaCha20Poly1305::new(&derived.finalize());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let mut plain = now.to_be_bytes().to_vec();
    plain.extend_from_slice(&u64::MAX.to_be_bytes());
    plain.extend_from_slice(&record.encode());
    let nonce = [9u8; 12];
    let payload = Payload {
        msg: &plain,
        aad: named.as_bytes(),
    };
    let sealed = cipher.encrypt(&nonce.into(), payload).unwrap();
    let mut carried = nonce.to_vec();
    carried.extend_from_slice(&sealed);
    named + &base64::engine::general_purpose::STANDARD.encode(carried)
}

/// The attacker's completed record: another payment id, its cookie, a redirect elsewhere.
fn forged_record(fingerprint: Fingerprint) -> Record {
    let mut headers = http::HeaderMap::new();
    headers.insert("content-type", "application/json".parse().unwrap());
    headers.insert("set-cookie", "session=attacker".parse().unwrap());
    headers.insert("location", "https://evil.example/".parse().unwrap());
    Record::Completed {
        fingerprint,
        response: StoredResponse {
            status: StatusCode::CREATED,
            headers,
            body: FORGED_BODY.into(),
            trailers: None,
        },
    }
}

/// A role that may only read the table finds the key in progress, reads its scope, its
/// claim token and its fingerprint, forges a completion for it and notifies the table's
/// channel, along with other made-up payloads. The duplicate waiting on the other instance
/// takes none of it.
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn postgres_a_role_that_reads_the_table_cannot_forge_a_completion() {
    let request = || post("/pay").key("read-by-a-role").body("amount=100");
    let waiting = postgres_waiting(|layer| layer, request).await;
    let (schema, _) = waiting.table.split_once('.').unwrap();
    let role = Role::create(&[
        format!("GRANT USAGE ON SCHEMA {schema} TO {{role}}"),
        format!("GRANT SELECT ON {} TO {{role}}", waiting.table),
    ])
    .await;
    let held = role
        .connect()
        .await
        .query_one(
            &format!(
                "SELECT idempotency_key, endpoint, principal, claim_token, request_hash \
                 FROM {} WHERE status = 'in_progress'",
                waiting.table
            ),
            &[],
        )
        .await
        .expect("the role reads the key in progress");
    let key = IdempotencyKey::parse(&held.get::<_, &str>(0).parse().unwrap()).unwrap();
    let scope = Scope::new(Some(held.get(2)), held.get(1), key);
    let token: &[u8] = held.get(3);
    let fingerprint: &[u8] = held.get(4);
    let fingerprint = Fingerprint::from_bytes(fingerprint.try_into().unwrap());
    let record = forged_record(fingerprint);
    let forged = forged_completion(&waiting.channel, &scope, token.try_into().unwrap(), &record);
    let payloads = [forged.as_str(), &forged[..96], &forged[..64], "", "garbage"];
    waiting.not_taken_in_by(role, &payloads).await;
}

/// A role that may only connect cannot read the table, but a scope made of a user id and a
/// sequential key can be guessed, and so can a fingerprint of a plain body: it forges a
/// completion for the guessed scope with a token of its own. The duplicate takes none of it.
#[tokio::test]
#[ignore = "needs PostgreSQL: scripts/test.sh"]
async fn postgres_a_role_that_only_connects_cannot_forge_a_completion_for_a_guessed_scope() {
    let by_user = |_: &http::request::Parts| Some("user_1001".to_owned());
    let guessed = || post("/pay").key("order-1002").body("amount=100");
    let waiting = postgres_waiting(|layer| layer.principal(by_user), guessed).await;
    let role = Role::create(&[]).await;
    let read = format!("SELECT 1 FROM {}", waiting.table);
    let denied = role.connect().await.query(&read, &[]).await;
    assert!(denied.is_err(), "the role reads nothing of the table");
    let key = IdempotencyKey::parse(&"order-1002".parse().unwrap()).unwrap();
    let scope = Scope::new(Some("user_1001".into()), "POST /pay".into(), key);
    let (parts, _) = guessed().build().into_parts();
    let fingerprint = Fingerprint::of(&parts, &[], b"amount=100");
    let record = forged_record(fingerprint);
    let forged = forged_completion(&waiting.channel, &scope, [7; 16], &record);
    waiting.not_taken_in_by(role, &[&forged]).await;
}

// ---------------------------------------------------------------------------------------
// Redis.

/// A client whose ACL denies every key but allows pub/sub: it lists the channels in use,
/// captures the genuine announcement of one payment's completion, publishes it on the
/// channel of another payment a duplicate waits on, and publishes garbage there too. The
/// channels show no principal and no idempotency key, and the duplicate takes nothing.
#[tokio::test]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn redis_a_pubsub_client_cannot_move_an_announcement_to_another_key() {
    pubsub_client_moves_an_announcement(None).await;
}

/// The same, with instances whose completions carry their records signed: the captured
/// message carries X's record and a valid signature, for X's channel. Moved to Y's, it
/// does not verify, and the duplicate reads its own key.
#[tokio::test]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn redis_a_pubsub_client_cannot_move_a_signed_record_to_another_key() {
    pubsub_client_moves_an_announcement(Some(b"the instances' shared secret")).await;
}

/// The attack of the two tests above, on instances that sign with `secret`, if any.
async fn pubsub_client_moves_an_announcement(secret: Option<&'static [u8]>) {
    let server = RedisServer::start();
    server.cli(&[
        "ACL",
        "SETUSER",
        "eavesdropper",
        "on",
        ">listening",
        "resetkeys",
        "resetchannels",
        "&*",
        "-@all",
        "+@pubsub",
        "+@connection",
    ]);
    let prefix = support::unique_prefix("forged");
    let open = || async {
        let store = RedisStore::open(&server.url())
            .await
            .unwrap()
            .prefix(prefix.clone());
        match secret {
            Some(secret) => store.announce_signed_records(secret),
            None => store.announce_outcomes(),
        }
    };
    let (a, b) = (open().await, open().await);
    let secret_key = "8e03978e-40d5-43e8-bc93-6894a57f9324";
    let y_key = b.redis_key(&scope(secret_key));
    let handler = Handler::default();
    let (app_a, app_b) = apps(Arc::new(a), Arc::new(b), &handler);

    let url = format!(
        "redis://eavesdropper:listening@127.0.0.1:{}/",
        server.port()
    );
    let eavesdropper = redis::Client::open(url).unwrap();
    let mut attacker = eavesdropper
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let read: redis::RedisResult<Option<Vec<u8>>> = redis::cmd("GET")
        .arg(&y_key)
        .query_async(&mut attacker)
        .await;
    assert!(read.is_err(), "the client reads no key");
    let mut pubsub = eavesdropper.get_async_pubsub().await.unwrap();
    pubsub.psubscribe("*").await.unwrap();

    // Payment X completes on A: its announcement is captured.
    let x = send(&app_a, post("/pay").key("x").body("amount=100")).await;
    assert_eq!(x.status, StatusCode::CREATED);
    let captured = tokio::time::timeout(Duration::from_secs(2), pubsub.on_message().next())
        .await
        .expect("X's completion is announced")
        .unwrap();
    let captured: Vec<u8> = captured.get_payload().unwrap();
    if secret.is_some() {
        assert!(
            captured.len() > 16 + x.body.len(),
            "a signed record is carried"
        );
    }

    // Payment Y, with the same body, runs on A; its duplicate waits on B.
    let original = spawn_send(&app_a, post_waiting(secret_key).body("amount=100"));
    until_executing(&handler, 2).await;
    let duplicate = spawn_send(&app_b, post("/pay").key(secret_key).body("amount=100"));
    still_waiting(&duplicate).await;
    let channels: Vec<String> = redis::cmd("PUBSUB")
        .arg("CHANNELS")
        .query_async(&mut attacker)
        .await
        .unwrap();
    assert_eq!(channels.len(), 1, "{channels:?}");
    let channel = &channels[0];
    for shown in [secret_key, "8e03978e", prefix.as_str(), "POST /pay"] {
        assert!(!channel.contains(shown), "{channel} shows {shown}");
    }
    let payloads: [&[u8]; 5] = [&captured, b"", &[0; 17], &[1; 16], &[b'x'; 5_000]];
    for payload in payloads {
        let _: i64 = redis::cmd("PUBLISH")
            .arg(channel)
            .arg(payload)
            .query_async(&mut attacker)
            .await
            .unwrap();
    }
    the_duplicate_answers_its_own_original(&handler, (original, duplicate), 2).await;
}

/// Two deployments on two databases of one Redis server, given the same prefix and the
/// same secret: Redis relays messages across its databases, so a payment completed on one
/// is announced, signed, on the very channel where the other's duplicate waits. The
/// signature covers the database: the duplicate does not take the record, and answers its
/// own original's response.
#[tokio::test]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn redis_a_deployment_on_another_database_cannot_answer_a_waiter() {
    let server = RedisServer::start();
    let prefix = support::unique_prefix("databases");
    another_database_cannot_answer_a_waiter(|database| {
        let url = format!("redis://127.0.0.1:{}/{database}", server.port());
        let prefix = prefix.clone();
        async move { RedisStore::open(&url).await.unwrap().prefix(prefix) }
    })
    .await;
}

/// The same through Sentinel, with clients the application configured for each database.
#[tokio::test]
#[ignore = "needs a Sentinel set: scripts/test.sh"]
async fn sentinel_a_deployment_on_another_database_cannot_answer_a_waiter() {
    let urls = support::urls_from("REDIS_SENTINEL_URLS");
    let master = std::env::var("REDIS_SENTINEL_MASTER").expect("REDIS_SENTINEL_MASTER");
    let prefix = support::unique_prefix("sentinel-databases");
    another_database_cannot_answer_a_waiter(|database| {
        let node = SentinelNodeConnectionInfo::default()
            .set_redis_connection_info(redis::RedisConnectionInfo::default().set_db(database));
        let client = SentinelClient::build(
            urls.clone(),
            master.clone(),
            Some(node),
            SentinelServerType::Master,
        )
        .unwrap();
        let prefix = prefix.clone();
        async move {
            let store = RedisStore::from_sentinel_client(client).await.unwrap();
            store.prefix(prefix)
        }
    })
    .await;
}

/// The attack of the two tests above, on stores that `open` makes for a database.
async fn another_database_cannot_answer_a_waiter<F, O>(open: F)
where
    F: Fn(i64) -> O,
    O: std::future::Future<Output = RedisStore>,
{
    let signed = |store: RedisStore| {
        Arc::new(store.announce_signed_records(b"the secret both deployments were given"))
    };
    let handler = Handler::default();
    let (app_a, app_b) = apps(signed(open(1).await), signed(open(1).await), &handler);
    let elsewhere = Handler::default();
    let other: Arc<dyn Store> = signed(open(2).await);
    let app_elsewhere = router(&elsewhere, layer(&other));

    let key = "5d7c1a8e-2b7e-4d0e-9a51-0f6f3c1b2a77";
    let original = spawn_send(&app_a, post_waiting(key).body("amount=100"));
    until_executing(&handler, 1).await;
    let duplicate = spawn_send(&app_b, post("/pay").key(key).body("amount=100"));
    still_waiting(&duplicate).await;
    // The same request on the other deployment executes there and is announced, signed.
    let there = send(&app_elsewhere, post("/pay").key(key).body("amount=100")).await;
    there.assert_executed();
    assert_eq!(elsewhere.executions(), 1);
    the_duplicate_answers_its_own_original(&handler, (original, duplicate), 1).await;
}
