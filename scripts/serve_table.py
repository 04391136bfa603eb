#!/usr/bin/env python3
"""Markdown table of `omniprefix bench serve --json` lines (stdin) for docs/serve.md ("Figures").

scripts/make_figures.sh writes the lines to docs/reports/bench_serve.jsonl:
    python3 scripts/serve_table.py < docs/reports/bench_serve.jsonl

One row per (workload, arrival) with caching on and off side by side, then the
three ratios per row: cached TTFT p50 / uncached, cached ITL p50 /
uncached, and (per workload) output tokens/s at the highest concurrency over concurrency 1.
"""
import json
import sys

rows = [json.loads(line) for line in sys.stdin if line.strip()]


def arrival(r):
    return f"c={r['concurrency']}" if r.get("concurrency") is not None else f"{r['rate']}/s"


pairs = {}
for r in rows:
    pairs.setdefault((r["workload"], arrival(r)), {})["on" if r["cache"] else "off"] = r

print("| workload | arrival | reqs | out tok | hit rate | TTFT p50 ms (on / off) | TTFT p99 ms (on / off) | ITL p50 ms (on / off) | ITL p99 ms (on / off) | out tok/s (on / off) | TTFT on/off | ITL on/off |")
print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for (workload, arr), p in pairs.items():
    on, off = p.get("on"), p.get("off")
    if on is None or off is None:
        continue
    both = lambda k, f="{:.1f}": f"{f.format(on[k])} / {f.format(off[k])}"
    print(
        f"| {workload} | {arr} | {on['requests']} | {on['output_tokens']} | {on['hit_rate']:.3f} "
        f"| {both('ttft_ms_p50')} | {both('ttft_ms_p99')} | {both('itl_ms_p50', '{:.2f}')} | {both('itl_ms_p99', '{:.2f}')} "
        f"| {both('output_tokens_per_s')} | {on['ttft_ms_p50'] / off['ttft_ms_p50']:.3f} | {on['itl_ms_p50'] / off['itl_ms_p50']:.3f} |"
    )

for workload in dict.fromkeys(r["workload"] for r in rows):
    closed = [r for r in rows if r["workload"] == workload and r.get("concurrency") is not None]
    for cache in (True, False):
        runs = sorted((r for r in closed if r["cache"] == cache), key=lambda r: r["concurrency"])
        if len(runs) >= 2 and runs[0]["concurrency"] == 1:
            top = runs[-1]
            print(
                f"\n`{workload}`, caching {'on' if cache else 'off'}: output tokens/s at concurrency {top['concurrency']} = "
                f"{top['output_tokens_per_s'] / runs[0]['output_tokens_per_s']:.2f} x concurrency 1"
            )
