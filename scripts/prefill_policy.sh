#!/usr/bin/env bash
# Does the prefill cap keep decodes moving? Runs `bench serve --workload prefix_repetition`
# (5 prefixes x 4 prompts, 64 output tokens, concurrency 1 and 8, caching on and off) with
# the cap off (--prefill-cap equal to the step budget: whole prompts beside decodes) and
# with the engine's default cap, interleaved REPEAT times so that load from anything else
# on the machine falls on both alike. Writes every run to OUT (JSON lines) and prints the
# three ratios per policy against their targets, medians over the repeats:
#   caching off, c=8:  ITL p99 / ITL p50          (target <= 2)
#   caching off:       TTFT p50 c=8 / c=1         (target <= 4)
#   caching on:        output tok/s c=8 / c=1     (target >= 5)
# See docs/serving.md. About 4 minutes per policy and repeat on 2 cores.
#
# Env: REPEAT (default 1), CAP (the capped run's --prefill-cap; default: the engine's),
# OUT (default docs/reports/prefill_policy.jsonl), EXTRA (more bench serve flags),
# OMNIPREFIX (a built binary; default: builds the release one).
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/serve_runs.sh
source scripts/serve_runs.sh
out="${OUT:-docs/reports/prefill_policy.jsonl}"
bench_serve_args --workload prefix_repetition --trace --concurrency 1,8 --output-len 64 \
    --num-prefixes 5 --prompts-per-prefix 4 --max-tokens-per-step 2048
capped=()
[[ -n "${CAP:-}" ]] && capped=(--prefill-cap "$CAP")

: > "$out"
for ((i = 1; i <= ${REPEAT:-1}; i++)); do
    "$OMNIPREFIX" "${args[@]}" --prefill-cap 2048 >> "$out"
    "$OMNIPREFIX" "${args[@]}" "${capped[@]}" >> "$out"
done

PYTHONPATH=scripts python3 - "$out" <<'PY'
import sys

from serve_runs import load, median, print_table

rows = load(sys.argv[1])
print_table(rows, ["prefill_cap", "concurrency", "cache", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99",
                   "output_tokens_per_s"])

for cap in sorted({r["prefill_cap"] for r in rows}, reverse=True):
    c8, c1 = 8, 1
    off8, off1 = dict(prefill_cap=cap, concurrency=c8, cache=False), dict(prefill_cap=cap, concurrency=c1, cache=False)
    on8, on1 = dict(prefill_cap=cap, concurrency=c8, cache=True), dict(prefill_cap=cap, concurrency=c1, cache=True)
    itl = median(rows, "itl_ms_p99", **off8) / median(rows, "itl_ms_p50", **off8)
    ttft = median(rows, "ttft_ms_p50", **off8) / median(rows, "ttft_ms_p50", **off1)
    tput = median(rows, "output_tokens_per_s", **on8) / median(rows, "output_tokens_per_s", **on1)
    label = "off (uncapped)" if cap == rows[0]["max_tokens_per_step"] else f"{cap} tokens"
    print(f"prefill cap {label}: ITL p99/p50 at c=8, caching off {itl:.2f} (<= 2); "
          f"TTFT p50 c=8/c=1, caching off {ttft:.2f} (<= 4); tok/s c=8/c=1, caching on {tput:.2f} (>= 5)")
PY
