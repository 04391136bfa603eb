#!/usr/bin/env bash
# Installs what `python -m omniprefix.fleet` and `python -m omniprefix.worker` need into VENV:
# Dynamo 1.6.1's pinned working set (python/requirements-fleet.txt, every package pinned and
# installed with --no-deps, since `pip install ai-dynamo==1.6.1` fails on its aisimulate stub),
# then the checkpoint encoder's torch, transformers, torchvision and pillow
# (python/requirements-encoder.txt, constrained to that set), then this package (`pip install
# ./python`, which builds the Rust extension with maturin).
#
# Idempotent: an existing VENV is reused, pinned packages already there are kept, and cargo
# rebuilds the extension only when the sources changed. Quiet unless something fails.
#
# Usage: bash scripts/install_fleet.sh VENV
# Env: PYTHON (default python3; Dynamo needs >= 3.10),
#      OMNIPREFIX_WHEEL_PROFILE (cargo profile of the extension, default release),
#      OMNIPREFIX_FLEET_DEPS_ONLY=1 (Dynamo's set only: CI fills it while cargo compiles).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ $# -ne 1 || -z "$1" ]]; then
    echo "usage: bash scripts/install_fleet.sh VENV" >&2
    exit 2
fi
venv="$1"

if [[ ! -x "$venv/bin/python" ]] && ! "${PYTHON:-python3}" -m venv "$venv"; then
    echo "error: ${PYTHON:-python3} could not make a venv at $venv" >&2
    exit 1
fi
if ! "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "error: $venv has Python $("$venv/bin/python" -V 2>&1); Dynamo 1.6.1 needs >= 3.10" >&2
    exit 1
fi
pip=("$venv/bin/pip" --quiet --disable-pip-version-check)

"${pip[@]}" install --no-deps -r python/requirements-fleet.txt
# PyPI's torch is the CUDA build (~3 GB with its libraries); it runs here on the CPU.
"${pip[@]}" install -r python/requirements-encoder.txt -c python/requirements-fleet.txt
if [[ "${OMNIPREFIX_FLEET_DEPS_ONLY:-0}" == 1 ]]; then
    exit 0
fi

profile="${OMNIPREFIX_WHEEL_PROFILE:-release}"
CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$(pwd)/target}" MATURIN_PEP517_ARGS="--profile $profile" \
    "${pip[@]}" install --no-deps ./python

# Everything the fleet imports, so a broken set fails here rather than at the first request.
"$venv/bin/python" -c 'import omniprefix, omniprefix.worker, omniprefix.fleet, dynamo.frontend, dynamo.llm, dynamo.runtime, torch, transformers, torchvision, PIL'
