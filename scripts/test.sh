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

# The Python venv (the package's tests and the notebooks) fills from PyPI while cargo compiles:
# pip waits on the network, the build on the CPU. Its log is shown if it fails.
venv="${CARGO_TARGET_DIR:-target}/python-venv"
venv_log="$(mktemp)"
bash scripts/python_venv.sh "$venv" python/requirements-test.txt notebooks/requirements.txt \
    python/requirements-typecheck.txt > "$venv_log" 2>&1 &
venv_pid=$!
# Beside it, the fleet's venv (Dynamo 1.6.1's pinned set, scripts/install_fleet.sh) for
# python/tests/test_fleet.py; the package goes in after the Python tests built the wheel.
fleet_venv="${CARGO_TARGET_DIR:-target}/fleet-venv"
fleet_log="$(mktemp)"
(OMNIPREFIX_FLEET_DEPS_ONLY=1 bash scripts/install_fleet.sh "$fleet_venv" &&
    "$fleet_venv/bin/pip" install --quiet --disable-pip-version-check -r python/requirements-fleet-test.txt) \
    > "$fleet_log" 2>&1 &
fleet_pid=$!

# A clean CI build gains nothing from incremental caches, and they double the disk it needs.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
echo "disk free before the build: $(df -h . | awk 'NR==2 {print $4}')"
# Each phase prints its wall time, so a slow CI says where its minutes went.
phase() {
  local start=$SECONDS
  "$@"
  echo "[phase] $(( SECONDS - start )) s: $*"
}

# The gates, cheapest first so a slip fails in seconds: one style (rustfmt.toml), then clippy
# with every warning an error (undocumented `unsafe` blocks included: [workspace.lints]).
phase cargo fmt --all --check
# Clippy lints inside the builds below rather than in a `cargo clippy` pass of its own: that pass
# checked every dependency and every workspace crate once more before the test build compiled
# them again (376 s of a 1306 s CI). `cargo clippy` itself works this way: it sets
# RUSTC_WORKSPACE_WRAPPER to clippy-driver, which is rustc plus clippy's lints, for the workspace's
# crates only. Exported for the whole run, so every build (the test build with all targets and the
# features it unifies, the no-default-features check, the Python extension's maturin build) lints
# what it compiles and fingerprints stay equal, so nothing is compiled twice.
export RUSTC_WORKSPACE_WRAPPER="${RUSTC_WORKSPACE_WRAPPER:-$(rustup which clippy-driver 2>/dev/null || command -v clippy-driver)}"
export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"

# The engine alone: without default features the library builds with none of the GPU or
# CLI crates (wgpu, naga, clap, indicatif, criterion) nor the KV-event publisher's (zeromq, tokio)
# in its normal dependency tree.
phase cargo check -p omniprefix --no-default-features --lib --quiet
if cargo tree -p omniprefix --no-default-features -e normal --prefix none | grep -E '^(wgpu|naga|clap|indicatif|criterion|zeromq|tokio|tokenizers|minijinja) '; then
  echo "the engine without default features pulls in the crates above" >&2
  exit 1
fi

# Root default members: the engine (`omniprefix`) and its harnesses (`omniprefix-cli`).
phase cargo test --all-targets --no-run "$@"
phase cargo test --all-targets "$@"
phase cargo test --doc "$@"
# Broken intra-doc links fail the build, so the API docs stay navigable.
RUSTDOCFLAGS="-D warnings" phase cargo doc --no-deps --quiet

# The Python package: pip install ./python into the venv made beside the build, then its pytest suite.
wait_for() {
  local pid="$1" log="$2" what="$3"
  if ! wait "$pid"; then
    cat "$log" >&2
    echo "error: $what failed" >&2
    return 1
  fi
}
phase wait_for "$venv_pid" "$venv_log" scripts/python_venv.sh
PYTHON_VENV="$venv" PYTHON_VENV_READY=1 phase bash scripts/test_python.sh
# The Python gate: mypy --strict over the package, stubtest of the wheel just built against its stub.
phase bash scripts/typecheck_python.sh "$venv"

# A real 2-worker fleet behind Dynamo's frontend, over HTTP; the package is the dev wheel the
# step above built (cargo has nothing left to compile).
phase wait_for "$fleet_pid" "$fleet_log" scripts/install_fleet.sh
OMNIPREFIX_WHEEL_PROFILE=dev phase bash scripts/test_fleet.sh "$fleet_venv"

# The demo (--quick) and the notebooks, on a small report, so neither can rot; on the CLI the
# test build made, with the same venv.
NOTEBOOK_VENV="$venv" OMNIPREFIX_BIN="${CARGO_TARGET_DIR:-target}/debug/omniprefix" phase bash scripts/ci_notebooks.sh
