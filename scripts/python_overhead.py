#!/usr/bin/env python3
"""What each call of the Python package costs, and how much of it is the binding.

For the engine calls, every call's wall time as Python sees it is paired with the
time the engine measured inside Rust for the same call (`timings["total"]`, from
submission to the finished result); the difference is the binding: argument
conversion, releasing and re-taking the GIL, the engine lock and building the
numpy results. The other rows are wall times of calls with no Rust-side timer.

Model: the tiny 3-layer checkpoint `fixtures/tiny/qwen3_dense` (hidden 64) and a
random Qwen3 shape of hidden 512 x 8 layers for the per-token rows, so the model's
own work is small and the binding's share shows.

Usage: python scripts/python_overhead.py [--calls N] [--json FILE] [--markdown]
Build with `pip install ./python` (release) first; CI's dev-profile wheel is slower.
"""

import argparse
import json
import pathlib
import statistics
import time

import numpy as np

import omniprefix

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ROOT / "fixtures" / "tiny" / "qwen3_dense"
PROMPT_LEN = 16


def p50_us(samples):
    return statistics.median(samples) * 1e6


def wall(call, calls):
    """Median wall time of `call` in µs, and its last result."""
    samples, result = [], None
    for _ in range(calls):
        t0 = time.perf_counter()
        result = call()
        samples.append(time.perf_counter() - t0)
    return p50_us(samples), result


def against_engine(call, calls):
    """(wall µs, engine µs, overhead µs) medians, pairing each call with its own `timings["total"]`."""
    walls, inside = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        result = call()
        walls.append(time.perf_counter() - t0)
        inside.append(result.timings["total"] / 1e3)
    return p50_us(walls), p50_us(inside), p50_us([w - i for w, i in zip(walls, inside)])


def measure(calls):
    rows = []

    def row(call, what, wall_us, engine_us=None, overhead_us=None):
        rows.append({"call": call, "what": what, "wall_us": wall_us, "engine_us": engine_us, "overhead_us": overhead_us})

    load_us, engine = wall(lambda: omniprefix.Engine.from_dir(TINY, block_size=16), 5)
    row("Engine.from_dir", "tiny qwen3_dense (3 layers, hidden 64, 0.2 MB of weights)", load_us)

    ids = list(range(1, PROMPT_LEN + 1))
    fresh = iter(range(10**6))
    # Uncached: new first two tokens each call (57600 pairs), so no block matches.
    def uncached():
        i = next(fresh)
        return engine.prefill([i % 240, i // 240 % 240] + ids[2:])

    row("engine.prefill", f"{PROMPT_LEN} tokens, uncached", *against_engine(uncached, calls))
    engine.prefill(ids)
    row("engine.prefill", f"{PROMPT_LEN} tokens, {PROMPT_LEN - 1} cached", *against_engine(lambda: engine.prefill(ids), calls))
    gen = lambda: engine.generate(ids, max_tokens=8, ignore_eos=True)  # noqa: E731
    row("engine.generate", f"{PROMPT_LEN}-token prompt, 8 tokens", *against_engine(gen, max(calls // 4, 1)))

    def streamed():
        stream = engine.stream(ids, max_tokens=8, ignore_eos=True)
        for _ in stream:
            pass
        return stream.generation

    row("engine.stream", "the same 8 tokens, iterated", *against_engine(streamed, max(calls // 4, 1)))

    prop_us, _ = wall(lambda: engine.block_size, calls)
    row("engine.block_size", "a property read: the floor of any call", prop_us)

    embeddings = np.random.default_rng(0).standard_normal((6, 64)).astype(np.float32)
    pixels = np.zeros((32, 48, 3), np.uint8)
    layout = {"kind": "image", "grid_thw": [1, 4, 6]}
    item_us, _ = wall(lambda: omniprefix.Item("image", pixels, layout, embeddings=embeddings), calls)
    row("omniprefix.Item", "image with 6 x 64 float32 embeddings (copied)", item_us)
    key = bytes(32)
    fp_small_us, _ = wall(lambda: omniprefix.fingerprint(pixels, layout, key=key), calls)
    row("omniprefix.fingerprint", f"{pixels.nbytes} bytes", fp_small_us)
    big = np.ones((64, 1024, 1024), np.uint8)
    fp_big_us, _ = wall(lambda: omniprefix.fingerprint(big, layout, key=key), 10)
    row("omniprefix.fingerprint", f"{big.nbytes >> 20} MiB ({big.nbytes / fp_big_us / 1e3:.1f} GB/s)", fp_big_us)

    index = omniprefix.PrefixIndex(block_size=16)
    text = list(range(1, 1025))
    prompt_us, prompt = wall(lambda: omniprefix.Prompt(text), calls)
    row("omniprefix.Prompt", "1024 text tokens", prompt_us)
    index.insert(prompt, list(range(64)))
    match_us, m = wall(lambda: index.match(prompt), calls)
    assert m.tokens == 1024
    row("PrefixIndex.match", "1024 tokens, all 64 blocks cached", match_us)
    return rows


def markdown(rows):
    lines = ["| call | what | wall µs (p50) | engine µs (p50) | binding µs (p50) |", "|---|---|---:|---:|---:|"]
    for r in rows:
        fmt = lambda v: "" if v is None else f"{v:.1f}"  # noqa: E731
        lines.append(f"| `{r['call']}` | {r['what']} | {fmt(r['wall_us'])} | {fmt(r['engine_us'])} | {fmt(r['overhead_us'])} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--json", type=pathlib.Path, help="write the rows as JSON lines here")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args()
    rows = measure(args.calls)
    if args.json:
        args.json.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(markdown(rows) if args.markdown else "\n".join(json.dumps(r) for r in rows))


if __name__ == "__main__":
    main()
