#!/usr/bin/env bash
# Where the `payments` example's CPU goes per request, sampled: each build in memory on
# CPU 1 (as in interleaved.sh), loaded by wrk on CPU 0 with 128 connections, its process
# sampled by `perf record -e cpu-clock` for 4 s in the middle of a 6 s run; the samples'
# time divided by the requests answered in those 4 s. Per build and workload: CPU time per
# request, in the kernel and in user space, and user space by component (this crate,
# hyper, axum and tower, http, tokio, the allocator and memcpy, metrics, tracing, the clock,
# serde, SHA-256, the example itself). Runs alternate between the builds ($RUNS each).
#
#   benches/profile.sh 09e953f .                 # first executions and replays
#   RUNS=3 WORKLOADS=replay benches/profile.sh . # one build, replays only
#
# A build is a path to an example binary, `.` for this tree, or a git revision. Needs perf
# (Debian's linux-perf) and permission to sample the server; the samples stay in
# target/http-bench/profile-<time>/ for `perf report -i`.
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,15p' "$0" >&2; exit 2; }
source "$(dirname "$0")/example-build.sh"
harness=${HARNESS:-$example_root/../shared/bench}
runs=${RUNS:-2}
workloads=${WORKLOADS:-first replay}
for tool in wrk curl taskset perf; do
  command -v $tool >/dev/null || { echo "needs $tool" >&2; exit 1; }
done
builds=()
for what in "$@"; do
  bin=$(example_build "$what")
  builds+=("$bin")
done
out=$example_work/profile-$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out"
example_pid=
trap 'kill "$example_pid" 2>/dev/null || true' EXIT

# "total kernel user" ns per request, then "component ns" lines, from one recording.
per_request() { # perf.data requests
  perf report -i "$1" --stdio --no-children -g none --sort dso,sym --percent-limit 0 2>/dev/null |
    awk -v requests="$2" '
      /^# Event count/ { total = $NF }
      /^ +[0-9.]+%/ {
        share = $1; sub("%", "", share); kind = $3; symbol = $0
        part = "other"
        if (kind == "[k]") part = "kernel"
        else if (symbol ~ /tower_idempotency/) part = "this crate"
        else if (symbol ~ /payments::/) part = "the example"
        else if (symbol ~ /hyper/) part = "hyper"
        else if (symbol ~ /axum|tower::|tower_http|matchit/) part = "axum and tower"
        else if (symbol ~ /metrics/) part = "metrics"
        else if (symbol ~ /tracing/) part = "tracing"
        else if (symbol ~ /http::/) part = "http"
        else if (symbol ~ /tokio|mio::/) part = "tokio"
        else if (symbol ~ /malloc|free|_int_|memmove|memcpy|memset|consolidate|unlink_chunk/) part = "allocator and memcpy"
        else if (symbol ~ /clock_gettime/) part = "clock"
        else if (symbol ~ /serde/) part = "serde"
        else if (symbol ~ /sha2/) part = "SHA-256"
        ns[part] += share / 100
      }
      END {
        per = total / requests
        printf "total %.0f kernel %.0f user %.0f\n", per, ns["kernel"] * per, (1 - ns["kernel"]) * per
        for (part in ns) if (part != "kernel") printf "%s\t%.0f\n", part, ns[part] * per
      }'
}

for workload in $workloads; do
  for run in $(seq "$runs"); do
    for i in "${!builds[@]}"; do
      bin=${builds[$i]}
      example_start "$bin"
      example_prewarm
      taskset -c 0 wrk -t1 -c128 -d2s -s "$harness/first.lua" "http://$example_addr" -- warm >/dev/null
      if [ "$workload" = first ]; then args=(first.lua -- bench); else args=(replay.lua -- 100 1 bench); fi
      before=$(curl -s "http://$example_addr/v1/stats")
      taskset -c 0 wrk -t1 -c128 -d6s --timeout 5s -s "$harness/${args[0]}" \
        "http://$example_addr" "${args[@]:1}" >"$out/$workload-$run-$i.wrk" &
      wrk_pid=$!
      sleep 1
      perf record -q -e cpu-clock -F 4000 -p "$example_pid" -o "$out/$workload-$run-$i.data" -- sleep 4 \
        >/dev/null 2>&1
      wait "$wrk_pid"
      kill "$example_pid" && wait "$example_pid" 2>/dev/null || true
      example_pid=
      # The sampled 4 s of a steady 6 s run: two thirds of its requests.
      requests=$(awk '/^RESULT/ {printf "%.0f", $5 * 4 / 6}' "$out/$workload-$run-$i.wrk")
      echo "== $workload, run $run, build $((i + 1)) ($bin): $requests requests sampled"
      per_request "$out/$workload-$run-$i.data" "$requests" >"$out/$workload-$run-$i.txt"
      head -n 1 "$out/$workload-$run-$i.txt"
      tail -n +2 "$out/$workload-$run-$i.txt" | sort -t$'\t' -k2 -n -r
    done
  done
done
