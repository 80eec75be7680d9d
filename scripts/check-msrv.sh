#!/usr/bin/env bash
# The crate's `rust-version` (its MSRV) only holds if every dependency builds on that Rust
# too. This fails when a package reachable through normal or build dependencies (all
# features, every target platform; dev-dependencies excluded) declares a newer
# `rust-version` than the crate does, listing each one.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo metadata --quiet --format-version 1 --all-features | python3 -c '
import json, sys

def parse(v):
    parts = [int(p) for p in v.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))

meta = json.load(sys.stdin)
packages = {p["id"]: p for p in meta["packages"]}
nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
root = meta["resolve"]["root"]
declared = packages[root]["rust_version"]
if not declared:
    sys.exit("check-msrv: Cargo.toml declares no rust-version")

seen, stack = set(), [root]
while stack:
    node = stack.pop()
    if node in seen:
        continue
    seen.add(node)
    for dep in nodes[node]["deps"]:
        if any(k["kind"] in (None, "build") for k in dep["dep_kinds"]):
            stack.append(dep["pkg"])
seen.discard(root)

too_new = sorted(
    (parse(p["rust_version"]), p["name"], p["version"], p["rust_version"])
    for p in (packages[i] for i in seen)
    if p["rust_version"] and parse(p["rust_version"]) > parse(declared)
)
if too_new:
    print(f"check-msrv: the crate declares rust-version {declared}, but these dependencies need newer:", file=sys.stderr)
    for _, name, version, needs in too_new:
        print(f"  {name} {version} (rust-version {needs})", file=sys.stderr)
    sys.exit("check-msrv: raise rust-version in Cargo.toml, or hold these back with `cargo update -p NAME --precise VERSION`")
print(f"check-msrv: all {len(seen)} dependencies build on rust-version {declared}")
'
