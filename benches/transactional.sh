#!/usr/bin/env bash
# HTTP load on PostgreSQL, side by side in one run: the payments example with its ledger
# (each payment also inserts one row of `payments`), in the transactional mode (the row
# commits in the layer's transaction, with the record: one commit) against `PostgresStore`
# with the handler's own autocommit insert (three commits: the claim, the row, the record).
# Both as a user runs them: `RUST_LOG` unset, the recorder installed, the local cache of
# completed records in front.
#
#   benches/transactional.sh                # 3 passes, the order swapped each pass
#   PASSES=5 DURATION=10s benches/transactional.sh
#
# Needs ../shared/bench (the harness), wrk, curl, taskset, psql and a PostgreSQL at
# $BENCH_DATABASE_SERVER (default: postgres://postgres@127.0.0.1:5432), where it creates
# and drops a database of its own. Every knob of the harness's run.sh passes through.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
harness=${HARNESS:-$root/../shared/bench}
work=${BENCH_WORK:-$root/target/http-bench}
passes=${PASSES:-3}
server=${BENCH_DATABASE_SERVER:-postgres://postgres@127.0.0.1:5432}
database=idempotency_bench_transactional
mkdir -p "$work"
command -v wrk >/dev/null || { echo "the HTTP benchmarks need wrk (apt-get install wrk)" >&2; exit 1; }

cargo build --release --example payments --features postgres,sqlx --manifest-path "$root/Cargo.toml"
cp "$root/target/release/examples/payments" "$work/payments-sqlx"
payments_bin=$work/payments-sqlx

psql "$server/postgres" -qc "DROP DATABASE IF EXISTS $database WITH (FORCE)"
psql "$server/postgres" -qc "CREATE DATABASE $database"
trap 'psql "$server/postgres" -qc "DROP DATABASE IF EXISTS $database WITH (FORCE)" || true' EXIT
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
autocommit="pg_autocommit=$common $payments_bin"
transactional="pg_transactional=$common IDEMPOTENCY_TRANSACTIONAL=1 $payments_bin"
for pass in $(seq "$passes"); do
  echo "== pass $pass of $passes"
  if [ $((pass % 2)) = 1 ]; then order=("$autocommit" "$transactional"); else order=("$transactional" "$autocommit"); fi
  (cd "$harness" && SKIP_BUILD=1 SKIP_LIMITS=1 ./run_all.sh "${order[@]}")
done
"$harness/aggregate.sh" "$BENCH_OUT"/*/results.tsv | tee "$BENCH_OUT/median.txt"
grep -h '^CHECK' "$BENCH_OUT"/*/checks.txt | sort | uniq -c | tee "$BENCH_OUT/checks.txt"
