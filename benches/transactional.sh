#!/usr/bin/env bash
# HTTP load on PostgreSQL, side by side in one run: the payments example with its ledger
# (each payment also inserts one row of `payments`), in the transactional mode on each
# driver (the row commits in the layer's transaction, with the record: one commit) against
# `PostgresStore` with the handler's own autocommit insert (three commits: the claim, the
# row, the record). All as a user runs them: `RUST_LOG` unset, the recorder installed, the
# local cache of completed records in front.
#
#   benches/transactional.sh                  # 3 passes, the order rotated each pass
#   PASSES=5 DURATION=10s benches/transactional.sh
#   SYNC_STANDBY=1 benches/transactional.sh   # on a primary with a synchronous standby
#   SYNC_STANDBY=1 STANDBY_DELAY_MS=1 benches/transactional.sh   # the standby 2 ms away
#
# By default on the PostgreSQL at $BENCH_DATABASE_SERVER (postgres://postgres@127.0.0.1:5432),
# in a database of its own, dropped afterwards. With SYNC_STANDBY=1 on a primary and a
# synchronous standby of its own (initdb, pg_basebackup; free ports, removed afterwards):
# every commit then waits for the standby's flush, as in a deployment that loses no
# committed write when it fails over, and a commit costs what it costs there. With
# STANDBY_DELAY_MS, the standby reaches the primary through benches/delay-proxy.py, which
# holds the traffic that long each way: a commit then waits a network round trip, as with
# the standby in another zone. The script prints what a commit takes before the load.
#
# Needs ../shared/bench (the harness), wrk, curl, taskset, psql (and the PostgreSQL server
# binaries for SYNC_STANDBY). Every knob of the harness's run.sh passes through.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
harness=${HARNESS:-$root/../shared/bench}
work=${BENCH_WORK:-$root/target/http-bench}
passes=${PASSES:-3}
database=idempotency_bench_transactional
mkdir -p "$work"
command -v wrk >/dev/null || { echo "the HTTP benchmarks need wrk (apt-get install wrk)" >&2; exit 1; }

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
as_postgres() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

cleanup=()
# Undone last first: the database goes before the servers that hold it.
trap 'for ((i = ${#cleanup[@]} - 1; i >= 0; i--)); do eval "${cleanup[i]}" || true; done' EXIT
if [ "${SYNC_STANDBY:-0}" = 1 ]; then
  bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
  bin=${PG_BIN:-$bin}
  cluster=$(mktemp -d)
  cleanup+=("rm -rf '$cluster'")
  chmod 755 "$cluster"
  [ "$(id -u)" = 0 ] && chown postgres "$cluster"
  primary=$(free_port) standby=$(free_port)
  as_postgres "$bin/initdb" -D "$cluster/primary" -U postgres --auth=trust >/dev/null
  cat >>"$cluster/primary/postgresql.conf" <<EOF
