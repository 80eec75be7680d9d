# Sourced by scripts/test.sh: a shared Redis Cluster and Sentinel set for the tests that run
# the store on those topologies. Uses the script's `log` and `cleanup`.

# Prints $1 distinct free loopback ports, space-separated: the sockets are all held until
# every one is bound, so no port comes out twice.
free_ports() {
  python3 -c 'import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))' "$1" 2>/dev/null && return
  local base=$((20000 + RANDOM % 20000))
  seq -s ' ' "$base" $((base + $1 - 1))
}

# Polls the command "$2..." every 0.1 s until it succeeds; fails after 20 s, naming $1.
redis_wait() {
  local what=$1 _
  shift
  for _ in $(seq 200); do
    "$@" && return 0
    sleep 0.1
  done
  log "gave up waiting for $what"
  return 1
}

# Succeeds once every port given answers PING.
redis_pong() {
  local port
  for port in "$@"; do
    [ "$(redis-cli -p "$port" ping 2>/dev/null)" = PONG ] || return 1
  done
}

# Succeeds once every replica among the ports given has its link to the master up.
redis_replicas_linked() {
  local port info
  for port in "$@"; do
    info=$(redis-cli -p "$port" info replication 2>/dev/null) || return 1
    [[ $info == *role:master* || $info == *master_link_status:up* ]] || return 1
  done
}

# Succeeds once every cluster node given reports cluster_state:ok and every replica among
# them has its link to the master up.
redis_cluster_ready() {
  local port info
  for port in "$@"; do
    info=$(redis-cli -p "$port" cluster info 2>/dev/null) || return 1
    [[ $info == *cluster_state:ok* ]] || return 1
  done
  redis_replicas_linked "$@"
}

# Succeeds once every Sentinel given knows the replica and the two other Sentinels.
redis_sentinels_ready() {
  local port info
  for port in "$@"; do
    info=$(redis-cli -p "$port" info sentinel 2>/dev/null) || return 1
    [[ $info == *status=ok*,slaves=1,sentinels=3* ]] || return 1
  done
}

# Starts one daemonized redis-server on port $2 with a directory of its own under $1 (nodes
# sharing one would overwrite each other's files); further arguments go to redis-server.
start_redis_node() {
  local dir=$1 port=$2
  shift 2
  mkdir -p "$dir/$port"
  redis-server --port "$port" --bind 127.0.0.1 --protected-mode no --save "" \
    --appendonly no --repl-diskless-sync-delay 0 --dir "$dir/$port" --daemonize yes \
    --pidfile "$dir/$port.pid" --logfile "$dir/$port.log" "$@"
}

# Uses REDIS_CLUSTER_URLS (comma-separated redis:// URLs of cluster nodes) when set;
# otherwise starts a throwaway cluster of 3 masters and 3 replicas. Uses REDIS_SENTINEL_URLS
# (comma-separated redis:// URLs of Sentinels) with REDIS_SENTINEL_MASTER when set;
# otherwise starts a primary, a replica and 3 Sentinels monitoring it as "idem". Whatever it
# starts is stopped and removed on exit.
ensure_redis_topologies() {
  local dir port i ports=() urls=() addresses=()
  if [ -n "${REDIS_CLUSTER_URLS:-}" ]; then
    log "Redis Cluster: REDIS_CLUSTER_URLS=$REDIS_CLUSTER_URLS"
  else
    dir=$(mktemp -d)
    # Registered first, so a failed start is cleaned up too.
    cleanup+=("for p in '$dir'/*.pid; do kill \$(cat \"\$p\") 2>/dev/null; done; sleep 0.2; rm -rf '$dir'")
    # Six client ports, then six cluster bus ports: given explicitly, as the default
    # (port + 10000) overflows for high ports.
    read -r -a ports <<<"$(free_ports 12)"
    for i in 0 1 2 3 4 5; do
      start_redis_node "$dir" "${ports[i]}" --cluster-enabled yes \
        --cluster-port "${ports[i + 6]}" --cluster-config-file nodes.conf \
        --cluster-node-timeout 1000 --cluster-replica-validity-factor 0
      addresses+=("127.0.0.1:${ports[i]}")
      urls+=("redis://127.0.0.1:${ports[i]}/")
    done
    redis_wait "cluster nodes to start" redis_pong "${ports[@]:0:6}"
    if ! redis-cli --cluster create "${addresses[@]}" --cluster-replicas 1 --cluster-yes \
      </dev/null >"$dir/create.log" 2>&1; then
      cat "$dir/create.log" >&2
      return 1
    fi
    redis_wait "the Redis Cluster to form" redis_cluster_ready "${ports[@]:0:6}"
    REDIS_CLUSTER_URLS=$(IFS=,; echo "${urls[*]}")
    export REDIS_CLUSTER_URLS
    log "Redis Cluster: started a throwaway one at $REDIS_CLUSTER_URLS"
  fi

  if [ -n "${REDIS_SENTINEL_URLS:-}" ]; then
    : "${REDIS_SENTINEL_MASTER:?set REDIS_SENTINEL_MASTER with REDIS_SENTINEL_URLS}"
    export REDIS_SENTINEL_MASTER
    log "Sentinel: REDIS_SENTINEL_URLS=$REDIS_SENTINEL_URLS, master $REDIS_SENTINEL_MASTER"
  else
    dir=$(mktemp -d)
    cleanup+=("for p in '$dir'/*.pid; do kill \$(cat \"\$p\") 2>/dev/null; done; sleep 0.2; rm -rf '$dir'")
    read -r -a ports <<<"$(free_ports 5)"
    start_redis_node "$dir" "${ports[0]}"
    start_redis_node "$dir" "${ports[1]}" --replicaof 127.0.0.1 "${ports[0]}"
    # Sentinels learn of replicas from the primary's INFO, which they ask for at once and
    # then only every 10 s: start them once the replica is attached.
    redis_wait "the Sentinel replica to sync" redis_replicas_linked "${ports[1]}"
    urls=()
    for port in "${ports[@]:2:3}"; do
      # Sentinel rewrites its config file, so each gets a writable one of its own.
      cat >"$dir/sentinel-$port.conf" <<CONF
port $port
bind 127.0.0.1
protected-mode no
daemonize yes
dir $dir
pidfile $dir/$port.pid
logfile $dir/$port.log
sentinel monitor idem 127.0.0.1 ${ports[0]} 2
sentinel down-after-milliseconds idem 1000
sentinel failover-timeout idem 3000
sentinel parallel-syncs idem 1
CONF
      redis-server "$dir/sentinel-$port.conf" --sentinel
      urls+=("redis://127.0.0.1:$port/")
    done
    redis_wait "the Sentinels to find each other" redis_sentinels_ready "${ports[@]:2:3}"
    REDIS_SENTINEL_URLS=$(IFS=,; echo "${urls[*]}")
    export REDIS_SENTINEL_URLS REDIS_SENTINEL_MASTER=idem
    log "Sentinel: started a throwaway set at $REDIS_SENTINEL_URLS, master idem"
  fi
}
