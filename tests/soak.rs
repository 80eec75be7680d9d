//! Soak: mixed traffic over real HTTP against two independent service instances sharing one
//! Redis, through a Redis restart, then the checks of what the layer promises.
//!
//! Two `RedisStore` connections and two `IdempotencyLayer`s, each around its own axum router
//! on its own loopback port; one `redis-server` of the test's own, killed mid-run and started
//! again empty (the services are not restarted). Every handler execution is written to a
//! ledger both instances share, with the exact body it answered (unique per execution).
//!
//! A restart empties Redis, so a key may legitimately run once per Redis lifetime ("epoch").
//! Which epoch served a claim follows from when things happened: a handler that started
//! before the new Redis was spawned claimed in the old one; a request sent once the old one
//! was dead claimed in the new one. A request sent before that whose handler started after
//! the spawn may be either, and the checks accept any epoch assignment consistent with
//! those bounds. Replays and mismatched bodies are only sent while no restart is under way,
//! so their epoch is always known.

mod support;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    ops::RangeInclusive,
    sync::{
        atomic::{AtomicU64, AtomicU8, Ordering::SeqCst},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use axum::{
    body::Body,
    extract::{Request, State},
    http::{header::CONTENT_LENGTH, HeaderMap, HeaderValue, StatusCode},
    response::Response,
    routing::post,
    Router,
};
use bytes::Bytes;
use futures_util::{stream, StreamExt};
use http_body_util::BodyExt;
use rand::{rngs::StdRng, Rng, SeedableRng};
use support::{
    app::{handle, Handler},
    redis_server::RedisServer,
};
use tokio::{net::TcpListener, sync::RwLock, time::sleep};
use tower_idempotency::{IdempotencyLayer, RedisStore, REPLAYED_HEADER};

/// Client tasks sending at the same time (a duplicate pair counts as one).
const CLIENTS: usize = 16;
/// How long the clients send traffic, and the bound on each client's actions.
const TRAFFIC: Duration = Duration::from_secs(22);
const MAX_ACTIONS_PER_CLIENT: usize = 5_000;
/// When Redis is killed (from the start of the traffic), and how long it stays down.
const KILL_AFTER: Duration = Duration::from_secs(8);
const OUTAGE: Duration = Duration::from_millis(1_500);
/// The in-progress lease, short so that leases run out within the test.
const LEASE: Duration = Duration::from_secs(1);
/// Attempts at a key whose first executions answer 500, and the pause after a 503.
const RETRY_ATTEMPTS: usize = 8;
const RETRY_PAUSE: Duration = Duration::from_millis(100);
/// A bound on any one request; one that takes longer fails the test.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(20);
/// 503s are expected from the kill until the connections have come back, at most this long
/// after Redis answers again.
const RECOVERY_GRACE: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn mixed_traffic_across_two_instances_through_a_redis_restart() {
    let started = Instant::now();
    let redis = RedisServer::start();
    let shared = Arc::new(Shared::default());
    let urls = [
        serve(&shared, &redis.url()).await,
        serve(&shared, &redis.url()).await,
    ];
    let http = reqwest::Client::builder()
        .timeout(REQUEST_TIMEOUT)
        .build()
        .unwrap();

    let deadline = Instant::now() + TRAFFIC;
    let restart = tokio::spawn(restart_redis(redis, shared.clone(), KILL_AFTER));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let client = Client {
                http: http.clone(),
                urls: urls.clone(),
                shared: shared.clone(),
                rng: StdRng::from_os_rng(),
            };
            tokio::spawn(client.run(deadline))
        })
        .collect();
    for client in clients {
        client.await.expect("client task");
    }
    let _redis = restart.await.expect("restart task");

    // Whatever is still claimed (a write lost in the outage) frees within one lease.
    sleep(LEASE + Duration::from_millis(500)).await;
    final_round(&http, &urls, &shared).await;

    let log = shared.log.lock().unwrap().clone();
    let ledger = shared.ledger.lock().unwrap().clone();
    let restarted_at = *shared.restart.restarted_at.lock().unwrap();
    let restarted_at = restarted_at.expect("the restart happened");
    let report = check(&log, &ledger, restarted_at);
    println!(
        "soak: {:.1}s {}",
        started.elapsed().as_secs_f64(),
        report.counts
    );
    report.assert_no_violations();
    report.counts.assert_mixed();
}

