"""Streaming (what a talker stage consumes) and sampling."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import omniprefix
from conftest import BLOCK_SIZE, assert_bit_equal, image_item, model_dir, random_ids, unexpanded_image


def fresh(qwen3_config, **options):
    return omniprefix.Engine.random(qwen3_config, 9, block_size=BLOCK_SIZE, capture="all", **options)


def check_stream_against(steps, gen):
    """Each streamed (token, rows) is generate's token and generate's hidden row at the
    position that produced it (token i comes from position prompt_len - 1 + i)."""
    assert [t for t, _ in steps] == gen.tokens
    for i, (token, rows) in enumerate(steps):
        assert type(token) is int
        assert list(rows) == list(gen.hidden), f"step {i}: capture names"
        for name, row in rows.items():
            row = np.asarray(row)
            assert row.dtype == np.float32 and row.shape == (gen.hidden[name].shape[1],), name
            want = gen.hidden[name][gen.prompt_len - 1 + i]
            assert np.array_equal(row, want), f"step {i} {name}: row differs from generate's"


@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.8, top_k=50, top_p=0.9)])
def test_stream_yields_generates_tokens_and_rows(qwen3_config, params):
    ids = random_ids(40, 18)
    gen = fresh(qwen3_config).generate(ids, max_tokens=10, seed=123, ignore_eos=True, **params)
    stream = fresh(qwen3_config).stream(ids, max_tokens=10, seed=123, ignore_eos=True, **params)
    steps = list(stream)
    assert len(steps) == 10
    check_stream_against(steps, gen)
    done = stream.generation
    assert done.tokens == gen.tokens
    assert done.finish_reason == "length"
    assert done.prompt_len == gen.prompt_len == len(ids)
    assert_bit_equal("stream.generation", done.hidden, gen.hidden)


def test_stream_stops_at_a_stop_id(qwen3_config):
    ids = random_ids(41, 12)
    free = fresh(qwen3_config).generate(ids, max_tokens=8, ignore_eos=True)
    stop = free.tokens[3]
    first = free.tokens.index(stop)
    steps = list(fresh(qwen3_config).stream(ids, max_tokens=8, stop=[stop]))
    assert [t for t, _ in steps] == free.tokens[: first + 1]  # the stop id included
    gen = fresh(qwen3_config).generate(ids, max_tokens=8, stop=[stop])
    assert gen.finish_reason == "stop"
    assert gen.tokens == free.tokens[: first + 1]


def test_two_streams_interleaved_on_one_engine(qwen3_config):
    a_ids, b_ids = random_ids(50, 15), random_ids(51, 22)
    params = dict(max_tokens=7, temperature=0.9, ignore_eos=True)
    want_a = fresh(qwen3_config).generate(a_ids, seed=1, **params)
    want_b = fresh(qwen3_config).generate(b_ids, seed=2, **params)

    engine = fresh(qwen3_config)
    sa = engine.stream(a_ids, seed=1, **params)
    sb = engine.stream(b_ids, seed=2, **params)
    got_a, got_b = [], []
    for _ in range(7):
        got_a.append(next(sa))
        got_b.append(next(sb))
    for s in (sa, sb):
        with pytest.raises(StopIteration):
            next(s)
    check_stream_against(got_a, want_a)
    check_stream_against(got_b, want_b)
    assert sa.generation.tokens == want_a.tokens and sb.generation.tokens == want_b.tokens
    engine.validate()
    # Both replies were cached: re-sending history + reply reuses every position that ran.
    nxt = engine.prefill(a_ids + want_a.tokens + [1])
    assert nxt.num_cached_tokens == len(a_ids) + 7 - 1


def test_stream_interleaved_with_a_blocking_call(qwen3_config):
    ids = random_ids(52, 10)
    engine = fresh(qwen3_config)
    want = fresh(qwen3_config).generate(ids, max_tokens=5, ignore_eos=True)
    stream = engine.stream(ids, max_tokens=5, ignore_eos=True)
    steps = [next(stream), next(stream)]
    other = engine.prefill(random_ids(53, 9))
    assert other.prompt_len == 9
    steps += list(stream)
    check_stream_against(steps, want)


def test_stream_close_and_drop_leave_the_engine_consistent(qwen3_config):
    engine = fresh(qwen3_config)
    ids = random_ids(54, 14)
    stream = engine.stream(ids, max_tokens=20, ignore_eos=True)
    next(stream)
    next(stream)
    stream.close()
    with pytest.raises(StopIteration):
        next(stream)
    engine.validate()

    dropped = engine.stream(random_ids(55, 14), max_tokens=20, ignore_eos=True)
    next(dropped)
    del dropped
    gc.collect()
    engine.validate()

    # The engine still serves, and its results are still those of a fresh engine.
    want = fresh(qwen3_config).generate(ids, max_tokens=6, ignore_eos=True)
    got = engine.generate(ids, max_tokens=6, ignore_eos=True)
    assert got.tokens == want.tokens
    assert_bit_equal("after close", got.hidden, want.hidden)
    engine.validate()


def test_multimodal_stream():
    ids = [1, 2, 3] + unexpanded_image() + [4, 5, 6]
    engine = omniprefix.Engine.from_dir(model_dir("omni_thinker"), block_size=BLOCK_SIZE)
    want = omniprefix.Engine.from_dir(model_dir("omni_thinker"), block_size=BLOCK_SIZE).generate(
        ids, [image_item(3)], max_tokens=6, ignore_eos=True
    )
    steps = list(engine.stream(ids, [image_item(3)], max_tokens=6, ignore_eos=True))
    check_stream_against(steps, want)


# ------------------------------------------------------------------ sampling


def test_same_seed_gives_the_same_tokens(qwen3_config):
    ids = random_ids(60, 16)
    params = dict(max_tokens=12, temperature=1.2, top_k=100, top_p=0.95, ignore_eos=True)
    a = fresh(qwen3_config).generate(ids, seed=42, **params)
    b = fresh(qwen3_config).generate(ids, seed=42, **params)
    c = fresh(qwen3_config, cache=False).generate(ids, seed=42, **params)
    assert a.tokens == b.tokens == c.tokens
    assert a.seed == 42


def test_unseeded_generation_reports_its_seed_and_replays(qwen3_config):
    ids = random_ids(61, 16)
    params = dict(max_tokens=10, temperature=1.5, ignore_eos=True)
    a = fresh(qwen3_config).generate(ids, **params)
    assert isinstance(a.seed, int)
    replay = fresh(qwen3_config).generate(ids, seed=a.seed, **params)
    assert replay.tokens == a.tokens


def test_temperature_sampling_differs_from_greedy_for_some_seed(qwen3_config):
    ids = random_ids(62, 16)
    engine = fresh(qwen3_config)
    greedy = engine.generate(ids, max_tokens=10, ignore_eos=True).tokens
    assert engine.generate(ids, max_tokens=10, ignore_eos=True, seed=5).tokens == greedy  # seed is moot at T=0
    sampled = [engine.generate(ids, max_tokens=10, temperature=2.0, seed=s, ignore_eos=True).tokens for s in range(12)]
    assert any(t != greedy for t in sampled)
    assert len({tuple(t) for t in sampled}) > 1, "different seeds gave the same tokens every time"


def test_top_k_1_is_greedy(qwen3_config):
    ids = random_ids(63, 16)
    engine = fresh(qwen3_config)
    greedy = engine.generate(ids, max_tokens=8, ignore_eos=True).tokens
    for seed in range(3):
        assert engine.generate(ids, max_tokens=8, temperature=1.5, top_k=1, seed=seed, ignore_eos=True).tokens == greedy


@pytest.mark.parametrize("run_last_token", [False, True])
@pytest.mark.parametrize("how", ["length", "stop"])
def test_the_last_token_says_why_the_stream_stops_before_its_end(qwen3_config, how, run_last_token):
    """Stream.finish_reason is None until the last token is read, then the reason, while the
    stream has not ended yet: a reader (the fleet's worker) ends a reply there, without
    restating the engine's stop rule."""
    ids = random_ids(42, 12)
    free = fresh(qwen3_config).generate(ids, max_tokens=6, ignore_eos=True)
    options = dict(max_tokens=6, ignore_eos=True) if how == "length" else dict(max_tokens=6, stop=[free.tokens[2]])
    want = free.tokens if how == "length" else free.tokens[: free.tokens.index(free.tokens[2]) + 1]
    stream = fresh(qwen3_config).stream(ids, run_last_token=run_last_token, **options)
    seen = []
    for token, _ in stream:
        seen.append(token)
        if len(seen) < len(want):
            assert stream.finish_reason is None, f"token {len(seen)} of {len(want)}"
        else:
            assert stream.finish_reason == how
            assert stream.generation is None, "the reason comes with the token, before the end"
    assert seen == want
    assert stream.generation.finish_reason == how


def test_an_async_stream_says_why_it_stops_with_its_last_token(qwen3_config):
    import asyncio

    from omniprefix.aio import AsyncEngine

    ids = random_ids(43, 10)

    async def run():
        engine = AsyncEngine(fresh(qwen3_config))
        stream = engine.stream(ids, max_tokens=4, ignore_eos=True)
        reasons = []
        async for _token, _rows in stream:
            reasons.append(stream.finish_reason)
        engine.close()
        return reasons

    assert asyncio.run(run()) == [None, None, None, "length"]
