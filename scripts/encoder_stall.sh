#!/usr/bin/env bash
# Issue 22: does a slow encoder stall the other streams? Runs `bench serve --workload
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

if [[ -z "${OMNIPREFIX:-}" ]]; then
    cargo build --quiet --release -p omniprefix-cli
    OMNIPREFIX="${CARGO_TARGET_DIR:-$(pwd)/target}/release/omniprefix"
fi
slow="${ENCODER_MS:-200}"
args=(bench serve --workload multi_round --json
      --concurrency "${CONCURRENCY:-4}" --conversations "${CONVERSATIONS:-4}" --output-len "${OUTPUT_LEN:-32}")
# shellcheck disable=SC2206
args+=(${EXTRA:-})

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for ((i = 1; i <= ${REPEAT:-3}; i++)); do
    for ms in 0 "$slow"; do
        "$OMNIPREFIX" "${args[@]}" --encoder-ms "$ms" >> "$work/runs.jsonl"
    done
done

python3 - "$work/runs.jsonl" <<'PY'
import json
import statistics
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print(f"{'encoder_ms':>10} {'cache':>5} {'itl p50':>9} {'itl p99':>9} {'ttft p50':>9} {'ttft p99':>9} {'tok/s':>7} {'enc calls':>9}")
for r in rows:
    print(f"{r['encoder_ms']:>10} {'on' if r['cache'] else 'off':>5} {r['itl_ms_p50']:>7.1f}ms {r['itl_ms_p99']:>7.1f}ms "
          f"{r['ttft_ms_p50']:>7.0f}ms {r['ttft_ms_p99']:>7.0f}ms {r['output_tokens_per_s']:>7.1f} {r['encoder_calls']:>9}")
slow = max(r["encoder_ms"] for r in rows)
for cache in (True, False):
    def median(key, ms):
        return statistics.median(r[key] for r in rows if r["cache"] == cache and r["encoder_ms"] == ms)
    p50, p99 = ([median(key, ms) for ms in (0, slow)] for key in ("itl_ms_p50", "itl_ms_p99"))
    ratio = p99[1] / p99[0]
    verdict = "ok" if ratio <= 1.2 else "ABOVE the 1.2 target"
    print(f"cache {'on ' if cache else 'off'}: median ITL p50 {p50[0]:.1f} / {p50[1]:.1f} ms, p99 {p99[0]:.1f} / {p99[1]:.1f} ms "
          f"(encoder 0 / {slow} ms): p99 ratio {ratio:.3f} ({verdict})")
PY
