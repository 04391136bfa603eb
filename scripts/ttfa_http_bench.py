#!/usr/bin/env python3
"""Time to first audio through HTTP: multi-round voice chats against a fleet, spoken replies out.

Each tenant has a system prompt and one conversation of ``--rounds`` rounds; each round's user
turn carries an audio (a seeded 16 kHz WAV as an ``input_audio`` part), every other tenant's
first and third rounds an image too (``image_url``), and a question; the reply comes back as
speech (``"modalities": ["text", "audio"]``, streamed PCM16), and its transcript goes into the
next round as the assistant's turn. ``--concurrency`` conversations are in flight at once (each
conversation's rounds one after the other, each turn sent after a seeded pause of 0 to
``--think-ms``: the user's, which also keeps the conversations from moving in lockstep, where
round-robin would send each tenant to the same worker every round by accident). Every (router,
caching) pair runs on a fresh fleet (``omniprefix.fleet.Fleet``: Dynamo's frontend, N
``omniprefix.worker`` processes, the edge that routes spoken chats with Dynamo's KV router); each
concurrency sends conversations of its own (their prompts seeded by it), so one run does not warm
the next.

Per request: TTFA (send to the first ``delta.audio.data`` chunk), time to the last audio chunk,
audio seconds (samples / the checkpoint's rate) and the real-time factor (audio seconds / wall
seconds to the last chunk). Per run: the workers' token hit rates of both stages
(``omniprefix_prefix_cache_{hits,queries}_total`` and ``omniprefix_talker_prefix_cache_*``), read
before and after. ``--json FILE`` appends one object per run; ``--table FILE`` prints the
Markdown table of such a file; ``--figure FILE.svg`` draws TTFA p50 against concurrency from it.

    python scripts/make_bench_omni.py    # the bench-size checkpoint, target/bench_omni (~20 s)
    python scripts/ttfa_http_bench.py --json docs/reports/ttfa_http_bench.jsonl    # 3 runs, ~20 min
    python scripts/ttfa_http_bench.py --table docs/reports/ttfa_http_bench.jsonl
    python scripts/ttfa_http_bench.py --figure docs/figures/ttfa_http.svg docs/reports/ttfa_http_bench.jsonl

The checkpoint is ``scripts/make_bench_omni.py``'s by default: ``bench ttfa``'s sizes with random
weights, where a request does enough work for caching and batching to show (on the tiny fixture a
request is 20-150 ms of mostly fixed costs and a reply ~17 ms of audio).

Run it in the venv of ``scripts/install_fleet.sh``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import sys
import threading
import time
import urllib.request
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import numpy as np

from cpuinfo import cpu_model_and_flags

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "target" / "bench_omni"  # scripts/make_bench_omni.py
IMAGE = REPO / "fixtures" / "media" / "image_a.png"
WORDS = ("voice", "river", "mountain", "window", "garden", "music", "engine", "letter", "morning", "signal",
         "market", "island", "paper", "bridge", "summer", "forest", "silver", "planet", "doctor", "coffee")


def tone_wav(seed: int, seconds: float = 1.0, rate: int = 16000) -> str:
    """A seeded WAV (a tone plus noise, 16 kHz mono PCM16: the feature extractor's rate), base64."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    wav = 0.3 * np.sin(2 * np.pi * rng.uniform(150, 900) * t) + 0.02 * rng.standard_normal(t.size)
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(wav, -1, 1) * 32767).astype("<i2").tobytes())
    return base64.b64encode(out.getvalue()).decode()


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def conversation(seed: int, tenant: int, rounds: int, system_words: int) -> list[dict[str, Any]]:
    """The user turns of one tenant's conversation (the assistant's come from the replies)."""
    rng = random.Random(seed * 1000 + tenant)
    image = "data:image/png;base64," + base64.b64encode(IMAGE.read_bytes()).decode()
    turns = []
    for r in range(rounds):
        parts: list[dict[str, Any]] = [{"type": "input_audio",
                                        "input_audio": {"data": tone_wav(seed * 1000 + tenant * 10 + r),
                                                        "format": "wav"}}]
        if tenant % 2 == 0 and r in (0, 2):
            parts.append({"type": "image_url", "image_url": {"url": image}})
        parts.append({"type": "text", "text": text(rng, 12) + "?"})
        turns.append({"role": "user", "content": parts})
    system = {"role": "system", "content": f"Tenant {seed}-{tenant}. " + text(rng, system_words)}
    return [system] + turns


