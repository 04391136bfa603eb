#!/usr/bin/env bash
# The Python type-check gate, two checks:
#   mypy --strict over python/omniprefix: the .py modules and the extension's stub
#     (_omniprefix.pyi), as configured in python/pyproject.toml ([tool.mypy]);
#   mypy's stubtest: the installed extension (omniprefix._omniprefix, the Rust build) against
#     python/omniprefix/_omniprefix.pyi, so the stub cannot drift from what PyO3 exports (no
#     allowlist: the stub matches the runtime; stub-only types are @type_check_only).
# Both run even if the first fails; the status is non-zero if either found an error. Each prints
# its wall time.
#
# Usage: bash scripts/typecheck_python.sh VENV
# VENV already holds the package (`pip install ./python`, any cargo profile) and
# python/requirements-test.txt, as scripts/test_python.sh leaves target/python-venv; this adds
# python/requirements-typecheck.txt (mypy, pinned, and the typed packages the modules import).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ $# -ne 1 || -z "$1" ]]; then
    echo "usage: bash scripts/typecheck_python.sh VENV" >&2
    exit 2
fi
if [[ ! -x "$1/bin/python" ]]; then
    echo "error: $1 is not a venv (no bin/python)" >&2
    exit 2
fi
venv="$(cd "$1" && pwd)"
python="$venv/bin/python"
repo="$(pwd)"

"$venv/bin/pip" install --quiet --disable-pip-version-check -r python/requirements-typecheck.txt

# Runs "$@" and prints its wall time under the name $1; returns its status.
timed() {
    local name="$1" start="$EPOCHREALTIME" status=0
    shift
    "$@" || status=$?
    awk -v name="$name" -v a="$start" -v b="$EPOCHREALTIME" -v s="$status" \
        'BEGIN { printf "[typecheck] %s: %.1f s (%s)\n", name, b - a, s == 0 ? "ok" : "FAILED" }'
    return "$status"
}

failed=0
# Caches in the venv, whose packages they describe: one for each check, since their options differ.
cache="$venv/typecheck-cache"
mkdir -p "$cache/stubtest"
# From python/, where mypy reads pyproject.toml (files = omniprefix). Warm, it takes under a second.
timed "mypy --strict python/omniprefix" \
    bash -c 'cd python && exec "$1" -m mypy --cache-dir "$2/mypy"' _ "$python" "$cache" || failed=1
# stubtest takes no cache option and writes .mypy_cache in its working folder: it runs in the
# venv's, where `import omniprefix._omniprefix` is the installed build (python/ has no compiled
# module). MYPYPATH points mypy at the source tree's stub rather than the copy the wheel
# installed, so an edited stub is checked before it is reinstalled.
timed "stubtest omniprefix._omniprefix" \
    bash -c 'cd "$1" && MYPYPATH="$2/python" exec "$3" -m mypy.stubtest omniprefix._omniprefix \
                 --mypy-config-file "$2/python/pyproject.toml"' _ "$cache/stubtest" "$repo" "$python" || failed=1
exit "$failed"
