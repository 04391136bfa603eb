#!/usr/bin/env bash
# scripts/gpu_bundle.sh [DIR]
#
# Builds what scripts/gpu_bench.sh needs on a GPU machine that has no Rust toolchain, into
# DIR (default .gpu/, git-ignored): the stripped release CLI (`omniprefix`), the stripped
# attention bench executable (`attention_bench`), and the Vulkan loader's Debian package
# (`libvulkan1*.deb`; the GPU machine may have a driver but no loader). ~21 MB in all, so
# DIR travels with the working tree. On the GPU machine, from the repo root:
#
#   for f in .gpu/*.deb; do dpkg -x "$f" /; done; ldconfig
#   OMNIPREFIX_BIN=.gpu/omniprefix OMNIPREFIX_ATTN_BENCH=.gpu/attention_bench \
#       WGPU_BACKEND=vulkan bash scripts/gpu_bench.sh OUT_DIR
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
dir=${1:-$root/.gpu}
target=${CARGO_TARGET_DIR:-$root/target}
mkdir -p "$dir"

cargo build --release -p omniprefix-cli
# The bench executable's path, from cargo's own report of what it built.
bench=$(cargo bench --bench attention --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "attention":
        print(m["executable"])
')
strip -o "$dir/omniprefix" "$target/release/omniprefix"
strip -o "$dir/attention_bench" "$bench"
rm -f "$dir"/libvulkan1*.deb
(cd "$dir" && apt-get download libvulkan1 2>/dev/null || { apt-get update -qq && apt-get download libvulkan1; })
ls -l "$dir"
