//! The `payments` example's contract (DESIGN.md, "The `payments` example server"), checked
//! over real HTTP: every case runs against the in-memory store and against Redis, and two
//! tests run the compiled example binary itself.

#[path = "../examples/payments/app.rs"]
mod app;
mod support;

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, OnceLock},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use reqwest::{
    header::{HeaderMap, HeaderValue, CONTENT_TYPE, LOCATION, RETRY_AFTER},
    StatusCode,
};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::{
    io::AsyncWriteExt,
    net::{TcpListener, TcpStream},
    task::JoinHandle,
};
use tower_idempotency::Store;

/// The longest any wait in this file may take before the test fails.
const DEADLINE: Duration = Duration::from_secs(20);
/// The example's default in-progress lease.
const DEFAULT_LEASE_SECS: u64 = 30;
/// 2020-01-01 in unix milliseconds: a `created` before it is not in milliseconds.
const EPOCH_2020_MS: u64 = 1_577_836_800_000;
/// The default `max_request_body`.
const MAX_REQUEST_BODY: usize = 1024 * 1024;

// ---------------------------------------------------------------------------------------
// The matrix: one `#[tokio::test]` per (case, store).
// ---------------------------------------------------------------------------------------

macro_rules! contract {
    ($($case:ident),+ $(,)?) => {
        mod memory {
            $(
                #[tokio::test]
                async fn $case() {
                    let store = std::sync::Arc::new(tower_idempotency::MemoryStore::new());
                    super::$case(store).await;
                }
            )+
        }

        mod redis {
            $(
                #[tokio::test]
                async fn $case() {
                    let store = crate::support::shared_redis_store(stringify!($case)).await;
                    super::$case(store).await;
                }
            )+
        }
    };
}

contract!(
    payment_is_created_once_and_replayed,
    quoted_key_names_the_bare_key,
    key_is_required_on_payments_and_tokens,
    key_is_optional_on_refunds,
    reused_key_with_different_body_conflicts,
    declined_payment_is_replayed,
    failed_payment_is_released,
    concurrent_retry_is_told_to_wait_then_replayed,
    principals_do_not_share_keys,
    token_bytes_are_replayed,
    invalid_keys_are_rejected_without_execution,
    oversized_body_claims_nothing,
    client_disconnect_does_not_cancel_the_payment,
);

// ---------------------------------------------------------------------------------------
// The cases.
// ---------------------------------------------------------------------------------------

async fn payment_is_created_once_and_replayed(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();

    let first = api.pay(&key, "alice", &charge(1999)).await;
    first.assert_fresh();
    first.assert_payment(1999, "usd");

    let retry = api.pay(&key, "alice", &charge(1999)).await;
    retry.assert_replay_of(&first);
    assert_eq!(api.stats().await.payments_executed, 1);
}

async fn quoted_key_names_the_bare_key(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();

    let bare = api.pay(&key, "alice", &charge(500)).await;
    bare.assert_payment(500, "usd");
    let quoted = api.pay(&format!("\"{key}\""), "alice", &charge(500)).await;
    quoted.assert_replay_of(&bare);

    // Inside quotes a space is part of the key.
    let spaced = "\"order 42\"";
    let first = api.pay(spaced, "alice", &charge(501)).await;
    first.assert_payment(501, "usd");
    api.pay(spaced, "alice", &charge(501))
        .await
        .assert_replay_of(&first);
    assert_eq!(api.stats().await.payments_executed, 2);
}

async fn key_is_required_on_payments_and_tokens(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    for path in ["/v1/payments", "/v1/tokens"] {
        api.post(path)
            .user("alice")
            .json(&charge(100))
            .send()
            .await
            .assert_error(StatusCode::BAD_REQUEST, "idempotency_key_required");
    }
    assert_eq!(api.stats().await, Stats::default());
}

