#!/usr/bin/env bash
# HTTP load on a 3-master Redis Cluster next to one Redis node, in the same run: the payments
# example on each (without its local cache, so every operation reaches Redis, and with it),
# beside bare Axum and the hand-written Redis middleware on the single node; and on a
# primary with one replica, with and without waiting for the replica's acknowledgement
# (IDEMPOTENCY_REPLICAS=1), the cost of the durability option. Afterwards, the Redis
# commands each master ran per request and how the keys spread over the masters.
#
#   benches/cluster.sh                     # 3 passes, then the median table
#   PASSES=5 DURATION=10s benches/cluster.sh
#   PASSES=0 benches/cluster.sh            # the spread over the masters alone
#
# Same harness and pinning as benches/http.sh (the server on CPU 1, wrk on CPU 0, Redis
# floating). The cluster has no replicas: replication would be a cost of its own.
set -euo pipefail
passes=${PASSES:-3}
export PEERS=${PEERS:-bare naive_redis}
export CONNS=${CONNS:-128}
source "$(dirname "$0")/http-env.sh"

log() { printf '%s\n' "cluster.sh: $*" >&2; }
cleanup=("kill \"\$(cat '$work/redis.pid')\" 2>/dev/null")
trap 'for cmd in "${cleanup[@]}"; do eval "$cmd" || true; done' EXIT
source "$root/scripts/redis-topologies.sh"

dir=$(mktemp -d)
cleanup+=("for p in '$dir'/*.pid; do kill \$(cat \"\$p\") 2>/dev/null; done; sleep 0.2; rm -rf '$dir'")
read -r -a ports <<<"$(free_ports 8)"
masters=("${ports[@]:0:3}")
primary=${ports[6]} replica=${ports[7]}
start_redis_node "$dir" "$primary"
start_redis_node "$dir" "$replica" --replicaof 127.0.0.1 "$primary"
redis_wait "the replica to sync" redis_replicas_linked "$replica"
addresses=() urls=()
for i in 0 1 2; do
  start_redis_node "$dir" "${ports[i]}" --cluster-enabled yes --cluster-port "${ports[i + 3]}" \
    --cluster-config-file nodes.conf --cluster-node-timeout 1000
  addresses+=("127.0.0.1:${ports[i]}")
  urls+=("redis://127.0.0.1:${ports[i]}/")
done
redis_wait "cluster nodes to start" redis_pong "${masters[@]}"
redis-cli --cluster create "${addresses[@]}" --cluster-yes </dev/null >"$dir/create.log"
redis_wait "the cluster to form" redis_cluster_ready "${masters[@]}"
cluster_urls=$(IFS=,; echo "${urls[*]}")

# The harness flushes and counts commands through one command each: these cover the
# single node and every master (one server runs at a time, so the sum is its own).
cat >"$work/flush-all" <<SH
#!/bin/sh
for p in $port ${masters[*]} $primary; do redis-cli -p \$p flushall >/dev/null; done
SH
cat >"$work/redis-all" <<SH
#!/bin/sh
for p in $port ${masters[*]} $primary; do redis-cli -p \$p "\$@"; done | awk -F: '/^total_commands_processed/ { n += \$2 } END { print "total_commands_processed:" n }'
SH
chmod +x "$work/flush-all" "$work/redis-all"
export FLUSH_CMD="$work/flush-all" REDIS_CLI="$work/redis-all"

base="env -u RUST_LOG PAYMENTS_STATS=payments"
runs=(
  "ours_single_nocache=$base IDEMPOTENCY_CACHE_RECORDS=0 REDIS_URL=$REDIS_URL $payments_bin"
  "ours_cluster_nocache=$base IDEMPOTENCY_CACHE_RECORDS=0 REDIS_CLUSTER_URLS=$cluster_urls $payments_bin"
  "ours_single=$base REDIS_URL=$REDIS_URL $payments_bin"
  "ours_cluster=$base REDIS_CLUSTER_URLS=$cluster_urls $payments_bin"
  "ours_replicated_nocache=$base IDEMPOTENCY_CACHE_RECORDS=0 REDIS_URL=redis://127.0.0.1:$primary/ $payments_bin"
  "ours_replica_acks_nocache=$base IDEMPOTENCY_CACHE_RECORDS=0 IDEMPOTENCY_REPLICAS=1 REDIS_URL=redis://127.0.0.1:$primary/ $payments_bin"
)
export CARGO_TARGET_DIR="$work/peers-target" BENCH_OUT="$work/results/cluster-$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$BENCH_OUT"
for pass in $(seq "$passes"); do
  echo "== pass $pass of $passes"
  (cd "$harness" && SKIP_BUILD=1 SKIP_LIMITS=1 ./run_all.sh "${runs[@]}")
done
if [ "$passes" -gt 0 ]; then
  "$harness/aggregate.sh" "$BENCH_OUT"/*/results.tsv | tee "$BENCH_OUT/median.txt"
  grep -h '^CHECK' "$BENCH_OUT"/*/checks.txt | sort | uniq -c | tee "$BENCH_OUT/checks.txt"
fi

# Spread: first executions through the cluster for a few seconds, then each master's share
# of the keys and of the commands.
"$work/flush-all"
for p in "${masters[@]}"; do redis-cli -p "$p" config resetstat >/dev/null; done
spread_addr=127.0.0.1:3999
env -u RUST_LOG PAYMENTS_ADDR=$spread_addr PAYMENTS_STATS=payments IDEMPOTENCY_CACHE_RECORDS=0 \
  REDIS_CLUSTER_URLS="$cluster_urls" "$payments_bin" &
server=$!
cleanup+=("kill $server 2>/dev/null")
for _ in $(seq 100); do curl -sf "http://$spread_addr/v1/stats" >/dev/null && break; sleep 0.1; done
wrk -t1 -c32 -d3s -s "$harness/first.lua" "http://$spread_addr" >/dev/null
requests=$(curl -s "http://$spread_addr/v1/stats" | tr -dc '0-9')
echo "== spread over the masters after $requests first executions"
printf '%s\t%s\t%s\t%s\n' master keys commands commands/request
for p in "${masters[@]}"; do
  keys=$(redis-cli -p "$p" dbsize)
  commands=$(redis-cli -p "$p" info stats | awk -F: '/^total_commands_processed/ {print $2+0}')
  printf '%s\t%s\t%s\t%s\n' "$p" "$keys" "$commands" "$(echo "scale=2; $commands / $requests" | bc)"
done | tee "$BENCH_OUT/spread.tsv"
