#!/usr/bin/env bash
# The regression gate on instructions per request: counts each path that
# benches/instructions.expected names, in the configuration that ships (a fmt subscriber
# at `info`, the Prometheus recorder), and fails when one grows more than 3 % over its
# recorded count. A change that makes a path dearer on purpose records the new count on
# that path's line, with a line saying why; one that makes it cheaper may record it too.
#
# Counts are callgrind's, so the same on a busy or an idle machine. Redis paths run on a
# redis-server of the gate's own, on a free port, stopped afterwards. Installs valgrind
# (Debian's package) when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
expected=benches/instructions.expected
log() { printf '%s\n' "instructions-gate: $*" >&2; }

if ! command -v valgrind >/dev/null; then
  log "installing valgrind"
  if [ "$(id -u)" -eq 0 ]; then sudo=(); else sudo=(sudo); fi
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq valgrind >/dev/null
fi

port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' \
  2>/dev/null || echo $((20000 + RANDOM % 20000)))
dir=$(mktemp -d)
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes \
  --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" --dir "$dir"
trap 'kill "$(cat "$dir/redis.pid")" 2>/dev/null || true; rm -rf "$dir"' EXIT
for _ in $(seq 50); do redis-cli -p "$port" ping 2>/dev/null | grep -q PONG && break; sleep 0.1; done
export REDIS_URL="redis://127.0.0.1:$port/"

# path count why: one line each; `#` starts a comment.
mapfile -t lines < <(grep -v '^[[:space:]]*#' "$expected" | grep -v '^[[:space:]]*$')
paths=()
declare -A recorded
for line in "${lines[@]}"; do
  read -r path count why <<<"$line"
  if ! [[ "$count" =~ ^[0-9]+$ ]] || [ -z "${why:-}" ]; then
    log "$expected: '$line' is not 'path count why'"
    exit 1
  fi
  paths+=("$path")
  recorded[$path]=$count
done

counted=$(INSTRUCTIONS_RECORDER=prometheus INSTRUCTIONS_SUBSCRIBER=info N=${N:-500} \
  benches/instructions.sh "${paths[@]}")
failed=0
printf '%-15s %10s %10s %8s\n' path recorded counted change
while read -r path count; do
  [ -n "${recorded[$path]:-}" ] || continue
  was=${recorded[$path]}
  change=$(awk -v now="$count" -v was="$was" 'BEGIN { printf "%+.1f%%", 100 * (now - was) / was }')
  verdict=""
  if [ $((count * 100)) -gt $((was * 103)) ]; then
    verdict="  over 3 %: record the new count in $expected, with why, if it is meant"
    failed=1
  fi
  printf '%-15s %10d %10d %8s%s\n' "$path" "$was" "$count" "$change" "$verdict"
done < <(printf '%s\n' "$counted" | tail -n +2)
exit "$failed"
