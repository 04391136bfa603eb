#!/usr/bin/env python3
"""A step-level model of `bench serve --workload prefix_repetition`'s closed loop, to say which
of issue 23's serving ratios a scheduling policy can reach on a machine, and which it cannot.

Each step costs `decode_ms(b) + prefill_ms_per_token * prefill_tokens` (plus the lm_head row of a
prefill that ends in a step without decodes); the constants are measured on the 2-core machine
(`bench serve` c=1 and a pure-decode run at c=8, see docs/serving.md). The model replays the
scheduler's rule in Python (decodes first, prefill chunks within the budget, capped beside decodes,
optionally at most one long prompt per step) for `requests` prompts of `prompt_len` tokens at
`concurrency`, `output_len` tokens each, and prints the three ratios `scripts/prefill_policy.sh`
measures. It checks no code: `prefill_policy.sh` measures; this explains the measurements and
bounds them (e.g. with free prefills, `--prefill-ms-per-token 0`).

    python3 scripts/sched_model.py [--cap 64] [--prefill-ms-per-token 0.17] ...
"""

import argparse
import statistics
from dataclasses import dataclass


@dataclass
class Seq:
    left: int  # prompt tokens still to compute
    arrived: float
    decoded: int = 0
    last_token: float = 0.0


def simulate(a, cap, one_long, concurrency):
    """Runs the closed loop; returns (TTFT p50 ms, ITL p50 ms, ITL p99 ms, output tokens/s)."""
    t, issued, done = 0.0, 0, 0
    waiting, running, ttfts, itls = [], [], [], []

    def decode_ms(b):
        return a.decode_ms_base + a.decode_ms_per_row * b if b else 0.0

    def top_up():
        nonlocal issued
        while issued < a.requests and len(waiting) + len(running) < concurrency:
            reused = a.cached_tokens if issued % a.prompts_per_prefix else 0
            waiting.append(Seq(a.prompt_len - reused, t))
            issued += 1

    top_up()
    while done < a.requests:
        decodes = [s for s in running if s.left == 0]
        budget = min(a.budget, cap) if decodes else a.budget
        chunks, long_taken = [], False
        for s in [s for s in running if s.left > 0] + waiting:
            if budget == 0:
                break
            if one_long and s.left > cap:
                if long_taken:
                    if s in waiting:
                        break  # the queue is served in arrival order
                    continue
                long_taken = True
            k = min(s.left, budget)
            chunks.append((s, k))
            budget -= k
        for s, _ in chunks:
            if s in waiting:
                waiting.remove(s)
                running.append(s)
        tokens = sum(k for _, k in chunks)
        finished = [s for s, k in chunks if k == s.left]
        t += decode_ms(len(decodes)) + a.prefill_ms_per_token * tokens
        t += a.decode_ms_per_row * len(finished) if decodes else (a.lm_head_ms if finished else 0.0)
        for s, k in chunks:
            s.left -= k
        for s in finished:
            ttfts.append(t - s.arrived)
            s.last_token, s.decoded = t, 1
        for s in decodes:
            itls.append(t - s.last_token)
            s.last_token, s.decoded = t, s.decoded + 1
            if s.decoded >= a.output_len:
                running.remove(s)
                done += 1
        top_up()
    p99 = sorted(itls)[min(len(itls) - 1, int(0.99 * len(itls)))]
    return statistics.median(ttfts), statistics.median(itls), p99, a.requests * a.output_len / t * 1000


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--cached-tokens", type=int, default=0,
                    help="caching on: tokens each prompt but the first of its prefix reuses (256 in prefix_repetition)")
    ap.add_argument("--prompts-per-prefix", type=int, default=4)
    ap.add_argument("--budget", type=int, default=2048, help="max_tokens_per_step")
    ap.add_argument("--cap", type=int, default=64, help="prefill_cap")
    ap.add_argument("--decode-ms-base", type=float, default=9.5, help="a decode step's cost at 0 rows")
    ap.add_argument("--decode-ms-per-row", type=float, default=0.45, help="each decode row's added cost")
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.17)
    ap.add_argument("--lm-head-ms", type=float, default=7.0, help="the last row's lm_head, a prefill-only step")
    a = ap.parse_args()

    c1 = simulate(a, a.budget, False, 1)
    print(f"c=1: TTFT {c1[0]:.0f} ms, {c1[3]:.0f} tok/s")
    for name, cap, one_long in [
        ("cap off", a.budget, False),
        (f"cap {a.cap}, every prompt that fits", a.cap, False),
        (f"cap {a.cap}, one long prompt a step", a.cap, True),
    ]:
        ttft, itl50, itl99, tps = simulate(a, cap, one_long, a.concurrency)
        print(f"{name:38s} ITL p99/p50 {itl99 / itl50:5.2f}   TTFT p50 c={a.concurrency}/c=1 {ttft / c1[0]:5.2f}   "
              f"tok/s c={a.concurrency}/c=1 {tps / c1[3]:4.2f}")


if __name__ == "__main__":
    main()
