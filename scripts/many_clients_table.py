#!/usr/bin/env python3
"""Markdown table of `omniprefix bench serve --workload many_clients --json` for docs/engine.md
("Many clients over a small pool"): per round, the token hit rate and TTFT p50 of each engine, then
the two targets' ratios from round 3 on (pool + tier against the unbounded pool's hit rate, and its
TTFT p50 against pool-only's) and what the restart's round took from the tier.

    target/release/omniprefix bench serve --workload many_clients --json > docs/reports/bench_many_clients.jsonl
    python3 scripts/many_clients_table.py docs/reports/bench_many_clients.jsonl [--figure docs/figures/many_clients_hits.png]

``--figure PATH`` (needs matplotlib) also draws the README's figure: hit rate by round, one line per engine.
"""
import argparse
import json
import sys

parser = argparse.ArgumentParser(description="many_clients' table (and figure) from its --json report")
parser.add_argument("report", nargs="?", type=argparse.FileType(), default=sys.stdin)
parser.add_argument("--figure", help="also draw hit rate by round to this file (needs matplotlib)")
args = parser.parse_args()
figure = args.figure
lines = [json.loads(l) for l in args.report if l.strip()]
runs = {l["many_clients"]["engine"]: l["many_clients"] for l in lines}
order = [e for e in ("pool", "pool_tier", "unbounded", "restart") if e in runs]
names = {"pool": "pool", "pool_tier": "pool + tier", "unbounded": "unbounded", "restart": "restart"}
print("| round | " + " | ".join(f"{names[e]} | p50" for e in order) + " |")
print("|---|" + "---|---|" * len(order))
rounds = max(len(runs[e]["rounds"]) for e in order)
for k in range(rounds):
    cells = []
    for e in order:
        r = runs[e]["rounds"][k]
        cells.append(f"{r['hit_rate']:.3f} | {r['ttft_ms_p50']:.1f}")
    print(f"| {k + 1} | " + " | ".join(cells) + " |")

if {"pool", "pool_tier", "unbounded"} <= runs.keys():
    hit = [t["hit_rate"] / u["hit_rate"] for t, u in zip(runs["pool_tier"]["rounds"][2:], runs["unbounded"]["rounds"][2:])]
    ttft = [t["ttft_ms_p50"] / p["ttft_ms_p50"] for t, p in zip(runs["pool_tier"]["rounds"][2:], runs["pool"]["rounds"][2:])]
    ceiling = [u["ttft_ms_p50"] / p["ttft_ms_p50"] for u, p in zip(runs["unbounded"]["rounds"][2:], runs["pool"]["rounds"][2:])]
    fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs)
    print(f"\nFrom round 3: pool + tier hit rate / unbounded = {fmt(hit)}; TTFT p50 pool + tier / pool = {fmt(ttft)} "
          f"(unbounded / pool = {fmt(ceiling)}).")
if "restart" in runs:
    r = runs["restart"]["rounds"]
    first = next((x for x in r if x["round"] > 1 and x["tier_hit_tokens"] == x["cached_tokens"] > 0 and x["round"] == len(r) // 2 + 1), None)
    if first:
        print(f"Restart before round {first['round']}: {first['tier_hit_tokens']} of its {first['cached_tokens']} cached tokens "
              f"from the tier, hit rate {first['hit_rate']:.3f}.")

if figure:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    styles = {"pool": "o-", "pool_tier": "s-", "unbounded": "k--", "restart": "^:"}
    for e in order:
        rs = runs[e]["rounds"]
        label = f"pool + tier, restarted before round {len(rs) // 2 + 1}" if e == "restart" else names[e]
        ax.plot([r["round"] for r in rs], [r["hit_rate"] for r in rs], styles[e], label=label)
    c = runs[order[0]]
    ax.set_xlabel("round")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{c['conversations']} conversations, pool of {c['pool_blocks']} of {c['working_set_blocks']} blocks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(figure, dpi=110)
