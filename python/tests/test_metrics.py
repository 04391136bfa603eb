"""``Engine.metrics()`` / ``AsyncEngine.metrics()``: Prometheus text that the Prometheus
project's own parser reads, whose values agree with the calls made (prompt tokens queried
and hit, one TTFT per request, one ITL per gap between two tokens)."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

import omniprefix
from conftest import BLOCK_SIZE, random_ids


def parse(text: str) -> dict[str, float]:
    """Every sample: name, with ``{le="..."}`` for histogram buckets, to value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + (f'{{le="{sample.labels["le"]}"}}' if "le" in sample.labels else "")
            out[key] = sample.value
    return out


def test_metrics_agree_with_the_calls_made(qwen3_config):
    engine = omniprefix.Engine.random(qwen3_config, 9, block_size=BLOCK_SIZE, num_blocks=64)
    shared = random_ids(3, 12)
    prompts = [shared + random_ids(4, 3), shared + random_ids(5, 5), random_ids(6, 9)]
    lengths = [4, 3, 1]
    for ids, n in zip(prompts, lengths):
        engine.generate(ids, max_tokens=n, ignore_eos=True)
    engine.prefill(shared)
    m = parse(engine.metrics())
    stats = engine.stats()

    assert m["omniprefix_prefix_cache_queries_total"] == sum(map(len, prompts)) + len(shared)
    assert m["omniprefix_prefix_cache_hits_total"] == stats["hit_tokens"] >= 12 + 11
    assert m["omniprefix_num_preemptions_total"] == stats["preemptions"] == 0
    assert m["omniprefix_kv_events_dropped_total"] == 0
    assert m["omniprefix_time_to_first_token_seconds_count"] == 4
    assert m["omniprefix_inter_token_latency_seconds_count"] == sum(n - 1 for n in lengths)
    assert m['omniprefix_inter_token_latency_seconds_bucket{le="+Inf"}'] == sum(n - 1 for n in lengths)
    assert m["omniprefix_num_requests_running"] == m["omniprefix_num_requests_waiting"] == 0
    assert 0 < m["omniprefix_kv_cache_usage_ratio"] <= 1


def test_async_engine_metrics_follow_its_requests(qwen3_config):
    async def main():
        engine = omniprefix.AsyncEngine.random(qwen3_config, 9, block_size=BLOCK_SIZE)
        try:
            await asyncio.gather(*(engine.generate(random_ids(s, 10), max_tokens=3, ignore_eos=True) for s in range(3)))
            return await engine.metrics()
        finally:
            engine.close()

    m = parse(asyncio.run(main()))
    assert m["omniprefix_prefix_cache_queries_total"] == 30
    assert m["omniprefix_time_to_first_token_seconds_count"] == 3
    assert m["omniprefix_inter_token_latency_seconds_count"] == 6
