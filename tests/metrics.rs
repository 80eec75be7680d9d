//! The layer's metrics as an operator scrapes them: each outcome driven over HTTP against
//! the `payments` example, `GET /metrics` read before and after, and every counter and
//! histogram checked to have moved by exactly what was done (no more, no less).
//!
//! Each test runs a process of its own, so that no other test's requests reach its counts.

mod support;

use std::{collections::BTreeMap, fmt::Write as _, net::SocketAddr};

use reqwest::StatusCode;
use serde_json::{json, Value};
use support::{
    payments::{charge, eventually, fresh_key, slow_charge, ExampleProcess, DEADLINE},
    raw_http,
    redis_server::RedisServer,
    redis_url,
};

/// The layer's default request body limit: 1 MiB.
const DEFAULT_LIMIT: usize = 1024 * 1024;

const REQUESTS: &str = "idempotency_requests_total";
const STORE_OPERATIONS: &str = "idempotency_store_operation_seconds";
const EXECUTION: &str = "idempotency_execution_seconds";
const IN_FLIGHT: &str = "idempotency_in_flight";
const FENCE_LOST: &str = "idempotency_fence_lost_total";
const CACHE_HITS: &str = "idempotency_cache_hits_total";
const CACHE_MISSES: &str = "idempotency_cache_misses_total";

// ---------------------------------------------------------------------------------------
// Scrapes.
// ---------------------------------------------------------------------------------------

/// Labels, sorted by name.
type Labels = Vec<(String, String)>;

/// One Prometheus text exposition: each series, by metric name and labels, with its value.
#[derive(Clone, Debug, Default, PartialEq)]
struct Scrape(BTreeMap<(String, Labels), f64>);

impl Scrape {
    /// Parses `name{label="value",...} value [timestamp]` lines; `#` lines (help, type) and
    /// blank ones are skipped.
    fn parse(text: &str) -> Self {
        let mut series = BTreeMap::new();
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (name, labels, rest) = match line.find('{') {
                Some(open) => {
                    let close = line.rfind('}').unwrap_or_else(|| panic!("no `}}`: {line}"));
                    let labels = parse_labels(&line[open + 1..close]);
                    (&line[..open], labels, &line[close + 1..])
                }
                None => {
                    let space = line.find(' ').unwrap_or_else(|| panic!("no value: {line}"));
                    (&line[..space], Vec::new(), &line[space..])
                }
            };
            let value = rest.split_whitespace().next().unwrap_or_default();
            let value: f64 = value
                .parse()
                .unwrap_or_else(|_| panic!("not a number: {value:?} in {line}"));
            let previous = series.insert((name.to_owned(), labels), value);
            assert!(previous.is_none(), "a series given twice: {line}");
        }
        Self(series)
    }

    /// The value of series `name{labels}`; 0 for one not exposed (yet).
    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.0
            .get(&(name.to_owned(), sorted(labels)))
            .copied()
            .unwrap_or(0.0)
    }

    /// Every series of metric `name`, by labels.
    fn named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = (&'a Labels, f64)> + 'a {
        self.0
            .iter()
            .filter(move |((series, _), _)| series == name)
            .map(|((_, labels), value)| (labels, *value))
    }
}

/// `label="value",...`, with `\"`, `\\` and `\n` escapes in values; sorted by name.
fn parse_labels(text: &str) -> Labels {
    let mut labels = Vec::new();
    let mut chars = text.chars().peekable();
    loop {
        while chars.next_if(|c| *c == ',' || c.is_whitespace()).is_some() {}
        let name: String = std::iter::from_fn(|| chars.next_if(|c| *c != '=')).collect();
        if name.is_empty() {
            break;
        }
        assert_eq!(chars.next(), Some('='), "labels: {text}");
        assert_eq!(chars.next(), Some('"'), "labels: {text}");
        let mut value = String::new();
        loop {
            match chars.next() {
                Some('"') => break,
                Some('\\') => match chars.next() {
                    Some('n') => value.push('\n'),
                    Some(escaped) => value.push(escaped),
                    None => panic!("labels: {text}"),
                },
                Some(c) => value.push(c),
                None => panic!("an unterminated label value: {text}"),
            }
        }
        labels.push((name.trim().to_owned(), value));
    }
    labels.sort();
    labels
}

