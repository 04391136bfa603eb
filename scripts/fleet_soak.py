"""A bounded load test of a 2-worker fleet: N concurrent clients, T seconds of multi-round chats.

    python scripts/fleet_soak.py [--clients 32] [--seconds 600] [--model fixtures/tiny/omni_thinker]
        [--workers 2] [--rounds 3] [--max-tokens 16] [--json PATH]

Starts ``python -m omniprefix.fleet`` (loopback, the kv router, through its edge) and runs
``--clients`` asyncio clients until ``--seconds`` pass. Each client holds chats of ``--rounds``
user turns, streamed (SSE) with temperature 0; some turns carry an image (a data URL from a pool
of seeded PNGs, so repeats hit the encoder and prefix caches) and every reply joins the chat as
the assistant's turn. The conversations come from a fixed set of seeded scripts, so a greedy
fleet gives each the same replies and many requests repeat a prefix.

Checks, each reported in the JSON line it prints (exit status 1 if one fails):

* no failed request (a non-200, an error chunk, a timeout);
* every distinct request's reply equals ``Engine.generate`` on the same ids and images (the chat
  template rendered by the tokenizer, greedy, the tokenizer's and checkpoint's eos as stops, as
  the worker does), computed after the load so it does not compete with it; and its
  ``prompt_tokens`` equals the ids' length (the frontend rendered the same prompt);
* each worker's RSS (``/proc/PID/status`` VmRSS, sampled every second) flat after the warm-up:
  the least-squares slope in MiB/min under ``--max-rss-slope``;
* running and waiting requests back to 0 at the end;
* metrics that add up: per worker prefix-cache hits <= queries, and time-to-first-token
  observations over the workers == the requests served (each counted once).

Client-side TTFT (request sent to first content chunk) and ITL (between content chunks) p50/p99
are in the report, and the workers' own (their histograms' buckets): a fast model's chunks
arrive coalesced, so the client's ITL p50 is near 0 and the workers' is the decode step. Every loop is bounded by the clock, every request by a timeout, and the fleet
is stopped (SIGTERM, then SIGKILL to its group) whatever happens. Needs the fleet venv
(``scripts/install_fleet.sh``) with pillow.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import random
import selectors
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("cache prefix token image model reply worker fleet block route engine tower layer batch queue "
         "stream chunk prompt context window").split()
#: Seconds to wait for the fleet's ready line, for one request, and for the drain at the end.
READY_S, REQUEST_S, DRAIN_S = 120.0, 120.0, 30.0
RUNNING, WAITING = "omniprefix_num_requests_running", "omniprefix_num_requests_waiting"
HITS, QUERIES = "omniprefix_prefix_cache_hits_total", "omniprefix_prefix_cache_queries_total"
TTFT, ITL = "omniprefix_time_to_first_token_seconds", "omniprefix_inter_token_latency_seconds"
TTFT_COUNT = TTFT + "_count"
HISTOGRAMS = (TTFT, ITL)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--model", type=Path, default=ROOT / "fixtures" / "tiny" / "omni_thinker")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="user turns per chat")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--scripts", type=int, default=24, help="distinct conversations the clients draw from")
    p.add_argument("--images", type=int, default=6, help="distinct images in the pool")
    p.add_argument("--image-every", type=int, default=3, help="about one turn in this many carries an image")
    p.add_argument("--warm-up", type=float, help="seconds before the RSS slope is measured (default: a fifth, 15 s to half the run)")
    p.add_argument("--max-rss-slope", type=float, default=2.0, help="MiB/min a worker's RSS may grow after warm-up")
    p.add_argument("--max-verify", type=int, default=400, help="distinct requests checked against Engine.generate")
    p.add_argument("--past-the-edge", action="store_true",
                   help="send to Dynamo's frontend directly (the ready line's dynamo_frontend), to measure the edge's cost")
    p.add_argument("--json", type=Path, help="also write the report here")
    args = p.parse_args(argv)
    if args.clients < 1 or args.seconds <= 0 or args.rounds < 1 or args.max_tokens < 1:
        p.error("--clients, --seconds, --rounds and --max-tokens must be positive")
    return args


# -- the fleet -------------------------------------------------------------------------------------

class FleetProcess:
    """``python -m omniprefix.fleet`` in its own process group, and its ready line."""

    def __init__(self, model: Path, workers: int):
        self.proc = subprocess.Popen([sys.executable, "-m", "omniprefix.fleet", "--model", str(model), "--workers",
                                      str(workers), "--router", "kv", "--port", "0"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout=READY_S)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.stop()
            raise SystemExit(f"the fleet did not start: {self.proc.stderr.read().decode(errors='replace')[-2000:]}")
        self.info = json.loads(line)

    def stop(self) -> None:
        from omniprefix.fleet import terminate

        terminate(self.proc)


def rss_mib(pid: int) -> Optional[float]:
    try:
        for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def slope_per_min(samples: list[tuple[float, float]]) -> Optional[float]:
    """Least-squares slope of (seconds, MiB), in MiB per minute."""
    if len(samples) < 3:
        return None
    ts, ys = [t for t, _ in samples], [y for _, y in samples]
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return 60 * sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var if var else None


def metrics(fleet: FleetProcess) -> list[dict[str, float]]:
    from omniprefix.fleet import worker_metrics

    return [worker_metrics(w["metrics"]) for w in fleet.info["workers"]]


def buckets(fleet: FleetProcess, name: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts by upper bound, summed over the workers."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    out: dict[float, float] = {}
    for w in fleet.info["workers"]:
        with urllib.request.urlopen(w["metrics"], timeout=10) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name + "_bucket":
                    le = float(sample.labels["le"])
                    out[le] = out.get(le, 0.0) + sample.value
    return out


def bucket_quantiles(after: dict[float, float], before: dict[float, float]) -> dict[str, Optional[float]]:
    """p50 and p99 of the observations between two bucket snapshots, as the upper bound (ms) of
    the bucket they fall in (the workers' own timing, not coalesced by the network)."""
    delta = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = delta[-1][1] if delta else 0
    pick = lambda q: next((round(1000 * le, 2) for le, c in delta if c >= q * total), None)  # noqa: E731
    return {"p50_le_ms": pick(0.50) if total else None, "p99_le_ms": pick(0.99) if total else None, "n": total}


# -- the conversations -----------------------------------------------------------------------------

def png_url(seed: int) -> str:
    from PIL import Image

    rng = random.Random(seed)
    out = io.BytesIO()
    Image.frombytes("RGB", (56, 40), bytes(rng.randrange(256) for _ in range(56 * 40 * 3))).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def script(seed: int, rounds: int, images: list[str], image_every: int) -> list[dict]:
    """One conversation's user turns: a few words, an image in some."""
    rng = random.Random(seed)
    turns = []
    for _ in range(rounds):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(3, 12))) + "?"
        if rng.randrange(image_every) == 0:
            url = images[rng.randrange(len(images))]
            turns.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": text}]})
        else:
            turns.append({"role": "user", "content": text})
    return turns


