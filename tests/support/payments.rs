//! The `payments` example over real HTTP: a client for its API ([`Api`], [`Reply`]), and
//! the compiled example binary as a child process ([`ExampleProcess`]).

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::OnceLock,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use reqwest::{
    header::{HeaderMap, HeaderValue, CONTENT_TYPE, LOCATION, RETRY_AFTER},
    StatusCode,
};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::task::JoinHandle;

/// The longest any wait (and any HTTP request, unless it sets its own timeout) may take
/// before the test fails.
pub const DEADLINE: Duration = Duration::from_secs(20);
/// 2020-01-01 in unix milliseconds: a `created` before it is not in milliseconds.
const EPOCH_2020_MS: u64 = 1_577_836_800_000;

// ---------------------------------------------------------------------------------------
// A client for the API.
// ---------------------------------------------------------------------------------------

/// What `GET /v1/stats` answers: handler executions, never replays.
#[derive(Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Stats {
    pub payments_executed: u64,
    pub refunds_executed: u64,
    pub tokens_executed: u64,
    pub webhooks_executed: u64,
}

/// An HTTP client for one payments server.
#[derive(Clone)]
pub struct Api {
    addr: SocketAddr,
    http: reqwest::Client,
}

impl Api {
    /// A client for the server at `addr`; each request times out after [`DEADLINE`].
    pub fn new(addr: SocketAddr) -> Self {
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(DEADLINE)
            .build()
            .expect("HTTP client");
        Self { addr, http }
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// A `POST` to `path`, to be built further and sent.
    pub fn post(&self, path: &str) -> Post {
        Post {
            request: self.http.post(self.url(path)),
        }
    }

    /// `POST /v1/payments` with `key`, as `user`.
    pub async fn pay(&self, key: &str, user: &str, charge: &Value) -> Reply {
        self.post("/v1/payments")
            .key(key)
            .user(user)
            .json(charge)
            .send()
            .await
    }

    /// [`Api::pay`] in a task of its own.
    pub fn pay_in_background(&self, key: &str, user: &str, charge: &Value) -> JoinHandle<Reply> {
        let (api, key, user, charge) = (
            self.clone(),
            key.to_owned(),
            user.to_owned(),
            charge.clone(),
        );
        tokio::spawn(async move { api.pay(&key, &user, &charge).await })
    }

    /// `GET /v1/stats`, or `None` while the server does not answer.
    pub async fn try_stats(&self) -> Option<Stats> {
        let response = self.http.get(self.url("/v1/stats")).send().await.ok()?;
        assert_eq!(response.status(), StatusCode::OK);
        Some(response.json().await.expect("stats JSON"))
    }

    /// Whether the server answers `GET /v1/stats` yet.
    pub async fn answers(&self) -> bool {
        let response = self.http.get(self.url("/v1/stats")).send().await;
        response.is_ok_and(|r| r.status() == StatusCode::OK)
    }

    /// `GET /v1/stats`, the body as text.
    pub async fn stats_text(&self) -> String {
        let response = self.http.get(self.url("/v1/stats")).send().await;
        response
            .expect("GET /v1/stats")
            .text()
            .await
            .expect("stats body")
    }

    /// `GET /v1/stats`.
    pub async fn stats(&self) -> Stats {
        self.try_stats().await.expect("GET /v1/stats")
    }

    /// Waits until the payments handler has been entered `n` times (and fails if it is
    /// entered more often).
    pub async fn wait_for_payments(&self, n: u64) {
        eventually(&format!("{n} payment execution(s)"), async || {
            let executed = self.stats().await.payments_executed;
            assert!(executed <= n, "{executed} payment executions, expected {n}");
            (executed == n).then_some(())
        })
        .await;
    }
}

/// A `POST` being built.
pub struct Post {
    request: reqwest::RequestBuilder,
}

impl Post {
    /// Adds `Idempotency-Key: <key>`.
    pub fn key(self, key: &str) -> Self {
        self.raw_key(header(key))
    }

