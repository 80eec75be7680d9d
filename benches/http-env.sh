# Sourced by the HTTP benchmark scripts: builds the `payments` example (release) and the
# shared harness's peers under $work, and starts a Redis of their own on $port so that
# nothing else is flushed. Leaves $root, $harness, $work, $port, $peers_bin, $payments_bin,
# $REDIS_URL and `ours`: our three configurations as harness entries (`name=command`), each
# as a user runs the example: `RUST_LOG` unset (its default, `info`), the recorder installed.
# With BASELINE=<git revision>, the example is also built from that revision and each
# configuration gets a `base_` twin right after it, so an A/B runs interleaved in one session.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
harness=${HARNESS:-$root/../shared/bench}
work=${BENCH_WORK:-$root/target/http-bench}
port=${BENCH_REDIS_PORT:-6391}
mkdir -p "$work"
# Without wrk the harness measures nothing and still prints a table, of zeros.
command -v wrk >/dev/null || { echo "the HTTP benchmarks need wrk (apt-get install wrk)" >&2; exit 1; }

cargo build --release --example payments --manifest-path "$root/Cargo.toml"
cp "$root/target/release/examples/payments" "$work/payments"
CARGO_TARGET_DIR="$work/peers-target" cargo build --release --manifest-path "$harness/peers/Cargo.toml"
payments_bin=$work/payments
if [ -n "${BASELINE:-}" ]; then
  source "$root/benches/example-build.sh"
  baseline_bin=$(example_build "$BASELINE")
  cp "$baseline_bin" "$work/payments-baseline"
fi
peers_bin=$work/peers-target/release

if redis-cli -p "$port" ping >/dev/null 2>&1; then
  echo "something already answers on Redis port $port: stop it or set BENCH_REDIS_PORT" >&2
  exit 1
fi
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
  --pidfile "$work/redis.pid" --logfile "$work/redis.log" --dir "$work"
trap 'kill "$(cat "$work/redis.pid")" 2>/dev/null || true' EXIT
for _ in $(seq 50); do redis-cli -p "$port" ping 2>/dev/null | grep -q PONG && break; sleep 0.1; done

export REDIS_URL="redis://127.0.0.1:$port/"
ours=(
  "ours_redis=env -u RUST_LOG PAYMENTS_STATS=payments REDIS_URL=$REDIS_URL $payments_bin"
  "ours_redis_nocache=env -u RUST_LOG PAYMENTS_STATS=payments IDEMPOTENCY_CACHE_RECORDS=0 REDIS_URL=$REDIS_URL $payments_bin"
  "ours_memory=env -u REDIS_URL -u DATABASE_URL -u RUST_LOG PAYMENTS_STATS=payments $payments_bin"
)
if [ -n "${BASELINE:-}" ]; then
  paired=()
  for entry in "${ours[@]}"; do
    paired+=("$entry" "base_${entry/$payments_bin/$work/payments-baseline}")
  done
  ours=("${paired[@]}")
fi
