#!/usr/bin/env python3
"""The summary rows of docs/benchmarks.md ("Against PyTorch") from `scripts/compare_torch.py`'s reports.

Usage: python3 scripts/torch_table.py docs/reports/compare_torch.jsonl docs/reports/compare_torch_bf16.jsonl
Prints one markdown row per report file: checkpoint dtype and lm_head (tied or untied), then (a) uncached prefill, (b) cached
prefill, (c) decode as "omniprefix vs torch: ratio", the peak RSS of both sides, and the machine the row came from (its CPU,
its widest vector flags, and the kernel build omniprefix ran, where the report names them).
"""

import json
import sys


def row(path: str) -> str:
    rows, machine = {}, {}
    for line in open(path):
        r = json.loads(line)
        if "part" in r:
            rows[r["part"]] = r
        elif "cpu" in r:
            machine = r
    a, b, c = rows["a"], rows["b"], rows["c"]
    ms = lambda r: f"{r['omniprefix_ms']:.0f} vs {r['torch_ms']:.0f} ms: **{r['ratio']:.2f}**"
    rate = f"{c['omniprefix_tok_s']:.1f} vs {c['torch_tok_s']:.1f} tok/s: **{c['omniprefix_tok_s'] / c['torch_tok_s']:.2f} ×**"
    rss = f"{max(a['omniprefix_rss_mib'], c['omniprefix_rss_mib']):.0f} / {max(a['torch_rss_mib'], c['torch_rss_mib']):.0f} MiB"
    return f"| {a['dtype']} | {a.get('lm_head', 'tied')} | {ms(a)} | {ms(b)} | {rate} | {rss} | {machine_of(machine)} |"


def machine_of(m: dict) -> str:
    """"AMD EPYC, avx512_bf16, avx512bf16 kernels": the CPU, its widest flags, omniprefix's build."""
    flags = [f for f in m.get("cpu_flags", []) if f in ("amx_bf16", "avx512_bf16")] or [f for f in m.get("cpu_flags", []) if f in ("avx512f", "avx2")][-1:]
    build = [f"{m['omniprefix_simd']} kernels"] if "omniprefix_simd" in m else []
    return ", ".join([m.get("cpu", "?")] + flags + build)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(row(path))
