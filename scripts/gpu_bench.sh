#!/usr/bin/env bash
# scripts/gpu_bench.sh [--quick] OUT_DIR
#
# One prepared run on whatever adapter wgpu opens (set WGPU_BACKEND to choose), writing
# JSON lines under OUT_DIR (docs/backends.md, "GPU bench script"):
#   adapter.jsonl   the adapter, its driver, limits, subgroups  (omniprefix gpu-info)
#   parity.jsonl    wgpu vs CPU on fixtures/tiny/*, f32 and f16  (omniprefix bench parity)
#   ttft.jsonl      TTFT cached / uncached, f32 and f16          (omniprefix bench ttft --json)
#   decode.jsonl    greedy decode tokens/s, f32 and f16          (omniprefix generate --json)
#   serve.jsonl     bench serve --quick, f32 and f16             (full run only)
#   attention.jsonl decode attention vs copy_kv bandwidth        (full run only: cargo bench)
#   timing.jsonl    wall seconds of each step
# --quick: the tiny fixture for TTFT and decode, no serve and no attention bench (≤ 1 min on
# lavapipe); the full run (≤ 8 min on a GPU) uses the embedded bench model.
# OMNIPREFIX_BIN: a built binary to use (default: cargo build --release, then target/release).
# OMNIPREFIX_ATTN_BENCH: a built attention bench executable (default: cargo bench). With both
# set the script needs no Rust toolchain: scripts/gpu_bundle.sh builds them for a GPU machine.
set -euo pipefail

quick=0
if [[ "${1:-}" == "--quick" ]]; then
    quick=1
    shift
fi
source "$(dirname "$0")/report_setup.sh"
report_setup "$0 [--quick] OUT_DIR" "$@"

# timing NAME T0 T1: one line of timing.jsonl.
timing() {
    awk -v name="$1" -v t0="$2" -v t1="$3" 'BEGIN { printf "{\"kind\":\"timing\",\"step\":\"%s\",\"seconds\":%.3f}\n", name, t1 - t0 }' \
        >>"$out/timing.jsonl"
}

# step NAME FILE CMD...: runs CMD, appends its stdout (JSON objects, one a line) to
# OUT_DIR/FILE with "step":"NAME" first in each, and times it.
step() {
    local name=$1 file=$2
    shift 2
    local t0 t1
    t0=$(date +%s.%N)
    "$@" | sed "s/^{/{\"step\":\"$name\",/" >>"$out/$file"
    t1=$(date +%s.%N)
    timing "$name" "$t0" "$t1"
}

rm -f "$out"/*.jsonl
step adapter adapter.jsonl "$bin" gpu-info

for model in qwen3_dense omni_thinker qwen2_dense; do
    for dt in f32 f16; do
        step "parity $model $dt" parity.jsonl "$bin" bench parity --model "fixtures/tiny/$model" --dtype "$dt" --kv-dtype "$dt"
    done
done

request=$(mktemp "$out/request.XXXXXX.json")
trap 'rm -f "$request"' EXIT
printf '{"segments": [{"text": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]}]}\n' >"$request"
for dt in f32 f16; do
    common=(--backend wgpu --dtype "$dt" --kv-dtype "$dt")
    if [[ $quick -eq 1 ]]; then
        step "ttft $dt" ttft.jsonl "$bin" bench ttft --model fixtures/tiny/qwen3_dense "${common[@]}" \
            --prefix 32 --suffix 16 --runs 1 --warmup 0 --workloads prefix_repetition --json
        step "decode $dt" decode.jsonl "$bin" generate --model fixtures/tiny/qwen3_dense "${common[@]}" \
            --request "$request" --max-tokens 8 --ignore-eos --json
    else
        step "ttft $dt" ttft.jsonl "$bin" bench ttft "${common[@]}" --runs 3 \
            --workloads prefix_repetition,prefix_repetition_long --json
        step "decode $dt" decode.jsonl "$bin" generate --model fixtures/tiny/qwen3_dense "${common[@]}" \
            --request "$request" --max-tokens 64 --ignore-eos --json
        step "serve $dt" serve.jsonl "$bin" bench serve --quick "${common[@]}" --json
    fi
done

if [[ $quick -eq 0 ]]; then
    # Criterion's medians of wgpu decode (K/V bytes read) and copy_kv (bytes read + written),
    # from a prebuilt bench executable (OMNIPREFIX_ATTN_BENCH) or cargo bench.
    t0=$(date +%s.%N)
    criterion=${CRITERION_HOME:-${CARGO_TARGET_DIR:-$root/target}/criterion}
    # Groups of an earlier run (another OMNIPREFIX_ATTN_BENCH_SCALE) would be read as this run's.
    rm -rf "$criterion"/attention_*
    args=(--warm-up-time 1 --measurement-time 3 'wgpu/(decode|copy_kv)')
    if [[ -n "${OMNIPREFIX_ATTN_BENCH:-}" ]]; then
        CRITERION_HOME="$criterion" "$OMNIPREFIX_ATTN_BENCH" --bench "${args[@]}" >&2
    else
        cargo bench --bench attention -- "${args[@]}" >&2
    fi
    python3 scripts/attention_fraction.py "$criterion" >>"$out/attention.jsonl"
    t1=$(date +%s.%N)
    timing attention "$t0" "$t1"
fi
echo "gpu_bench: JSON lines in $out" >&2
