#!/usr/bin/env python3
"""KV-aware routing against round-robin through Dynamo's OpenAI frontend, over HTTP.

The text counterpart of ``scripts/route_bench.py``: a multi-tenant, multi-round chat trace
goes as ``/v1/chat/completions`` requests through a fleet (``omniprefix.fleet.Fleet``: Dynamo's
frontend and N ``omniprefix.worker`` processes on loopback), once with ``--router kv`` and once
with ``round-robin``, each on a fresh fleet. Each tenant has a system prompt; each of its
conversations starts with the same first question and sends its whole history again every
round, the assistant's replies included. Requests go one at a time.

The token hit rate (cached prompt tokens / prompt tokens) and the mean TTFT come from the
workers' own metrics (``omniprefix_prefix_cache_{hits,queries}_total``,
``omniprefix_time_to_first_token_seconds``), read before and after the trace; requests per
worker from each worker's TTFT count. Prints a table; ``--json FILE`` writes one object per
policy. Run it in the venv of ``scripts/install_fleet.sh``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from omniprefix.fleet import Fleet, worker_metrics
from omniprefix.ports import free_port

REPO = Path(__file__).resolve().parent.parent


def widened_checkpoint(src: Path, dst: Path, hidden: int, layers: int, seed: int) -> Path:
    """A Qwen3 checkpoint with ``src``'s tokenizer and vocabulary and seeded random weights
    of ``hidden`` width and ``layers`` layers (head_dim 64, GQA 2:1): big enough that prefill,
    not the HTTP path, sets the TTFT."""
    config = json.loads((src / "config.json").read_text())
    head_dim = 64
    heads = hidden // head_dim
    config.update(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads,
                  num_key_value_heads=max(1, heads // 2), head_dim=head_dim, num_hidden_layers=layers,
                  layer_types=["full_attention"] * layers)
    vocab, kv = config["vocab_size"], config["num_key_value_heads"] * head_dim
    rng = np.random.default_rng(seed)

    def dense(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)

    weights = {"model.embed_tokens.weight": dense(vocab, hidden), "lm_head.weight": dense(vocab, hidden),
               "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        layer = f"model.layers.{i}"
        weights.update({
            f"{layer}.input_layernorm.weight": np.ones(hidden, np.float32),
            f"{layer}.post_attention_layernorm.weight": np.ones(hidden, np.float32),
            f"{layer}.self_attn.q_proj.weight": dense(heads * head_dim, hidden),
            f"{layer}.self_attn.k_proj.weight": dense(kv, hidden),
            f"{layer}.self_attn.v_proj.weight": dense(kv, hidden),
            f"{layer}.self_attn.o_proj.weight": dense(hidden, heads * head_dim),
            f"{layer}.self_attn.q_norm.weight": np.ones(head_dim, np.float32),
            f"{layer}.self_attn.k_norm.weight": np.ones(head_dim, np.float32),
            f"{layer}.mlp.gate_proj.weight": dense(2 * hidden, hidden),
            f"{layer}.mlp.up_proj.weight": dense(2 * hidden, hidden),
            f"{layer}.mlp.down_proj.weight": dense(hidden, 2 * hidden),
        })
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(dst / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def words(rng: random.Random, vocabulary: list[str], n: int) -> str:
    return " ".join(rng.choice(vocabulary) for _ in range(n))


def trace(args) -> list[tuple[int, int, str, str]]:
    """(tenant, conversation, system prompt, user turn) in sending order: round by round."""
    vocabulary = sorted(set((REPO / "fixtures/tokenizer_corpus.txt").read_text().lower().split()))
    rng = random.Random(args.seed)
    first = words(rng, vocabulary, args.turn_words)
    systems = [words(rng, vocabulary, args.system_words) for _ in range(args.tenants)]
    turns = {(t, c): [first] + [words(rng, vocabulary, args.turn_words) for _ in range(args.rounds - 1)]
             for t in range(args.tenants) for c in range(args.conversations)}
    return [(t, c, systems[t], turns[t, c][r]) for r in range(args.rounds)
            for t in range(args.tenants) for c in range(args.conversations)]


def run_policy(router: str, model: Path, args) -> dict:
    fleet = Fleet(model, args.workers, router, free_port(),
                  worker_args=["--num-blocks", str(args.num_blocks)])
    try:
        ready = fleet.start()
        before = [worker_metrics(w["metrics"]) for w in ready["workers"]]
        histories: dict[tuple[int, int], list[dict]] = {}
        failed = 0
        started = time.monotonic()
        for tenant, conversation, system, question in trace(args):
            messages = histories.setdefault((tenant, conversation), [{"role": "system", "content": system}])
            messages.append({"role": "user", "content": question})
            body = {"model": ready["model"], "messages": messages, "max_tokens": args.reply, "temperature": 0,
                    "ignore_eos": True}
            req = urllib.request.Request(ready["frontend"] + "/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    # None when the random model's reply held nothing but reasoning tags.
                    reply = json.loads(r.read())["choices"][0]["message"].get("content") or ""
            except OSError as e:
                failed += 1
                body = e.read().decode(errors="replace") if isinstance(e, urllib.error.HTTPError) else ""
                print(f"request failed: {e} {body}", file=sys.stderr)
                reply = ""
            messages.append({"role": "assistant", "content": reply})
        wall_s = time.monotonic() - started
        after = [worker_metrics(w["metrics"]) for w in ready["workers"]]
    finally:
        fleet.stop()

    def delta(name: str) -> list[float]:
        return [a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before)]

    queries = sum(delta("omniprefix_prefix_cache_queries_total"))
    hits = sum(delta("omniprefix_prefix_cache_hits_total"))
    ttft_count = delta("omniprefix_time_to_first_token_seconds_count")
    ttft_sum = sum(delta("omniprefix_time_to_first_token_seconds_sum"))
    return {"router": router, "workers": args.workers, "requests": int(sum(ttft_count)), "failed": failed,
            "prompt_tokens": int(queries), "cached_tokens": int(hits), "hit_rate": hits / queries if queries else 0.0,
            "ttft_ms_mean": 1000 * ttft_sum / max(1.0, sum(ttft_count)), "per_worker": [int(n) for n in ttft_count],
            "wall_s": wall_s, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=REPO / "fixtures/tiny/qwen3_dense",
                   help="a Qwen3 checkpoint with a tokenizer (default: the tiny one, widened)")
    p.add_argument("--hidden", type=int, default=512, help="widen --model to this width (0: as it is)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--num-blocks", type=int, default=160, help="KV blocks per worker (16 tokens each)")
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--system-words", type=int, default=170, help="about 500 tokens")
    p.add_argument("--turn-words", type=int, default=16, help="about 40 tokens")
    p.add_argument("--reply", type=int, default=16, help="tokens per reply")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="append one JSON object per policy")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="route-http-") as tmp:
        model = args.model
        if args.hidden:
            model = widened_checkpoint(args.model, Path(tmp) / args.model.name, args.hidden, args.layers, args.seed)
        reports = [run_policy(router, model, args) for router in ("kv", "round-robin")]
    rr = reports[1]
    print("| router | requests | failed | hit rate | mean TTFT ms | vs round-robin | requests per worker |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in reports:
        r["ttft_vs_round_robin"] = r["ttft_ms_mean"] / rr["ttft_ms_mean"] if rr["ttft_ms_mean"] else None
        print(f"| {r['router']} | {r['requests']} | {r['failed']} | {r['hit_rate']:.3f} | {r['ttft_ms_mean']:.2f} | "
              f"{r['ttft_vs_round_robin']:.2f} | {r['per_worker']} |")
    if args.json:
        with args.json.open("a") as f:
            for r in reports:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
