#!/usr/bin/env bash
# Instructions per request on each path of the layer (see benches/instructions.rs), from
# two callgrind runs with N and 2N requests. Repeatable to the instruction whatever else
# the machine runs. Under valgrind the SHA-256 fingerprint uses its portable code (valgrind
# has no SHA extensions), so it counts for more than it costs natively.
#
#   benches/instructions.sh                 # every path, N=2000
#   N=500 benches/instructions.sh replay_memory first_redis
#   INSTRUCTIONS_RECORDER=prometheus benches/instructions.sh first_memory   # metrics recorded
set -euo pipefail
cd "$(dirname "$0")/.."
n=${N:-2000}
paths=("$@")
[ ${#paths[@]} -gt 0 ] || paths=(bare pass_through first_memory replay_memory first_redis replay_redis first_cached_redis
  replay_cached_redis)
bin=$(cargo bench --bench instructions --no-run --message-format=json 2>/dev/null \
  | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
[ -x "$bin" ] || { echo "could not build benches/instructions.rs" >&2; exit 1; }
count() { # path requests -> instructions of the whole run
  valgrind --tool=callgrind --callgrind-out-file=/dev/null --collect-atstart=no \
    --toggle-collect='instructions::measured' "$bin" "$1" "$2" 2>&1 \
    | sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
}
printf '%-15s %14s\n' path instructions/request
for path in "${paths[@]}"; do
  once=$(count "$path" "$n")
  twice=$(count "$path" $((2 * n)))
  printf '%-15s %14d\n' "$path" $(((twice - once) / n))
done
