#!/usr/bin/env bash
# A build of the `payments` example re-linked with the functions its requests run placed
# first, together: the same code, fewer pages of it per request (see "Where the hot code
# sits" in BENCHMARKS.md). The example runs in memory under callgrind, loaded with first
# executions and then replays (the shared harness's scripts); every function of the
# binary that ran at least one instruction every other request goes, hottest first, into an lld
# `--symbol-ordering-file`, and the example is linked again with it.
#
#   benches/hot-first.sh .         # this tree
#   benches/hot-first.sh 09e953f   # a revision, as it shipped
#
# Prints the re-linked binary's path (target/http-bench/hot-first-<name>), for
# interleaved.sh, profile.sh or server-instructions.sh; the ordering file lies beside it.
# This tree's own build is linked back as it was afterwards.
set -euo pipefail
[ $# = 1 ] || { sed -n '2,14p' "$0" >&2; exit 2; }
source "$(dirname "$0")/example-build.sh"
harness=${HARNESS:-$example_root/../shared/bench}
for tool in wrk curl valgrind callgrind_control; do
  command -v $tool >/dev/null || { echo "needs $tool" >&2; exit 1; }
done
what=$1
bin=$(example_build "$what")
read -r src target < <(example_source "$what")
name=$([ "$what" = . ] && echo tree || git -C "$example_root" rev-parse --short "$what^{commit}")
out=$(mktemp -d)
server=
trap 'kill "$server" 2>/dev/null || true; rm -rf "$out"' EXIT

addr=127.0.0.1:${HOT_FIRST_PORT:-3008}
# Mangled names, as the linker knows them.
env -u REDIS_URL -u REDIS_CLUSTER_URLS -u REDIS_SENTINEL_URLS -u DATABASE_URL -u RUST_LOG \
  PAYMENTS_STATS=payments PAYMENTS_ADDR=$addr \
  valgrind --tool=callgrind --demangle=no --callgrind-out-file="$out/callgrind.out" "$bin" \
  >"$out/server.log" 2>&1 &
server=$!
for _ in $(seq 200); do curl -s -o /dev/null "http://$addr/v1/stats" && break; sleep 0.1; done
for i in $(seq 100); do
  curl -s -o /dev/null -X POST "http://$addr/v1/payments" -H 'Content-Type: application/json' \
    -H "Idempotency-Key: $(printf '00000000-0000-4000-8000-%012d' "$i")" \
    -H 'Authorization: Bearer bench' --data '{"amount":1000,"currency":"usd"}'
done
wrk -t1 -c8 -d2s -s "$harness/first.lua" "http://$addr" -- bench >/dev/null
callgrind_control -z "$server" >/dev/null 2>&1
requests=0
for load in "first.lua -- bench" "replay.lua -- 100 0 bench"; do
  # shellcheck disable=SC2086 # the script and its arguments, split on purpose
  answered=$(wrk -t1 -c8 -d4s -s "$harness/${load%% *}" "http://$addr" ${load#* } |
    sed -n 's/^ *\([0-9]*\) requests in.*/\1/p')
  requests=$((requests + answered))
done
callgrind_control -d "$server" >/dev/null 2>&1
sleep 0.5
kill -INT "$server"; wait "$server" || true
server=

order=$example_work/hot-first-$name.order
# Self cost per function of the binary (a call's line after `calls=` is the callee's
# inclusive cost, not the caller's own), then those at or above half the requests. A
# recursive call is counted under the function's name with a quote and a number
# (`symbol'2`): one function to the linker.
awk -v binary="$(basename "$bin")" -v least=$((requests / 2)) -v quote="'" '
  /^ob=/ { id = $1; sub(/^ob=/, "", id); sub(/\).*/, ")", id)
           if ($0 ~ /\) ./) { file = $0; sub(/^ob=\([0-9]+\) /, "", file); objects[id] = file }
           ob = objects[id]; next }
  /^fn=/ { id = $1; sub(/^fn=/, "", id); sub(/\).*/, ")", id)
           if ($0 ~ /\) ./) { fname = $0; sub(/^fn=\([0-9]+\) /, "", fname); names[id] = fname }
           fn = names[id]; mine = ob ~ ("/" binary "$"); next }
  /^c(fn|ob|fi|fl)=/ { if ($0 ~ /\) ./) { cid = $1; sub(/^c(fn|ob|fi|fl)=/, "", cid); sub(/\).*/, ")", cid)
                         cname = $0; sub(/^c(fn|ob|fi|fl)=\([0-9]+\) /, "", cname)
                         if ($0 ~ /^cfn/) names[cid] = cname; else if ($0 ~ /^cob/) objects[cid] = cname }
                       next }
  /^calls=/ { call = 1; next }
  /^(0x|\+|-|\*|[0-9])/ { if (call) { call = 0; next }
                          if (mine) { f = fn; sub(quote "[0-9]+$", "", f); cost[f] += $2 }
                          next }
  END { for (f in cost) if (cost[f] >= least) print cost[f], f }
' "$(ls "$out"/callgrind.out.* | head -1)" | sort -k1,1 -n -r | cut -d' ' -f2- >"$order"
echo "$(wc -l <"$order") hot functions of $requests requests" >&2

relink() { # extra rustc arguments...
  CARGO_TARGET_DIR=$target cargo rustc --release --example payments \
    --manifest-path "$src/Cargo.toml" -- "$@" >&2
}
relink -C "link-arg=-Wl,--symbol-ordering-file=$order" -C link-arg=-Wl,--no-warn-symbol-ordering
cp "$target/release/examples/payments" "$example_work/hot-first-$name"
relink # linked back as `cargo build` links it
echo "$example_work/hot-first-$name"
