"""Faults inside one process: a ``Stream`` used from several threads at once never deadlocks,
and an engine whose step panics is dead for every pending and later call
(``EngineDeadError``, ``Engine.is_dead``, ``AsyncEngine.errored``). The step fault is the
test-only ``OMNIPREFIX_FAULT_STEP_PANIC`` of debug builds (the suite's dev-profile wheel).
Every wait is bounded."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

import omniprefix
from conftest import BLOCK_SIZE, random_ids

FAULT = "OMNIPREFIX_FAULT_STEP_PANIC"


# Run in a child process: a deadlock there holds the GIL, which no timeout in this process
# could break, so the child is what times out.
_THREADED_STREAM = """
import sys, threading, time
import omniprefix
config, ids = eval(sys.argv[1]), eval(sys.argv[2])
engine = omniprefix.Engine.random(config, 9, block_size=4)
stream = engine.stream(ids, max_tokens=3000, ignore_eos=True)
read, errors = [], []

def reader():
    try:
        for token, _rows in stream:
            read.append(token)
    except Exception as e:
        errors.append(e)

def poller():
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            _ = stream.done
            stream.next_batch()
        stream.close()
    except Exception as e:
        errors.append(e)

threads = [threading.Thread(target=reader), threading.Thread(target=poller)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not errors, errors
assert stream.done and 0 < len(read) < 3000, len(read)
print("ok", len(read))
"""


def test_a_stream_read_polled_and_closed_from_other_threads_never_deadlocks(qwen3_config):
    """Thread A waits in ``next()`` (GIL released, the stream's handle taken) while B polls
    ``done``, calls ``next_batch()`` and finally ``close()``. B used to block on the handle's
    lock holding the GIL, so A, its event in hand, could never take the GIL back."""
    args = [sys.executable, "-c", _THREADED_STREAM, repr(qwen3_config), repr(random_ids(5, 12))]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("a stream read from one thread and polled from another deadlocked (60 s)")
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-2000:]


@pytest.fixture
def dying(monkeypatch, qwen3_config):
    """An engine whose third step panics."""
    monkeypatch.setenv(FAULT, "3")
    engine = omniprefix.Engine.random(qwen3_config, 9, block_size=BLOCK_SIZE)
    monkeypatch.delenv(FAULT)
    return engine


def test_a_step_that_panics_kills_the_engine_for_every_pending_and_later_call(dying):
    streams = [dying.stream(random_ids(s, 10), max_tokens=50, ignore_eos=True) for s in range(2)]
    assert not dying.is_dead
    for stream in streams:
        with pytest.raises(omniprefix.EngineDeadError, match="step 3 panics"):
            for _ in stream:
                pass
    assert dying.is_dead
    assert issubclass(omniprefix.EngineDeadError, omniprefix.Error)
    for call in (lambda: dying.generate(random_ids(7, 10), max_tokens=2), lambda: dying.prefill(random_ids(8, 6)),
                 dying.stats, dying.metrics, dying.validate):
        with pytest.raises(omniprefix.EngineDeadError):
            call()


def test_an_async_engine_that_died_says_so(dying):
    async def main():
        engine = omniprefix.AsyncEngine(dying)
        try:
            with pytest.raises(omniprefix.EngineDeadError):
                await engine.generate(random_ids(3, 10), max_tokens=50, ignore_eos=True)
            assert engine.errored
            with pytest.raises(omniprefix.EngineDeadError):
                async for _ in engine.stream(random_ids(4, 10), max_tokens=5):
                    pass
            with pytest.raises(omniprefix.EngineDeadError):
                await engine.stats()
        finally:
            engine.close()

    asyncio.run(main())


def test_a_healthy_engine_is_not_dead(qwen3_config):
    engine = omniprefix.Engine.random(qwen3_config, 9, block_size=BLOCK_SIZE)
    engine.generate(random_ids(1, 10), max_tokens=4)
    assert not engine.is_dead
