#!/usr/bin/env python3
"""What a Python `prefill` / `generate` call costs over the engine's own work.

Runs a short prompt through `omniprefix.Engine` (the installed package) many
times and compares, call by call, the wall time Python sees with the time the
engine measured inside Rust for the same call (`Output.timings["total"]`,
from submission to the finished output). The difference is the binding:
argument conversion, the GIL release and re-acquisition, the engine lock and
building the numpy results. Also timed: a bare property read (the floor of any
call into the extension) and `fingerprint` of a small image.

Usage: python scripts/python_overhead.py [--calls N] [--json]
(build with `pip install ./python` for release figures; CI's dev-profile wheel is slower).
"""

import argparse
import json
import pathlib
import statistics
import time

import numpy as np

import omniprefix

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODEL = ROOT / "fixtures" / "tiny" / "qwen3_dense"


def median_us(samples):
    return statistics.median(samples) * 1e6


def timed(call, calls):
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        result = call()
        samples.append(time.perf_counter() - t0)
    return samples, result


def measure(calls, prompt_len):
    engine = omniprefix.Engine.from_dir(MODEL, block_size=16)
    ids = list(range(1, prompt_len + 1))
    report = {"model": "fixtures/tiny/qwen3_dense", "prompt_len": prompt_len, "calls": calls}

    engine.prefill(ids)  # warm: the prompt is cached from here on
    wall, inside = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        out = engine.prefill(ids)
        wall.append(time.perf_counter() - t0)
        inside.append(out.timings["total"] / 1e3)
    overhead = [w - i for w, i in zip(wall, inside)]
    report["prefill_wall_us_p50"] = median_us(wall)
    report["prefill_engine_us_p50"] = median_us(inside)
    report["prefill_overhead_us_p50"] = median_us(overhead)
    report["prefill_wall_over_engine"] = statistics.median(w / i for w, i in zip(wall, inside))
    report["num_cached_tokens"] = out.num_cached_tokens

    wall, inside = [], []
    for _ in range(max(calls // 4, 1)):
        t0 = time.perf_counter()
        gen = engine.generate(ids, max_tokens=4, ignore_eos=True)
        wall.append(time.perf_counter() - t0)
        inside.append(gen.timings["total"] / 1e3)
    report["generate4_wall_us_p50"] = median_us(wall)
    report["generate4_engine_us_p50"] = median_us(inside)
    report["generate4_overhead_us_p50"] = median_us([w - i for w, i in zip(wall, inside)])

    samples, _ = timed(lambda: engine.block_size, calls)
    report["property_read_us_p50"] = median_us(samples)
    image = np.zeros((32, 48, 3), np.uint8)
    layout = {"kind": "image", "grid_thw": [1, 4, 6]}
    key = bytes(32)
    samples, _ = timed(lambda: omniprefix.fingerprint(image, layout, key=key), calls)
    report["fingerprint_4608_bytes_us_p50"] = median_us(samples)
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=400)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    report = measure(args.calls, args.prompt_len)
    if args.json:
        print(json.dumps(report))
        return
    for key, value in report.items():
        print(f"{key:32} {value:.2f}" if isinstance(value, float) else f"{key:32} {value}")


if __name__ == "__main__":
    main()