    /// Adds one `Idempotency-Key` header (call twice for two).
    pub fn raw_key(self, value: HeaderValue) -> Self {
        // `header` appends; `headers` would replace an earlier key.
        Self {
            request: self.request.header("idempotency-key", value),
        }
    }

    /// Adds `Authorization: Bearer <user>`: the example's principal.
    pub fn user(self, user: &str) -> Self {
        Self {
            request: self.request.bearer_auth(user),
        }
    }

    /// Adds `Authorization: <value>` as it is.
    pub fn authorization(self, value: &str) -> Self {
        Self {
            request: self.request.header(reqwest::header::AUTHORIZATION, value),
        }
    }

    /// Adds `Connection: close`: for a request the server may answer before reading its
    /// body (a `413`), after which it closes the connection, so that the client's pool
    /// does not hand that connection to the next request.
    pub fn closing(self) -> Self {
        Self {
            request: self.request.header(reqwest::header::CONNECTION, "close"),
        }
    }

    /// Sends `body` as JSON.
    pub fn json(self, body: &Value) -> Self {
        self.typed("application/json", body.to_string())
    }

    /// Sends `body` as `application/x-www-form-urlencoded` (`amount=1999&currency=usd`).
    pub fn form(self, body: &'static str) -> Self {
        self.typed("application/x-www-form-urlencoded", body)
    }

    /// Sends `body`, spelled as it is, as JSON.
    pub fn json_text(self, body: impl Into<String>) -> Self {
        self.typed("application/json", body.into())
    }

    /// Sends `body` as `content_type`.
    pub fn typed(self, content_type: &str, body: impl Into<reqwest::Body>) -> Self {
        Self {
            request: self.request.header(CONTENT_TYPE, content_type).body(body),
        }
    }

    /// Sends `body` as it is.
    pub fn body(self, body: &'static str) -> Self {
        Self {
            request: self.request.body(body),
        }
    }

    /// Lets this request take up to `timeout` instead of [`DEADLINE`].
    pub fn timeout(self, timeout: Duration) -> Self {
        Self {
            request: self.request.timeout(timeout),
        }
    }

    /// Sends it and reads the whole answer; fails the test if there is none.
    pub async fn send(self) -> Reply {
        self.try_send().await.expect("HTTP request")
    }

    /// Sends it and reads the whole answer: `None` when the server never answered whole
    /// (it was killed, or refused the connection).
    pub async fn try_send(self) -> Option<Reply> {
        let response = self.request.send().await.ok()?;
        Some(Reply {
            status: response.status(),
            headers: response.headers().clone(),
            body: response.bytes().await.ok()?.to_vec(),
        })
    }
}

/// A whole response.
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
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
    /// The header's value, which must be ASCII.
    pub fn header(&self, name: &str) -> Option<&str> {
        let value = self.headers.get(name)?;
        Some(value.to_str().expect("an ASCII header value"))
    }