async fn key_is_optional_on_refunds(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let refund = || api.post("/v1/refunds").user("alice").json(&charge(250));

    // Without a key every request executes.
    let one = refund().send().await;
    let two = refund().send().await;
    let ids = [one.assert_refund(250), two.assert_refund(250)];
    assert_ne!(ids[0], ids[1], "two keyless refunds got one id");
    assert_eq!(api.stats().await.refunds_executed, 2);

    // With a key the retry is a replay.
    let key = fresh_key();
    let first = refund().key(&key).send().await;
    first.assert_fresh();
    first.assert_refund(250);
    refund().key(&key).send().await.assert_replay_of(&first);
    assert_eq!(api.stats().await.refunds_executed, 3);
}

async fn reused_key_with_different_body_conflicts(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();

    let first = api.pay(&key, "alice", &charge(1000)).await;
    first.assert_payment(1000, "usd");
    api.pay(&key, "alice", &charge(2000)).await.assert_error(
        StatusCode::CONFLICT,
        "idempotency_key_reused_with_different_params",
    );
    assert_eq!(api.stats().await.payments_executed, 1);

    // The conflict did not touch the record.
    api.pay(&key, "alice", &charge(1000))
        .await
        .assert_replay_of(&first);
}

async fn declined_payment_is_replayed(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();
    let declined = json!({ "amount": 4200, "currency": "eur", "simulate": "decline" });

    let first = api.pay(&key, "alice", &declined).await;
    first.assert_fresh();
    let body = first.assert_error(StatusCode::PAYMENT_REQUIRED, "card_declined");
    assert_id(&body["id"], "pay_");

    api.pay(&key, "alice", &declined)
        .await
        .assert_replay_of(&first);
    assert_eq!(api.stats().await.payments_executed, 1);
}

async fn failed_payment_is_released(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();
    let failing = json!({ "amount": 4200, "currency": "eur", "simulate": "error" });

    for executions in 1..=2 {
        let reply = api.pay(&key, "alice", &failing).await;
        assert_eq!(reply.status, StatusCode::INTERNAL_SERVER_ERROR, "{reply:?}");
        reply.assert_fresh();
        assert_eq!(api.stats().await.payments_executed, executions);
    }
}

async fn concurrent_retry_is_told_to_wait_then_replayed(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();
    let slow = slow_charge(1500);

    let first = api.pay_in_background(&key, "alice", &slow);
    // The handler counts itself on entry: from here on the first request holds the key.
    api.wait_for_payments(1).await;

    let retry_after = api.pay(&key, "alice", &slow).await.assert_in_progress();
    assert!(
        retry_after <= DEFAULT_LEASE_SECS,
        "retry_after {retry_after} is longer than the lease"
    );
    // A different body is a mismatch even while the first runs: retrying cannot fix it.
    api.pay(&key, "alice", &charge(1)).await.assert_error(
        StatusCode::CONFLICT,
        "idempotency_key_reused_with_different_params",
    );

    let first = first.await.expect("the first request");
    first.assert_fresh();
    first.assert_payment(700, "usd");
    api.pay(&key, "alice", &slow).await.assert_replay_of(&first);
    assert_eq!(api.stats().await.payments_executed, 1);
}

async fn principals_do_not_share_keys(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();

    let alice = api.pay(&key, "alice", &charge(300)).await;
    let bob = api.pay(&key, "bob", &charge(300)).await;
    bob.assert_fresh();
    let (alice_id, bob_id) = (
        alice.assert_payment(300, "usd"),
        bob.assert_payment(300, "usd"),
    );
    assert_ne!(alice_id, bob_id, "alice and bob share a payment");
    assert_eq!(api.stats().await.payments_executed, 2);

    // Each keeps their own record.
    api.pay(&key, "alice", &charge(300))
        .await
        .assert_replay_of(&alice);
    api.pay(&key, "bob", &charge(300))
        .await
        .assert_replay_of(&bob);
    assert_eq!(api.stats().await.payments_executed, 2);
}

async fn token_bytes_are_replayed(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();
    let token = || {
        api.post("/v1/tokens")
            .key(&key)
            .user("alice")
            .body("any body")
    };

    let first = token().send().await;
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    assert_eq!(
        first.header(CONTENT_TYPE.as_str()),
        Some("application/octet-stream")
    );
    assert_eq!(first.body.len(), 64, "{first:?}");
    first.assert_fresh();

    token().send().await.assert_replay_of(&first);
    assert_eq!(api.stats().await.tokens_executed, 1);
}