// ---------------------------------------------------------------------------------------
// The restart, and the epochs it delimits.
// ---------------------------------------------------------------------------------------

/// Where the Redis restart stands; it only moves forward, and only while the gate is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    /// The first Redis serves.
    Up,
    /// It is being killed.
    Killing,
    /// It is dead; none serves.
    Down,
    /// The second one is being started.
    Starting,
    /// The second one serves.
    Restarted,
}

impl Phase {
    const ALL: [Phase; 5] = [
        Phase::Up,
        Phase::Killing,
        Phase::Down,
        Phase::Starting,
        Phase::Restarted,
    ];

    /// The epoch a request made entirely within this phase is served in, if any.
    fn epoch(self) -> Option<usize> {
        match self {
            Phase::Up => Some(0),
            Phase::Restarted => Some(1),
            _ => None,
        }
    }
}

/// The epochs that can have served a claim made after phase `from` and before phase `to`:
/// from `Down` on only the new Redis can serve, and until `Starting` only the old one can.
fn epochs(from: Phase, to: Phase) -> RangeInclusive<usize> {
    usize::from(from >= Phase::Down)..=usize::from(to >= Phase::Starting)
}

#[derive(Default)]
struct Restart {
    phase: AtomicU8,
    /// Held (read) by every replay or mismatch for its whole exchange, and (write) by the
    /// restart from before the kill until Redis answers again.
    gate: RwLock<()>,
    restarted_at: Mutex<Option<Instant>>,
}

impl Restart {
    fn phase(&self) -> Phase {
        Phase::ALL[usize::from(self.phase.load(SeqCst))]
    }

    fn enter(&self, phase: Phase) {
        self.phase.store(phase as u8, SeqCst);
    }
}

/// Kills Redis `after` the traffic began, waits for the outage, and starts it again.
async fn restart_redis(server: RedisServer, shared: Arc<Shared>, after: Duration) -> RedisServer {
    sleep(after).await;
    let restart = &shared.restart;
    let _gate = restart.gate.write().await;
    restart.enter(Phase::Killing);
    let server = blocking(server, RedisServer::stop).await;
    restart.enter(Phase::Down);
    sleep(OUTAGE).await;
    restart.enter(Phase::Starting);
    let server = blocking(server, RedisServer::restart).await;
    restart.enter(Phase::Restarted);
    *restart.restarted_at.lock().unwrap() = Some(Instant::now());
    server
}

async fn blocking(mut server: RedisServer, action: fn(&mut RedisServer)) -> RedisServer {
    tokio::task::spawn_blocking(move || {
        action(&mut server);
        server
    })
    .await
    .unwrap()
}

// ---------------------------------------------------------------------------------------
// The two service instances and their shared ledger.
// ---------------------------------------------------------------------------------------

#[derive(Default)]
struct Shared {
    restart: Restart,
    /// Every handler execution, from both instances.
    ledger: Mutex<Vec<Execution>>,
    /// Every request sent and what came back.
    log: Mutex<Vec<Exchange>>,
    /// Keys that completed, by the epoch they certainly completed in: replay targets.
    completed: Mutex<[Vec<Completed>; 2]>,
    /// Every key sent, with its body, for the final round.
    keys: Mutex<Vec<(String, String)>>,
    handler: Handler,
    next_key: AtomicU64,
    next_request: AtomicU64,
}

#[derive(Clone, Debug)]
struct Execution {
    key: String,
    request: u64,
    started: Instant,
    ended: Instant,
    started_in: Phase,
    status: StatusCode,
    body: Bytes,
}

impl Execution {
    /// Whether the layer released the key instead of recording the response.
    fn released(&self) -> bool {
        self.status.is_server_error()
    }
}

