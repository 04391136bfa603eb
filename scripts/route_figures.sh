#!/usr/bin/env bash
# Regenerates docs/reports/route_bench.jsonl (docs/scale-out.md "Figures"): a venv with the Python
# package built in release, pyzmq, msgspec and Dynamo's KV indexer (requirements-test.txt),
# then scripts/route_bench.py with the kv, round_robin and dynamo policies (~7 min on 2 cores),
# and scripts/route_http_bench.py through a fleet (docs/reports/route_http_bench.jsonl, ~2 min).
# Prints the table of docs/scale-out.md; `python3 scripts/route_bench.py --table docs/reports/route_bench.jsonl`
# prints it again from the committed report.
# Env: ROUTE_VENV (default target/route-venv), PYTHON (default python3), CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${ROUTE_VENV:-target/route-venv}"
if [[ ! -x "$venv/bin/python" ]]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
pip=("$venv/bin/pip" --quiet --disable-pip-version-check)
"${pip[@]}" install -r python/requirements-test.txt
CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$(pwd)/target}" MATURIN_PEP517_ARGS="--profile release" \
    "${pip[@]}" install --force-reinstall --no-deps ./python
"$venv/bin/python" scripts/route_bench.py --dynamo-python "$venv/bin/python" --json docs/reports/route_bench.jsonl

# The same question through Dynamo's HTTP frontend (docs/scale-out.md "Through HTTP",
# docs/reports/route_http_bench.jsonl, ~2 min): the fleet venv of scripts/install_fleet.sh, a
# pool that cannot hold every tenant's prompt on one worker (160 blocks), then one that can (480).
fleet_venv="${FLEET_VENV:-target/fleet-venv}"
bash scripts/install_fleet.sh "$fleet_venv"
rm -f docs/reports/route_http_bench.jsonl
for blocks in 160 160 480; do
    "$fleet_venv/bin/python" scripts/route_http_bench.py --num-blocks "$blocks" --json docs/reports/route_http_bench.jsonl
done
