#!/usr/bin/env bash
# HTTP load, side by side: the payments example (on Redis with and without its local cache
# of completed records, and in memory) against the
# peers of the shared load harness (bare Axum, a hand-written Redis middleware, the
# published crates), on a Redis of its own so nothing else is flushed.
#
#   benches/http.sh                 # 3 passes, then the median table
#   PASSES=5 PEERS="bare naive_redis" benches/http.sh
#   PASSES=9 PEERS=bare OURS=ours_memory benches/http.sh   # one goal, more passes
#   BASELINE=v0.1.0 benches/http.sh  # each configuration also from that revision, interleaved
#
# Needs ../shared/bench (the harness), wrk, redis-server, redis-cli, taskset, curl.
# Writes build outputs and results under $BENCH_WORK (default: target/http-bench).
# Every knob of the harness's run.sh (DURATION, CONNS, POOL, ...) passes through.
set -euo pipefail
passes=${PASSES:-3}
export PEERS=${PEERS:-bare naive_redis axum_idempotent hwhkit_idem}
export CONNS=${CONNS:-128}
source "$(dirname "$0")/http-env.sh"
if [ -n "${OURS:-}" ]; then # keep only the configurations named in $OURS
  kept=()
  for entry in "${ours[@]}"; do
    name=${entry%%=*}
    [[ " $OURS " == *" ${name#base_} "* ]] && kept+=("$entry")
  done
  ours=("${kept[@]}")
fi

export REDIS_PORT=$port
export FLUSH_CMD="redis-cli -p $port flushall" REDIS_CLI="redis-cli -p $port"
export CARGO_TARGET_DIR="$work/peers-target" BENCH_OUT="$work/results/$(date -u +%Y%m%dT%H%M%SZ)"
for pass in $(seq "$passes"); do
  echo "== pass $pass of $passes"
  skip_limits=1; [ "$pass" = 1 ] && skip_limits=0
  (cd "$harness" && SKIP_BUILD=1 SKIP_LIMITS=$skip_limits ./run_all.sh "${ours[@]}")
done
"$harness/aggregate.sh" "$BENCH_OUT"/*/results.tsv | tee "$BENCH_OUT/median.txt"
grep -h '^CHECK' "$BENCH_OUT"/*/checks.txt | sort | uniq -c | tee "$BENCH_OUT/checks.txt"
