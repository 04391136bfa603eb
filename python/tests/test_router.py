"""Routing from KV events: omniprefix.router against round-robin, and Dynamo's KV
indexer (PyPI ``ai-dynamo-runtime``, no control plane) following the same stream.

Replicas are engines on one random tiny model, publishing on loopback; every wait
is bounded. ``OMNIPREFIX_REQUIRE_DYNAMO=1`` (set by CI) turns a missing Dynamo
wheel into a failure instead of a skip.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

import omniprefix
from omniprefix.router import DynamoIndexer, ReplicaView, Router, leading_hits, wait_until
from conftest import REPO_ROOT, image_item, importable, load_config, random_ids, unexpanded_image

KEY = bytes(range(32))
BLOCK = 4
LOOPBACK = "tcp://127.0.0.1:0"


def replicas(n: int, config: dict) -> list:
    return [
        omniprefix.Engine.random(config, 0, block_size=BLOCK, num_blocks=64, fingerprint_key=KEY,
                                 kv_events=LOOPBACK, kv_replay=LOOPBACK)
        for _ in range(n)
    ]


@pytest.fixture()
def omni_config() -> dict:
    return load_config("omni_thinker")


def hashes(ids, items, config: dict, tenant: int = 0) -> list[int]:
    return omniprefix.block_hashes(ids, items, fingerprint_key=KEY, block_size=BLOCK, tenant=tenant, tokens=config)


def serve(router: Router, engines: list, ids, items=None, tenant: int = 0) -> int:
    """Routes and runs one request; returns after the router saw its blocks."""
    choice = router.route(ids, items, tenant=tenant)
    engines[choice].generate(ids, items, tenant=tenant, max_tokens=2, ignore_eos=True)
    # Returns as soon as the events arrive; the bound only says when to give up (a loaded CI
    # machine once took more than the default 5 s).
    seen = router.wait_for(choice, hashes(ids, items, router.tokens, tenant), timeout_s=30.0)
    assert seen, "the router never saw the request's blocks"
    return choice


def test_a_router_that_subscribes_after_a_request_still_scores_its_blocks(omni_config):
    # Every batch of the request goes out before the router exists, and nothing follows it,
    # so no later batch reveals the gap: the quiet view must ask the replay endpoint itself.
    [engine] = replicas(1, omni_config)
    prompt = random_ids(3, 20)
    engine.generate(prompt, tenant=0, max_tokens=2, ignore_eos=True)
    router = Router([ReplicaView(engine.kv_events_endpoint, engine.kv_replay_endpoint)],
                    fingerprint_key=KEY, block_size=BLOCK, tokens=omni_config)
    try:
        whole = len(hashes(prompt, None, omni_config))
        assert wait_until(lambda: router.scores(prompt) == [whole], timeout_s=10.0, interval_s=0.01)
        assert sorted(router.replicas[0].cached) == engine.cached_block_hashes()
        assert router.replicas[0].replays == 1  # once, after the first quiet spell
    finally:
        router.close()


def test_kv_routing_follows_tenants_and_images_where_round_robin_does_not(omni_config):
    engines = replicas(2, omni_config)
    views = [ReplicaView(e.kv_events_endpoint, e.kv_replay_endpoint) for e in engines]
    router = Router(views, fingerprint_key=KEY, block_size=BLOCK, tokens=omni_config)
    try:
        system = random_ids(1, 24)
        image_x, image_y = image_item(1), image_item(2)
        prompt = system + unexpanded_image() + random_ids(2, 8)
        # Tenant 0 lands on one replica (a tie: the least used), tenant 1 on the other.
        first = serve(router, engines, prompt, [image_x], tenant=0)
        second = serve(router, engines, prompt, [image_x], tenant=1)
        assert first != second
        # The same image again, for tenant 0: its replica, which caches every full block.
        whole = len(hashes(prompt, [image_x], omni_config))
        assert router.scores(prompt, [image_x], tenant=0) == [whole if r == first else 0 for r in range(2)]
        assert serve(router, engines, prompt, [image_x], tenant=0) == first
        # Another image under the same placeholder ids: only the text before it is shared
        # (the system prompt and vision_start: 25 positions, 6 full blocks).
        assert router.scores(prompt, [image_y], tenant=0) == [6 if r == first else 0 for r in range(2)]
        # What the router knows is what the replicas cache.
        for view, engine in zip(views, engines):
            assert sorted(view.cached) == engine.cached_block_hashes()
    finally:
        router.close()


def test_round_robin_ignores_the_cache(omni_config):
    engines = replicas(2, omni_config)
    router = Router([ReplicaView(e.kv_events_endpoint, e.kv_replay_endpoint) for e in engines],
                    fingerprint_key=KEY, block_size=BLOCK, policy="round_robin", tokens=omni_config)
    try:
        prompt = random_ids(3, 30)
        assert [serve(router, engines, prompt) for _ in range(4)] == [0, 1, 0, 1]
    finally:
        router.close()
    with pytest.raises(ValueError, match="policy"):
        Router([], fingerprint_key=KEY, block_size=BLOCK, policy="random")


def test_route_bench_quick_hits_more_with_kv_routing(tmp_path):
    out = tmp_path / "route.jsonl"
    subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "route_bench.py"), "--quick", "--json", str(out)],
                   check=True, timeout=120, capture_output=True)
    reports = {(r["arrival"], r["policy"]): r for r in map(json.loads, out.read_text().splitlines())}
    for arrival in ("sequential", "waves"):
        kv, rr = reports[(arrival, "kv")], reports[(arrival, "round_robin")]
        assert kv["requests"] == rr["requests"] > 0
        assert kv["hit_rate"] > rr["hit_rate"] + 0.1, reports
        assert kv["evicted_blocks"] < rr["evicted_blocks"], reports
        assert kv["events_dropped"] == rr["events_dropped"] == 0
        assert kv["unsynced"] == 0


def wait_matched(indexer: DynamoIndexer, token_ids: list[int], want: list[int], timeout_s: float = 10.0) -> list[int]:
    """Dynamo's matches per replica, once they equal ``want`` or the wait is over."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = indexer.matched(token_ids, len(want))
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


