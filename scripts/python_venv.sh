#!/usr/bin/env bash
# Makes a fresh venv at $1 and installs the requirements files that follow (one pip run, so
# shared packages such as numpy are fetched once). scripts/test.sh runs it in the background
# while cargo compiles: pip waits on the network, the build on the CPU.
# Usage: scripts/python_venv.sh VENV REQUIREMENTS.txt...   Env: PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."

venv="$1"
shift
rm -rf "$venv"
"${PYTHON:-python3}" -m venv "$venv"
requirements=()
for file in "$@"; do
    requirements+=(-r "$file")
done
"$venv/bin/pip" install --quiet --disable-pip-version-check "${requirements[@]}"