/// One instance: its own Redis connection, its own layer, its own server; returns its URL.
async fn serve(shared: &Arc<Shared>, redis_url: &str) -> String {
    let store = RedisStore::open(redis_url).await.expect("connect to Redis");
    let app = Router::new()
        .route("/pay", post(ledgered))
        .layer(IdempotencyLayer::new(store).allow_anonymous().lease(LEASE))
        .with_state(shared.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/pay", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

/// The test handler `handle`, plus random bytes that make each body unique, recorded.
async fn ledgered(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let key = header(&request, "idempotency-key");
    let id = header(&request, "x-request-id").parse().unwrap();
    let started_in = shared.restart.phase();
    let started = Instant::now();
    let response = handle(State(shared.handler.clone()), request).await;
    let (mut parts, body) = response.into_parts();
    let mut bytes = body.collect().await.unwrap().to_bytes().to_vec();
    bytes.extend_from_slice(&rand::random::<[u8; 16]>());
    parts.headers.remove(CONTENT_LENGTH);
    let body = Bytes::from(bytes);
    shared.ledger.lock().unwrap().push(Execution {
        key,
        request: id,
        started,
        ended: Instant::now(),
        started_in,
        status: parts.status,
        body: body.clone(),
    });
    Response::from_parts(parts, Body::from(body))
}

fn header(request: &Request, name: &str) -> String {
    request.headers()[name].to_str().unwrap().to_owned()
}

// ---------------------------------------------------------------------------------------
// The clients.
// ---------------------------------------------------------------------------------------

/// Why a request was sent, which decides the answers it may get.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    /// A new key, sent once.
    First,
    /// A new key, sent to both instances at once.
    Duplicate,
    /// A new key, answered 500 by its first executions, retried until it completes.
    Retry,
    /// A key that completed in this epoch, same body (the request with this id completed it).
    Replay { of: u64 },
    /// A key that completed in this epoch, another body.
    Mismatch,
    /// Every key once more, after the traffic and one lease.
    Final,
}

/// What a request was, for one send.
#[derive(Clone)]
struct Call {
    key: String,
    body: String,
    headers: Vec<(&'static str, String)>,
    action: Action,
}

#[derive(Clone, Debug)]
struct Exchange {
    id: u64,
    instance: usize,
    key: String,
    body: String,
    action: Action,
    sent: Instant,
    sent_in: Phase,
    received: Instant,
    received_in: Phase,
    answer: Result<Answer, String>,
}

#[derive(Clone, Debug)]
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

/// How the layer answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// The handler ran and answered (the ledger must hold it).
    Executed,
    Replayed,
    InProgress,
    Mismatch,
    Unavailable,
    /// No answer (a transport error or the timeout).
    Failed,
}

impl Exchange {
    fn outcome(&self) -> Outcome {
        let Ok(answer) = &self.answer else {
            return Outcome::Failed;
        };
        if answer.headers.get(REPLAYED_HEADER) == Some(&HeaderValue::from_static("true")) {
            return Outcome::Replayed;
        }
        let error = serde_json::from_slice::<serde_json::Value>(&answer.body)
            .ok()
            .and_then(|json| json["error"].as_str().map(str::to_owned));
        match (answer.status.as_u16(), error.as_deref()) {
            (409, Some("request_in_progress")) => Outcome::InProgress,
            (409, Some("idempotency_key_reused_with_different_params")) => Outcome::Mismatch,
            (503, Some("idempotency_store_unavailable")) => Outcome::Unavailable,
            _ => Outcome::Executed,
        }
    }

    fn status(&self) -> Option<StatusCode> {
        self.answer.as_ref().ok().map(|answer| answer.status)
    }

    /// Whether the handler ran and its response was recorded.
    fn completed(&self) -> bool {
        self.outcome() == Outcome::Executed && self.status().is_some_and(|s| !s.is_server_error())
    }

    /// Whether the handler's answer or a replay came back.
    fn succeeded(&self) -> bool {
        self.completed() || self.outcome() == Outcome::Replayed
    }
}

struct Completed {
    key: String,
    body: String,
    exchange: u64,
}

struct Client {
    http: reqwest::Client,
    urls: [String; 2],
    shared: Arc<Shared>,
    rng: StdRng,
}

impl Client {
    async fn run(mut self, deadline: Instant) {
        for _ in 0..MAX_ACTIONS_PER_CLIENT {
            if Instant::now() >= deadline {
                return;
            }
            match self.rng.random_range(0..100) {
                0..35 => self.first().await,
                35..60 => self.replay_or_mismatch(false).await,
                60..72 => self.duplicate().await,
                72..84 => self.replay_or_mismatch(true).await,
                _ => self.retry_until_complete().await,
            }
        }
    }

    async fn first(&mut self) {
        let mut call = self.new_key(Action::First);
        if self.rng.random_bool(0.4) {
            let ms = self.rng.random_range(50..=400);
            call.headers.push(("x-sleep-ms", ms.to_string()));
        }
        if self.rng.random_bool(0.2) {
            call.headers.push(("x-binary", "1".to_owned()));
        }
        let exchange = self.send_anywhere(call).await;
        self.remember(&exchange);
    }

    async fn duplicate(&mut self) {
        let mut call = self.new_key(Action::Duplicate);
        let ms = self.rng.random_range(200..=400);
        call.headers.push(("x-sleep-ms", ms.to_string()));
        let (a, b) = tokio::join!(self.send(0, call.clone()), self.send(1, call));
        self.remember(&a);
        self.remember(&b);
    }

    async fn retry_until_complete(&mut self) {
        let call = self.new_key(Action::Retry);
        let mut failures = self.rng.random_range(1..=2);
        for _ in 0..RETRY_ATTEMPTS {
            let mut attempt = call.clone();
            if failures > 0 {
                attempt.headers.push(("x-status", "500".to_owned()));
            }
            let exchange = self.send_anywhere(attempt).await;
            if exchange.completed() {
                return self.remember(&exchange);
            }
            if exchange.outcome() == Outcome::Executed {
                failures -= 1;
            } else {
                sleep(RETRY_PAUSE).await;
            }
        }
    }

    /// Resends a key that completed in this epoch, with its body or another; while Redis is
    /// being restarted (or nothing completed yet) sends a new key instead.
    async fn replay_or_mismatch(&mut self, mismatch: bool) {
        let shared = self.shared.clone();
        let Ok(_gate) = shared.restart.gate.try_read() else {
            return self.first().await;
        };
        let epoch = shared
            .restart
            .phase()
            .epoch()
            .expect("no restart under way");
        let picked = {
            let completed = shared.completed.lock().unwrap();
            let candidates = &completed[epoch];
            (!candidates.is_empty()).then(|| {
                let done = &candidates[self.rng.random_range(0..candidates.len())];
                (done.key.clone(), done.body.clone(), done.exchange)
            })
        };
        let Some((key, body, of)) = picked else {
            return self.first().await;
        };
        let call = if mismatch {
            let body = format!("{body} and {}", self.rng.random::<u32>());
            Call::new(key, body, Action::Mismatch)
        } else {
            Call::new(key, body, Action::Replay { of })
        };
        self.send_anywhere(call).await;
    }

    fn new_key(&mut self, action: Action) -> Call {
        let key = format!("soak-{}", self.shared.next_key.fetch_add(1, SeqCst));
        let body = format!(r#"{{"amount":{}}}"#, self.rng.random_range(1..100_000));
        let keys = &self.shared.keys;
        keys.lock().unwrap().push((key.clone(), body.clone()));
        Call::new(key, body, action)
    }

    async fn send_anywhere(&mut self, call: Call) -> Exchange {
        let instance = self.rng.random_range(0..2);
        self.send(instance, call).await
    }

    /// Makes a key that certainly completed in one epoch a replay target in that epoch.
    fn remember(&self, exchange: &Exchange) {
        let epoch = (exchange.sent_in == exchange.received_in)
            .then(|| exchange.sent_in.epoch())
            .flatten();
        if let (Some(epoch), true) = (epoch, exchange.completed()) {
            self.shared.completed.lock().unwrap()[epoch].push(Completed {
                key: exchange.key.clone(),
                body: exchange.body.clone(),
                exchange: exchange.id,
            });
        }
    }

    async fn send(&self, instance: usize, call: Call) -> Exchange {
        send(
            &self.http,
            &self.urls[instance],
            instance,
            &self.shared,
            call,
        )
        .await
    }
}

impl Call {
    fn new(key: String, body: String, action: Action) -> Self {
        Self {
            key,
            body,
            headers: Vec::new(),
            action,
        }
    }
}

/// Sends one request and logs it with its answer.
async fn send(
    http: &reqwest::Client,
    url: &str,
    instance: usize,
    shared: &Shared,
    call: Call,
) -> Exchange {
    let id = shared.next_request.fetch_add(1, SeqCst);
    let mut request = http
        .post(url)
        .header("idempotency-key", &call.key)
        .header("x-request-id", id.to_string())
        .body(call.body.clone());
    for (name, value) in &call.headers {
        request = request.header(*name, value);
    }
    let sent = Instant::now();
    let sent_in = shared.restart.phase();
    let answer = match request.send().await {
        Ok(response) => {
            let (status, headers) = (response.status(), response.headers().clone());
            response.bytes().await.map(|body| Answer {
                status,
                headers,
                body,
            })
        }
        Err(error) => Err(error),
    };
    let exchange = Exchange {
        id,
        instance,
        key: call.key,
        body: call.body,
        action: call.action,
        sent,
        sent_in,
        received: Instant::now(),
        received_in: shared.restart.phase(),
        answer: answer.map_err(|error| error.to_string()),
    };
    shared.log.lock().unwrap().push(exchange.clone());
    exchange
}

/// Every key sent, once more with its body, to either instance.
async fn final_round(http: &reqwest::Client, urls: &[String; 2], shared: &Shared) {
    let keys = shared.keys.lock().unwrap().clone();
    stream::iter(keys.into_iter().enumerate())
        .for_each_concurrent(CLIENTS, |(n, (key, body))| async move {
            let call = Call::new(key, body, Action::Final);
            send(http, &urls[n % 2], n % 2, shared, call).await;
        })
        .await;
}

// ---------------------------------------------------------------------------------------
// The checks.
// ---------------------------------------------------------------------------------------

#[derive(Default)]
struct Report {
    counts: Counts,
    /// What went wrong, by kind.
    violations: BTreeMap<&'static str, Vec<String>>,
}

impl Report {
    fn violation(&mut self, kind: &'static str, detail: String) {
        self.violations.entry(kind).or_default().push(detail);
    }

    fn assert_no_violations(&self) {
        let mut text = String::new();
        for (kind, details) in &self.violations {
            text.push_str(&format!("\n{} x {kind}, e.g.:", details.len()));
            for detail in details.iter().take(3) {
                text.push_str(&format!("\n  {detail}"));
            }
        }
        assert!(text.is_empty(), "violations:{text}");
    }
}

#[derive(Default)]
struct Counts {
    requests: usize,
    executions: usize,
    /// Executions whose epoch the timing leaves open.
    either_epoch: usize,
    completions: usize,
    releases: usize,
    replays: usize,
    in_flight_409: usize,
    mismatch_409: usize,
    unavailable_503: usize,
    longest_503_ms: u128,
    after_restart_ok: usize,
    final_replays: usize,
    final_executions: usize,
}

impl std::fmt::Display for Counts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "requests={} executions={} (completed={} released={} either_epoch={}) replays={} \
             in_flight_409={} mismatch_409={} unavailable_503={} (longest {} ms) \
             ok_after_restart={} final: replayed={} executed={}",
            self.requests,
            self.executions,
            self.completions,
            self.releases,
            self.either_epoch,
            self.replays,
            self.in_flight_409,
            self.mismatch_409,
            self.unavailable_503,
            self.longest_503_ms,
            self.after_restart_ok,
            self.final_replays,
            self.final_executions
        )
    }
}

