#!/usr/bin/env bash
# HTTP load, side by side: the payments example (on Redis with and without its local cache
# of completed records, and in memory) against the
# peers of the shared load harness (bare Axum, a hand-written Redis middleware, the
# published crates), on a Redis of its own so nothing else is flushed.
#
#   benches/http.sh                 # 3 passes, then the median table
#   PASSES=5 PEERS="bare naive_redis" benches/http.sh
#
# Needs ../shared/bench (the harness), wrk, redis-server, redis-cli, taskset, curl.
# Writes build outputs and results under $BENCH_WORK (default: target/http-bench).
# Every knob of the harness's run.sh (DURATION, CONNS, POOL, ...) passes through.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
harness=${HARNESS:-$root/../shared/bench}
work=${BENCH_WORK:-$root/target/http-bench}
passes=${PASSES:-3}
port=${BENCH_REDIS_PORT:-6391}
export PEERS=${PEERS:-bare naive_redis axum_idempotent hwhkit_idem}
export CONNS=${CONNS:-128}
mkdir -p "$work"

cargo build --release --example payments --manifest-path "$root/Cargo.toml"
cp "$root/target/release/examples/payments" "$work/payments"
CARGO_TARGET_DIR="$work/peers-target" cargo build --release --manifest-path "$harness/peers/Cargo.toml"

redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
  --pidfile "$work/redis.pid" --logfile "$work/redis.log" --dir "$work"
trap 'kill "$(cat "$work/redis.pid")" 2>/dev/null || true' EXIT
for _ in $(seq 50); do redis-cli -p "$port" ping 2>/dev/null | grep -q PONG && break; sleep 0.1; done

export REDIS_URL="redis://127.0.0.1:$port/" REDIS_PORT=$port
export FLUSH_CMD="redis-cli -p $port flushall" REDIS_CLI="redis-cli -p $port"
export CARGO_TARGET_DIR="$work/peers-target" BENCH_OUT="$work/results/$(date -u +%Y%m%dT%H%M%SZ)"
ours=(
  "ours_redis=env PAYMENTS_STATS=payments RUST_LOG=warn REDIS_URL=$REDIS_URL $work/payments"
  "ours_redis_nocache=env PAYMENTS_STATS=payments RUST_LOG=warn IDEMPOTENCY_CACHE_RECORDS=0 REDIS_URL=$REDIS_URL $work/payments"
  "ours_memory=env -u REDIS_URL -u DATABASE_URL PAYMENTS_STATS=payments RUST_LOG=warn $work/payments"
)
for pass in $(seq "$passes"); do
  echo "== pass $pass of $passes"
  skip_limits=1; [ "$pass" = 1 ] && skip_limits=0
  (cd "$harness" && SKIP_BUILD=1 SKIP_LIMITS=$skip_limits ./run_all.sh "${ours[@]}")
done
"$harness/aggregate.sh" "$BENCH_OUT"/*/results.tsv | tee "$BENCH_OUT/median.txt"
grep -h '^CHECK' "$BENCH_OUT"/*/checks.txt | sort | uniq -c | tee "$BENCH_OUT/checks.txt"