def speak(url: str, model: str, messages: list[dict[str, Any]], options: dict[str, Any]) -> dict[str, Any]:
    """One streamed spoken request: its timings, audio and transcript."""
    body = {"model": model, "messages": messages, "modalities": ["text", "audio"],
            "audio": {"voice": "ethan", "format": "pcm16"}, "stream": True, **options}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    sent = time.perf_counter()
    first = last = None
    samples, transcript, finish = 0, "", None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']}")
            choice = chunk["choices"][0]
            audio = choice["delta"].get("audio") or {}
            if audio.get("data"):
                now = time.perf_counter()
                first = now if first is None else first
                last = now
                samples += len(base64.b64decode(audio["data"])) // 2
            transcript += audio.get("transcript", "")
            finish = choice["finish_reason"] or finish
    done = time.perf_counter()
    return {"ttfa_s": None if first is None else first - sent, "last_audio_s": None if last is None else last - sent,
            "total_s": done - sent, "samples": samples, "transcript": transcript, "finish": finish}


def run_trace(url: str, model: str, concurrency: int, tenants: int, rounds: int, system_words: int,
              options: dict[str, Any], rate: int, think_s: float = 0.0) -> list[dict[str, Any]]:
    """``max(tenants, concurrency)`` conversations, ``concurrency`` in flight; per request its row."""
    count = max(tenants, concurrency)
    convs = [conversation(concurrency, t, rounds, system_words) for t in range(count)]
    rows: list[dict[str, Any]] = []
    lock = threading.Lock()

    def one(t: int) -> None:
        history = [convs[t][0]]
        pauses = random.Random(concurrency * 1000 + t + 500)
        for r in range(rounds):
            time.sleep(pauses.uniform(0, think_s))
            history.append(convs[t][1 + r])
            row = speak(url, model, history, options)
            history.append({"role": "assistant", "content": row["transcript"]})
            row.update(tenant=t, round=r + 1, audio_s=row["samples"] / rate)
            row["rtf"] = row["audio_s"] / row["last_audio_s"] if row["last_audio_s"] else None
            with lock:
                rows.append(row)

    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(one, t) for t in range(count)]:
            f.result()  # a failed request fails the run
    return rows


def hit_rates(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, Optional[float]]:
    def rate(hits: str, queries: str) -> Optional[float]:
        h = sum(a.get(hits, 0.0) - b.get(hits, 0.0) for a, b in zip(after, before))
        q = sum(a.get(queries, 0.0) - b.get(queries, 0.0) for a, b in zip(after, before))
        return h / q if q else None

    engine_ttfa = rate("omniprefix_time_to_first_audio_seconds_sum", "omniprefix_time_to_first_audio_seconds_count")
    return {"thinker_hit_rate": rate("omniprefix_prefix_cache_hits_total", "omniprefix_prefix_cache_queries_total"),
            "talker_hit_rate": rate("omniprefix_talker_prefix_cache_hits_total",
                                    "omniprefix_talker_prefix_cache_queries_total"),
            # The engines' own TTFA (submission to the first sample), mean: the rest is HTTP, the
            # edge (template, tokenizer, router) and the worker's media decoding.
            "engine_ttfa_mean_ms": _ms(engine_ttfa)}


def pct(values: list[float], q: float) -> Optional[float]:
    return float(np.percentile(values, q)) if values else None


def summary(rows: list[dict[str, Any]], **where: Any) -> dict[str, Any]:
    ttfa = [r["ttfa_s"] for r in rows if r["ttfa_s"] is not None]
    later = [r["ttfa_s"] for r in rows if r["ttfa_s"] is not None and r["round"] >= 2]
    last = [r["last_audio_s"] for r in rows if r["last_audio_s"] is not None]
    rtf = [r["rtf"] for r in rows if r["rtf"] is not None]
    return {**where, "requests": len(rows), "no_audio": sum(r["ttfa_s"] is None for r in rows),
            "ttfa_p50_ms": _ms(pct(ttfa, 50)), "ttfa_p99_ms": _ms(pct(ttfa, 99)),
            "ttfa_round2plus_p50_ms": _ms(pct(later, 50)), "last_audio_p50_ms": _ms(pct(last, 50)),
            "audio_s_total": sum(r["audio_s"] for r in rows), "rtf_p50": pct(rtf, 50)}


