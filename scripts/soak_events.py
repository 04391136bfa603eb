#!/usr/bin/env python3
"""The KV events of a soak, followed by a router's view: drops, gaps, and whether the view ends
equal to the index.

Runs ``omniprefix bench soak --kv-events ... --kv-replay ... --json`` (scheduler only, no model:
the fastest producer of events there is) while an ``omniprefix.router.ReplicaView`` subscribes,
then prints one JSON object: the soak's publisher counters, the view's batches, replays and final
set (size and hash sum) against the soak's ``published_blocks`` / ``published_hash_sum``.

    python3 scripts/soak_events.py --bin target/release/omniprefix --requests 100000
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import time

from omniprefix.router import ReplicaView


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", default="target/release/omniprefix")
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--pool-blocks", type=int, default=1024)
    p.add_argument("--linger-s", type=float, default=3.0)
    args = p.parse_args()
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    view = ReplicaView(pub, replay)
    soak = subprocess.Popen([args.bin, "bench", "soak", "--requests", str(args.requests), "--pool-blocks",
                             str(args.pool_blocks), "--json", "--kv-events", pub, "--kv-replay", replay,
                             "--linger-s", str(args.linger_s), "--fingerprint-key", "00" * 32],
                            stdout=subprocess.PIPE, text=True)
    started = time.monotonic()
    while soak.poll() is None:
        view.poll(50)
    out, _ = soak.communicate()
    report = json.loads(out)
    view.poll(0)
    print(json.dumps({
        "requests": report["requests"],
        "seconds": round(time.monotonic() - started, 2),
        "publisher": report["kv_events"],
        "index_blocks": report["index_blocks"],
        "published_blocks": report["published_blocks"],
        "view_batches": view.batches,
        "view_replays": view.replays,
        "view_blocks": len(view.cached),
        "view_equals_index": len(view.cached) == report["published_blocks"]
        and sum(view.cached) % 2**64 == report["published_hash_sum"],
    }))


if __name__ == "__main__":
    main()
