//! Makes payments of the `payments` example through the crate's idempotent client.
//!
//! ```sh
//! cargo run --example payments &
//! cargo run --example charge --features client -- --url http://127.0.0.1:3000 --count 100 --concurrency 8 [--user alice]
//! ```
//!
//! Each payment is one logical call: one idempotency key, made before its first attempt
//! and sent on every retry, over hyper-util's client. `--url` is the server's base URL
//! (`/v1/payments` is added unless it is there); `--user` is sent as
//! `Authorization: Bearer <user>` (default `charge`). Progress goes to stderr; the last
//! line of stdout is one JSON object:
//! `{"succeeded":n,"failed":n,"attempts":n,"distinct_ids":n}` (payments answered `201`,
//! the others, attempts made by all of them, distinct payment ids among the successes).

use std::{collections::HashSet, process::ExitCode, time::Duration};

use bytes::Bytes;
use futures_util::{stream, StreamExt};
use http::{header, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use tower::{Layer, ServiceExt};
use tower_idempotency::client::{Backoff, IdempotentCall, IdempotentClientLayer};

/// The command line.
struct Args {
    url: String,
    count: usize,
    concurrency: usize,
    user: String,
}

const USAGE: &str = "usage: charge --url URL --count N --concurrency C [--user U]";

fn parse_args() -> Result<Args, String> {
    let (mut url, mut count, mut concurrency, mut user) = (None, None, None, None);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<usize>()
                .map_err(|_| format!("{flag} {value}: not a number"))
        };
        match flag.as_str() {
            "--url" => url = Some(value.clone()),
            "--count" => count = Some(number()?),
            "--concurrency" => concurrency = Some(number()?.max(1)),
            "--user" => user = Some(value.clone()),
            _ => return Err(format!("unknown argument {flag}")),
        }
    }
    let url = url.ok_or("--url is required")?;
    let url = match url.trim_end_matches('/') {
        base if base.ends_with("/v1/payments") => base.to_owned(),
        base => format!("{base}/v1/payments"),
    };
    Ok(Args {
        url,
        count: count.ok_or("--count is required")?,
        concurrency: concurrency.ok_or("--concurrency is required")?,
        user: user.unwrap_or_else(|| "charge".to_owned()),
    })
}

/// What one payment came to: its attempts, and its id if it was created.
struct Outcome {
    attempts: u32,
    id: Option<String>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(problem) => {
            eprintln!("{problem}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let client = IdempotentClientLayer::new()
        .max_attempts(10)
        .backoff(Backoff::new(
            Duration::from_millis(50),
            Duration::from_secs(2),
        ))
        .layer(http);

    let outcomes: Vec<Outcome> = stream::iter(0..args.count)
        .map(|i| {
            let request = Request::post(&args.url)
                .header(header::CONTENT_TYPE, "application/json")
                .header(header::AUTHORIZATION, format!("Bearer {}", args.user))
                .body(Full::new(Bytes::from(format!(
                    r#"{{"amount":{},"currency":"usd"}}"#,
                    100 + i
                ))))
                .expect("a valid request");
            let client = client.clone();
            async move {
                match client.oneshot(request).await {
                    Ok(response) => {
                        let call = response.extensions().get::<IdempotentCall>().cloned();
                        let attempts = call.map_or(1, |call| call.attempts);
                        let status = response.status();
                        let body = response.into_body().collect().await.map(|b| b.to_bytes());
                        let id = match (status, body) {
                            (StatusCode::CREATED, Ok(body)) => payment_id(&body),
                            (status, body) => {
                                eprintln!("payment {i}: {status} {body:?}");
                                None
                            }
                        };
                        Outcome { attempts, id }
                    }
                    Err(error) => {
                        eprintln!("payment {i}: {error}");
                        let attempts = error.call().map_or(0, |call| call.attempts);
                        Outcome { attempts, id: None }
                    }
                }
            }
        })
        .buffer_unordered(args.concurrency)
        .collect()
        .await;

    let succeeded = outcomes.iter().filter(|o| o.id.is_some()).count();
    let attempts: u64 = outcomes.iter().map(|o| u64::from(o.attempts)).sum();
    let ids: HashSet<&str> = outcomes.iter().filter_map(|o| o.id.as_deref()).collect();
    println!(
        r#"{{"succeeded":{succeeded},"failed":{},"attempts":{attempts},"distinct_ids":{}}}"#,
        outcomes.len() - succeeded,
        ids.len()
    );
    ExitCode::SUCCESS
}

/// The `id` of a created payment's JSON body.
fn payment_id(body: &[u8]) -> Option<String> {
    let body: serde_json::Value = serde_json::from_slice(body).ok()?;
    body["id"].as_str().map(str::to_owned)
}
