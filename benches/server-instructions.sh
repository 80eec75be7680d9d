#!/usr/bin/env bash
# Instructions per request of the whole `payments` example process (hyper, axum, the
# handler and the layer), as a user runs it in memory: the server under callgrind, loaded
# by wrk with the shared harness's scripts for a few seconds, its total count divided by
# the requests it answered (start-up included: a few hundred instructions per request).
# Unlike req/s, the count barely moves with whatever else the machine runs, so builds can
# be compared on a noisy machine. Under valgrind SHA-256 runs its portable code.
#
#   benches/server-instructions.sh                       # this tree, first and replay
#   benches/server-instructions.sh path/to/payments ...  # other builds of the example
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
harness=${HARNESS:-$root/../shared/bench}
addr=127.0.0.1:${SERVER_INSTRUCTIONS_PORT:-3007}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
command -v wrk >/dev/null || { echo "needs wrk (apt-get install wrk)" >&2; exit 1; }
bins=("$@")
if [ ${#bins[@]} -eq 0 ]; then
  cargo build --release --example payments --manifest-path "$root/Cargo.toml"
  bins=("$root/target/release/examples/payments")
fi
pay() { # key
  curl -s -o /dev/null -X POST "http://$addr/v1/payments" -H 'Content-Type: application/json' \
    -H "Idempotency-Key: $1" -H 'Authorization: Bearer bench' --data '{"amount":1000,"currency":"usd"}'
}
printf '%-10s %10s %s\n' workload instr/req build
for bin in "${bins[@]}"; do
  for workload in first replay; do
    env -u REDIS_URL -u DATABASE_URL -u RUST_LOG PAYMENTS_STATS=payments PAYMENTS_ADDR=$addr \
      valgrind --tool=callgrind --callgrind-out-file="$out/callgrind.out" "$bin" \
      >"$out/server.log" 2>&1 &
    server=$!
    for _ in $(seq 200); do curl -s -o /dev/null "http://$addr/v1/stats" && break; sleep 0.1; done
    args=bench warmed=0
    if [ "$workload" = replay ]; then
      for i in $(seq 100); do pay "$(printf '00000000-0000-4000-8000-%012d' "$i")"; done
      args="100 0 bench" warmed=100
    fi
    requests=$(wrk -t1 -c8 -d"${DURATION:-8s}" -s "$harness/$workload.lua" "http://$addr" -- $args |
      sed -n 's/^ *\([0-9]*\) requests in.*/\1/p')
    kill -INT "$server"; wait "$server" || true
    total=$(sed -n 's/^summary: *\([0-9]*\).*/\1/p' "$out/callgrind.out")
    printf '%-10s %10d %s\n' "$workload" $((total / (requests + warmed))) "$bin"
  done
done