def _ms(s: Optional[float]) -> Optional[float]:
    return None if s is None else round(1000 * s, 2)


def machine() -> str:
    cpu, flags = cpu_model_and_flags()
    return f"{cpu}, {os.cpu_count()} cores ({' '.join(flags)})"


def bench(args: argparse.Namespace) -> None:
    from omniprefix.fleet import Fleet, worker_metrics
    from omniprefix.ports import free_port

    model = Path(args.model).resolve()
    options = {"max_tokens": args.reply_tokens, "temperature": 0,
               "talker": {"temperature": 0, "max_tokens": args.talker_tokens}}
    where = machine()
    pool = ["--num-blocks", str(args.num_blocks)] if args.num_blocks else []
    rate = int(json.loads((model / "audio_reference.json").read_text()).get("sample_rate", 24000)) \
        if (model / "audio_reference.json").exists() else 24000
    for run, router, cache in ((k, r, c) for k in range(args.runs) for r in args.routers for c in args.cache):
        fleet = Fleet(model, args.workers, router, free_port(), worker_args=["--cache", cache, *pool])
        try:
            url = fleet.start(timeout_s=180)["frontend"]
            # One request first: the first call of each worker loads its encoder's towers.
            run_trace(url, model.name, 1, 1, 1, 8, options, rate)
            for c in args.concurrency:
                before = [worker_metrics(w["metrics"]) for w in fleet.workers]
                started = time.perf_counter()
                rows = run_trace(url, model.name, c, args.tenants, args.rounds, args.system_words, options, rate,
                                 args.think_ms / 1000)
                wall = time.perf_counter() - started
                after = [worker_metrics(w["metrics"]) for w in fleet.workers]
                result = summary(rows, router=router, cache=cache, concurrency=c, workers=args.workers,
                                 tenants=max(args.tenants, c), rounds=args.rounds, model=model.name,
                                 think_ms=args.think_ms, run=run, num_blocks=args.num_blocks,
                                 machine=where, wall_s=round(wall, 3))
                result.update(hit_rates(before, after))
                result["audio_s_per_wall_s"] = result["audio_s_total"] / wall
                print(json.dumps(result), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(result) + "\n")
        finally:
            fleet.stop()


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The objects of a ``--json`` file, one per (run, router, caching, c)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_runs(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """``rows`` (of :func:`read_rows`), one per (router, caching, c): each figure the median over
    the runs (``--runs``; the machine moves single runs by up to 2 x), and the number of runs."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["router"], r["cache"], r["concurrency"]), []).append(r)
    merged = []
    for runs in groups.values():
        row = dict(runs[0])
        for key, value in runs[0].items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("concurrency", "run"):
                values = [r[key] for r in runs if r.get(key) is not None]
                if len(set(values)) > 1:
                    row[key] = float(np.median(values))
        merged.append(row)
    return merged, len({r.get("run", 0) for r in rows})


def targets(rows: list[dict[str, Any]]) -> list[tuple[str, list[float], float]]:
    """The issue's three ratios in each run of ``rows`` (of :func:`read_rows`): (what, per run, the target)."""
    at = {(r.get("run", 0), r["router"], r["cache"], r["concurrency"]): r for r in rows}
    runs = sorted({r.get("run", 0) for r in rows})

    def ratio(num: tuple[str, str, int], den: tuple[str, str, int], key: str) -> list[float]:
        return [at[(k, *num)][key] / at[(k, *den)][key] for k in runs
                if (k, *num) in at and (k, *den) in at and at[(k, *num)][key] and at[(k, *den)][key]]

    top = max(r["concurrency"] for r in rows)
    return [("caching on / off, rounds 2-4, kv, c=1", ratio(("kv", "on", 1), ("kv", "off", 1), "ttfa_round2plus_p50_ms"),
             0.35),
            (f"c={top} / c=1, kv, caching on", ratio(("kv", "on", top), ("kv", "on", 1), "ttfa_p50_ms"), 2.5),
            ("kv / round-robin, c=4, caching on", ratio(("kv", "on", 4), ("round-robin", "on", 4), "ttfa_p50_ms"), 0.6)]


def table(path: Path) -> str:
    every = read_rows(path)
    rows, runs = load_runs(every)
    where = (f"{rows[0]['machine']}; {rows[0]['model']}, {rows[0]['workers']} workers, {rows[0]['rounds']} rounds, "
             f"{rows[0]['tenants']} tenants; median of {runs} run{'s' if runs > 1 else ''}") if rows else ""
    out = [where, "",
           "| router | caching | c | TTFA p50 ms | TTFA p99 ms | TTFA p50 rounds 2-4 ms | engine TTFA mean ms | "
           "last audio p50 ms | RTF p50 | thinker hits | talker hits | no audio |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        out.append(f"| {r['router']} | {r['cache']} | {r['concurrency']} | {fmt(r['ttfa_p50_ms'], '.1f')} | "
                   f"{fmt(r['ttfa_p99_ms'], '.1f')} | {fmt(r['ttfa_round2plus_p50_ms'], '.1f')} | "
                   f"{fmt(r.get('engine_ttfa_mean_ms'), '.1f')} | "
                   f"{fmt(r['last_audio_p50_ms'], '.1f')} | {fmt(r['rtf_p50'], '.2f')} | "
                   f"{fmt(r['thinker_hit_rate'], '.3f')} | {fmt(r['talker_hit_rate'], '.3f')} | {fmt(r['no_audio'], '.0f')} |")
    out += ["", "| ratio of TTFA p50 | each run | median | target |", "|---|---|---:|---:|"]
    for what, values, goal in targets(every):
        each = ", ".join(f"{v:.2f}" for v in values)
        out.append(f"| {what} | {each} | {fmt(float(np.median(values)) if values else None, '.2f')} | {goal} |")
    return "\n".join(out)


def figure(path: Path, out: Path) -> None:
    """TTFA p50 against concurrency, one line per (router, caching), as an SVG (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, runs = load_runs(read_rows(path))
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({(r["router"], r["cache"]) for r in rows}):
        pts = sorted((r["concurrency"], r["ttfa_p50_ms"]) for r in rows if (r["router"], r["cache"]) == key
                     and r["ttfa_p50_ms"] is not None)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key[0]}, caching {key[1]}")
    ax.set_xlabel("conversations in flight")
    ax.set_ylabel("TTFA p50 (ms)")
    ax.set_xticks(sorted({r["concurrency"] for r in rows}))
    ax.set_title(f"Time to first audio through HTTP ({rows[0]['workers']} workers, median of {runs} runs)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(MODEL),
                   help="a checkpoint with a talker (default: scripts/make_bench_omni.py's; the tiny fixture: "
                        "fixtures/tiny/omni_audio)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tenants", type=int, default=8, help="conversations (at least --concurrency)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--system-words", type=int, default=150, help="words in each tenant's system prompt")
    p.add_argument("--reply-tokens", type=int, default=16)
    p.add_argument("--talker-tokens", type=int, default=32, help="codec frames a reply takes at most")
    p.add_argument("--num-blocks", type=int, help="KV blocks per worker (16 tokens each; default: the worker's)")
    p.add_argument("--runs", type=int, default=3, help="sweeps, one after another (the table shows medians)")
    p.add_argument("--think-ms", type=float, default=300, help="each turn waits a seeded 0 to this many ms")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    p.add_argument("--cache", type=lambda s: s.split(","), default=["on", "off"])
    p.add_argument("--routers", type=lambda s: s.split(","), default=["kv", "round-robin"])
    p.add_argument("--json", type=Path, help="append one JSON line per run here")
    p.add_argument("--table", type=Path, help="print the Markdown table of a --json file, and exit")
    p.add_argument("--figure", nargs=2, type=Path, metavar=("OUT_SVG", "JSONL"),
                   help="draw TTFA p50 against concurrency from a --json file, and exit")
    args = p.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    if args.figure:
        figure(args.figure[1], args.figure[0])
        return 0
    if not (Path(args.model) / "config.json").exists():
        p.error(f"no checkpoint at {args.model}: run scripts/make_bench_omni.py first, or name one with --model")
    bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
