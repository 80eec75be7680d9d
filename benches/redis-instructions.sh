#!/usr/bin/env bash
# Instructions Redis itself executes per request: a redis-server of its own, on a free
# port, runs under `valgrind --tool=callgrind` while the requests are sent; two runs with N
# and 2N requests give the cost of one without the start-up. Repeatable to the instruction
# whatever else the machine runs, unlike Redis's CPU time under load.
#
# Rows: our layer's first execution and replay on `RedisStore` (benches/instructions.rs,
# 256-byte bodies), one request at a time and 16 at a time (as under load, where their
# commands leave in shared batches); as the baseline, naive_redis's pattern, two plain SETs
# per first execution (`SET … NX PX` of a 58-byte value, then `SET … PX` of a 400-byte
# one), sent by redis-benchmark one at a time and pipelined 16 deep.
#
#   benches/redis-instructions.sh             # N=2000
set -euo pipefail
cd "$(dirname "$0")/.."
n=${N:-2000}
bin=$(cargo bench --bench instructions --no-run --message-format=json 2>/dev/null \
  | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
[ -x "$bin" ] || { echo "could not build benches/instructions.rs" >&2; exit 1; }
port=${REDIS_INSTRUCTIONS_PORT:-6397}
while redis-cli -p "$port" ping >/dev/null 2>&1; do port=$((port + 1)); done
log=$(mktemp)
trap 'redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true; rm -f "$log"' EXIT

count() { # command... -> the instructions redis-server executed, start-up included
  valgrind --tool=callgrind --callgrind-out-file=/dev/null \
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no 2>"$log" >/dev/null &
  local server=$!
  for _ in $(seq 100); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.2; done
  "$@" >/dev/null
  redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
  wait "$server" || true
  sed -n 's/.*Collected : \([0-9]*\).*/\1/p' "$log"
}
ours() { REDIS_URL="redis://127.0.0.1:$port/" "$bin" "$@"; }
plain_sets() { # depth requests -> two SETs each, of the sizes a first execution stores
  local bench=(redis-benchmark -p "$port" -c 1 -P "$1" -r 1000000000 -q -n "$2")
  "${bench[@]}" SET "plain:__rand_int__" "$(printf '%058d' 0)" NX PX 30000
  "${bench[@]}" SET "plain:__rand_int__" "$(printf '%0400d' 0)" PX 86400000
}
per_request() { # label command... (the command takes the request count last)
  local label=$1; shift
  local once twice
  once=$(count "$@" "$n")
  twice=$(count "$@" $((2 * n)))
  printf '%-40s %12d\n' "$label" $(((twice - once) / n))
}
printf '%-40s %12s\n' path "Redis instructions/request"
per_request "first execution, ours" ours first_redis
per_request "first execution, ours, 16 at a time" ours first_redis_16
per_request "replay, ours" ours replay_redis
per_request "two plain SETs (naive_redis's pattern)" plain_sets 1
per_request "two plain SETs, 16 at a time" plain_sets 16
