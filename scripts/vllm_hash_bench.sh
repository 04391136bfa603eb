#!/usr/bin/env bash
# vLLM's own multimodal hashing against multi_modal_uuids from omniprefix.vllm_uuids, on the
# Qwen3-Omni mixed request (scripts/vllm_hash_bench.py; docs/vllm.md shows the table). CPU only;
# not part of CI. Makes the venv at $1 (or reuses it), installs the pinned vLLM and this package
# (a release build), then runs the benchmark; arguments after the venv go to the script.
#
# Usage: scripts/vllm_hash_bench.sh VENV [--runs 21] [--json docs/reports/vllm_hash_bench.json]
# Env:   PYTHON (default python3; vLLM 0.34.0 needs 3.11-3.14), CARGO_TARGET_DIR (default target),
#        VLLM_BENCH_SKIP_BUILD=1 to keep the omniprefix already installed in the venv.
#
# Why not `pip install vllm==0.34.0`: it cannot resolve on PyPI (vllm pins flashinfer-python==0.7.3,
# which PyPI does not serve), and it would pull CUDA kernel packages the hashing never imports. So
# the venv gets vllm's other requirements from python/requirements-vllm-bench.txt (PyPI's default
# torch: the CUDA build, ~3 GB, imports fine without a GPU; ~7 GB of venv in all), then vllm itself
# with --no-deps. vllm then warns "Failed to import from vllm._C" at import: harmless here.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.34.0
venv="${1:?usage: scripts/vllm_hash_bench.sh VENV [benchmark args...]}"
shift

if [[ ! -x "$venv/bin/python" ]]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
pip=("$venv/bin/pip" install --disable-pip-version-check --quiet)
"${pip[@]}" -r python/requirements-vllm-bench.txt
if [[ "$("$venv/bin/python" -c 'from importlib.metadata import version; print(version("vllm"))' 2>/dev/null)" != "$VLLM_VERSION" ]]; then
    "${pip[@]}" --no-deps "vllm==$VLLM_VERSION"
fi
if [[ "${VLLM_BENCH_SKIP_BUILD:-0}" != 1 ]]; then
    CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target}" MATURIN_PEP517_ARGS="--profile release" \
        "${pip[@]}" --force-reinstall --no-deps ./python
fi
exec "$venv/bin/python" scripts/vllm_hash_bench.py "$@"
