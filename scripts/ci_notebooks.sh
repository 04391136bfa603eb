#!/usr/bin/env bash
# CI: installs notebooks/requirements.txt into a venv, makes a SMALL report set
# (demo --quick, bench match on tiny media with one run, bench serve --quick) in a temporary folder,
# executes every notebook on it headless and checks each wrote its figures.
# A couple of minutes on 2 cores once the debug binary is built.
#
# Env: NOTEBOOK_VENV (default target/notebook-venv), PYTHON (default python3),
#      OMNIPREFIX_BIN (a built `omniprefix`; default: cargo build --bin omniprefix).
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${NOTEBOOK_VENV:-target/notebook-venv}"
if [[ ! -x "$venv/bin/python" ]]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check -r notebooks/requirements.txt

# scripts/test.sh passes the CLI its test build made (OMNIPREFIX_BIN): a plain `cargo build`
# resolves features without the dev-dependencies and would compile most dependencies again.
bin="${OMNIPREFIX_BIN:-}"
if [[ -z "$bin" ]]; then
    cargo build --quiet --bin omniprefix
    bin="${CARGO_TARGET_DIR:-$(pwd)/target}/debug/omniprefix"
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/reports" "$work/figures"
"$bin" demo --quick --backend cpu --json "$work/reports/demo.json" > "$work/reports/demo.txt"
"$bin" bench match --workload all --scale tiny --runs 1 --threads 1 --json > "$work/reports/bench_match_1t.jsonl"
"$bin" bench match --workload all --scale tiny --runs 1 --threads 2 --json > "$work/reports/bench_match_Nt.jsonl"
"$bin" bench serve --quick --threads 1 --json > "$work/reports/bench_serve.jsonl"
# scripts/prefill_policy.sh in small: the cap off (= the budget), then the default (a thirty-second: 2).
for cap in --prefill-cap=64 ""; do
    # shellcheck disable=SC2086
    "$bin" bench serve --quick --threads 1 --json --trace --workload prefix_repetition --concurrency 1,4 \
        --max-tokens-per-step 64 $cap >> "$work/reports/prefill_policy.jsonl"
done

OMNIPREFIX_REPORTS="$work/reports" OMNIPREFIX_FIGURES="$work/figures" OMNIPREFIX_CRITERION="$work/no-criterion" \
    "$venv/bin/python" notebooks/execute.py notebooks/*.ipynb

for figure in match_time_vs_bytes ttft_vs_cached_fraction multi_round_hits hidden_state_difference serve_ttft_itl serve_itl_policy; do
    if [[ ! -s "$work/figures/$figure.png" ]]; then
        echo "error: the notebooks did not write $figure.png" >&2
        exit 1
    fi
done
echo "notebooks OK: $(ls "$work/figures" | tr '\n' ' ')"
