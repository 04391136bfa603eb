"""Does Dynamo's KV router send a repeated image to the worker that caches it?

    python scripts/route_mm_bench.py [--model fixtures/tiny/omni_thinker] [--images 8] [--json PATH]

Starts 2-worker fleets (``omniprefix.fleet.Fleet``) on the Omni fixture and sends ``--images``
distinct seeded 56x40 PNGs (same size, so the same placeholder count), each twice, interleaved
(1..n, then the n again in a seeded shuffle), one streamed request at a time, after
``WARM_UP`` other images. Per setup it times each request's TTFT (to the first token's chunk) and counts the second sends that hit the
image in the worker's cache (``usage.prompt_tokens_details.cached_tokens`` past the image's end),
the encoder calls over both workers (a miss runs the tower again) and, for the kv router, the
``overlap_blocks`` the frontend logged for each routing decision: for a first send it must stay 0
(a different image of the same size does not match past the image's start). Setups: kv router
with the worker's image keys (``--dynamo-mm-keys on``), kv without them, round-robin.
Needs the fleet venv (``scripts/install_fleet.sh``) and pillow.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from omniprefix.fleet import Fleet
from omniprefix.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
#: Tokens before the image in the chat template, and the image's expansion (56x40, patch 4, merge 2).
PREFIX, IMAGE_TOKENS = 5, 35
#: Distinct images sent before the measured ones, so both workers have run their tower.
WARM_UP = 4


def png(seed: int, width: int = 56, height: int = 40) -> str:
    from PIL import Image

    rng = random.Random(seed)
    img = Image.frombytes("RGB", (width, height), bytes(rng.randrange(256) for _ in range(width * height * 3)))
    out = io.BytesIO()
    img.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def chat(url: str, model: str, image: str) -> tuple[float, int]:
    """One streamed image chat: (seconds to the first token's chunk, the reply's cached prompt tokens)."""
    body = {"model": model, "max_tokens": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": "Describe this briefly."}]}]}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    ttft, cached = None, None
    with urllib.request.urlopen(req, timeout=60) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    if ttft is None or cached is None:
        raise RuntimeError("the stream carried no token or no usage")
    return ttft, cached


def metric(url: str, name: str) -> float | None:
    """A counter of a worker's /metrics, or None when its engine does not export it (an older build)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + " ", name + "{"))]
    return sum(values) if values else None


def overlaps(log: Path) -> list[int]:
    """The frontend's ``overlap_blocks`` per routed request, in order (ANSI colours stripped)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))
    return [int(m) for m in re.findall(r"route request completed.*?overlap_blocks=(\d+)", text)]


def run(model: Path, router: str, keys: str, images: list[str], order: list[int]) -> dict:
    fleet = Fleet(model, 2, router, free_port(), worker_args=["--dynamo-mm-keys", keys])
    try:
        info = fleet.start(timeout_s=120)
        for seed in range(10_000, 10_000 + WARM_UP):  # warm-up: each worker's first tower runs, allocations
            chat(info["frontend"], info["model"], png(seed))
        cached, ttfts = [], []
        for image in images + [images[i] for i in order]:
            ttft, hit = chat(info["frontend"], info["model"], image)
            ttfts.append(ttft)
            cached.append(hit)
            time.sleep(0.2)  # the KV events of one request reach the router before the next is routed
        time.sleep(0.5)
        n = len(images)
        end = PREFIX + IMAGE_TOKENS
        counts = [metric(w["metrics"], "omniprefix_encoder_calls_total") for w in info["workers"]]
        enc = None if None in counts else int(sum(counts)) - WARM_UP
        ov = overlaps(fleet.dir / "frontend.log") if router == "kv" else []
        return {"router": router, "keys": keys, "images": n,
                "repeat_hits": sum(c >= end for c in cached[n:]), "encoder_calls": enc,
                "ttft_ms_first": round(1000 * statistics.median(ttfts[:n]), 2),
                "ttft_ms_repeat": round(1000 * statistics.median(ttfts[n:]), 2),
                "ttft_ms_repeat_hit": round(1000 * statistics.median([t for t, c in zip(ttfts[n:], cached[n:]) if c >= end]
                                                                    or [float("nan")]), 2),
                "ttft_ms": [round(1000 * t, 2) for t in ttfts],
                "first_cached_max": max(cached[:n]), "cached_tokens": cached,
                "first_overlap_max": max(ov[:n]) if ov else None,
                "repeat_overlap_blocks": ov[n:] if ov else None}
    finally:
        fleet.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=ROOT / "fixtures/tiny/omni_thinker")
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--json", type=Path, help="write the report here (e.g. docs/reports/route_mm_bench.json)")
    args = p.parse_args()
    images = [png(seed) for seed in range(args.images)]
    # The second round in a seeded shuffle: in plain order round-robin would land every repeat
    # on its first worker (an even count of requests in between).
    order = list(range(args.images))
    random.Random(1).shuffle(order)
    rows = [run(args.model, "kv", "on", images, order), run(args.model, "kv", "off", images, order),
            run(args.model, "round-robin", "on", images, order)]
    print(f"{'router':<12} {'image keys':<10} {'repeat hits':>11} {'encoder calls':>13} {'1st-send overlap':>16} "
          f"{'TTFT 1st / repeat (median ms)':>30}")
    for r in rows:
        ov = "-" if r["first_overlap_max"] is None else f"max {r['first_overlap_max']}"
        enc = "n/a" if r["encoder_calls"] is None else r["encoder_calls"]
        ttft = f"{r['ttft_ms_first']:.1f} / {r['ttft_ms_repeat']:.1f}"
        print(f"{r['router']:<12} {r['keys']:<10} {r['repeat_hits']:>6}/{r['images']:<4} {enc:>13} {ov:>16} {ttft:>30}")
    if args.json:
        report = {"model": args.model.name, "workers": 2, "image": "56x40 PNG, 35 tokens", "order": ["first round"] + list(range(args.images)) + ["second round"] + order,
                  "hit": f"cached_tokens >= {PREFIX + IMAGE_TOKENS}", "rows": rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
