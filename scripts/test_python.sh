#!/usr/bin/env bash
# The Python package's tests: a fresh venv, `pip install ./python` (PEP 517, maturin
# builds the extension), then pytest over python/tests. Called by scripts/test.sh.
#
# CI builds the wheel in the dev profile into the shared target folder, reusing the
# dependencies the Rust tests compiled (a user's `pip install ./python` builds release).
# Env: PYTHON_VENV (default target/python-venv), PYTHON (default python3),
#      OMNIPREFIX_WHEEL_PROFILE (default dev; "release" for a user's build),
#      PYTHON_VENV_READY=1 (use PYTHON_VENV as it is: made with python/requirements-test.txt).
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${PYTHON_VENV:-target/python-venv}"
# PYTHON_VENV_READY=1: scripts/test.sh already made it (scripts/python_venv.sh, beside the build).
if [[ "${PYTHON_VENV_READY:-0}" != 1 ]]; then
    bash scripts/python_venv.sh "$venv" python/requirements-test.txt
fi
pip=("$venv/bin/pip" --quiet --disable-pip-version-check)

profile="${OMNIPREFIX_WHEEL_PROFILE:-dev}"
echo "pip install ./python (cargo profile $profile)"
CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$(pwd)/target}" MATURIN_PEP517_ARGS="--profile $profile" \
    "${pip[@]}" install ./python
# Dynamo's KV indexer is in requirements-test.txt: its test must run, not skip.
export OMNIPREFIX_REQUIRE_DYNAMO=1
# From outside the source tree, so the tests import the installed wheel, not python/omniprefix.
python="$(cd "$venv" && pwd)/bin/python"
(cd python/tests && "$python" -m pytest -q -p no:cacheprovider .)
