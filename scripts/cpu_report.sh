#!/usr/bin/env bash
# scripts/cpu_report.sh OUT_DIR: the CPU counterpart of scripts/gpu_bench.sh. One prepared run on
# this machine, writing under OUT_DIR (give it docs/reports to regenerate the committed reports):
#   compare_torch{,_bf16,_untied,_bf16_untied}.jsonl  omniprefix against torch, f32 and bf16,
#                                  tied and untied lm_head (scripts/compare_torch.py, ~7 min)
#   bench_match_1t.jsonl, bench_match_Nt.jsonl  bench match --workload all, 1 and nproc threads (~3 min)
#   bench_serve_prefix_repetition.jsonl  bench serve prefix_repetition, 5 prefixes x 4 prompts,
#                                  64 tokens out (scripts/prefill_policy.sh's), c=1 and 8, caching
#                                  on and off (~2 min)
#   bench_serve_decode.jsonl       the same with 16 + 16-token prompts and 128 tokens out: decode
#                                  batching alone, without the prompts' prefill (~1 min)
#   real_width_rss.json            peak RSS of a real-width bf16 thinker against its file
#                                  (scripts/real_width_rss.py; writes 3.7 GB under /tmp once, ~1 min)
#   bench_ttft.jsonl               bench ttft, the README's workloads (~2 min)
#   cpu_report.json                the machine (model, flags, the kernel build that ran) and every
#                                  headline ratio above, each beside the target issue 40 set
# Env: STEPS (which runs, comma-separated, of torch,match,serve,ttft,rss; default all: the summary
#      reads the others' reports from OUT_DIR as they are), TORCH_VENV (the venv compare_torch.py uses; default target/torch-venv, made if missing),
#      OMNIPREFIX_BIN (a built binary; default: cargo build --release, then target/release),
#      RUNS (compare_torch's runs, default 3), OMNIPREFIX_SIMD (cap the kernels' build: the
#      report names the one that ran).
# Run it with nothing else busy: another process skews both engines (torch's OpenMP most).
set -euo pipefail

source "$(dirname "$0")/report_setup.sh"
report_setup "$0 OUT_DIR" "$@"

venv=${TORCH_VENV:-$root/target/torch-venv}
runs=${RUNS:-3}
threads=$(nproc)

steps=",${STEPS:-torch,match,serve,ttft,rss},"
if [[ $steps == *,torch,* ]]; then
    for dtype in f32 bf16; do
        for head in tied untied; do
            name=compare_torch
            [[ $dtype == bf16 ]] && name+=_bf16
            [[ $head == untied ]] && name+=_untied
            python3 scripts/compare_torch.py --venv "$venv" --omniprefix "$bin" --runs "$runs" \
                --threads "$threads" --dtype "$dtype" --lm-head "$head" --json "$out/$name.jsonl"
        done
    done
fi
if [[ $steps == *,match,* ]]; then
    "$bin" bench match --workload all --threads 1 --runs 21 --json > "$out/bench_match_1t.jsonl"
    "$bin" bench match --workload all --threads "$threads" --runs 21 --json > "$out/bench_match_Nt.jsonl"
fi
if [[ $steps == *,serve,* ]]; then
    "$bin" bench serve --workload prefix_repetition --num-prefixes 5 --prompts-per-prefix 4 \
        --output-len 64 --concurrency 1,8 --json > "$out/bench_serve_prefix_repetition.jsonl"
    "$bin" bench serve --workload prefix_repetition --num-prefixes 5 --prompts-per-prefix 4 \
        --prefix-len 16 --suffix-len 16 --output-len 128 --concurrency 1,8 --json > "$out/bench_serve_decode.jsonl"
fi
if [[ $steps == *,ttft,* ]]; then
    "$bin" bench ttft --runs 7 --json \
        --workloads prefix_repetition,prefix_repetition_long,multi_round,capture_overhead > "$out/bench_ttft.jsonl"
fi
if [[ $steps == *,rss,* ]]; then
    python=$venv/bin/python
    [[ -x $python ]] || python=python3
    "$python" scripts/real_width_rss.py --bin "$bin" > "$out/real_width_rss.json"
fi

"$bin" cpu-info > "$out/cpu_info.json"
python3 - "$out" <<'EOF'
import json
import pathlib
import platform
import sys

