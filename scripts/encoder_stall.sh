#!/usr/bin/env bash
# Issue 22: does a slow encoder stall the other streams? Runs `bench serve --workload
# multi_round` twice with the same settings: the stand-in encoder free (--encoder-ms 0)
# and sleeping 200 ms per encoder-cache miss on the submitting thread (--encoder-ms 200).
# Prints ITL p50/p99 and encoder calls of both (caching on and off), then the ITL p99
# ratio 200 ms / 0 ms. Target: at most 1.2. See docs/serving.md.
#
# Env: ENCODER_MS (default 200), CONCURRENCY (4), CONVERSATIONS (4), OUTPUT_LEN (32),
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
for ms in 0 "$slow"; do
    "$OMNIPREFIX" "${args[@]}" --encoder-ms "$ms" > "$work/$ms.jsonl"
done

python3 - "$work/0.jsonl" "$work/$slow.jsonl" <<'PY'
import json
import sys

runs = [[json.loads(line) for line in open(path) if line.strip()] for path in sys.argv[1:]]
print(f"{'encoder_ms':>10} {'cache':>5} {'itl p50':>9} {'itl p99':>9} {'ttft p50':>9} {'ttft p99':>9} {'tok/s':>7} {'enc calls':>9}")
for run in runs:
    for r in run:
        print(f"{r['encoder_ms']:>10} {'on' if r['cache'] else 'off':>5} {r['itl_ms_p50']:>7.1f}ms {r['itl_ms_p99']:>7.1f}ms "
              f"{r['ttft_ms_p50']:>7.0f}ms {r['ttft_ms_p99']:>7.0f}ms {r['output_tokens_per_s']:>7.1f} {r['encoder_calls']:>9}")
fast, slow = runs
for f, s in zip(fast, slow):
    ratio = s["itl_ms_p99"] / f["itl_ms_p99"]
    verdict = "ok" if ratio <= 1.2 else "ABOVE the 1.2 target"
    print(f"cache {'on' if f['cache'] else 'off'}: ITL p99 ratio ({s['encoder_ms']} ms / 0 ms) = {ratio:.3f}  ({verdict})")
PY
