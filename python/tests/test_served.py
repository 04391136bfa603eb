"""The engine steps on its own thread: a stream nobody reads keeps generating, an
encoder blocked in one thread does not stop another thread's stream, and
``AsyncEngine`` gives the sync engine's results under asyncio, with other tasks
running and cancellation aborting the request. Every wait is bounded."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

import omniprefix
from conftest import (BLOCK_SIZE, IMAGE_TOKENS, OMNI, assert_bit_equal, image_item, load_config, model_dir,
                      random_ids, unexpanded_image)


def fresh(config, **options):
    return omniprefix.Engine.random(config, 9, block_size=BLOCK_SIZE, **options)


def wait_until(done, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(0.005)
    return False


def test_an_unread_stream_keeps_generating(qwen3_config):
    engine = fresh(qwen3_config)
    stream = engine.stream(random_ids(70, 12), max_tokens=40, ignore_eos=True)
    # Nobody reads: the engine finishes the request on its own.
    assert wait_until(lambda: engine.stats()["finished"] == 1), "the unread stream did not finish"
    steps = list(stream)
    assert len(steps) == 40
    assert stream.generation.tokens == [t for t, _ in steps]


def test_a_blocked_encoder_does_not_stall_another_threads_stream():
    engine = omniprefix.Engine.from_dir(model_dir("omni_thinker"), block_size=BLOCK_SIZE)
    inside, release = threading.Event(), threading.Event()
    embeddings = image_item(5).embeddings

    def encoder(item):
        inside.set()
        release.wait(timeout=30)  # bounded: a regression fails instead of hanging
        return embeddings

    results = {}

    def submit():
        ids = [1, 2] + unexpanded_image() + [3]
        results["image"] = engine.prefill(ids, [image_item(5, with_embeddings=False)], encoder=encoder)

    submitter = threading.Thread(target=submit)
    submitter.start()
    try:
        assert inside.wait(timeout=30), "the encoder was never called"
        # The encoder is blocked inside its call; a whole generation streams meanwhile.
        started = time.monotonic()
        steps = list(engine.stream(random_ids(71, 10), max_tokens=24, ignore_eos=True))
        assert len(steps) == 24
        assert time.monotonic() - started < 25, "the stream waited for the encoder"
    finally:
        release.set()
        submitter.join(timeout=60)
    assert results["image"].prompt_len == 2 + IMAGE_TOKENS + 2 + 1


def test_special_token_ids_are_properties():
    engine = omniprefix.Engine.from_dir(model_dir("omni_thinker"), block_size=BLOCK_SIZE)
    got = {
        "image": engine.image_token_id,
        "video": engine.video_token_id,
        "audio": engine.audio_token_id,
        "vision_start": engine.vision_start_token_id,
        "vision_end": engine.vision_end_token_id,
        "audio_start": engine.audio_start_token_id,
        "audio_end": engine.audio_end_token_id,
    }
    assert got == OMNI


def test_sampling_keywords_are_the_librarys(qwen3_config):
    engine = fresh(qwen3_config)
    ids = random_ids(72, 9)
    with pytest.raises(omniprefix.RequestError, match="temprature"):
        engine.generate(ids, max_tokens=4, temprature=0.5)
    with pytest.raises(TypeError, match="max_tokens"):
        engine.stream(ids)
    # run_last_token runs the last token too: one more hidden row.
    plain = engine.generate(ids, max_tokens=4, ignore_eos=True)
    last = fresh(qwen3_config).generate(ids, max_tokens=4, ignore_eos=True, run_last_token=True)
    assert last.tokens == plain.tokens
    rows = {name: h.shape[0] for name, h in last.hidden.items()}
    assert set(rows.values()) == {len(ids) + 4}, rows
    engine.validate()


# ------------------------------------------------------------------ asyncio


def test_async_engine_gives_the_sync_results_while_other_tasks_run(qwen3_config):
    ids = random_ids(73, 14)
    sync = fresh(qwen3_config)
    want_prefill = sync.prefill(ids)
    want_generate = sync.generate(ids, max_tokens=8, ignore_eos=True)

    async def main():
        engine = omniprefix.AsyncEngine.random(qwen3_config, 9, block_size=BLOCK_SIZE)
        ticks = 0
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        prefill = await engine.prefill(ids)
        generated = await engine.generate(ids, max_tokens=8, ignore_eos=True)
        stream = engine.stream(ids, max_tokens=8, ignore_eos=True)
        steps = [step async for step in stream]
        stop.set()
        await task
        engine.close()
        return prefill, generated, steps, stream.generation, ticks

    prefill, generated, steps, streamed, ticks = asyncio.run(main())
    assert_bit_equal("async prefill", prefill.hidden, want_prefill.hidden)
    assert generated.tokens == want_generate.tokens
    assert_bit_equal("async generate", generated.hidden, want_generate.hidden)
    assert [t for t, _ in steps] == want_generate.tokens
    assert streamed.tokens == want_generate.tokens
    assert ticks > 0, "the event loop ran nothing else while the engine worked"


def test_cancelling_a_task_aborts_its_request(qwen3_config):
    async def main():
        # Generations long enough (3000 tokens of the 4096-position context) to be cancelled mid-way.
        engine = omniprefix.AsyncEngine.random(qwen3_config, 9, block_size=BLOCK_SIZE)
        stream = engine.stream(random_ids(74, 12), max_tokens=3000, ignore_eos=True)
        first = await stream.__anext__()

        async def read_all():
            return [step async for step in stream]

        task = asyncio.create_task(read_all())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        generating = asyncio.create_task(engine.generate(random_ids(75, 12), max_tokens=3000, ignore_eos=True))
        await asyncio.sleep(0.05)
        generating.cancel()
        with pytest.raises(asyncio.CancelledError):
            await generating
        # The stream is still referenced: only the cancellation can have aborted it.
        return engine, first, stream

    engine, first, stream = asyncio.run(main())
    assert len(first) == 2
    # Both requests were aborted: nothing is pending, so a reset is allowed.
    assert wait_until(lambda: _reset_allowed(engine.engine), timeout_s=10), "a cancelled request is still pending"
    assert engine.engine.stats()["finished"] == 0
    engine.validate()
    del stream


def _reset_allowed(engine) -> bool:
    try:
        engine.reset_cache()
        return True
    except omniprefix.CacheError:
        return False


def test_async_encoder_runs_off_the_event_loop():
    """An encoder that sleeps runs in a worker thread: the loop keeps ticking."""
    embeddings = image_item(6).embeddings

    def encoder(item):
        time.sleep(0.2)
        return embeddings

    async def main():
        engine = omniprefix.AsyncEngine.from_dir(model_dir("omni_thinker"), block_size=BLOCK_SIZE)
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        task = asyncio.create_task(ticker())
        ids = [1, 2] + unexpanded_image() + [3]
        out = await engine.prefill(ids, [image_item(6, with_embeddings=False)], encoder=encoder)
        task.cancel()
        return out, ticks

    out, ticks = asyncio.run(main())
    assert out.prompt_len == 2 + IMAGE_TOKENS + 2 + 1
    assert ticks >= 5, f"the loop ticked {ticks} times during a 200 ms encoder"


def os_threads() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_500_concurrent_streams_run_on_a_few_threads_and_give_the_sync_results(qwen3_config):
    """One event pump reads every request in flight: 500 concurrent ``async for`` streams cost
    a fixed few OS threads (one each would be 500), and each stream's tokens equal the sync
    engine's greedy generation of the same prompt."""
    prompts = [random_ids(1000 + k, 6 + k % 5) for k in range(500)]
    sync = fresh(qwen3_config, num_blocks=4096)
    distinct = {tuple(p) for p in prompts}
    want = {p: sync.generate(list(p), max_tokens=4, ignore_eos=True).tokens for p in distinct}
    peak = 0

    async def main():
        nonlocal peak
        engine = omniprefix.AsyncEngine.random(qwen3_config, 9, block_size=BLOCK_SIZE, num_blocks=4096)

        async def one(prompt):
            nonlocal peak
            tokens = []
            async for token, _rows in engine.stream(prompt, max_tokens=4, ignore_eos=True):
                tokens.append(token)
                peak = max(peak, os_threads())
            return tokens

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(p) for p in prompts)), timeout=240)
        finally:
            engine.close()

    got = asyncio.run(main())
    for prompt, tokens in zip(prompts, got):
        assert tokens == want[tuple(prompt)], prompt
    print(f"peak OS threads: {peak}")
    assert peak <= 16, f"{peak} OS threads for 500 concurrent streams"
