#!/usr/bin/env python3
"""Markdown TTFA table of `omniprefix bench ttfa --json PATH` for docs/engine.md ("Time to first audio").

    cargo build --release -p omniprefix-cli
    target/release/omniprefix bench ttfa --json docs/reports/bench_ttfa.json
    python3 scripts/ttfa_table.py docs/reports/bench_ttfa.json

Prints the machine line, one row per round with caller TTFA p50 / p99 caching on and off at c=1 and
their ratio, the rounds-2.. headline, TTFA p50 at the highest concurrency over c=1, and where the
first audio's time went (medians, rounds 2.., c=1). Every figure is read from the report.
``--figure PATH`` (needs matplotlib) also draws the README's figure: TTFA p50 by round, caching on
and off, one line per concurrency.
"""
import argparse
import json
import sys

parser = argparse.ArgumentParser(description="bench ttfa's table (and the README's figure) from its --json report")
parser.add_argument("report", nargs="?", type=argparse.FileType(), default=sys.stdin)
parser.add_argument("--figure", help="also draw TTFA p50 by round to this file (needs matplotlib)")
args = parser.parse_args()
figure = args.figure
r = json.load(args.report)
m, s = r["machine"], r["shapes"]
features = " ".join(m["cpu_features"]) or "no AVX2"
print(
    f"{m['cpu_model']}, {m['cores']} cores ({features}), {m['threads']} threads; {r['size']} model "
    f"(thinker {s['thinker']['hidden']}x{s['thinker']['layers']}, talker {s['talker']['hidden']}x{s['talker']['layers']} "
    f"with {s['talker']['experts']} experts top-{s['talker']['experts_per_token']}, code2wav "
    f"{s['code2wav_hidden']}x{s['code2wav_layers']} + decoder {s['code2wav_decoder_dim']}, {r['dtype']}); "
    f"reply {r['max_tokens']} tokens, {r['frames']} frames, first chunk {r['first_chunk']} frames; prefill cap "
    f"{r.get('prefill_cap') or 'off'}; audio yield "
    f"{'off' if r.get('audio_yield_ms') is None else format(r['audio_yield_ms'], '.0f') + ' ms'}\n"
)

runs = {(x["cache"], x["concurrency"]): x for x in r["runs"]}
on, off = runs.get((True, 1)), runs.get((False, 1))
print("| round | prompt tokens (hit) | talker rows (hit) | TTFA p50 ms on / off | TTFA p99 ms on / off | on / off |")
print("|---|---:|---:|---:|---:|---:|")
for a, b in zip(on["rounds"] + [on["later_rounds"]], off["rounds"] + [off["later_rounds"]]):
    name = str(a["round"]) if a["round"] else "2-" + str(r["rounds"])
    print(
        f"| {name} | {a['prompt_tokens']} ({a['cached_tokens']}) | {a['talker_prompt_rows']} ({a['talker_cached_rows']}) "
        f"| {a['ttfa_ms_p50']:.0f} / {b['ttfa_ms_p50']:.0f} | {a['ttfa_ms_p99']:.0f} / {b['ttfa_ms_p99']:.0f} "
        f"| {a['ttfa_ms_p50'] / b['ttfa_ms_p50']:.3f} |"
    )

print(
    f"\nTTFA p50, rounds 2-{r['rounds']}, c=1: cached / uncached = {r['later_rounds_cached_over_uncached_c1']:.3f}. "
    f"TTFA p50 at c={r['top_c']} / c=1: {r['ttfa_p50_top_c_over_c1_cached']:.2f} caching on, "
    f"{r['ttfa_p50_top_c_over_c1_uncached']:.2f} off."
)
for b in r["breakdown"]:
    print(
        f"First audio, rounds 2-{r['rounds']}, c={b['concurrency']}, caching {'on' if b['cache'] else 'off'} (ms): "
        f"prepare {b['prepare_ms']:.1f}, thinker prefill {b['thinker_prefill_ms']:.1f}, "
        f"first token to first chunk {b['first_token_to_audio_ms']:.1f} (talker start, prefill, first frames, code2wav), "
        f"chunk to caller {b['audio_delivery_ms']:.1f}; the audio began {b['audio_before_reply_end_ms']:.1f} ms before the reply's last token."
    )
print(
    "\nBy concurrency, caching on, rounds 2-" + str(r["rounds"]) + " (p50 ms; stall: the silence a listener playing each "
    "chunk as it arrives hears after the first audio):"
)
print("| c | TTFT | TTFA | TTFA p99 | stall | stall p99 |")
print("|---:|---:|---:|---:|---:|---:|")
for x in r["runs"]:
    if x["cache"]:
        l = x["later_rounds"]
        print(
            f"| {x['concurrency']} | {l['ttft_ms_p50']:.0f} | {l['ttfa_ms_p50']:.0f} | {l['ttfa_ms_p99']:.0f} "
            f"| {l.get('stall_ms_p50', float('nan')):.0f} | {l.get('stall_ms_p99', float('nan')):.0f} |"
        )
p = r.get("probe")
if p:
    print(
        f"The talker and code2wav alone ({p['talker_rows']} talker rows): prefill + first frame "
        f"{p['talker_prefill_first_frame_ms']:.1f} ms, {p['talker_frame_ms']:.1f} ms a frame, code2wav's first chunk "
        f"{p['code2wav_first_chunk_ms']:.1f} ms, then {p.get('code2wav_ms_per_frame', float('nan')):.1f} ms a frame."
    )

if figure:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    cs = sorted({x["concurrency"] for x in r["runs"]})
    for x in sorted(r["runs"], key=lambda x: (not x["cache"], x["concurrency"])):
        rs = x["rounds"]
        style = "-o" if x["cache"] else "--x"
        ax.plot([q["round"] for q in rs], [q["ttfa_ms_p50"] for q in rs], style, color=f"C{cs.index(x['concurrency'])}",
                label=f"c={x['concurrency']}, caching {'on' if x['cache'] else 'off'}")
    ax.set_xlabel("round of the voice chat")
    ax.set_ylabel("time to first audio, p50 (ms)")
    ax.set_xticks([q["round"] for q in r["runs"][0]["rounds"]])
    ax.set_ylim(bottom=0)
    ax.set_title(f"bench ttfa: {m['cpu_model']}, {m['cores']} cores")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(figure, dpi=110)
