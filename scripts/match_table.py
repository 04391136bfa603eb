#!/usr/bin/env python3
"""Markdown table of `omniprefix bench match --json` lines (stdin) for docs/benchmarks.md ("Match benchmark").

scripts/make_figures.sh writes the lines to docs/reports/bench_match_{1t,Nt}.jsonl:
    cat docs/reports/bench_match_1t.jsonl docs/reports/bench_match_Nt.jsonl | python3 scripts/match_table.py
"""
import json
import sys

rows = [json.loads(line) for line in sys.stdin if line.strip()]
print("| workload | thr | tokens | input MB | read floor ms | cold ms | warm ms | vLLM path ms | cold/floor | warm/floor | vLLM/warm | radix match µs | chain µs | chain/match | matched (radix / chain) | index B/token |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for r in rows:
    ms = lambda k: f"{r[k] / 1e6:.3f}"
    us = lambda k: f"{r[k] / 1e3:.2f}"
    print(
        f"| {r['workload']} | {r['threads']} | {r['prompt_tokens']} | {r['input_bytes'] / 1e6:.2f} "
        f"| {ms('read_floor_ns')} | {ms('omniprefix_cold_ns')} | {ms('omniprefix_warm_ns')} | {ms('hashchain_ns')} "
        f"| {r['cold_over_read_floor']:.2f} | {r['warm_over_read_floor']:.2f} | {r['hashchain_over_warm']:.2f} "
        f"| {us('radix_match_ns')} | {us('hashchain_chain_ns')} | {r['chain_over_radix_match']:.0f} "
        f"| {r['matched_tokens_warm']} / {r['hashchain_matched_tokens_warm']} | {r['index_bytes_per_token']:.2f} |"
    )
for r in rows:
    p = r.get("warm_ns_by_policy")
    if p:
        print(
            f"\nwarm `{r['workload']}` by policy ({r['threads']} thread(s)): second_digest {p['second_digest'] / 1e6:.2f} ms, "
            f"exact_bytes {p['exact_bytes'] / 1e6:.2f} ms, unvalidated {p['unvalidated'] / 1e6:.2f} ms"
        )
