# A build of the `payments` example re-linked with the functions its requests run placed
# first, together: the same code, fewer pages of it per request (see "Where the hot code
# sits" in BENCHMARKS.md). server-instructions.sh runs the example in memory under
# callgrind, through first executions and through replays (the shared harness's scripts);
# every function of the binary that ran at least one instruction every other request, over
# both, goes, hottest first, into an lld `--symbol-ordering-file`, and the example is
# linked again with it.
#
#   benches/hot-first.sh .         # this tree
#   benches/hot-first.sh 09e953f   # a revision, as it shipped
#
# Prints the re-linked binary's path (target/http-bench/hot-first-<name>), for
# interleaved.sh, profile.sh or server-instructions.sh; the ordering file lies beside it.
# This tree's own build is linked back as it was afterwards.
set -euo pipefail
[ $# = 1 ] || { sed -n '2,15p' "$0" >&2; exit 2; }
source "$(dirname "$0")/example-build.sh"
command -v callgrind_control >/dev/null || { echo "needs valgrind" >&2; exit 1; }
what=$1
bin=$(example_build "$what")
read -r src target < <(example_source "$what")
name=$([ "$what" = . ] && echo tree || git -C "$example_root" rev-parse --short "$what^{commit}")
dumps=$(mktemp -d)
trap 'rm -rf "$dumps"' EXIT

# Mangled names, as the linker knows them.
CACHE=1 DUMPS=$dumps VALGRIND_ARGS=--demangle=no DURATION=${DURATION:-4s} \
  "$example_root/benches/server-instructions.sh" "$bin" >&2
requests=0
for dump in "$dumps"/*.callgrind; do
  answered=${dump%.callgrind}
  requests=$((requests + ${answered##*.}))
done

order=$example_work/hot-first-$name.order
# Self cost per function of the binary (a call's line after `calls=` is the callee's
# inclusive cost, not the caller's own), then those at or above half the requests. A
# recursive call is counted under the function's name with a quote and a number
# (`symbol'2`): one function to the linker.
awk -v binary="$(basename "$bin")" -v least=$((requests / 2)) -v quote="'" '
  FNR == 1 { delete names; delete objects; ob = ""; mine = 0; call = 0 } # ids are per dump
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
  /^positions:/ { columns = NF - 1; next }
  /^calls=/ { call = 1; next }
  /^(0x|\+|-|\*|[0-9])/ { if (call) { call = 0; next }
                          if (mine) { f = fn; sub(quote "[0-9]+$", "", f); cost[f] += $(columns + 1) }
                          next }
  END { for (f in cost) if (cost[f] >= least) print cost[f], f }
' "$dumps"/*.callgrind | sort -k1,1 -n -r | cut -d' ' -f2- >"$order"
echo "$(wc -l <"$order") hot functions of $requests requests" >&2

relink() { # extra rustc arguments...
  CARGO_TARGET_DIR=$target cargo rustc --release --example payments \
    --manifest-path "$src/Cargo.toml" -- "$@" >&2
}
relink -C "link-arg=-Wl,--symbol-ordering-file=$order" -C link-arg=-Wl,--no-warn-symbol-ordering
cp "$target/release/examples/payments" "$example_work/hot-first-$name"
relink # linked back as `cargo build` links it
echo "$example_work/hot-first-$name"