impl Counts {
    fn assert_mixed(&self) {
        for (what, count) in [
            ("first executions", self.completions),
            ("releases", self.releases),
            ("replays", self.replays),
            ("in-flight duplicate 409s", self.in_flight_409),
            ("mismatch 409s", self.mismatch_409),
            ("503s during the outage", self.unavailable_503),
            ("successes after the restart", self.after_restart_ok),
        ] {
            assert!(count > 0, "the traffic had no {what}: {self}");
        }
    }
}

fn check(log: &[Exchange], ledger: &[Execution], restarted_at: Instant) -> Report {
    let mut report = Report::default();
    let by_id: HashMap<u64, &Exchange> = log.iter().map(|e| (e.id, e)).collect();
    check_answers(log, &by_id, restarted_at, &mut report);
    check_ledger_matches_answers(ledger, &by_id, &mut report);
    check_once_per_epoch(log, ledger, &by_id, &mut report);
    report
}

/// Each request got an answer its action allows, and the counts.
fn check_answers(
    log: &[Exchange],
    by_id: &HashMap<u64, &Exchange>,
    restarted_at: Instant,
    report: &mut Report,
) {
    report.counts.requests = log.len();
    for exchange in log {
        let outcome = exchange.outcome();
        let allowed = match exchange.action {
            Action::First | Action::Retry => {
                matches!(outcome, Outcome::Executed | Outcome::Unavailable)
            }
            Action::Duplicate => outcome != Outcome::Mismatch && outcome != Outcome::Failed,
            Action::Replay { of } => {
                outcome == Outcome::Replayed && same_answer(exchange, by_id[&of])
            }
            Action::Mismatch => outcome == Outcome::Mismatch,
            Action::Final => exchange.succeeded(),
        };
        if !allowed {
            let kind = match (exchange.action, outcome) {
                (Action::Replay { .. }, Outcome::Replayed) => "replay differs from the original",
                (Action::Final, Outcome::InProgress) => "key stuck in progress after the leases",
                _ => "answer the request's action does not allow",
            };
            report.violation(kind, describe(exchange));
        }
        match (exchange.action, outcome) {
            (Action::Replay { .. }, Outcome::Replayed) => report.counts.replays += 1,
            (Action::Duplicate, Outcome::InProgress) => report.counts.in_flight_409 += 1,
            (Action::Mismatch, Outcome::Mismatch) => report.counts.mismatch_409 += 1,
            (Action::Final, Outcome::Replayed) => report.counts.final_replays += 1,
            (Action::Final, Outcome::Executed) => report.counts.final_executions += 1,
            _ => {}
        }
        if outcome == Outcome::Unavailable {
            report.counts.unavailable_503 += 1;
            report.counts.longest_503_ms = report
                .counts
                .longest_503_ms
                .max((exchange.received - exchange.sent).as_millis());
            let during_outage = exchange.received_in >= Phase::Killing
                && (exchange.sent_in < Phase::Restarted
                    || exchange.sent < restarted_at + RECOVERY_GRACE);
            if !during_outage {
                report.violation("503 outside the outage", describe(exchange));
            }
        }
        if exchange.sent_in == Phase::Restarted
            && exchange.action != Action::Final
            && exchange.succeeded()
        {
            report.counts.after_restart_ok += 1;
        }
    }
}