class Stats:
    def __init__(self) -> None:
        self.ok = 0
        self.failures: list[str] = []
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.prompt_tokens = 0
        #: Distinct requests (their messages as JSON) -> (reply text, prompt tokens).
        self.seen: dict[str, tuple[str, int]] = {}
        self.mismatched_repeats = 0


async def one_request(session: Any, url: str, model: str, messages: list[dict], max_tokens: int,
                      stats: Stats) -> Optional[str]:
    """A streamed chat; returns the reply text (None on failure, recorded)."""
    import aiohttp

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    last, parts, usage = None, [], None
    try:
        async with session.post(url + "/v1/chat/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=REQUEST_S)) as r:
            if r.status != 200:
                stats.failures.append(f"HTTP {r.status}: {(await r.text())[:200]}")
                return None
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    stats.failures.append(f"error chunk: {str(chunk)[:200]}")
                    return None
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        now = time.monotonic()
                        (stats.ttft if last is None else stats.itl).append(now - (sent if last is None else last))
                        last = now
                        parts.append(text)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        stats.failures.append(f"{type(e).__name__}: {e}"[:200])
        return None
    reply = "".join(parts)
    stats.ok += 1
    prompt = (usage or {}).get("prompt_tokens", -1)
    stats.prompt_tokens += max(prompt, 0)
    key = json.dumps(messages, sort_keys=True)
    if key in stats.seen and stats.seen[key][0] != reply:
        stats.mismatched_repeats += 1
    stats.seen.setdefault(key, (reply, prompt))
    return reply


async def client(k: int, url: str, model: str, scripts: list[list[dict]], args: argparse.Namespace,
                 deadline: float, stats: Stats) -> None:
    import aiohttp

    rng = random.Random(1000 + k)
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            messages: list[dict] = []
            for turn in scripts[rng.randrange(len(scripts))]:
                if time.monotonic() >= deadline:
                    return
                messages.append(turn)
                reply = await one_request(session, url, model, messages, args.max_tokens, stats)
                if reply is None:
                    break
                messages.append({"role": "assistant", "content": reply})


async def sample_rss(pids: dict[str, int], deadline: float, out: dict[str, list[tuple[float, float]]]) -> None:
    start = time.monotonic()
    while time.monotonic() < deadline:
        for label, pid in pids.items():
            mib = rss_mib(pid)
            if mib is not None:
                out.setdefault(label, []).append((time.monotonic() - start, mib))
        await asyncio.sleep(1.0)


async def load(url: str, model: str, pids: dict[str, int], scripts: list[list[dict]], args: argparse.Namespace,
               stats: Stats, rss: dict) -> None:
    deadline = time.monotonic() + args.seconds
    tasks = [client(k, url, model, scripts, args, deadline, stats) for k in range(args.clients)]
    # A hard bound past the deadline: the last requests' timeout and a margin.
    await asyncio.wait_for(asyncio.gather(sample_rss(pids, deadline, rss), *tasks), args.seconds + REQUEST_S + 30)


# -- the checks ------------------------------------------------------------------------------------

def verify(model_dir: Path, stats: Stats, max_tokens: int, limit: int) -> tuple[int, list[str]]:
    """Replays up to ``limit`` distinct requests on ``Engine.generate``; returns (checked, problems)."""
    import omniprefix
    from omniprefix.encoder import encoder_for
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    engine = omniprefix.Engine.from_dir(model_dir)
    encoder = encoder_for(model_dir)
    stop = sorted({tokenizer.eos_token_id, *engine.eos_token_ids})
    problems, checked = [], 0
    for key, (reply, prompt_tokens) in list(stats.seen.items())[:limit]:
        messages = json.loads(key)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        urls = [p["image_url"]["url"] for m in messages if isinstance(m["content"], list)
                for p in m["content"] if p.get("type") == "image_url"]
        items = [encoder.from_data_url(u, "image", f"image {i}") for i, u in enumerate(urls)] or None
        want = engine.generate(ids, items, encoder=encoder if items else None, max_tokens=max_tokens,
                               temperature=0.0, stop=stop).tokens
        want_text = tokenizer.decode(want, skip_special_tokens=True)
        checked += 1
        if prompt_tokens != len(ids):
            problems.append(f"prompt_tokens {prompt_tokens} != {len(ids)} ids: {key[:120]}")
        elif reply != want_text:
            problems.append(f"reply {reply!r} != Engine.generate's {want_text!r}: {key[:120]}")
    return checked, problems


def percentiles(values: list[float]) -> dict[str, Optional[float]]:
    if not values:
        return {"p50_ms": None, "p99_ms": None, "n": 0}
    values = sorted(values)
    pick = lambda q: round(1000 * values[min(len(values) - 1, int(q * len(values)))], 2)  # noqa: E731
    return {"p50_ms": pick(0.50), "p99_ms": pick(0.99), "n": len(values)}


def drained(fleet: FleetProcess) -> tuple[bool, list[dict[str, float]]]:
    deadline = time.monotonic() + DRAIN_S
    while True:
        now = metrics(fleet)
        if all(m.get(RUNNING, 0) == 0 and m.get(WAITING, 0) == 0 for m in now) or time.monotonic() > deadline:
            return all(m.get(RUNNING, 0) == 0 and m.get(WAITING, 0) == 0 for m in now), now
        time.sleep(0.2)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    images = [png_url(seed) for seed in range(args.images)]
    scripts = [script(seed, args.rounds, images, args.image_every) for seed in range(args.scripts)]
    stats, rss = Stats(), {}
    started = time.monotonic()
    fleet = FleetProcess(args.model, args.workers)
    try:
        # The workers, and the fleet's own process, where the edge runs.
        pids = {f"worker{k}": w["pid"] for k, w in enumerate(fleet.info["workers"])} | {"edge": fleet.proc.pid}
        before = metrics(fleet)
        hist_before = {name: buckets(fleet, name) for name in HISTOGRAMS}
        url = fleet.info["dynamo_frontend" if args.past_the_edge else "frontend"]
        asyncio.run(load(url, fleet.info["model"], pids, scripts, args, stats, rss))
        idle, after = drained(fleet)
        hist = {name: bucket_quantiles(buckets(fleet, name), hist_before[name]) for name in HISTOGRAMS}
    finally:
        fleet.stop()
    verify_started = time.monotonic()
    checked, problems = verify(args.model, stats, args.max_tokens, args.max_verify)
    verify_s = time.monotonic() - verify_started

    # A fifth of the run, but at least 15 s (the caches fill in about that) and at most half.
    warm = min(max(args.seconds / 5, 15.0), args.seconds / 2) if args.warm_up is None else args.warm_up
    slopes = {label: slope_per_min([s for s in samples if s[0] >= warm]) for label, samples in rss.items()}
    ttft_served = sum(a.get(TTFT_COUNT, 0) - b.get(TTFT_COUNT, 0) for a, b in zip(after, before))
    cache = [{"queries": a[QUERIES] - b[QUERIES], "hits": a[HITS] - b[HITS]} for a, b in zip(after, before)]
    checks = {
        "no_failed_request": not stats.failures,
        "replies_equal_engine_generate": not problems and stats.mismatched_repeats == 0,
        "rss_flat": all(s is not None and s <= args.max_rss_slope for s in slopes.values()),
        "idle_at_the_end": idle,
        "hits_at_most_queries": all(c["hits"] <= c["queries"] for c in cache),
        "requests_counted_once": ttft_served == stats.ok,
        "queries_cover_the_prompts": sum(c["queries"] for c in cache) >= stats.prompt_tokens,
    }
    report = {
        "clients": args.clients, "seconds": args.seconds, "workers": args.workers, "model": fleet.info["model"],
        "through": "dynamo_frontend" if args.past_the_edge else "edge",
        "requests_ok": stats.ok, "requests_failed": len(stats.failures), "failures": stats.failures[:5],
        "requests_per_s": round(stats.ok / args.seconds, 2),
        "distinct_requests": len(stats.seen), "verified": checked, "verify_problems": problems[:5],
        "mismatched_repeats": stats.mismatched_repeats,
        "ttft": percentiles(stats.ttft), "itl": percentiles(stats.itl),
        "worker_ttft": hist[TTFT], "worker_itl": hist[ITL], "verify_s": round(verify_s, 1),
        "rss_mib": {label: {"first": round(s[0][1], 1), "last": round(s[-1][1], 1)} for label, s in rss.items() if s},
        "rss_slope_mib_per_min": {label: None if s is None else round(s, 3) for label, s in slopes.items()},
        # Ten points of each process's RSS over the run (seconds, MiB): the shape behind the slope.
        "rss_series": {label: [(round(t), round(m, 1)) for t, m in s[::max(1, len(s) // 10)]] for label, s in rss.items()},
        "rss_warm_up_s": warm, "cache": cache, "ttft_observations": ttft_served,
        "prompt_tokens": stats.prompt_tokens, "wall_s": round(time.monotonic() - started, 1),
        "checks": checks, "ok": all(checks.values()),
    }
    line = json.dumps(report)
    print(line, flush=True)
    if args.json:
        args.json.write_text(line + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