async fn invalid_keys_are_rejected_without_execution(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let repeated = fresh_key();
    let cases: [(&str, Vec<HeaderValue>); 9] = [
        ("empty", vec![HeaderValue::from_static("")]),
        ("256 characters", vec![header(&"k".repeat(256))]),
        (
            "256 quoted",
            vec![header(&format!("\"{}\"", "k".repeat(256)))],
        ),
        ("non-ASCII", vec![raw_header(b"caf\xc3\xa9")]),
        ("control character", vec![header("a\tb")]),
        ("bare space", vec![header("a b")]),
        ("unterminated quote", vec![header("\"abc")]),
        ("stray quote", vec![header("abc\"")]),
        ("two headers", vec![header(&repeated), header(&repeated)]),
    ];
    for path in ["/v1/payments", "/v1/refunds"] {
        for (what, keys) in &cases {
            let mut request = api.post(path).user("alice").json(&charge(100));
            for key in keys {
                request = request.raw_key(key.clone());
            }
            let reply = request.send().await;
            assert_eq!(
                reply.status,
                StatusCode::BAD_REQUEST,
                "{path}, {what}: {reply:?}"
            );
            reply.assert_error(StatusCode::BAD_REQUEST, "invalid_idempotency_key");
        }
    }
    assert_eq!(api.stats().await, Stats::default());

    // The repeated key was not claimed, and the longest valid key is accepted.
    for key in [repeated, "k".repeat(255)] {
        let reply = api.pay(&key, "alice", &charge(100)).await;
        reply.assert_fresh();
        reply.assert_payment(100, "usd");
    }
}

async fn oversized_body_claims_nothing(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();
    let padding = "x".repeat(MAX_REQUEST_BODY);
    let oversized = json!({ "amount": 100, "currency": "usd", "padding": padding });

    let reply = api.pay(&key, "alice", &oversized).await;
    let body = reply.assert_error(StatusCode::PAYLOAD_TOO_LARGE, "request_body_too_large");
    assert_eq!(body["limit"], MAX_REQUEST_BODY, "{reply:?}");
    assert_eq!(api.stats().await.payments_executed, 0);

    let small = api.pay(&key, "alice", &charge(100)).await;
    small.assert_fresh();
    small.assert_payment(100, "usd");
    assert_eq!(api.stats().await.payments_executed, 1);
}