/// The original answer of a replayed request, byte for byte.
fn same_answer(replay: &Exchange, original: &Exchange) -> bool {
    match (&replay.answer, &original.answer) {
        (Ok(replay), Ok(original)) => {
            replay.status == original.status
                && replay.body == original.body
                && replay.headers.get("content-type") == original.headers.get("content-type")
        }
        _ => false,
    }
}

/// Executions and handler answers match one to one: every execution reached its client
/// (not as a 503: nothing executes when the store is unavailable), byte for byte.
fn check_ledger_matches_answers(
    ledger: &[Execution],
    by_id: &HashMap<u64, &Exchange>,
    report: &mut Report,
) {
    let counts = &mut report.counts;
    counts.executions = ledger.len();
    counts.releases = ledger.iter().filter(|e| e.released()).count();
    counts.completions = counts.executions - counts.releases;
    let mut bodies = HashSet::new();
    let mut executed = HashSet::new();
    for execution in ledger {
        let exchange = by_id[&execution.request];
        let answered = exchange.outcome() == Outcome::Executed
            && exchange.answer.as_ref().is_ok_and(|answer| {
                answer.status == execution.status && answer.body == execution.body
            });
        if !answered || !executed.insert(execution.request) {
            let detail = format!("{} executed, {}", execution.status, describe(exchange));
            report.violation("execution not answered as such", detail);
        }
        let epochs = epochs(exchange.sent_in, execution.started_in);
        if epochs.is_empty() {
            report.violation("executed while Redis was down", describe(exchange));
        }
        report.counts.either_epoch += usize::from(epochs == (0..=1));
        assert!(bodies.insert(&execution.body), "bodies must be unique");
    }
    for exchange in by_id.values() {
        if exchange.outcome() == Outcome::Executed && !executed.contains(&exchange.id) {
            report.violation("handler answer with no execution", describe(exchange));
        }
    }
}

