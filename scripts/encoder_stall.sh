#!/usr/bin/env bash
# Does a slow encoder stall the other streams? Runs `bench serve --workload
# multi_round` twice with the same settings: the stand-in encoder free (--encoder-ms 0)
# and sleeping 200 ms per encoder-cache miss on the submitting thread (--encoder-ms 200).
# The pair runs REPEAT times, interleaved (0, 200, 0, 200, ...) so that load from anything
# else on the machine falls on both alike. Prints each run's ITL p50/p99 and encoder calls
# (caching on and off), then per cache mode the ratio of the median ITL p99s, 200 ms / 0 ms.
# Target: at most 1.2. See docs/serving.md. About 40 s per run on 2 cores.
#
# Env: ENCODER_MS (default 200), REPEAT (3), CONCURRENCY (4), CONVERSATIONS (4), OUTPUT_LEN (32),
# EXTRA (more bench serve flags), OMNIPREFIX (a built binary; default: builds the release one).
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=scripts/serve_runs.sh
source scripts/serve_runs.sh
slow="${ENCODER_MS:-200}"
bench_serve_args --workload multi_round \
    --concurrency "${CONCURRENCY:-4}" --conversations "${CONVERSATIONS:-4}" --output-len "${OUTPUT_LEN:-32}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for ((i = 1; i <= ${REPEAT:-3}; i++)); do
    for ms in 0 "$slow"; do
        "$OMNIPREFIX" "${args[@]}" --encoder-ms "$ms" >> "$work/runs.jsonl"
    done
done

PYTHONPATH=scripts python3 - "$work/runs.jsonl" <<'PY'
import sys

from serve_runs import load, median, print_table

rows = load(sys.argv[1])
print_table(rows, ["encoder_ms", "cache", "itl_ms_p50", "itl_ms_p99", "ttft_ms_p50", "ttft_ms_p99", "output_tokens_per_s",
                   "encoder_calls"])
slow = max(r["encoder_ms"] for r in rows)
for cache in (True, False):
    p50, p99 = ([median(rows, key, cache=cache, encoder_ms=ms) for ms in (0, slow)] for key in ("itl_ms_p50", "itl_ms_p99"))
    ratio = p99[1] / p99[0]
    verdict = "ok" if ratio <= 1.2 else "ABOVE the 1.2 target"
    print(f"cache {'on ' if cache else 'off'}: median ITL p50 {p50[0]:.1f} / {p50[1]:.1f} ms, p99 {p99[0]:.1f} / {p99[1]:.1f} ms "
          f"(encoder 0 / {slow} ms): p99 ratio {ratio:.3f} ({verdict})")
PY