fn sorted(labels: &[(&str, &str)]) -> Labels {
    let mut labels: Labels = labels
        .iter()
        .map(|&(name, value)| (name.to_owned(), value.to_owned()))
        .collect();
    labels.sort();
    labels
}

/// How much each series moved from `before` to `after` (a series not exposed counts as 0).
fn delta(before: &Scrape, after: &Scrape) -> Scrape {
    let mut moved = BTreeMap::new();
    for series in before.0.keys().chain(after.0.keys()) {
        let was = before.0.get(series).copied().unwrap_or(0.0);
        let is = after.0.get(series).copied().unwrap_or(0.0);
        moved.insert(series.clone(), is - was);
    }
    Scrape(moved)
}

fn show(labels: &Labels) -> String {
    let pairs: Vec<String> = labels.iter().map(|(n, v)| format!("{n}={v:?}")).collect();
    format!("{{{}}}", pairs.join(","))
}

impl Scrape {
    /// Checks, on a [`delta`], that every series of metric `name` moved by exactly what
    /// `expected` says, and every series it does not list by nothing.
    fn assert_moved(&self, name: &str, expected: &[(&[(&str, &str)], f64)]) {
        let expected: BTreeMap<Labels, f64> = expected
            .iter()
            .map(|(labels, value)| (sorted(labels), *value))
            .collect();
        let mut wrong = String::new();
        for (labels, moved) in self.named(name) {
            let want = expected.get(labels).copied().unwrap_or(0.0);
            if moved != want {
                let _ = writeln!(
                    wrong,
                    "  {name}{} moved by {moved}, expected {want}",
                    show(labels)
                );
            }
        }
        for (labels, want) in &expected {
            let exposed = self.named(name).any(|(theirs, _)| theirs == labels);
            if !exposed && *want != 0.0 {
                let _ = writeln!(
                    wrong,
                    "  {name}{} is not exposed, expected {want}",
                    show(labels)
                );
            }
        }
        assert!(
            wrong.is_empty(),
            "metrics moved otherwise than expected:\n{wrong}"
        );
    }

    /// Checks, on a [`delta`], that the `_count` series of histogram `name` moved by
    /// exactly what `expected` says (every other labelling by nothing), and that its `_sum`
    /// grew wherever its count did.
    fn assert_histogram_moved(&self, name: &str, expected: &[(&[(&str, &str)], f64)]) {
        let count = format!("{name}_count");
        self.assert_moved(&count, expected);
        let sum = format!("{name}_sum");
        for (labels, moved) in self.named(&count) {
            let summed = self.0.get(&(sum.clone(), labels.clone())).copied();
            if moved > 0.0 {
                assert!(
                    summed.is_some_and(|summed| summed > 0.0),
                    "{sum}{} moved by {summed:?} while its count moved by {moved}",
                    show(labels)
                );
            }
        }
    }
}

