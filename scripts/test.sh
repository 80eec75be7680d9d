#!/usr/bin/env bash
# Runs the whole test suite against real servers.
#
# Redis: uses REDIS_URL when set; otherwise a Redis already answering on 127.0.0.1:6379;
# otherwise starts a throwaway redis-server on a free port (installing Debian's package
# when it is missing) and stops it afterwards. Tests that stop or restart Redis start
# their own redis-server, so the binary is installed in every case.
#
# Redis Cluster and Sentinel: use REDIS_CLUSTER_URLS and REDIS_SENTINEL_URLS (with
# REDIS_SENTINEL_MASTER) when set; otherwise start a throwaway 3-master cluster and a
# primary, replica and three sentinels on free ports, stopped afterwards
# (scripts/redis-topologies.sh). Tests that kill or reshard nodes start their own.
#
# PostgreSQL: uses DATABASE_URL when set; otherwise a server accepting the postgres user on
# 127.0.0.1:5432; otherwise starts a throwaway cluster on a free port (installing Debian's
# postgresql when it is missing) and removes it afterwards. Test tables live in the schema
# idempotency_tests, dropped before each run too (one cut short may have left it).
#
# At exit, pass or fail, the run removes what it wrote on those servers (Redis keys under
# test:*, the schema idempotency_tests, crash tests' databases; scripts/test-cleanup.sh),
# then logs what is left ("left behind: ...") and fails if anything is.
#
# With no arguments it also tests the crate built with serde_json's `arbitrary_precision`
# (checks/arbitrary_precision), as an application's other crates may build it.
#
# Extra arguments go to `cargo test` (for example `--test flow`, or a test name filter).
# The tests that need a server are ignored by a plain `cargo test`: this script runs them
# too (`--include-ignored`, added to the test binaries' arguments given after `--`, if any).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '%s\n' "test.sh: $*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

apt_updated=""
install_packages() {
  if [ -z "$apt_updated" ]; then
    as_root apt-get update -qq
    apt_updated=1
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null \
    || echo $((20000 + RANDOM % 20000))
}

cleanup=()
left_behind=""
# Runs the cleanup commands, last registered first (the suite's data goes before the
# servers holding it stop), and keeps the run's exit status; a run that passed but left
# data behind fails.
on_exit() {
  local status=$? i
  for ((i = ${#cleanup[@]} - 1; i >= 0; i--)); do eval "${cleanup[i]}" || true; done
  if [ "$status" -eq 0 ] && [ -n "$left_behind" ]; then status=1; fi
  exit "$status"
}
trap on_exit EXIT

ensure_redis() {
  if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    log "installing redis-server"
    install_packages redis-server redis-tools
  fi
  if [ -n "${REDIS_URL:-}" ]; then
    log "Redis: REDIS_URL=$REDIS_URL"
    return
  fi
  if redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; then
    export REDIS_URL="redis://127.0.0.1:6379/"
    log "Redis: the one answering on 127.0.0.1:6379"
    return
  fi
  local port dir
  port=$(free_port)
  dir=$(mktemp -d)
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
    --dir "$dir" --daemonize yes --pidfile "$dir/redis.pid" --logfile "$dir/redis.log"
  cleanup+=("kill \$(cat '$dir/redis.pid') 2>/dev/null; rm -rf '$dir'")
  for _ in $(seq 100); do
    redis-cli -p "$port" ping 2>/dev/null | grep -q PONG && break
    sleep 0.1
  done
  export REDIS_URL="redis://127.0.0.1:$port/"
  log "Redis: started a throwaway server at $REDIS_URL"
}

as_postgres() {
  if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

ensure_postgres() {
  if ! command -v psql >/dev/null; then
    log "installing postgresql-client"
    install_packages postgresql-client
  fi
  if [ -z "${DATABASE_URL:-}" ]; then
    local local_url="postgres://postgres@127.0.0.1:5432/postgres"
    if psql "$local_url" -qAtc 'select 1' >/dev/null 2>&1; then
      export DATABASE_URL="$local_url"
      log "PostgreSQL: the one answering on 127.0.0.1:5432"
    else
      start_throwaway_postgres
    fi
  else
    log "PostgreSQL: DATABASE_URL=$DATABASE_URL"
  fi
  drop_test_schema
}

start_throwaway_postgres() {
  local bin port dir
  bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  if [ -z "$bin" ] || [ ! -x "$bin/initdb" ]; then
    log "installing postgresql"
    install_packages postgresql
    bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
  fi
  port=$(free_port)
  dir=$(mktemp -d)
  chmod 755 "$dir"
  [ "$(id -u)" -eq 0 ] && chown postgres "$dir"
  as_postgres "$bin/initdb" -D "$dir/data" -A trust -U postgres >/dev/null
  as_postgres "$bin/pg_ctl" -D "$dir/data" -l "$dir/log" -w \
    -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c fsync=off" start >/dev/null
  cleanup+=("as_postgres '$bin/pg_ctl' -D '$dir/data' -m immediate stop >/dev/null; rm -rf '$dir'")
  export DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres"
  log "PostgreSQL: started a throwaway cluster at $DATABASE_URL"
}

# shellcheck source=scripts/redis-topologies.sh
. scripts/redis-topologies.sh
# shellcheck source=scripts/test-cleanup.sh
. scripts/test-cleanup.sh

# A cluster or Sentinel set given by the environment outlives the run: clean it up too.
given_cluster=${REDIS_CLUSTER_URLS:-}
given_sentinels=${REDIS_SENTINEL_URLS:-}
ensure_redis
ensure_redis_topologies
ensure_postgres
find_redis_targets "$given_cluster" "$given_sentinels"
count_default_keys
cleanup+=("remove_test_data; report_left_behind || left_behind=1")
binary_args=(-- --include-ignored)
for arg in "$@"; do
  if [ "$arg" = -- ]; then
    binary_args=(--include-ignored)
    break
  fi
done
cargo test --all-features "$@" "${binary_args[@]}"
# The whole suite also builds the crate as an application may: with serde_json's
# `arbitrary_precision` unified into it (checks/arbitrary_precision).
if [ $# -eq 0 ]; then
  cargo test --manifest-path checks/arbitrary_precision/Cargo.toml \
    --target-dir "${CARGO_TARGET_DIR:-target}/arbitrary-precision"
fi
