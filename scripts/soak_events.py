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
import subprocess
import time

from omniprefix.router import ReplicaView


BOUND = "kv events: publishing on "


def bound_endpoints(line: str) -> tuple[str, str]:
    """The PUB and replay endpoints of the line the binary prints on stderr once its
    sockets are bound (``kv events: publishing on PUB, replay on REPLAY``)."""
    if not line.startswith(BOUND) or ", replay on " not in line:
        raise SystemExit(f"expected the bound endpoints on stderr, got {line!r}")
    pub, replay = line[len(BOUND):].strip().split(", replay on ")
    return pub, replay


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bin", default="target/release/omniprefix")
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--pool-blocks", type=int, default=1024)
    p.add_argument("--linger-s", type=float, default=3.0)
    args = p.parse_args()
    # Port 0: the soak binds free ports and names them on stderr before its first request; the
    # view replays whatever was published before it subscribed.
    started = time.monotonic()
    soak = subprocess.Popen([args.bin, "bench", "soak", "--requests", str(args.requests), "--pool-blocks",
                             str(args.pool_blocks), "--json", "--kv-events", "tcp://127.0.0.1:0", "--kv-replay",
                             "tcp://127.0.0.1:0", "--linger-s", str(args.linger_s), "--fingerprint-key", "00" * 32],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert soak.stderr is not None
    view = ReplicaView(*bound_endpoints(soak.stderr.readline()))
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