/// Checks that every histogram in a scrape is whole: each labelling has a `+Inf` bucket
/// equal to its `_count`, and its buckets never decrease.
fn assert_histograms_whole(scrape: &Scrape) {
    let mut histograms = 0;
    for ((name, labels), count) in &scrape.0 {
        let Some(base) = name.strip_suffix("_count") else {
            continue;
        };
        histograms += 1;
        let bucket = format!("{base}_bucket");
        let mut buckets: Vec<(f64, f64)> = scrape
            .named(&bucket)
            .filter_map(|(theirs, value)| {
                let mut rest = theirs.clone();
                let at = rest.iter().position(|(n, _)| n == "le")?;
                let (_, le) = rest.remove(at);
                (&rest == labels).then(|| (le.parse::<f64>().expect("le"), value))
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        let inf = buckets.last().filter(|(le, _)| *le == f64::INFINITY);
        assert_eq!(
            inf.map(|(_, value)| *value),
            Some(*count),
            "{bucket}{} le=\"+Inf\" against {name}: {buckets:?}",
            show(labels)
        );
        assert!(
            buckets.windows(2).all(|pair| pair[0].1 <= pair[1].1),
            "{bucket}{} decreases: {buckets:?}",
            show(labels)
        );
    }
    assert!(histograms > 0, "no histogram exposed");
}

// ---------------------------------------------------------------------------------------
// The example, scraped.
// ---------------------------------------------------------------------------------------

/// `GET /metrics` from the example at `addr`.
async fn scrape(addr: SocketAddr) -> Scrape {
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(DEADLINE)
        .build()
        .expect("HTTP client");
    let response = http
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .expect("GET /metrics");
    assert_eq!(response.status(), StatusCode::OK);
    Scrape::parse(&response.text().await.expect("metrics text"))
}

/// A scrape once no execution holds a key (every outcome recorded, every write done).
async fn settled(example: &ExampleProcess) -> Scrape {
    eventually("no execution in flight", async || {
        let scrape = scrape(example.addr()).await;
        (scrape.get(IN_FLIGHT, &[]) == 0.0).then_some(scrape)
    })
    .await
}

/// The scrape once settled (see [`settled`]) and how far it moved since `before`; checks
/// that every histogram in it is whole.
async fn moved_since(example: &ExampleProcess, before: &Scrape) -> (Scrape, Scrape) {
    let after = settled(example).await;
    assert_histograms_whole(&after);
    let moved = delta(before, &after);
    (after, moved)
}

/// The `outcome` label.
fn outcome(label: &'static str) -> [(&'static str, &'static str); 1] {
    [("outcome", label)]
}

/// The labels of a store call.
fn operation(
    store: &'static str,
    operation: &'static str,
    result: &'static str,
) -> [(&'static str, &'static str); 3] {
    [
        ("store", store),
        ("operation", operation),
        ("result", result),
    ]
}

/// A payment of 100 `usd` whose handler answers 500.
fn failing_charge() -> Value {
    json!({ "amount": 100, "currency": "usd", "simulate": "error" })
}

// ---------------------------------------------------------------------------------------
// The cases.
// ---------------------------------------------------------------------------------------

/// On the in-memory store, one request of each outcome a client can cause alone.
#[tokio::test]
async fn every_outcome_on_the_memory_store_is_counted_once() {
    let example = ExampleProcess::start(&[]).await;
    let api = example.api();
    let before = settled(&example).await;

    // Executed, then replayed, then the key reused with another amount.
    let key = fresh_key();
    let first = api.pay(&key, "alice", &charge(100)).await;
    first.assert_payment(100, "usd");
    api.pay(&key, "alice", &charge(100))
        .await
        .assert_replay_of(&first);
    let reused = api.pay(&key, "alice", &charge(200)).await;
    reused.assert_error(
        StatusCode::CONFLICT,
        "idempotency_key_reused_with_different_params",
    );

    // Refused before any claim: no key, a malformed key, a body over the limit.
    let missing = api
        .post("/v1/payments")
        .user("alice")
        .json(&charge(100))
        .send()
        .await;
    missing.assert_error(StatusCode::BAD_REQUEST, "idempotency_key_required");
    let invalid = api.pay(&"k".repeat(300), "alice", &charge(100)).await;
    invalid.assert_error(StatusCode::BAD_REQUEST, "invalid_idempotency_key");
    // Only the head: the body it declares would be left unread (see `oversized_head`).
    let head = raw_http::oversized_head(&fresh_key(), DEFAULT_LIMIT as u64);
    let too_large = raw_http::exchange(example.addr(), &head, false).await;
    assert_eq!(
        too_large.status,
        StatusCode::PAYLOAD_TOO_LARGE,
        "{too_large:?}"
    );

    // The handler fails: the key is released.
    let failed = api.pay(&fresh_key(), "alice", &failing_charge()).await;
    assert_eq!(
        failed.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "{failed:?}"
    );

    // A duplicate while the original runs.
    let key = fresh_key();
    let slow = slow_charge(1500);
    let original = api.pay_in_background(&key, "alice", &slow);
    api.wait_for_payments(3).await;
    api.pay(&key, "alice", &slow).await.assert_in_progress();
    original
        .await
        .expect("the original")
        .assert_payment(700, "usd");

    let (after, moved) = moved_since(&example, &before).await;
    assert_eq!(api.stats().await.payments_executed, 3);
    moved.assert_moved(
        REQUESTS,
        &[
            (&outcome("executed"), 2.0),
            (&outcome("replayed"), 1.0),
            (&outcome("mismatch"), 1.0),
            (&outcome("key_missing"), 1.0),
            (&outcome("invalid_key"), 1.0),
            (&outcome("body_too_large"), 1.0),
            (&outcome("released"), 1.0),
            (&outcome("in_progress"), 1.0),
        ],
    );
    // Claims: the first payment, its replay and its reuse; the failing one; the slow one
    // and its duplicate. Completes: the two recorded. Releases: the failed one.
    moved.assert_histogram_moved(
        STORE_OPERATIONS,
        &[
            (&operation("memory", "claim", "ok"), 6.0),
            (&operation("memory", "complete", "ok"), 2.0),
            (&operation("memory", "release", "ok"), 1.0),
        ],
    );
    moved.assert_histogram_moved(EXECUTION, &[(&[], 3.0)]);
    let ran_for = moved.get(&format!("{EXECUTION}_sum"), &[]);
    assert!(
        ran_for >= 1.5,
        "the slow handler alone ran 1.5 s: {ran_for}"
    );
    moved.assert_moved(FENCE_LOST, &[]);
    moved.assert_moved(CACHE_HITS, &[]);
    moved.assert_moved(CACHE_MISSES, &[]);
    assert_eq!(after.get(IN_FLIGHT, &[]), 0.0);
}

/// Duplicates that wait for their original: each counted `waited` when it gets the replay,
/// `in_progress` when its wait ends first.
#[tokio::test]
async fn waiting_duplicates_are_counted_as_waited_or_in_progress() {
    const WAITERS: u64 = 3;
    let example = ExampleProcess::start(&[("IDEMPOTENCY_WAIT_MS", "1500")]).await;
    let api = example.api();
    let before = settled(&example).await;

    // The original takes 300 ms, well within the duplicates' 1.5 s.
    let key = fresh_key();
    let quick = slow_charge(300);
    let original = api.pay_in_background(&key, "alice", &quick);
    api.wait_for_payments(1).await;
    let duplicates: Vec<_> = (0..WAITERS)
        .map(|_| api.pay_in_background(&key, "alice", &quick))
        .collect();
    let original = original.await.expect("the original");
    original.assert_payment(700, "usd");
    for duplicate in duplicates {
        duplicate
            .await
            .expect("a duplicate")
            .assert_replay_of(&original);
    }
    let (waited, moved) = moved_since(&example, &before).await;
    moved.assert_moved(
        REQUESTS,
        &[
            (&outcome("executed"), 1.0),
            (&outcome("waited"), WAITERS as f64),
        ],
    );
    // A waiter claims once before waiting and once more as it begins to wait; after the
    // original's announcement the waiters read the key again, once each or one read for
    // them all, whichever way their wake-ups fall. Counted once per call, the claims are
    // within these bounds; counted twice, or not at all, they are not.
    let claims = moved.get(
        &format!("{STORE_OPERATIONS}_count"),
        &operation("memory", "claim", "ok"),
    );
    let (least, most) = (1 + 2 * WAITERS, 1 + 3 * WAITERS);
    assert!(
        (least as f64..=most as f64).contains(&claims),
        "{claims} claims, expected {least} to {most}"
    );
    let claim_ok = operation("memory", "claim", "ok");
    moved.assert_histogram_moved(
        STORE_OPERATIONS,
        &[
            (&claim_ok, claims),
            (&operation("memory", "complete", "ok"), 1.0),
        ],
    );
    moved.assert_histogram_moved(EXECUTION, &[(&[], 1.0)]);

    // The original takes 3 s: a duplicate's 1.5 s wait ends first.
    let key = fresh_key();
    let slow = slow_charge(3000);
    let original = api.pay_in_background(&key, "alice", &slow);
    api.wait_for_payments(2).await;
    api.pay(&key, "alice", &slow).await.assert_in_progress();
    original
        .await
        .expect("the original")
        .assert_payment(700, "usd");
    let (_, moved) = moved_since(&example, &waited).await;
    moved.assert_moved(
        REQUESTS,
        &[(&outcome("executed"), 1.0), (&outcome("in_progress"), 1.0)],
    );
    // The original claims once; the duplicate before waiting, as it begins to wait, and
    // once more when its wait runs out (nothing was announced in between).
    moved.assert_histogram_moved(
        STORE_OPERATIONS,
        &[
            (&operation("memory", "claim", "ok"), 4.0),
            (&operation("memory", "complete", "ok"), 1.0),
        ],
    );
    moved.assert_histogram_moved(EXECUTION, &[(&[], 1.0)]);
    assert_eq!(api.stats().await.payments_executed, 2);
}

/// A response over `max_response_body` reaches its client but is not kept: counted
/// `not_replayable`, its record a refusal to replay it.
#[tokio::test]
async fn a_response_too_large_to_keep_is_counted_not_replayable() {
    // A payment's JSON is about 100 bytes; a token is 64.
    let example = ExampleProcess::start(&[("IDEMPOTENCY_MAX_RESPONSE_BODY", "80")]).await;
    let api = example.api();
    let before = settled(&example).await;

    let key = fresh_key();
    let first = api.pay(&key, "alice", &charge(100)).await;
    first.assert_payment(100, "usd");
    assert!(first.body.len() > 80, "{first:?}");
    let retry = api.pay(&key, "alice", &charge(100)).await;
    retry.assert_error(StatusCode::CONFLICT, "response_not_replayable");

    let token_key = fresh_key();
    let token = || {
        api.post("/v1/tokens")
            .key(&token_key)
            .user("alice")
            .body("{}")
    };
    let first_token = token().send().await;
    assert_eq!(first_token.status, StatusCode::CREATED, "{first_token:?}");
    token().send().await.assert_replay_of(&first_token);

    let (_, moved) = moved_since(&example, &before).await;
    // The payment's retry finds a completed record (the refusal the layer kept in place of
    // the response) and gets it replayed: the code counts it `replayed`, as the token's.
    assert!(retry.replayed(), "{retry:?}");
    moved.assert_moved(
        REQUESTS,
        &[
            (&outcome("not_replayable"), 1.0),
            (&outcome("executed"), 1.0),
            (&outcome("replayed"), 2.0),
        ],
    );
    // The refusal is recorded like any response.
    moved.assert_histogram_moved(
        STORE_OPERATIONS,
        &[
            (&operation("memory", "claim", "ok"), 4.0),
            (&operation("memory", "complete", "ok"), 2.0),
        ],
    );
    moved.assert_histogram_moved(EXECUTION, &[(&[], 2.0)]);
    let stats = api.stats().await;
    assert_eq!((stats.payments_executed, stats.tokens_executed), (1, 1));
}

/// On Redis with the local cache in front: the store calls are labelled `redis`, a claim
/// the cache cannot answer is a miss, and a replay of a record read once is a hit.
#[tokio::test]
#[ignore = "needs Redis: scripts/test.sh"]
async fn the_cache_in_front_of_redis_counts_its_hits_and_misses() {
    let url = redis_url();
    let example = ExampleProcess::start(&[("REDIS_URL", url.as_str())]).await;
    let api = example.api();
    let before = settled(&example).await;

    let key = fresh_key();
    // A miss: the key is claimed in Redis.
    let first = api.pay(&key, "alice", &charge(100)).await;
    first.assert_payment(100, "usd");
    // A miss: the completed record is read from Redis, and kept.
    api.pay(&key, "alice", &charge(100))
        .await
        .assert_replay_of(&first);
    // Hits: two replays and a reuse with another amount, answered from the copy.
    for _ in 0..2 {
        let replay = api.pay(&key, "alice", &charge(100)).await;
        replay.assert_replay_of(&first);
    }
    let reused = api.pay(&key, "alice", &charge(200)).await;
    reused.assert_error(
        StatusCode::CONFLICT,
        "idempotency_key_reused_with_different_params",
    );

    let (_, moved) = moved_since(&example, &before).await;
    moved.assert_moved(CACHE_MISSES, &[(&[], 2.0)]);
    moved.assert_moved(CACHE_HITS, &[(&[], 3.0)]);
    moved.assert_moved(
        REQUESTS,
        &[
            (&outcome("executed"), 1.0),
            (&outcome("replayed"), 3.0),
            (&outcome("mismatch"), 1.0),
        ],
    );
    // The layer times its calls to the store it was given, the cache: a claim the cache
    // answers is a claim all the same, labelled with the store behind it.
    moved.assert_histogram_moved(
        STORE_OPERATIONS,
        &[
            (&operation("redis", "claim", "ok"), 5.0),
            (&operation("redis", "complete", "ok"), 1.0),
        ],
    );
    moved.assert_histogram_moved(EXECUTION, &[(&[], 1.0)]);
    assert_eq!(api.stats().await.payments_executed, 1);
}

/// Redis gone: a failed claim is an `error`, and the request is refused
/// (`store_unavailable`) or, failing open, executed unprotected (`fail_open`).
#[tokio::test]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn an_unreachable_store_is_counted_unavailable_or_fail_open() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    let closed = [
        ("REDIS_URL", url.as_str()),
        ("IDEMPOTENCY_CACHE_RECORDS", "0"),
    ];
    let open = [
        ("REDIS_URL", url.as_str()),
        ("IDEMPOTENCY_CACHE_RECORDS", "0"),
        ("IDEMPOTENCY_FAIL_OPEN", "1"),
    ];
    // Both start while Redis is there: the example does not start without its store.
    let (closed, open) = (
        ExampleProcess::start(&closed).await,
        ExampleProcess::start(&open).await,
    );
    let before = (settled(&closed).await, settled(&open).await);
    redis.stop();

    let refused = closed.api().pay(&fresh_key(), "alice", &charge(100)).await;
    refused.assert_error(
        StatusCode::SERVICE_UNAVAILABLE,
        "idempotency_store_unavailable",
    );
    let unprotected = open.api().pay(&fresh_key(), "alice", &charge(100)).await;
    unprotected.assert_payment(100, "usd");
    assert_eq!(closed.api().stats().await.payments_executed, 0);
    assert_eq!(open.api().stats().await.payments_executed, 1);

    for (example, before, counted, runs) in [
        (&closed, &before.0, "store_unavailable", 0.0),
        (&open, &before.1, "fail_open", 1.0),
    ] {
        let (_, moved) = moved_since(example, before).await;
        moved.assert_moved(REQUESTS, &[(&outcome(counted), 1.0)]);
        moved.assert_histogram_moved(
            STORE_OPERATIONS,
            &[(&operation("redis", "claim", "error"), 1.0)],
        );
        moved.assert_moved(FENCE_LOST, &[]);
        // One sample per handler run: the one run unprotected too (it holds no key, so
        // it is not in flight).
        moved.assert_histogram_moved(EXECUTION, &[(&[], runs)]);
    }
}