port = $primary
listen_addresses = '127.0.0.1'
unix_socket_directories = '$cluster'
wal_level = replica
max_wal_senders = 4
synchronous_standby_names = '*'
max_connections = 200
EOF
  echo "host replication postgres 127.0.0.1/32 trust" >>"$cluster/primary/pg_hba.conf"
  as_postgres "$bin/pg_ctl" -D "$cluster/primary" -l "$cluster/primary.log" -w start >/dev/null
  cleanup+=("as_postgres '$bin/pg_ctl' -D '$cluster/primary' -m immediate stop >/dev/null")
  as_postgres "$bin/pg_basebackup" -h 127.0.0.1 -p "$primary" -U postgres -D "$cluster/standby" -R
  echo "port = $standby" >>"$cluster/standby/postgresql.conf"
  if [ -n "${STANDBY_DELAY_MS:-}" ]; then
    proxy=$(free_port)
    python3 "$root/benches/delay-proxy.py" "$proxy" "$primary" "$STANDBY_DELAY_MS" &
    cleanup+=("kill $!")
    # The last setting in the file wins: the standby streams through the proxy.
    echo "primary_conninfo = 'host=127.0.0.1 port=$proxy user=postgres'" \
      >>"$cluster/standby/postgresql.auto.conf"
  fi
  as_postgres "$bin/pg_ctl" -D "$cluster/standby" -l "$cluster/standby.log" -w start >/dev/null
  cleanup+=("as_postgres '$bin/pg_ctl' -D '$cluster/standby' -m immediate stop >/dev/null")
  server=postgres://postgres@127.0.0.1:$primary
  for _ in $(seq 100); do
    state=$(psql "$server/postgres" -Atc "SELECT sync_state FROM pg_stat_replication" || true)
    [ "$state" = sync ] && break
    sleep 0.1
  done
  [ "$state" = sync ] || { echo "the standby did not become synchronous" >&2; exit 1; }
  # One client committing one row after another: what a commit waits for here.
  psql "$server/postgres" -qc "CREATE TABLE commit_probe (at timestamptz)"
  echo 'INSERT INTO commit_probe VALUES (now());' >"$cluster/commit.sql"
  pgbench -n -c 1 -T 3 -f "$cluster/commit.sql" -h 127.0.0.1 -p "$primary" -U postgres postgres |
    grep -E '^latency average' | sed 's/^/a commit on this primary: /'
else
  server=${BENCH_DATABASE_SERVER:-postgres://postgres@127.0.0.1:5432}
fi

cargo build --release --example payments --features postgres,sqlx --manifest-path "$root/Cargo.toml"
cp "$root/target/release/examples/payments" "$work/payments-sqlx"
payments_bin=$work/payments-sqlx

psql "$server/postgres" -qc "DROP DATABASE IF EXISTS $database WITH (FORCE)"
psql "$server/postgres" -qc "CREATE DATABASE $database"
cleanup+=("psql '$server/postgres' -qc 'DROP DATABASE IF EXISTS $database WITH (FORCE)'")
url="$server/$database"
# Before every measured run: empty tables, so that no run inherits another's rows. (The
# harness runs $FLUSH_CMD split on spaces, unquoted: a script of its own.)
truncate="DO \$\$ BEGIN IF to_regclass('public.payments') IS NOT NULL THEN
  TRUNCATE payments, idempotency_keys; END IF; END \$\$"
printf '#!/bin/bash\nexec psql %q -qc %q\n' "$url" "$truncate" >"$work/truncate-tables"
chmod +x "$work/truncate-tables"
export FLUSH_CMD="$work/truncate-tables"
export REDIS_CLI= PEERS=" " CONNS=${CONNS:-128}
export BENCH_OUT="$work/results/transactional-$(date -u +%Y%m%dT%H%M%SZ)"
common="env -u RUST_LOG -u REDIS_URL PAYMENTS_STATS=payments PAYMENTS_LEDGER=postgres DATABASE_URL=$url"
entries=(
  "pg_autocommit=$common $payments_bin"
  "pg_tx_sqlx=$common IDEMPOTENCY_TRANSACTIONAL=1 $payments_bin"
  "pg_tx_tokio_postgres=$common IDEMPOTENCY_TRANSACTIONAL=tokio-postgres $payments_bin"
)
for pass in $(seq "$passes"); do
  echo "== pass $pass of $passes"
  # Each entry first once in three passes: none always runs on the warmest machine.
  shift=$(((pass - 1) % ${#entries[@]}))
  order=("${entries[@]:shift}" "${entries[@]:0:shift}")
  (cd "$harness" && SKIP_BUILD=1 SKIP_LIMITS=1 ./run_all.sh "${order[@]}")
done
"$harness/aggregate.sh" "$BENCH_OUT"/*/results.tsv | tee "$BENCH_OUT/median.txt"
grep -h '^CHECK' "$BENCH_OUT"/*/checks.txt | sort | uniq -c | tee "$BENCH_OUT/checks.txt"
