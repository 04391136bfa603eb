#!/usr/bin/env python3
"""Does a slow encoder on one thread stall another thread's stream?

On the tiny Omni checkpoint, thread A streams a long generation and records when
each token arrives; thread B meanwhile submits image requests (each a new image,
so each misses the encoder cache) whose encoder sleeps ``--encoder-ms``. The
same stream runs once alone as the reference. Prints (and with ``--json``
writes) the worst and median inter-token gap of both runs.

Before the engine stepped on its own thread, the encoder ran under the engine's
lock and a 300 ms encoder stopped the stream for ~306 ms per submission.

    python scripts/stall_check.py --encoder-ms 300 --json docs/reports/stall.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import numpy as np

import omniprefix

REPO = Path(__file__).resolve().parent.parent
CHECKPOINT = REPO / "fixtures" / "tiny" / "omni_thinker"
IMAGE_LAYOUT = {"kind": "image", "grid_thw": [1, 4, 4]}


def stream_gaps(engine, tokens: int) -> list[float]:
    """Milliseconds between consecutive tokens of one stream, as its reader sees them."""
    ids = np.random.default_rng(1).integers(0, 240, size=24).tolist()
    arrivals = [time.perf_counter() for _ in engine.stream(ids, max_tokens=tokens, ignore_eos=True)]
    return [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])]


def submit_images(engine, count: int, encoder_ms: float, stop: threading.Event, done: list) -> None:
    """Image prefills whose encoder sleeps ``encoder_ms`` (each image new: a cache miss)."""
    hidden = engine.hidden_size
    ids = [1, 2, engine.vision_start_token_id, engine.image_token_id, engine.vision_end_token_id, 3]
    for i in range(count):
        if stop.is_set():
            return
        content = np.full((4, 4, 3), i, dtype=np.uint8)

        def encoder(item, i=i):
            time.sleep(encoder_ms / 1e3)
            return np.full((item.num_tokens, hidden), 0.01 * i, dtype=np.float32)

        engine.prefill(ids, [omniprefix.Item("image", content, IMAGE_LAYOUT)], encoder=encoder)
        done.append(i)


def summary(gaps: list[float]) -> dict:
    return {"tokens": len(gaps) + 1, "worst_gap_ms": max(gaps), "median_gap_ms": statistics.median(gaps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--encoder-ms", type=float, default=300.0, help="what the stand-in encoder sleeps per item")
    parser.add_argument("--tokens", type=int, default=2000, help="tokens the measured stream generates")
    parser.add_argument("--images", type=int, default=3, help="image requests thread B submits")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    engine = omniprefix.Engine.from_dir(str(CHECKPOINT), block_size=16, backend="cpu")
    alone = summary(stream_gaps(engine, args.tokens))

    engine = omniprefix.Engine.from_dir(str(CHECKPOINT), block_size=16, backend="cpu")
    stop, done = threading.Event(), []
    other = threading.Thread(target=submit_images, args=(engine, args.images, args.encoder_ms, stop, done))
    other.start()
    beside = summary(stream_gaps(engine, args.tokens))
    stop.set()
    other.join(timeout=120)

    report = {
        "checkpoint": "fixtures/tiny/omni_thinker",
        "encoder_ms": args.encoder_ms,
        "image_requests_during_stream": len(done),
        "alone": alone,
        "beside_slow_encoder": beside,
        "added_worst_gap_ms": beside["worst_gap_ms"] - alone["worst_gap_ms"],
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