/// A key taken from its holder while the handler runs: the holder's fenced write is
/// refused, counted as a lost fence on `complete`.
#[tokio::test]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn a_write_refused_by_the_fence_is_counted() {
    let redis = RedisServer::start();
    let url = redis.url();
    // The default 30 s lease is renewed every 10 s: a 2 s handler is never renewed, so
    // the fence is met by the completion, not by a renewal.
    let example = ExampleProcess::start(&[
        ("REDIS_URL", url.as_str()),
        ("IDEMPOTENCY_CACHE_RECORDS", "0"),
    ])
    .await;
    let api = example.api();
    let before = settled(&example).await;

    let key = fresh_key();
    let slow = slow_charge(2000);
    let original = api.pay_in_background(&key, "alice", &slow);
    api.wait_for_payments(1).await;
    // The key vanishes from Redis (its lease ran out, say): a duplicate claims it anew.
    let keys = redis.cli(&["KEYS", "*"]);
    let keys: Vec<&str> = keys.lines().filter(|key| !key.is_empty()).collect();
    assert!(!keys.is_empty(), "the running payment holds a key");
    let mut del = vec!["DEL"];
    del.extend(&keys);
    assert_eq!(redis.cli(&del).trim(), keys.len().to_string());
    let duplicate = api.pay_in_background(&key, "alice", &slow);
    api.wait_for_payments(2).await;

    original
        .await
        .expect("the original")
        .assert_payment(700, "usd");
    duplicate
        .await
        .expect("the duplicate")
        .assert_payment(700, "usd");
    let (_, moved) = moved_since(&example, &before).await;
    moved.assert_moved(FENCE_LOST, &[(&[], 1.0)]);
    moved.assert_histogram_moved(
        STORE_OPERATIONS,
        &[
            (&operation("redis", "claim", "ok"), 2.0),
            (&operation("redis", "complete", "fence_lost"), 1.0),
            (&operation("redis", "complete", "ok"), 1.0),
        ],
    );
    // The original's response reached its client: it executed, whether kept or not.
    moved.assert_moved(REQUESTS, &[(&outcome("executed"), 2.0)]);
    moved.assert_histogram_moved(EXECUTION, &[(&[], 2.0)]);
    assert_eq!(api.stats().await.payments_executed, 2);
}

