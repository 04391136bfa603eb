#!/usr/bin/env bash
# Regenerates every report in docs/reports/ with a release build, executes the
# notebooks headless on them and writes the figures to docs/figures/*.png.
#
#   scripts/make_figures.sh            # all reports, then the figures
#   FIGURES_ONLY=1 scripts/make_figures.sh   # figures from the committed reports
#   SERVE_ONLY=1 scripts/make_figures.sh     # only docs/reports/bench_serve.jsonl, then the figures
#
# Env: DEMO_BACKEND (auto | cpu | wgpu, default auto), NOTEBOOK_VENV, PYTHON, CARGO_TARGET_DIR.
# criterion's output (target/criterion, from `cargo bench`) is plotted when present.
#
# The docs quote these reports: docs/demo.md (headline numbers), docs/benchmarks.md (the match
# table: `cat docs/reports/bench_match_*.jsonl | scripts/match_table.py`; the TTFT table; every
# claim's figure, which the README's headline figures summarise), docs/serve.md "Figures" (the
# bench serve table: `scripts/serve_table.py < docs/reports/bench_serve.jsonl`), docs/scale-out.md
# "Figures" (the routing table: `scripts/route_bench.py --table docs/reports/route_bench.jsonl`), docs/engine.md's
# TTFA table (`scripts/ttfa_table.py docs/reports/bench_ttfa.json`).
# Nothing here rewrites them: update them from the new reports.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
reports="$root/docs/reports"
figures="$root/docs/figures"
target_dir="${CARGO_TARGET_DIR:-$root/target}"
mkdir -p "$reports" "$figures"

if [[ -z "${FIGURES_ONLY:-}" && -z "${SERVE_ONLY:-}" ]]; then
    cargo build --release --quiet --bin omniprefix
    bin="$target_dir/release/omniprefix"
    threads="$(nproc)"
    "$bin" demo --backend "${DEMO_BACKEND:-auto}" --json "$reports/demo.json" | tee "$reports/demo.txt"
    "$bin" bench match --workload all --threads 1 --runs 21 --json > "$reports/bench_match_1t.jsonl"
    "$bin" bench match --workload all --threads "$threads" --runs 21 --json > "$reports/bench_match_Nt.jsonl"
    if "$bin" bench ttft --help > /dev/null 2>&1; then
        "$bin" bench ttft --runs 7 --json \
            --workloads prefix_repetition,prefix_repetition_long,multi_round,capture_overhead \
            > "$reports/bench_ttft.jsonl"
        # docs/engine.md "The disk tier": restore against recompute (~20 s).
        "$bin" bench ttft --runs 7 --json --workloads tier_restore > "$reports/bench_tier_restore.jsonl"
    fi
    # docs/engine.md "Many clients over a small pool" and the README's hit-rate figure (~1 min).
    if "$bin" bench serve --help 2> /dev/null | grep -q many_clients; then
        "$bin" bench serve --workload many_clients --json > "$reports/bench_many_clients.jsonl"
    fi
    # docs/engine.md's TTFA table: `python3 scripts/ttfa_table.py docs/reports/bench_ttfa.json` (~3 min on 2 cores).
    if "$bin" bench ttfa --help > /dev/null 2>&1; then
        "$bin" bench ttfa --conversations 8 --json "$reports/bench_ttfa.json" | tee "$reports/bench_ttfa.txt"
    fi
fi
# The serve report alone (SERVE_ONLY=1 skips the rest, e.g. on shared cores); the bench serve
# table in docs/serve.md is `scripts/serve_table.py < docs/reports/bench_serve.jsonl`.
if [[ -z "${FIGURES_ONLY:-}" || -n "${SERVE_ONLY:-}" ]]; then
    cargo build --release --quiet --bin omniprefix
    # The reported sizes (10 prefixes of 256 + 256-token suffixes, 2 prompts per prefix, 128-token
    # replies) and 2 conversations of multi_round: ~8 min on 2 cores (4 conversations: ~15).
    "$target_dir/release/omniprefix" bench serve --output-len 128 --conversations 2 \
        --concurrency 1,8 --json > "$reports/bench_serve.jsonl"
    # The prefill cap off and on (ITL over time: serve_itl_policy.png), ~8 min.
    OMNIPREFIX="$target_dir/release/omniprefix" OUT="$reports/prefill_policy.jsonl" bash scripts/prefill_policy.sh
fi

# docs/scale-out.md "Figures": KV-aware routing against round-robin and Dynamo's indexer (~7 min).
if [[ -z "${FIGURES_ONLY:-}" && -z "${SERVE_ONLY:-}" ]]; then
    bash scripts/route_figures.sh
fi

venv="${NOTEBOOK_VENV:-target/notebook-venv}"
if [[ ! -x "$venv/bin/python" ]]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check -r notebooks/requirements.txt
OMNIPREFIX_REPORTS="$reports" OMNIPREFIX_FIGURES="$figures" \
    OMNIPREFIX_CRITERION="${OMNIPREFIX_CRITERION:-$target_dir/criterion}" \
    "$venv/bin/python" notebooks/execute.py notebooks/*.ipynb
# The README's TTFA figure (its table is this script's stdout).
"$venv/bin/python" scripts/ttfa_table.py "$reports/bench_ttfa.json" --figure "$figures/ttfa_by_round.png" > /dev/null
# The table of docs/engine.md's many_clients section is this script's stdout.
"$venv/bin/python" scripts/many_clients_table.py "$reports/bench_many_clients.jsonl" \
    --figure "$figures/many_clients_hits.png" > /dev/null
ls -l "$figures"