async fn client_disconnect_does_not_cancel_the_payment(store: Arc<dyn Store>) {
    let (api, _server) = serve(store).await;
    let key = fresh_key();
    let slow = slow_charge(800);

    let mut socket = TcpStream::connect(api.addr).await.expect("connect");
    socket
        .write_all(&raw_payment(&key, "alice", &slow))
        .await
        .expect("send the payment");
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(socket);

    api.wait_for_payments(1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The handler may still be sleeping: retry as a client would until it is not in progress.
    let retry = eventually("the abandoned payment to be recorded", async || {
        let reply = api.pay(&key, "alice", &slow).await;
        (reply.error_code().as_deref() != Some("request_in_progress")).then_some(reply)
    })
    .await;
    assert!(retry.replayed(), "the retry executed again: {retry:?}");
    retry.assert_payment(700, "usd");
    assert_eq!(api.stats().await.payments_executed, 1);
}

// ---------------------------------------------------------------------------------------
// The compiled example binary (memory store).
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn example_binary_serves_and_replays() {
    let server = ExampleProcess::start(&[]).await;
    let api = &server.api;
    let key = fresh_key();

    let first = api.pay(&key, "alice", &charge(1234)).await;
    first.assert_fresh();
    first.assert_payment(1234, "usd");
    api.pay(&key, "alice", &charge(1234))
        .await
        .assert_replay_of(&first);
    assert_eq!(api.stats().await.payments_executed, 1);
}

#[tokio::test]
async fn example_binary_honours_lease_secs() {
    let server = ExampleProcess::start(&[("IDEMPOTENCY_LEASE_SECS", "2")]).await;
    let api = &server.api;
    let key = fresh_key();
    let slow = slow_charge(5000);

    let first = api.pay_in_background(&key, "alice", &slow);
    api.wait_for_payments(1).await;

    let retry_after = api.pay(&key, "alice", &slow).await.assert_in_progress();
    assert!(
        retry_after <= 2,
        "retry_after {retry_after} with a 2 s lease"
    );

    // Past the first lease the handler still holds the key: it renews its lease while it
    // runs, so a retry now is told to wait again (or, on a slow machine, replayed).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let late = api.pay(&key, "alice", &slow).await;
    if !late.replayed() {
        late.assert_in_progress();
    }
    assert_eq!(api.stats().await.payments_executed, 1);

    let first = first.await.expect("the first request");
    first.assert_payment(700, "usd");
    api.pay(&key, "alice", &slow).await.assert_replay_of(&first);
    assert_eq!(api.stats().await.payments_executed, 1);
}

// ---------------------------------------------------------------------------------------
// Serving the router, and a client for it.
// ---------------------------------------------------------------------------------------

/// The example's router on a loopback port; stops serving when dropped.
struct Server(JoinHandle<()>);

impl Drop for Server {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn serve(store: Arc<dyn Store>) -> (Api, Server) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local address");
    let (router, _stats) = app::router(store, app::Timing::default());
    let task = tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
    (Api::new(addr), Server(task))
}

/// What `GET /v1/stats` answers.
#[derive(Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
struct Stats {
    payments_executed: u64,
    refunds_executed: u64,
    tokens_executed: u64,
}

/// An HTTP client for one server.
#[derive(Clone)]
struct Api {
    addr: SocketAddr,
    http: reqwest::Client,
}

impl Api {
    fn new(addr: SocketAddr) -> Self {
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(DEADLINE)
            .build()
            .expect("HTTP client");
        Self { addr, http }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn post(&self, path: &str) -> Post {
        Post {
            request: self.http.post(self.url(path)),
        }
    }

    /// `POST /v1/payments` with `key`, as `user`.
    async fn pay(&self, key: &str, user: &str, charge: &Value) -> Reply {
        self.post("/v1/payments")
            .key(key)
            .user(user)
            .json(charge)
            .send()
            .await
    }

    /// [`Api::pay`] in a task of its own.
    fn pay_in_background(&self, key: &str, user: &str, charge: &Value) -> JoinHandle<Reply> {
        let (api, key, user, charge) = (
            self.clone(),
            key.to_owned(),
            user.to_owned(),
            charge.clone(),
        );
        tokio::spawn(async move { api.pay(&key, &user, &charge).await })
    }

    async fn try_stats(&self) -> Option<Stats> {
        let response = self.http.get(self.url("/v1/stats")).send().await.ok()?;
        assert_eq!(response.status(), StatusCode::OK);
        Some(response.json().await.expect("stats JSON"))
    }

    async fn stats(&self) -> Stats {
        self.try_stats().await.expect("GET /v1/stats")
    }

    /// Waits until the payments handler has been entered `n` times.
    async fn wait_for_payments(&self, n: u64) {
        eventually(&format!("{n} payment execution(s)"), async || {
            let executed = self.stats().await.payments_executed;
            assert!(executed <= n, "{executed} payment executions, expected {n}");
            (executed == n).then_some(())
        })
        .await;
    }
}

/// A `POST` being built.
struct Post {
    request: reqwest::RequestBuilder,
}

impl Post {
    fn key(self, key: &str) -> Self {
        self.raw_key(header(key))
    }

    /// Adds one `Idempotency-Key` header (call twice for two).
    fn raw_key(self, value: HeaderValue) -> Self {
        // `header` appends; `headers` would replace an earlier key.
        Self {
            request: self.request.header("idempotency-key", value),
        }
    }

    fn user(self, user: &str) -> Self {
        Self {
            request: self.request.bearer_auth(user),
        }
    }

    fn json(self, body: &Value) -> Self {
        Self {
            request: self
                .request
                .header(CONTENT_TYPE, "application/json")
                .body(body.to_string()),
        }
    }

    fn body(self, body: &'static str) -> Self {
        Self {
            request: self.request.body(body),
        }
    }

    async fn send(self) -> Reply {
        let response = self.request.send().await.expect("HTTP request");
        Reply {
            status: response.status(),
            headers: response.headers().clone(),
            body: response.bytes().await.expect("response body").to_vec(),
        }
    }
}

/// A whole response.
struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Vec<u8>,
}

impl std::fmt::Debug for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reply")
            .field("status", &self.status)
            .field("headers", &self.headers)
            .field("body", &String::from_utf8_lossy(&self.body))
            .finish()
    }
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        let value = self.headers.get(name)?;
        Some(value.to_str().expect("an ASCII header value"))
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {self:?}"))
    }

    fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    fn error_code(&self) -> Option<String> {
        let body: Value = serde_json::from_slice(&self.body).ok()?;
        body["error"].as_str().map(str::to_owned)
    }

    fn assert_fresh(&self) {
        assert!(
            self.headers.get("idempotent-replayed").is_none(),
            "expected an execution, got a replay: {self:?}"
        );
    }

    /// A JSON error answer with `status` and `code`; returns the body.
    fn assert_error(&self, status: StatusCode, code: &str) -> Value {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(
            self.header(CONTENT_TYPE.as_str()),
            Some("application/json"),
            "{self:?}"
        );
        let body = self.json();
        assert_eq!(body["error"], code, "{self:?}");
        body
    }

    /// `409 request_in_progress`, with `Retry-After` equal to the body's `retry_after`;
    /// returns it.
    fn assert_in_progress(&self) -> u64 {
        let body = self.assert_error(StatusCode::CONFLICT, "request_in_progress");
        let secs = body["retry_after"]
            .as_u64()
            .unwrap_or_else(|| panic!("retry_after is not a whole number: {self:?}"));
        assert!(secs >= 1, "{self:?}");
        let header = self.header(RETRY_AFTER.as_str()).expect("Retry-After");
        assert_eq!(header, secs.to_string(), "{self:?}");
        secs
    }

    /// A created payment; returns its id.
    fn assert_payment(&self, amount: i64, currency: &str) -> String {
        self.assert_created("pay_", "/v1/payments", amount, currency)
    }

    /// A created refund; returns its id.
    fn assert_refund(&self, amount: i64) -> String {
        self.assert_created("re_", "/v1/refunds", amount, "usd")
    }

    fn assert_created(
        &self,
        prefix: &str,
        collection: &str,
        amount: i64,
        currency: &str,
    ) -> String {
        assert_eq!(self.status, StatusCode::CREATED, "{self:?}");
        let body = self.json();
        let id = assert_id(&body["id"], prefix);
        assert_eq!(
            self.header(LOCATION.as_str()),
            Some(format!("{collection}/{id}").as_str()),
            "{self:?}"
        );
        assert_eq!(body["amount"], amount, "{self:?}");
        assert_eq!(body["currency"], currency, "{self:?}");
        assert_eq!(body["status"], "succeeded", "{self:?}");
        let created = body["created"]
            .as_u64()
            .unwrap_or_else(|| panic!("created is not an integer: {self:?}"));
        assert!(
            (EPOCH_2020_MS..=now_ms() + 60_000).contains(&created),
            "created {created} is not a recent unix time in milliseconds"
        );
        id
    }

    /// The recorded answer to `first`, byte for byte, marked as a replay.
    fn assert_replay_of(&self, first: &Reply) {
        assert!(self.replayed(), "expected a replay, got: {self:?}");
        assert_eq!(self.status, first.status, "{self:?}\nfirst: {first:?}");
        assert_eq!(self.body, first.body, "{self:?}\nfirst: {first:?}");
        for name in [LOCATION, CONTENT_TYPE] {
            assert_eq!(
                self.headers.get(&name),
                first.headers.get(&name),
                "{name}: {self:?}\nfirst: {first:?}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// The example binary as a child process.
// ---------------------------------------------------------------------------------------

/// The `payments` example running as a process of its own; killed when dropped.
struct ExampleProcess {
    child: Child,
    api: Api,
}

impl ExampleProcess {
    /// Starts it on a free port with the in-memory store and `env`, and waits until it
    /// answers `GET /v1/stats`.
    async fn start(env: &[(&str, &str)]) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let child = Command::new(example_binary())
            .env("PAYMENTS_ADDR", addr.to_string())
            .env_remove("REDIS_URL")
            .env_remove("DATABASE_URL")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the payments example");
        let mut process = Self {
            child,
            api: Api::new(addr),
        };
        let deadline = Instant::now() + DEADLINE;
        while process.api.try_stats().await.is_none() {
            if let Some(status) = process.child.try_wait().expect("child status") {
                panic!("the payments example exited: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "the payments example never answered"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        process
    }
}

impl Drop for ExampleProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `target/<profile>/examples/payments`, next to this test's own
/// `target/<profile>/deps/<name>`.
///
/// Built (or found up to date) by cargo first: `cargo test --test payments_contract` does
/// not build examples, and a stale binary would test old code.
fn example_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| {
        let exe = std::env::current_exe().expect("test binary path");
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("target/<profile>/deps/<test>");
        let profile = match profile_dir.file_name().and_then(|name| name.to_str()) {
            Some("debug") => "dev",
            Some(name) => name,
            None => panic!("no profile directory in {}", exe.display()),
        };
        let target_dir = profile_dir.parent().expect("target directory");
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let output = Command::new(cargo)
            .args(["build", "--example", "payments", "--profile", profile])
            .args([
                "--manifest-path",
                concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"),
            ])
            .arg("--target-dir")
            .arg(target_dir)
            .output()
            .expect("run cargo");
        assert!(
            output.status.success(),
            "cargo build --example payments: {}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        let binary = profile_dir
            .join("examples")
            .join(format!("payments{}", std::env::consts::EXE_SUFFIX));
        assert!(binary.is_file(), "{} is missing", binary.display());
        binary
    })
}

// ---------------------------------------------------------------------------------------
// Small helpers.
// ---------------------------------------------------------------------------------------

fn fresh_key() -> String {
    format!("{:032x}", rand::random::<u128>())
}

fn charge(amount: i64) -> Value {
    json!({ "amount": amount, "currency": "usd" })
}

fn slow_charge(delay_ms: u64) -> Value {
    json!({ "amount": 700, "currency": "usd", "simulate": "slow", "delay_ms": delay_ms })
}

fn header(value: &str) -> HeaderValue {
    HeaderValue::from_str(value).expect("a header value")
}

fn raw_header(bytes: &[u8]) -> HeaderValue {
    HeaderValue::from_bytes(bytes).expect("a header value")
}

/// A complete HTTP/1.1 `POST /v1/payments`, as bytes.
fn raw_payment(key: &str, user: &str, charge: &Value) -> Vec<u8> {
    let body = charge.to_string();
    format!(
        "POST /v1/payments HTTP/1.1\r\nhost: 127.0.0.1\r\nidempotency-key: {key}\r\n\
         authorization: Bearer {user}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Checks that `id` is a string `<prefix><something>` and returns it.
fn assert_id(id: &Value, prefix: &str) -> String {
    let id = id
        .as_str()
        .unwrap_or_else(|| panic!("id {id} is not a string"));
    assert!(
        id.starts_with(prefix) && id.len() > prefix.len(),
        "id {id} does not start with {prefix}"
    );
    id.to_owned()
}

fn now_ms() -> u64 {
    let since_epoch = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock");
    u64::try_from(since_epoch.as_millis()).expect("milliseconds fit in u64")
}

/// Polls `probe` until it returns `Some`, failing after [`DEADLINE`].
async fn eventually<T, F>(what: &str, mut probe: F) -> T
where
    F: AsyncFnMut() -> Option<T>,
{
    let deadline = Instant::now() + DEADLINE;
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}
