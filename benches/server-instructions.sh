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
#   CACHE=1 benches/server-instructions.sh ...           # with first-level cache misses
#
# With CACHE=1, callgrind also simulates the caches (32 KiB first-level caches here), and
# the counts start after a warm-up (counters zeroed), so start-up is left out: per request,
# instructions, instruction-cache misses and data-cache misses (reads and writes), and the
# pages of code (4 KiB) a request runs in: those that ran at least one instruction per
# request. A build can count as many instructions as another and still miss the caches
# more often; and the same code spread over more pages costs the processor's translation
# caches, which callgrind does not simulate (BENCHMARKS.md measures what that costs).
# With CACHE=1, DUMPS=<dir> keeps each dump there as <build>.<workload>.<requests>.callgrind,
# and VALGRIND_ARGS adds callgrind options (hot-first.sh reads mangled names so).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/benches/example-build.sh"
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
cache=${CACHE:-0}
sim=()
if [ "$cache" = 1 ]; then
  sim=(--cache-sim=yes --dump-instr=yes)
  printf '%-10s %10s %10s %10s %10s %s\n' workload instr/req I1miss/req D1miss/req pages/req build
else
  printf '%-10s %10s %s\n' workload instr/req build
fi
for bin in "${bins[@]}"; do
  for workload in first replay; do
    # shellcheck disable=SC2086 # options, split on purpose
    "${example_memory_env[@]}" PAYMENTS_ADDR=$addr valgrind --tool=callgrind "${sim[@]}" \
      ${VALGRIND_ARGS:-} --callgrind-out-file="$out/callgrind.out" "$bin" >"$out/server.log" 2>&1 &
    server=$!
    for _ in $(seq 200); do curl -s -o /dev/null "http://$addr/v1/stats" && break; sleep 0.1; done
    args=bench warmed=0
    if [ "$workload" = replay ]; then
      example_prewarm "$addr" 0
      args="100 0 bench" warmed=100
    fi
    if [ "$cache" = 1 ]; then
      # Warm up, then count only what follows.
      wrk -t1 -c8 -d2s -s "$harness/$workload.lua" "http://$addr" -- $args >/dev/null
      callgrind_control -z "$server" >/dev/null 2>&1
      warmed=0
    fi
    requests=$(wrk -t1 -c8 -d"${DURATION:-8s}" -s "$harness/$workload.lua" "http://$addr" -- $args |
      sed -n 's/^ *\([0-9]*\) requests in.*/\1/p')
    if [ "$cache" = 1 ]; then
      callgrind_control -d "$server" >/dev/null 2>&1
      sleep 0.5
    fi
    kill -INT "$server"; wait "$server" || true
    if [ "$cache" = 1 ]; then
      # The dump's summary: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw.
      read -r ir _ _ i1 d1r d1w _ < <(sed -n 's/^summary: *//p' "$(ls "$out"/callgrind.out.* | head -1)")
      per=$((requests + warmed))
      pages=$(awk -v per="$per" -f "$root/benches/code-pages.awk" "$(ls "$out"/callgrind.out.* | head -1)")
      printf '%-10s %10d %10d %10d %10d %s\n' "$workload" $((ir / per)) $((i1 / per)) \
        $(((d1r + d1w) / per)) "$pages" "$bin"
      if [ -n "${DUMPS:-}" ]; then
        mkdir -p "$DUMPS"
        mv "$(ls "$out"/callgrind.out.* | head -1)" \
          "$DUMPS/$(basename "$bin").$workload.$requests.callgrind"
      fi
      rm -f "$out"/callgrind.out*
    else
      total=$(sed -n 's/^summary: *\([0-9]*\).*/\1/p' "$out/callgrind.out")
      printf '%-10s %10d %s\n' "$workload" $((total / (requests + warmed))) "$bin"
    fi
  done
done