/// The parser itself, on the forms the exporter writes.
#[test]
fn the_parser_reads_labels_escapes_and_special_values() {
    let text = "# HELP a_total things\n# TYPE a_total counter\n\
                a_total{outcome=\"executed\"} 2\n\
                a_total{z=\"1\", outcome=\"say \\\"hi\\\", \\\\ok\"} 3 1700000000000\n\
                g 0\n\
                h_bucket{le=\"+Inf\"} 4\n\
                h_sum 1.5e-3\n\
                \n";
    let scrape = Scrape::parse(text);
    assert_eq!(scrape.get("a_total", &[("outcome", "executed")]), 2.0);
    assert_eq!(
        scrape.get("a_total", &[("outcome", "say \"hi\", \\ok"), ("z", "1")]),
        3.0
    );
    assert_eq!(scrape.get("g", &[]), 0.0);
    assert_eq!(scrape.get("h_bucket", &[("le", "+Inf")]), 4.0);
    assert_eq!(scrape.get("h_sum", &[]), 0.0015);
    assert_eq!(scrape.get("absent", &[]), 0.0);
    let later = Scrape::parse("a_total{outcome=\"executed\"} 5\nnew 1\n");
    let moved = delta(&scrape, &later);
    assert_eq!(moved.get("a_total", &[("outcome", "executed")]), 3.0);
    assert_eq!(moved.get("new", &[]), 1.0);
    assert_eq!(moved.get("g", &[]), 0.0);
}

