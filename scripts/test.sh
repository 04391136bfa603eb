#!/usr/bin/env bash
# The project's one test command: installs what the tests need, then runs them all.
# GPU tests run for real on Mesa's software Vulkan driver (lavapipe) where no GPU exists,
# and fail (not skip) when no adapter is found, because OMNIPREFIX_REQUIRE_GPU=1.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! ls /usr/share/vulkan/icd.d/lvp_icd*.json >/dev/null 2>&1 || ! ldconfig -p | grep -q 'libvulkan.so.1 '; then
  echo "installing the software Vulkan driver (mesa-vulkan-drivers, libvulkan1)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mesa-vulkan-drivers libvulkan1 >/dev/null
fi

export WGPU_BACKEND=vulkan
export OMNIPREFIX_REQUIRE_GPU=1
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp/omniprefix-xdg}"
mkdir -p "$XDG_RUNTIME_DIR"
# Benches run once in test mode; lavapipe is ~100x slower than a GPU, so the attention bench
# shrinks its prefix/suffix lengths 16x there (figures on real GPUs use the full sizes).
export OMNIPREFIX_ATTN_BENCH_SCALE="${OMNIPREFIX_ATTN_BENCH_SCALE:-16}"

# A clean CI build gains nothing from incremental caches, and they double the disk it needs.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
echo "disk free before the build: $(df -h . | awk 'NR==2 {print $4}')"
# Each phase prints its wall time, so a slow CI says where its minutes went.
phase() {
  local start=$SECONDS
  "$@"
  echo "[phase] $(( SECONDS - start )) s: $*"
}

# The engine alone: without default features the library builds with none of the GPU or
# CLI crates (wgpu, naga, clap, indicatif, criterion) nor the KV-event publisher's (zeromq, tokio)
# in its normal dependency tree.
phase cargo check -p omniprefix --no-default-features --all-targets --quiet
if cargo tree -p omniprefix --no-default-features -e normal --prefix none | grep -E '^(wgpu|naga|clap|indicatif|criterion|zeromq|tokio) '; then
  echo "the engine without default features pulls in the crates above" >&2
  exit 1
fi

# Root default members: the engine (`omniprefix`) and its harnesses (`omniprefix-cli`).
phase cargo test --all-targets --no-run "$@"
phase cargo test --all-targets "$@"
phase cargo test --doc "$@"
# Broken intra-doc links fail the build, so the API docs stay navigable.
RUSTDOCFLAGS="-D warnings" phase cargo doc --no-deps --quiet

# The Python package: pip install ./python in a fresh venv, then its pytest suite.
phase bash scripts/test_python.sh

# The demo (--quick) and the notebooks, on a small report, so neither can rot.
phase bash scripts/ci_notebooks.sh