sys.path.insert(0, "scripts")
from cpuinfo import cpu_model_and_flags  # noqa: E402 (one reader of /proc/cpuinfo for every report)

out = pathlib.Path(sys.argv[1])
lines = lambda name: [json.loads(l) for l in (out / name).read_text().splitlines() if l.strip()]
model, flags = cpu_model_and_flags()
cpu = json.loads((out / "cpu_info.json").read_text())
ratios = []


def ratio(what, value, target, meets=None):
    """One headline ratio; `met` is null where the issue set no target."""
    ratios.append({"what": what, "value": round(value, 3), "target": target, "met": meets(value) if meets else None})


for dtype in ["f32", "bf16"]:
    for head in ["tied", "untied"]:
        name = "compare_torch" + ("_bf16" if dtype == "bf16" else "") + ("_untied" if head == "untied" else "")
        rows = {r["part"]: r for r in lines(f"{name}.jsonl") if "part" in r}
        label = f"{dtype} {head}"
        ratio(f"{label}: uncached prefill, time / torch's", rows["a"]["ratio"], "<= 0.9", lambda v: v <= 0.9)
        ratio(f"{label}: cached prefill, time / torch's", rows["b"]["ratio"], "<= 0.9", lambda v: v <= 0.9)
        floor = 2.0 if dtype == "bf16" else 1.2
        ratio(f"{label}: decode tok/s / torch's", 1 / rows["c"]["ratio"], f">= {floor}", lambda v, f=floor: v >= f)
match = {(r["workload"], r["threads"]): r for r in lines("bench_match_1t.jsonl") + lines("bench_match_Nt.jsonl")}
ratio("match mixed, 1 thread: cold / read floor", match[("mixed", 1)]["cold_over_read_floor"], "<= 1.2", lambda v: v <= 1.2)
ratio("match mixed, 1 thread: warm / read floor", match[("mixed", 1)]["warm_over_read_floor"], "<= 1.3", lambda v: v <= 1.3)
n = max(t for (_, t) in match)
ratio(f"match mixed, {n} threads: vLLM-path port / warm", match[("mixed", n)]["hashchain_over_warm"], ">= 6", lambda v: v >= 6)
for item in ["audio", "image"]:
    r = match[(item, 1)]
    ratio(f"match {item} warm, 1 thread: time / vLLM-path port", 1 / r["hashchain_over_warm"], "<= 0.3", lambda v: v <= 0.3)
serve = {(r["concurrency"], r["cache"]): r for r in lines("bench_serve_prefix_repetition.jsonl")}
c1, c8 = serve[(1, True)], serve[(8, True)]
ratio("serve prefix_repetition, caching on: tok/s c=8 / c=1", c8["output_tokens_per_s"] / c1["output_tokens_per_s"], ">= 4", lambda v: v >= 4)
ratio("serve prefix_repetition, caching on, c=8: ITL p99 / p50", c8["itl_ms_p99"] / c8["itl_ms_p50"], "<= 2", lambda v: v <= 2)
decode = {(r["concurrency"], r["cache"]): r for r in lines("bench_serve_decode.jsonl")}
ratio("serve decode only (16 + 16-token prompts, 128 out), caching on: tok/s c=8 / c=1",
      decode[(8, True)]["output_tokens_per_s"] / decode[(1, True)]["output_tokens_per_s"], None)
for r in lines("bench_ttft.jsonl"):
    if r["workload"] == "prefix_repetition_long":
        ratio("ttft 256 over 2048 cached: cached / uncached", r["ratio"], f"ideal {r['ideal_ratio']:.3f}")
[rss] = lines("real_width_rss.json")
ratio("real-width bf16 thinker: peak RSS / checkpoint file", rss["peak_over_file"], "<= 1.25", lambda v: v <= 1.25)
report = {
    "kind": "cpu_report",
    "machine": {"cpu": model, "flags": flags, "threads": cpu["threads"], "omniprefix_simd": cpu["simd_running"],
                "simd_available": cpu["simd_available"], "os": f"{platform.system()} {platform.release()}"},
    "ratios": ratios,
}
(out / "cpu_report.json").write_text(json.dumps(report, indent=1) + "\n")
for r in ratios:
    target = f" (target {r['target']}{', NOT met' if r['met'] is False else ''})" if r["target"] else ""
    print(f"{r['what']}: {r['value']}{target}")
EOF
rm -f "$out/cpu_info.json"