/// With replicas asked for and none attached, in best effort: the claim executes, and it
/// and its completion are each counted unacknowledged once; the replay, which writes
/// nothing, is answered and counted as nothing of the kind.
#[tokio::test]
#[ignore = "needs redis-server: scripts/test.sh"]
async fn writes_no_replica_acknowledges_are_counted() {
    const MISSING: &str = "idempotency_replica_acks_missing_total";
    let redis = RedisServer::start();
    let url = redis.url();
    let example = ExampleProcess::start(&[
        ("REDIS_URL", url.as_str()),
        ("IDEMPOTENCY_REPLICAS", "1"),
        ("IDEMPOTENCY_REPLICAS_TIMEOUT_MS", "100"),
        ("IDEMPOTENCY_REPLICAS_BEST_EFFORT", "1"),
        ("IDEMPOTENCY_CACHE_RECORDS", "0"),
    ])
    .await;
    let api = example.api();
    let before = settled(&example).await;
    let key = fresh_key();
    let first = api.pay(&key, "alice", &charge(100)).await;
    first.assert_payment(100, "usd");
    api.pay(&key, "alice", &charge(100))
        .await
        .assert_replay_of(&first);
    let (after, _) = moved_since(&example, &before).await;
    for operation in ["claim", "complete"] {
        let labels = [("operation", operation)];
        let counted = after.get(MISSING, &labels) - before.get(MISSING, &labels);
        assert_eq!(counted, 1.0, "{operation}");
    }
}