/// Within each epoch, a key's executions ran one after another, all but the last released,
/// and every replay is the body of the execution that completed the key in its epoch.
fn check_once_per_epoch(
    log: &[Exchange],
    ledger: &[Execution],
    by_id: &HashMap<u64, &Exchange>,
    report: &mut Report,
) {
    let mut keys: HashMap<&str, (Vec<Execution>, Vec<&Exchange>)> = HashMap::new();
    for execution in ledger {
        let entry = keys.entry(&execution.key).or_default();
        entry.0.push(execution.clone());
    }
    for exchange in log.iter().filter(|e| e.outcome() == Outcome::Replayed) {
        keys.entry(&exchange.key).or_default().1.push(exchange);
    }
    for (key, (mut executions, replays)) in keys {
        executions.sort_by_key(|e| e.started);
        let execution_epochs: Vec<_> = executions
            .iter()
            .map(|e| epochs(by_id[&e.request].sent_in, e.started_in))
            .collect();
        let consistent = |split: usize| {
            let epoch = |i: usize| usize::from(i >= split);
            let placed = (0..executions.len()).all(|i| execution_epochs[i].contains(&epoch(i)));
            let one_after_another = executions.windows(2).enumerate().all(|(i, pair)| {
                epoch(i) != epoch(i + 1) || (pair[0].released() && pair[0].ended <= pair[1].started)
            });
            let replays_match = replays.iter().all(|replay| {
                let answer = replay.answer.as_ref().unwrap();
                let replay_epochs = epochs(replay.sent_in, replay.received_in);
                executions.iter().enumerate().any(|(i, execution)| {
                    !execution.released()
                        && execution.status == answer.status
                        && execution.body == answer.body
                        && replay_epochs.contains(&epoch(i))
                })
            });
            placed && one_after_another && replays_match
        };
        if !(0..=executions.len()).any(consistent) {
            let mut story = format!("key {key}:");
            for (execution, epochs) in executions.iter().zip(&execution_epochs) {
                story.push_str(&format!(
                    "\n    executed by {} (epochs {epochs:?}) {:?}: {} {}",
                    execution.request,
                    execution.ended - execution.started,
                    execution.status,
                    printable(&execution.body)
                ));
            }
            for replay in &replays {
                story.push_str(&format!("\n    replayed: {}", describe(replay)));
            }
            report.violation("key not executed once per epoch, or replayed wrong", story);
        }
    }
}

fn describe(exchange: &Exchange) -> String {
    let answer = match &exchange.answer {
        Ok(answer) => format!(
            "{} {:?} {}",
            answer.status,
            exchange.outcome(),
            printable(&answer.body)
        ),
        Err(error) => format!("no answer: {error}"),
    };
    format!(
        "request {} {:?} key {} to instance {} (sent {:?}, answered {:?}) -> {answer}",
        exchange.id,
        exchange.action,
        exchange.key,
        exchange.instance,
        exchange.sent_in,
        exchange.received_in
    )
}

/// The start of a body, readable.
fn printable(body: &[u8]) -> String {
    String::from_utf8_lossy(&body[..body.len().min(100)])
        .escape_debug()
        .to_string()
}
