#!/usr/bin/env python3
"""KV-aware routing against round-robin over omniprefix replicas on loopback.

A multi-tenant, multi-round chat trace with images goes through N replicas (one
Engine each, same random weights, each publishing KV events on 127.0.0.1). A
router picks the replica per request:

* ``kv``: omniprefix.router: the replica whose events show the longest cached
  prefix of the request's block hashes (``omniprefix.block_hashes`` under the
  fleet key), the least used one on a tie;
* ``round_robin``: the next replica in turn;
* ``dynamo`` (with ``--dynamo-python``): Dynamo's standalone KV indexer
  (``python -m dynamo.indexer``, PyPI ``ai-dynamo-runtime``) subscribed to the same
  ZMQ streams, queried with the request's token ids; it hashes token ids itself,
  so it cannot tell two images apart (their placeholder ids are equal).

Every request generates ``--reply`` tokens; the reply is part of the next round's
prompt. A round's requests arrive together: the router places all of them, then
they run one at a time (so TTFT is the replica's own prefill time), and after each
the router waits (bounded) until the replica's events show the prompt cached, so
every run routes the same trace the same way.

Per policy it prints the token hit rate (cached prompt tokens / prompt tokens),
TTFT p50 / mean and the ratio of its mean TTFT to round-robin's, and with
``--json FILE`` writes one JSON object per policy. docs/scale-out.md ("Figures")
quotes its output (``scripts/make_figures.sh`` reruns it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import omniprefix
from omniprefix.router import DynamoIndexer, ReplicaView, Router

REPO = Path(__file__).resolve().parent.parent
FLEET_KEY = bytes(range(32))
BLOCK_SIZE = 16


def model_config(hidden: int, layers: int) -> dict:
    """The tiny Omni thinker's config.json, widened: its special ids, a bigger text model."""
    config = json.loads((REPO / "fixtures/tiny/omni_thinker/config.json").read_text())
    text = config["thinker_config"]["text_config"]
    head_dim = 32
    text.update(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2,
        num_attention_heads=hidden // head_dim,
        num_key_value_heads=max(1, hidden // head_dim // 2),
        head_dim=head_dim,
        num_hidden_layers=layers,
        mlp_only_layers=list(range(layers)),
        max_position_embeddings=16384,
        vocab_size=4096,
    )
    text["rope_parameters"]["mrope_section"] = [4, 6, 6]
    return config


@dataclass
class Turn:
    tenant: int
    conversation: int
    image: int
    history: list[int] = field(default_factory=list)


@dataclass
class Trace:
    """Tenants with a system prompt each, conversations that open with an image (a small
    pool per tenant, so some are sent again) and one shared first question, then rounds."""

    systems: dict[int, list[int]]
    question: list[int]
    images: dict[tuple[int, int], omniprefix.Item]
    conversations: list[Turn]
    user_turns: dict[tuple[int, int], list[int]]
    order: list[tuple[int, int]]

    @staticmethod
    def make(args, hidden: int, special: dict) -> "Trace":
        rng = np.random.default_rng(args.seed)
        text = lambda n: rng.integers(0, 240, size=n).tolist()  # below the tiny vocab's special ids
        systems = {t: text(args.system_len) for t in range(args.tenants)}
        question = text(args.turn_len)
        side = int(np.sqrt(args.image_tokens)) * 2
        layout = {"kind": "image", "grid_thw": [1, side, side]}
        images = {}
        for t in range(args.tenants):
            for k in range(args.images_per_tenant):
                content = rng.integers(0, 256, size=(side * 4, side * 4, 3), dtype=np.uint8)
                emb = rng.standard_normal((args.image_tokens, hidden)).astype(np.float32)
                images[(t, k)] = omniprefix.Item("image", content, layout, embeddings=emb)
        conversations = [
            Turn(t, c, c % args.images_per_tenant) for t in range(args.tenants) for c in range(args.conversations)
        ]
        user_turns = {(i, r): text(args.turn_len) for i in range(len(conversations)) for r in range(1, args.rounds)}
        order = []
        for r in range(args.rounds):
            ids = list(range(len(conversations)))
            rng.shuffle(ids)
            order.extend((i, r) for i in ids)
        vision = [special["vision_start_token_id"], special["image_token_id"], special["vision_end_token_id"]]
        trace = Trace(systems, question, images, conversations, user_turns, order)
        trace.vision = vision
        return trace

    def prompt(self, i: int, r: int) -> tuple[list[int], list]:
        conv = self.conversations[i]
        if r == 0:
            conv.history = self.systems[conv.tenant] + self.vision + self.question
        else:
            conv.history = conv.history + self.user_turns[(i, r)]
        return conv.history, [self.images[(conv.tenant, conv.image)]]


def run_policy(policy: str, arrival: str, args, config: dict) -> dict:
    special = config["thinker_config"]
    specials = {v for k, v in special.items() if k.endswith("_token_id")}
    replicas = [
        omniprefix.Engine.random(config, 0, block_size=BLOCK_SIZE, num_blocks=args.num_blocks, capture=[],
                                 fingerprint_key=FLEET_KEY, kv_events="tcp://127.0.0.1:0", kv_replay="tcp://127.0.0.1:0")
        for _ in range(args.replicas)
    ]
    hidden = replicas[0].hidden_size
    trace = Trace.make(args, hidden, special)
    router = dynamo = None
    if policy == "dynamo":
        dynamo = DynamoIndexer(args.dynamo_python)
        dynamo.register(replicas, BLOCK_SIZE)
    else:
        views = [ReplicaView(e.kv_events_endpoint, e.kv_replay_endpoint) for e in replicas]
        router = Router(views, fingerprint_key=FLEET_KEY, block_size=BLOCK_SIZE, policy=policy, tokens=config)
    # Untimed warm-up of each replica (thread pools, allocator), under a tenant of its own.
    for e in replicas:
        e.generate(list(range(20)), tenant=999_999, max_tokens=2, ignore_eos=True)
    samples = []
    route_us = []
    # Time until the router's view shows a request's blocks; requests it never showed.
    sync_ms, unsynced = [], 0
    # "waves": a round's requests arrive together and are all placed before any of them
    # runs; "sequential": each is placed once the one before it ran.
    if arrival == "waves":
        groups = [[(i, rr) for i, rr in trace.order if rr == r] for r in range(args.rounds)]
    else:
        groups = [[request] for request in trace.order]
    for group in groups:
        wave = []
        for i, r in group:
            ids, items = trace.prompt(i, r)
            tenant = trace.conversations[i].tenant
            t0 = time.perf_counter()
            if dynamo is not None:
                expanded = omniprefix.Prompt(ids, items, key=FLEET_KEY, tenant=tenant, special_tokens=special).token_ids
                choice = dynamo.route(expanded, len(replicas))
            else:
                expanded = None
                choice = router.route(ids, items, tenant=tenant)
            route_us.append((time.perf_counter() - t0) * 1e6)
            wave.append((i, ids, items, tenant, expanded, choice))
        for i, ids, items, tenant, expanded, choice in wave:
            gen = replicas[choice].generate(ids, items, tenant=tenant, max_tokens=args.reply, ignore_eos=True)
            # A random model may sample a special id (a placeholder) that a client would never
            # send back as text: such a reply token becomes a text id, so the next round
            # recomputes from there (rare with 4096 ids; the same for every policy).
            reply = [t if t not in specials else t - 16 for t in gen.tokens]
            trace.conversations[i].history = ids + reply
            samples.append({"ttft_ms": gen.timings["ttft"], "cached": gen.num_cached_tokens,
                            "prompt": gen.prompt_len, "replica": choice})
            # The next round's decisions see this request's blocks (events are asynchronous).
            full = gen.prompt_len // BLOCK_SIZE
            t1 = time.perf_counter()
            if dynamo is not None:
                synced = dynamo.wait_for(choice, expanded, full * BLOCK_SIZE, len(replicas))
            else:
                want = omniprefix.block_hashes(ids, items, fingerprint_key=FLEET_KEY, block_size=BLOCK_SIZE,
                                               tenant=tenant, tokens=config)
                synced = router.wait_for(choice, want)
            sync_ms.append((time.perf_counter() - t1) * 1e3)
            unsynced += not synced
    stats = [e.kv_events_stats() for e in replicas]
    evicted = sum(e.stats()["evicted_blocks"] for e in replicas)
    if dynamo is not None:
        dynamo.close()
    else:
        router.close()
    ttft = [s["ttft_ms"] for s in samples]
    prompt_tokens = sum(s["prompt"] for s in samples)
    cached = sum(s["cached"] for s in samples)
    return {
        "policy": policy,
        "arrival": arrival,
        "replicas": args.replicas,
        "requests": len(samples),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "hit_rate": cached / prompt_tokens,
        "ttft_ms_p50": statistics.median(ttft),
        "ttft_ms_mean": statistics.fmean(ttft),
        "route_us_p50": statistics.median(route_us),
        "event_lag_ms_p50": statistics.median(sync_ms),
        "event_lag_ms_max": max(sync_ms),
        "unsynced": unsynced,
        "evicted_blocks": evicted,
        "per_replica": [sum(1 for s in samples if s["replica"] == k) for k in range(args.replicas)],
        "events_dropped": sum(s["dropped"] for s in stats),
        "events_published": sum(s["published"] for s in stats),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--conversations", type=int, default=3, help="per tenant")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--images-per-tenant", type=int, default=2)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--turn-len", type=int, default=48)
    p.add_argument("--image-tokens", type=int, default=64, help="a square number")
    p.add_argument("--reply", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=160, help="KV blocks per replica")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default="kv,round_robin", help="comma list of kv, round_robin, dynamo")
    p.add_argument("--arrivals", default="sequential,waves", help="comma list of sequential, waves")
    p.add_argument("--dynamo-python", default=None, help="a python with ai-dynamo-runtime (adds the dynamo policy)")
    p.add_argument("--quick", action="store_true", help="a CI-sized trace")
    p.add_argument("--json", type=Path, default=None, help="write one JSON object per policy here")
    p.add_argument("--table", type=Path, default=None, help="only print the table of this report")
    args = p.parse_args()
    if args.table:
        print_table([json.loads(line) for line in args.table.read_text().splitlines()])
        return
    if args.quick:
        args.tenants, args.conversations, args.rounds, args.system_len, args.num_blocks = 3, 2, 3, 96, 40
        args.hidden, args.layers = 64, 2
    policies = args.policies.split(",")
    if args.dynamo_python and "dynamo" not in policies:
        policies.append("dynamo")
    config = model_config(args.hidden, args.layers)
    reports = [run_policy(policy, arrival, args, config) for arrival in args.arrivals.split(",") for policy in policies]
    for r in reports:
        base = next((b for b in reports if b["arrival"] == r["arrival"] and b["policy"] == "round_robin"), r)
        r["ttft_vs_round_robin"] = r["ttft_ms_mean"] / base["ttft_ms_mean"]
    print_table(reports)
    if args.json:
        with open(args.json, "w") as f:
            for r in reports:
                f.write(json.dumps({**r, "args": vars(args) | {"json": str(args.json), "table": None}}) + "\n")
    sys.stdout.flush()
    os._exit(0)  # replicas' publisher threads linger 0 s; nothing else to wait for


def print_table(reports: list[dict]) -> None:
    """The table of docs/scale-out.md ("Figures"): one row per (arrival, policy)."""
    print("| arrival | policy | hit rate | TTFT p50 ms | TTFT mean ms | mean TTFT vs round-robin | requests per replica | evicted blocks |")
    print("|---|---|---:|---:|---:|---:|---|---:|")
    for r in reports:
        print(f"| {r['arrival']} | {r['policy']} | {r['hit_rate']:.3f} | {r['ttft_ms_p50']:.1f} | {r['ttft_ms_mean']:.1f} "
              f"| {r['ttft_vs_round_robin']:.2f} | {r['per_replica']} | {r['evicted_blocks']} |")


if __name__ == "__main__":
    main()
