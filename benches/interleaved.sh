#!/usr/bin/env bash
# Two builds of the `payments` example, in memory, measured in alternating rounds (ABBA):
# on a shared machine whose speed drifts from minute to minute, a difference of a few per
# cent between builds shows in the median of per-round ratios long before it shows in
# separate runs. Each round starts a fresh server on CPU 1 (one tokio worker), pays the
# 100 replay keys once, fills the store with first executions for $FILL, measures first
# executions for $DURATION, warms up replays for 1 s and measures them for $DURATION (wrk,
# one thread, 128 connections, on CPU 0, with the shared harness's first.lua and
# replay.lua).
#
#   benches/interleaved.sh 09e953f .            # A = that revision, B = this tree
#   ROUNDS=12 FILL=8s benches/interleaved.sh a/payments b/payments
#
# A build is a path to an example binary, `.` for this tree, or a git revision (built as
# it shipped: see example-build.sh). Prints each round, then per workload the medians of
# A and B, the median of the per-round ratios B/A and their range; keeps the rounds in
# target/http-bench/interleaved-<time>.tsv.
set -euo pipefail
[ $# = 2 ] || { sed -n '2,17p' "$0" >&2; exit 2; }
source "$(dirname "$0")/example-build.sh"
harness=${HARNESS:-$example_root/../shared/bench}
rounds=${ROUNDS:-8}
duration=${DURATION:-4s}
fill=${FILL:-2s}
for tool in wrk curl taskset; do
  command -v $tool >/dev/null || { echo "needs $tool (apt-get install wrk curl util-linux)" >&2; exit 1; }
done
a=$(example_build "$1")
b=$(example_build "$2")
out=$example_work/interleaved-$(date -u +%Y%m%dT%H%M%SZ).tsv
example_pid=
trap 'kill "$example_pid" 2>/dev/null || true' EXIT

load() { # duration script args...
  local duration=$1 script=$2
  shift 2
  taskset -c 0 wrk -t1 -c128 -d"$duration" --timeout 5s -s "$harness/$script" \
    "http://$example_addr" -- "$@" | awk '/^RESULT/ {print $2}'
}

round() { # round label binary
  example_start "$3"
  example_prewarm
  load "$fill" first.lua fill >/dev/null
  local first replay
  first=$(load "$duration" first.lua bench)
  load 1s replay.lua 100 1 bench >/dev/null
  replay=$(load "$duration" replay.lua 100 1 bench)
  kill "$example_pid" && wait "$example_pid" 2>/dev/null || true
  example_pid=
  printf '%s\t%s\tfirst\t%s\n%s\t%s\treplay\t%s\n' "$1" "$2" "$first" "$1" "$2" "$replay" |
    tee -a "$out"
}

printf 'A\t%s\nB\t%s\n' "$a" "$b"
for r in $(seq "$rounds"); do
  if [ $((r % 2)) = 1 ]; then round "$r" A "$a"; round "$r" B "$b"
  else round "$r" B "$b"; round "$r" A "$a"; fi
done

awk -F'\t' '
  { rate[$3, $1, $2] = $4; seen[$3] = 1 }
  function median(values, n,   i, j, t) {
    for (i = 2; i <= n; i++) for (j = i; j > 1 && values[j - 1] > values[j]; j--) {
      t = values[j]; values[j] = values[j - 1]; values[j - 1] = t
    }
    return n % 2 ? values[(n + 1) / 2] : (values[n / 2] + values[n / 2 + 1]) / 2
  }
  END {
    for (workload in seen) {
      delete as; delete bs; delete ratios; n = 0
      for (r = 1; r <= rounds; r++) if (rate[workload, r, "A"] > 0 && rate[workload, r, "B"] > 0) {
        n++; as[n] = rate[workload, r, "A"]; bs[n] = rate[workload, r, "B"]
        ratios[n] = bs[n] / as[n]
      }
      if (n == 0) continue
      lo = hi = ratios[1]
      for (i = 2; i <= n; i++) { if (ratios[i] < lo) lo = ratios[i]; if (ratios[i] > hi) hi = ratios[i] }
      printf "%-6s A %.0f/s  B %.0f/s  B/A: median of rounds %.3f (%.2f-%.2f), of medians %.3f, %d rounds\n",
        workload, median(as, n), median(bs, n), median(ratios, n), lo, hi,
        median(bs, n) / median(as, n), n
    }
  }' rounds="$rounds" "$out"
