#!/usr/bin/env python3
"""decode_bandwidth_fraction from criterion's output of `benches/attention.rs`.

usage: attention_fraction.py CRITERION_DIR

For every group `attention_<prefix>+<suffix>` under CRITERION_DIR, prints one JSON line:
wgpu `decode` bytes/s (K/V read) over `copy_kv` bytes/s (the same bytes read and written
by one buffer copy), from criterion's median and the throughput the bench declared.
`scripts/gpu_bench.sh` appends these lines to attention.jsonl.
"""
import json
import pathlib
import sys


def rate(group: pathlib.Path, case: str) -> float:
    """Bytes per second of the wgpu benchmark `case` of `group` (criterion's median)."""
    found = [d for d in group.iterdir() if d.name.startswith("wgpu") and f"_{case}_" in d.name]
    if len(found) != 1:
        sys.exit(f"{group}: expected one wgpu {case} benchmark, found {[d.name for d in found]}")
    (bench,) = found
    seconds = json.loads((bench / "new/estimates.json").read_text())["median"]["point_estimate"] / 1e9
    return json.loads((bench / "new/benchmark.json").read_text())["throughput"]["Bytes"] / seconds


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    groups = sorted(pathlib.Path(sys.argv[1]).glob("attention_*"))
    if not groups:
        sys.exit(f"no attention_* groups under {sys.argv[1]}")
    for group in groups:
        decode, copy = rate(group, "decode"), rate(group, "copy_kv")
        print(json.dumps({
            "kind": "attention",
            "shape": group.name.removeprefix("attention_"),
            "decode_bytes_per_s": decode,
            "copy_kv_bytes_per_s": copy,
            "decode_bandwidth_fraction": decode / copy,
        }))


if __name__ == "__main__":
    main()
