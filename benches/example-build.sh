# Sourced by the benchmark scripts that compare builds of the `payments` example.
# `example_build <what>` prints the path of a release build of the example: `<what>` is a
# path to one already built (used as is), `.` for this tree, or a git revision, exported
# with `git archive` and built under $BENCH_WORK (default target/http-bench) with its own
# Cargo.lock, so a baseline is the example exactly as that revision shipped it. Callers
# run these functions in `$(...)`, where `set -e` does not hold: each failure returns.
example_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
example_work=${BENCH_WORK:-$example_root/target/http-bench}
mkdir -p "$example_work"

example_build() {
  local what=$1
  if [ -f "$what" ]; then
    echo "$what"
    return
  fi
  local src target
  read -r src target < <(example_source "$what") || return
  if [ "$what" != . ] && [ -x "$src.payments" ]; then
    echo "$src.payments"
    return
  fi
  CARGO_TARGET_DIR=$target cargo build --release --example payments \
    --manifest-path "$src/Cargo.toml" >&2 || return
  if [ "$what" = . ]; then
    echo "$target/release/examples/payments"
  else
    cp "$target/release/examples/payments" "$src.payments" || return
    echo "$src.payments"
  fi
}

# `example_source <what>` prints the source tree and the target directory of `.` (this
# tree) or of a git revision, which it exports on first use.
example_source() {
  local what=$1
  if [ "$what" = . ]; then
    echo "$example_root ${CARGO_TARGET_DIR:-$example_root/target}"
    return
  fi
  local rev src
  rev=$(git -C "$example_root" rev-parse --short "$what^{commit}") || return
  src=$example_work/rev-$rev
  if [ ! -d "$src" ]; then
    rm -rf "$src.partial" && mkdir -p "$src.partial" || return
    git -C "$example_root" archive "$rev" | tar -x -C "$src.partial" || return
    mv "$src.partial" "$src" || return
  fi
  # One target for every revision: what two revisions share is built once.
  echo "$src $example_work/baseline-target"
}

# The example in memory, as a user runs it (`RUST_LOG` unset, the recorder installed), with
# the single counter the harness reads: put before its command.
example_memory_env=(env -u REDIS_URL -u REDIS_CLUSTER_URLS -u REDIS_SENTINEL_URLS
  -u DATABASE_URL -u RUST_LOG PAYMENTS_STATS=payments)

# Starts the example `$1` in memory on CPU 1 at $example_addr, and waits until it answers;
# leaves its pid in $example_pid.
example_addr=127.0.0.1:${EXAMPLE_BENCH_PORT:-3000}
example_start() {
  "${example_memory_env[@]}" PAYMENTS_ADDR="$example_addr" taskset -c 1 "$1" >/dev/null 2>&1 &
  example_pid=$!
  for _ in $(seq 100); do
    # Its own answer, not another server's on the same port.
    kill -0 "$example_pid" 2>/dev/null || break
    curl -s -o /dev/null "http://$example_addr/v1/stats" && return 0
    sleep 0.1
  done
  echo "the example did not start: $1" >&2
  return 1
}

# Pays once with each of the 100 keys the harness's replay.lua sends in namespace `$2`
# (default 1) for user bench, at `$1` (default $example_addr), so that its requests are
# replays.
example_prewarm() {
  local addr=${1:-$example_addr} namespace=${2:-1} i
  for i in $(seq 100); do
    curl -s -o /dev/null -X POST "http://$addr/v1/payments" \
      -H 'Content-Type: application/json' -H 'Authorization: Bearer bench' \
      -H "Idempotency-Key: $(printf '%08x-0000-4000-8000-%012d' "$namespace" "$i")" \
      --data '{"amount":1000,"currency":"usd"}'
  done
}