@pytest.mark.skipif(not importable("dynamo.llm", required_by="OMNIPREFIX_REQUIRE_DYNAMO"),
                    reason="ai-dynamo-runtime is not installed")
def test_dynamos_kv_indexer_routes_text_from_our_stream_but_cannot_tell_images_apart(omni_config):
    engines = replicas(2, omni_config)
    indexer = DynamoIndexer()
    try:
        indexer.register(engines, BLOCK)
        # Dynamo's listener joins late (PUB drops what it sends before): wait for a sentinel.
        sentinel = random_ids(9, 2 * BLOCK)
        deadline = time.monotonic() + 10
        while indexer.matched(sentinel, 2) != [2 * BLOCK, 2 * BLOCK]:
            assert time.monotonic() < deadline, "Dynamo's indexer never saw the sentinel"
            for e in engines:
                e.reset_cache()
                e.prefill(sentinel, tenant=7)
            time.sleep(0.05)
        # Text: replica 0 caches A, replica 1 caches B; Dynamo's scores route each to its replica.
        a, b = random_ids(10, 6 * BLOCK), random_ids(11, 6 * BLOCK)
        engines[0].generate(a, max_tokens=2, ignore_eos=True)
        engines[1].generate(b, max_tokens=2, ignore_eos=True)
        assert wait_matched(indexer, a, [6 * BLOCK, 0]) == [6 * BLOCK, 0]
        assert wait_matched(indexer, b, [0, 6 * BLOCK]) == [0, 6 * BLOCK]
        # Eviction reaches it: after a reset replica 0 holds nothing of A.
        engines[0].reset_cache()
        assert wait_matched(indexer, a, [0, 0]) == [0, 0]
        # Images: X on replica 0 only. Dynamo hashes token ids, so a request with image Y under
        # the same placeholder ids matches all of replica 0's blocks (a false hit: it holds
        # X's KV); omniprefix's block hashes, which key on the image content, match only the
        # text before the image.
        special = omni_config["thinker_config"]
        prompt = random_ids(12, 3) + unexpanded_image() + random_ids(13, 5)
        image_x, image_y = image_item(3), image_item(4)
        engines[0].generate(prompt, [image_x], max_tokens=2, ignore_eos=True)
        expanded = omniprefix.Prompt(prompt, [image_y], key=KEY, special_tokens=special).token_ids
        full = len(expanded) // BLOCK * BLOCK
        assert wait_matched(indexer, expanded, [full, 0]) == [full, 0]
        engines[1].generate(prompt, [image_y], max_tokens=2, ignore_eos=True)
        # 14 positions, 3 full blocks; only the first (text and vision_start) is X's too.
        ours = hashes(prompt, [image_y], omni_config)
        assert len(ours) == 3
        assert [leading_hits(ours, set(e.cached_block_hashes())) for e in engines] == [1, 3]
    finally:
        indexer.close()