    /// The body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {self:?}"))
    }

    /// Marked `Idempotent-Replayed: true`.
    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// The `error` of a JSON error body.
    pub fn error_code(&self) -> Option<String> {
        let body: Value = serde_json::from_slice(&self.body).ok()?;
        body["error"].as_str().map(str::to_owned)
    }

    /// Answered by the handler, not replayed.
    pub fn assert_fresh(&self) {
        assert!(
            self.headers.get("idempotent-replayed").is_none(),
            "expected an execution, got a replay: {self:?}"
        );
    }

    /// A JSON error answer with `status` and `code`; returns the body.
    pub fn assert_error(&self, status: StatusCode, code: &str) -> Value {
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
    pub fn assert_in_progress(&self) -> u64 {
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
    pub fn assert_payment(&self, amount: i64, currency: &str) -> String {
        self.assert_created("pay_", "/v1/payments", amount, currency)
    }

    /// A created refund; returns its id.
    pub fn assert_refund(&self, amount: i64) -> String {
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
    pub fn assert_replay_of(&self, first: &Reply) {
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
///
/// Its output (the log) goes to a file under `CARGO_TARGET_TMPDIR`, removed when the
/// process is dropped unless the test is failing.
pub struct ExampleProcess {
    child: Child,
    api: Api,
    env: Vec<(String, String)>,
    log: PathBuf,
}

impl ExampleProcess {
    /// Starts it on a free loopback port with `env`, and waits until it answers
    /// `GET /v1/stats`.
    ///
    /// The test's own store settings (`REDIS_URL`, `REDIS_CLUSTER_URLS`,
    /// `REDIS_SENTINEL_URLS`, `DATABASE_URL`, ...) are not passed on: the store is in-memory
    /// unless `env` names one. Unless `env` sets `IDEMPOTENCY_PREFIX`, its Redis keys go
    /// under a `test:` prefix of their own, which the test script removes after a run.
    pub async fn start(env: &[(&str, &str)]) -> Self {
        let mut env: Vec<(String, String)> = env
            .iter()
            .map(|&(name, value)| (name.to_owned(), value.to_owned()))
            .collect();
        if !env.iter().any(|(name, _)| name == "IDEMPOTENCY_PREFIX") {
            let prefix = super::unique_prefix("payments_example");
            env.push(("IDEMPOTENCY_PREFIX".to_owned(), prefix));
        }
        Self::spawn(env).await
    }

    /// Another process with the same environment (so on the same store, with the same
    /// TTL and lease) on a port of its own.
    pub async fn start_another(&self) -> Self {
        Self::spawn(self.env.clone()).await
    }

    async fn spawn(env: Vec<(String, String)>) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let log = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("payments-{port}.log"));
        let output = std::fs::File::create(&log).expect("example log file");
        let child = Command::new(example_binary())
            .env("PAYMENTS_ADDR", addr.to_string())
            .env_remove("REDIS_URL")
            .env_remove("REDIS_CLUSTER_URLS")
            .env_remove("REDIS_SENTINEL_URLS")
            .env_remove("REDIS_SENTINEL_MASTER")
            .env_remove("IDEMPOTENCY_REPLICAS")
            .env_remove("DATABASE_URL")
            .envs(env.iter().map(|(name, value)| (name, value)))
            .stdin(Stdio::null())
            .stdout(output.try_clone().expect("example log file"))
            .stderr(output)
            .spawn()
            .expect("start the payments example");
        let mut process = Self {
            child,
            api: Api::new(addr),
            env,
            log,
        };
        let deadline = Instant::now() + DEADLINE;
        while !process.api.answers().await {
            if let Some(status) = process.child.try_wait().expect("child status") {
                let log = std::fs::read_to_string(&process.log).unwrap_or_default();
                panic!("the payments example exited: {status}\n{log}");
            }
            assert!(
                Instant::now() < deadline,
                "the payments example never answered"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        process
    }

    /// What it has logged so far.
    #[allow(dead_code)] // Not every test reads the log.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).expect("the example's log")
    }

    /// A client for it.
    pub fn api(&self) -> &Api {
        &self.api
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.api.addr()
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.addr().port()
    }

    /// Kills it with SIGKILL (a crash: no graceful shutdown, nothing released) and waits
    /// until it is gone.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for ExampleProcess {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!(
                "the payments example on port {} logged to {}",
                self.port(),
                self.log.display()
            );
        } else {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

/// `target/<profile>/examples/payments`, next to this test's own
/// `target/<profile>/deps/<name>`.
///
/// Built (or found up to date) by cargo first: `cargo test --test <name>` does not build
/// examples, and a stale binary would test old code. It is built with exactly this test's
/// features, as `cargo test` builds it into the same path: with other features the two
/// builds would overwrite each other and relink the example on every run.
pub fn example_binary() -> &'static Path {
    static BINARY: OnceLock<PathBuf> = OnceLock::new();
    BINARY.get_or_init(|| build_example("payments"))
}

/// Builds example `name` with this test's features (see [`example_binary`]) and returns
/// the path of its binary.
pub fn build_example(name: &str) -> PathBuf {
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
    let features = test_features().join(",");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(cargo)
        .args(["build", "--example", name, "--profile", profile])
        .args(["--no-default-features", "--features", &features])
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
        "cargo build --example {name} --features {features:?}: {}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    let binary = profile_dir
        .join("examples")
        .join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(binary.is_file(), "{} is missing", binary.display());
    binary
}

/// The crate features this test was built with. `default` counts: `--all-features` turns it
/// on, and cargo tells builds apart by their feature lists, not by what the lists enable.
fn test_features() -> Vec<&'static str> {
    [
        ("default", cfg!(feature = "default")),
        ("memory", cfg!(feature = "memory")),
        ("redis", cfg!(feature = "redis")),
        ("postgres", cfg!(feature = "postgres")),
        ("axum", cfg!(feature = "axum")),
        ("hyper", cfg!(feature = "hyper")),
        ("tonic", cfg!(feature = "tonic")),
        ("client", cfg!(feature = "client")),
        ("reqwest", cfg!(feature = "reqwest")),
        ("sqlx", cfg!(feature = "sqlx")),
    ]
    .into_iter()
    .filter_map(|(feature, enabled)| enabled.then_some(feature))
    .collect()
}

// ---------------------------------------------------------------------------------------
// Small helpers.
// ---------------------------------------------------------------------------------------

/// A random idempotency key no other test uses.
pub fn fresh_key() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// A plain payment body of `amount` cents in `usd`.
pub fn charge(amount: i64) -> Value {
    json!({ "amount": amount, "currency": "usd" })
}

/// A payment body of 700 `usd` whose handler sleeps `delay_ms` before succeeding.
pub fn slow_charge(delay_ms: u64) -> Value {
    json!({ "amount": 700, "currency": "usd", "simulate": "slow", "delay_ms": delay_ms })
}

/// A header value from a string.
pub fn header(value: &str) -> HeaderValue {
    HeaderValue::from_str(value).expect("a header value")
}

/// A header value from raw bytes.
pub fn raw_header(bytes: &[u8]) -> HeaderValue {
    HeaderValue::from_bytes(bytes).expect("a header value")
}

/// A complete HTTP/1.1 `POST /v1/payments`, as bytes, for a client that does not wait for
/// the answer.
pub fn raw_payment(key: &str, user: &str, charge: &Value) -> Vec<u8> {
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
pub fn assert_id(id: &Value, prefix: &str) -> String {
    let id = id
        .as_str()
        .unwrap_or_else(|| panic!("id {id} is not a string"));
    assert!(
        id.starts_with(prefix) && id.len() > prefix.len(),
        "id {id} does not start with {prefix}"
    );
    id.to_owned()
}

/// Now, in unix milliseconds.
pub fn now_ms() -> u64 {
    let since_epoch = SystemTime::now().duration_since(UNIX_EPOCH).expect("clock");
    u64::try_from(since_epoch.as_millis()).expect("milliseconds fit in u64")
}

/// Polls `probe` until it returns `Some`, failing after [`DEADLINE`].
pub async fn eventually<T, F>(what: &str, probe: F) -> T
where
    F: AsyncFnMut() -> Option<T>,
{
    eventually_within(DEADLINE, what, probe).await
}

/// Polls `probe` until it returns `Some`, failing once `limit` has passed (a probe that
/// started in time may finish later).
pub async fn eventually_within<T, F>(limit: Duration, what: &str, mut probe: F) -> T
where
    F: AsyncFnMut() -> Option<T>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}
