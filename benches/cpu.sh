#!/usr/bin/env bash
# Where the CPU goes per request under load: for each server, the CPU time its process and
# redis-server spend per request, the Redis commands per request (those run inside scripts
# included), how busy each of the two CPUs was (CPU 1 runs the server, CPU 0 wrk; Redis
# runs on either), the time per request CPU 1 spent on anything but the server (mostly Redis
# woken there), and the page faults the server takes per request (memory it touches for
# the first time); each run's Redis commandstats (time per command) go to a log beside the
# table. Same load as benches/http.sh (the harness's first.lua and replay.lua, 128
# connections, the server pinned to CPU 1 and wrk to CPU 0, Redis floating), one fresh
# server per measured run.
#
#   benches/cpu.sh                          # 3 passes, medians
#   PASSES=5 DURATION=10s benches/cpu.sh
#   SERVERS="bare ours_memory" WORKLOADS=replay benches/cpu.sh   # only these runs
set -euo pipefail
passes=${PASSES:-3}
duration=${DURATION:-8s}
conns=${CONNS:-128}
source "$(dirname "$0")/http-env.sh"
addr=127.0.0.1:${CPU_BENCH_PORT:-3000}
redis=(redis-cli -p "$port")
servers=(
  "bare=$peers_bin/bare"
  "naive_redis=env REDIS_URL=$REDIS_URL $peers_bin/naive_redis"
  "${ours[@]}"
)
out=$work/cpu-$(date -u +%Y%m%dT%H%M%SZ).tsv
tick=$(getconf CLK_TCK)
server=
trap 'kill "$server" 2>/dev/null || true; kill "$(cat "$work/redis.pid")" 2>/dev/null || true' EXIT

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
faults() { awk '{print $10 + $12}' "/proc/$1/stat"; }
# "busy total steal" jiffies of one CPU ("cpu" for both): busy is user, nice, system, irq
# and softirq; steal is time the hypervisor gave to someone else, the machine's noise
core_ticks() { awk -v c="cpu$1" '$1 == c {print $2 + $3 + $4 + $7 + $8, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9, $9}' /proc/stat; }
redis_stat() { "${redis[@]}" info "$1" | tr -d '\r'; }
stats() { curl -s --max-time 1 "http://$addr/v1/stats"; }

measure() { # name workload command...
  local name=$1 workload=$2; shift 2
  if [ -n "$(stats)" ]; then echo "something already answers on $addr" >&2; exit 1; fi
  PAYMENTS_ADDR=$addr taskset -c 1 "$@" >"$work/cpu-server.log" 2>&1 &
  server=$!
  for _ in $(seq 100); do [ -n "$(stats)" ] && break; sleep 0.1; done
  [ -n "$(stats)" ] || { echo "$name did not start:" >&2; cat "$work/cpu-server.log" >&2; exit 1; }
  taskset -c 0 wrk -t1 -c32 -d2s -s "$harness/first.lua" "http://$addr" -- warmup >/dev/null
  "${redis[@]}" flushall >/dev/null
  local args=bench
  if [ "$workload" = replay ]; then
    for i in $(seq 100); do
      curl -s -o /dev/null -X POST "http://$addr/v1/payments" -H 'Content-Type: application/json' \
        -H "Idempotency-Key: $(printf '00000000-0000-4000-8000-%012d' "$i")" \
        -H 'Authorization: Bearer bench' --data '{"amount":1000,"currency":"usd"}'
    done
    args="100 0 bench"
  fi
  "${redis[@]}" config resetstat >/dev/null
  local redis_pid; redis_pid=$(cat "$work/redis.pid")
  local s0 r0 f0 c0 c1 call; s0=$(cpu_ticks "$server"); r0=$(cpu_ticks "$redis_pid"); f0=$(faults "$server")
  c0=$(core_ticks 0); c1=$(core_ticks 1); call=$(core_ticks "")
  # shellcheck disable=SC2086
  local result; result=$(taskset -c 0 wrk -t1 -c"$conns" -d"$duration" -s "$harness/$workload.lua" \
    "http://$addr" -- $args | grep '^RESULT')
  local s1 r1 f1 busy0 busy1 steal; s1=$(cpu_ticks "$server"); r1=$(cpu_ticks "$redis_pid"); f1=$(faults "$server")
  busy0=$(echo "$c0 $(core_ticks 0)" | awk '{printf "%.0f", 100 * ($4 - $1) / ($5 - $2)}')
  local end1; end1=$(core_ticks 1)
  busy1=$(echo "$c1 $end1" | awk '{printf "%.0f", 100 * ($4 - $1) / ($5 - $2)}')
  # CPU 1's busy time that was not the server's: Redis when the kernel woke it there, and
  # interrupt work; it takes turns with the server on the server's only core
  local others1; others1=$(echo "$c1 $end1 $((s1 - s0))" | awk '{print $4 - $1 - $7}')
  steal=$(echo "$call $(core_ticks "")" | awk '{printf "%.0f", 100 * ($6 - $3) / ($5 - $2)}')
  local commands
  commands=$(redis_stat stats | awk -F: '/^total_commands_processed/{print $2}')
  { echo "== $name $workload $result"; redis_stat commandstats | grep -v '^#'; } >>"${out%.tsv}.commandstats.txt"
  kill "$server"; wait "$server" 2>/dev/null || true
  server=
  awk -v n="$name" -v w="$workload" -v res="$result" -v s=$((s1 - s0)) -v r=$((r1 - r0)) \
    -v t="$tick" -v c="$commands" -v b0="$busy0" -v b1="$busy1" -v st="$steal" -v pf=$((f1 - f0)) \
    -v o1="$others1" 'BEGIN {
      split(res, f, " "); rps = f[2]; req = f[5]
      printf "%s\t%s\t%.0f\t%.1f\t%.1f\t%.2f\t%d\t%d\t%d\t%.3f\t%.1f\n", n, w, rps, s / t * 1e6 / req,
        r / t * 1e6 / req, c / req, b1, b0, st, pf / req, o1 / t * 1e6 / req }' | tee -a "$out"
}

only_servers=${SERVERS:-}
for pass in $(seq "$passes"); do
  for entry in "${servers[@]}"; do
    name=${entry%%=*}
    [ -z "$only_servers" ] || [[ " $only_servers " == *" $name "* ]] || continue
    for workload in ${WORKLOADS:-first replay}; do
      # shellcheck disable=SC2086
      measure "$name" "$workload" ${entry#*=}
    done
  done
done
echo
printf '%-20s %-7s %9s %14s %13s %9s %11s %11s %7s %11s %16s\n' server workload req/s server_us/req redis_us/req cmds/req cpu1_busy% cpu0_busy% steal% faults/req cpu1_other_us/req
sort -k1,1 -k2,2 -s "$out" | awk -F'\t' '
  function median(list,   n, a, i, j, t) {
    n = split(list, a, " ")
    for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
  }
  { k = $1 "\t" $2; if (!(k in seen)) { seen[k] = 1; order[++n] = k }
    for (i = 3; i <= 11; i++) v[k, i] = v[k, i] " " $i }
  END { for (o = 1; o <= n; o++) { k = order[o]; split(k, kk, "\t")
    printf "%-20s %-7s %9.0f %14.1f %13.1f %9.2f %11.0f %11.0f %7.0f %11.3f %16.1f\n", kk[1], kk[2],
      median(v[k, 3]), median(v[k, 4]), median(v[k, 5]), median(v[k, 6]), median(v[k, 7]),
      median(v[k, 8]), median(v[k, 9]), median(v[k, 10]), median(v[k, 11]) } }' \
  | tee "${out%.tsv}.median.txt"