/// An execution is timed to the end of the response body the layer keeps: a handler that
/// streams its body for 300 ms ran for 300 ms, and the record's write, which starts when
/// the body ends, is not charged for it. (In process, with a recorder of its own: the
/// example streams no body.)
#[test]
fn an_execution_is_timed_to_the_end_of_its_streamed_body() {
    use std::{convert::Infallible, time::Duration};

    use axum::{body::Body, http::Request, routing::post, Router};
    use bytes::Bytes;
    use http_body_util::BodyExt;
    use metrics_exporter_prometheus::PrometheusBuilder;
    use tower::ServiceExt;
    use tower_idempotency::{IdempotencyLayer, MemoryStore};

    const STREAMED_FOR: Duration = Duration::from_millis(300);
    let recorder = PrometheusBuilder::new().build_recorder();
    let scraper = recorder.handle();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let streams = || async {
        let body = futures_util::stream::once(async {
            tokio::time::sleep(STREAMED_FOR).await;
            Ok::<_, Infallible>(Bytes::from_static(b"paid"))
        });
        (StatusCode::CREATED, Body::from_stream(body))
    };
    let app = Router::new()
        .route("/pay", post(streams))
        .layer(IdempotencyLayer::new(MemoryStore::new()).allow_anonymous());
    // Every handle the layer makes is made on its first request, from this recorder.
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let request = Request::post("/pay")
                .header("idempotency-key", "streamed-1")
                .body(Body::empty())
                .expect("a request");
            let response = app.oneshot(request).await.expect("a response");
            assert_eq!(response.status(), StatusCode::CREATED);
            let body = response.into_body().collect().await.expect("the body");
            assert_eq!(body.to_bytes(), "paid");
        })
    });
    let scrape = Scrape::parse(&scraper.render());
    assert_eq!(scrape.get(&format!("{EXECUTION}_count"), &[]), 1.0);
    let ran_for = scrape.get(&format!("{EXECUTION}_sum"), &[]);
    assert!(
        ran_for >= STREAMED_FOR.as_secs_f64(),
        "the body streamed for {STREAMED_FOR:?}, the execution counted {ran_for} s"
    );
    let completed = operation("memory", "complete", "ok");
    let writing = scrape.get(&format!("{STORE_OPERATIONS}_sum"), &completed);
    assert!(
        writing < STREAMED_FOR.as_secs_f64(),
        "the record's write counted {writing} s"
    );
    assert_eq!(
        scrape.get(&format!("{STORE_OPERATIONS}_count"), &completed),
        1.0
    );
}
