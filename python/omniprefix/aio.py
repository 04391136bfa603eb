"""``AsyncEngine``: the engine under asyncio.

The engine steps on its own thread whatever Python does; an ``AsyncEngine``
only waits for it. Each call prepares its request (fingerprints, prompt,
checks, encoder calls) and reads its events in a worker thread with the GIL
released, so the event loop keeps running other tasks meanwhile. Cancelling a
task that awaits a request aborts that request: its blocks go back and nothing
of it is cached.

    engine = AsyncEngine.random(config, seed=0)
    out = await engine.prefill(ids)
    gen = await engine.generate(ids, max_tokens=16)
    async for token, rows in engine.stream(ids, max_tokens=16):
        ...
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
from typing import Any, Callable, Optional

from ._omniprefix import Engine, Generation, Output, Stream

__all__ = ["AsyncEngine", "AsyncStream"]

# Worker threads of one AsyncEngine: each in-flight request holds one while it
# waits for its next event (blocked in Rust, GIL released), so allow many.
_DEFAULT_WORKERS = 64


class AsyncEngine:
    """An ``Engine`` for asyncio: the same options, ``from_dir`` and ``random``,
    and ``prefill`` / ``generate`` / ``stream`` as coroutines and async iterators."""

    def __init__(self, engine: Engine, *, max_workers: int = _DEFAULT_WORKERS):
        self.engine = engine
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="omniprefix-aio")

    @classmethod
    def from_dir(cls, path: Any, **options: Any) -> "AsyncEngine":
        """An engine over the checkpoint in ``path``; the options of ``Engine.from_dir``."""
        return cls(Engine.from_dir(path, **options))

    @classmethod
    def random(cls, config: dict, seed: int, **options: Any) -> "AsyncEngine":
        """An engine with seeded random weights; the options of ``Engine.random``."""
        return cls(Engine.random(config, seed, **options))

    def __getattr__(self, name: str) -> Any:
        # Properties and quick calls (capture, vocab_size, image_token_id, stats, ...).
        return getattr(self.engine, name)

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def _submit(self, submit: Callable[..., Stream], *args: Any, **kwargs: Any) -> Stream:
        """Submits in a worker thread; a stream that arrives after its task was
        cancelled is closed (the request aborted) right away."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, functools.partial(submit, *args, **kwargs))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(_close_when_submitted)
            raise

    async def prefill(self, token_ids: Any, items: Optional[list] = None, **kwargs: Any) -> Output:
        """``Engine.prefill``, awaited: full hidden states and the last logits."""
        stream = await self._submit(self.engine.submit_prefill, token_ids, items, **kwargs)
        await _drain(self, stream)
        return stream.output

    async def generate(self, token_ids: Any, items: Optional[list] = None, **kwargs: Any) -> Generation:
        """``Engine.generate``, awaited: the tokens and every position's hidden rows."""
        stream = await self._submit(self.engine.stream, token_ids, items, **kwargs)
        await _drain(self, stream)
        return stream.generation

    def stream(self, token_ids: Any, items: Optional[list] = None, **kwargs: Any) -> "AsyncStream":
        """``Engine.stream`` as an async iterator of ``(token, {capture: row})``;
        submitted when first iterated. ``.generation`` holds the result at the end."""
        return AsyncStream(self, functools.partial(self.engine.stream, token_ids, items, **kwargs))

    def metrics(self) -> str:
        """``Engine.metrics``: the Prometheus text (answered between two engine steps)."""
        return self.engine.metrics()

    def close(self) -> None:
        """Stops the worker threads (requests in flight are aborted when their streams drop)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __repr__(self) -> str:
        return f"Async{self.engine!r}"


class AsyncStream:
    """The tokens of one generation, awaited: ``async for token, rows in stream``.
    Leaving the loop early (``break``, an exception, a cancelled task) or
    ``await stream.aclose()`` aborts the request."""

    def __init__(self, engine: AsyncEngine, submit: Callable[[], Stream]):
        self._engine = engine
        self._submit = submit
        self._stream: Optional[Stream] = None
        self._buffer: collections.deque = collections.deque()

    def __aiter__(self) -> "AsyncStream":
        return self

    async def __anext__(self) -> tuple:
        try:
            if self._stream is None:
                self._stream = await self._engine._submit(self._submit)
            while not self._buffer:
                batch = await self._engine._call(self._stream.next_batch)
                if not batch:
                    raise StopAsyncIteration
                self._buffer.extend(batch)
            return self._buffer.popleft()
        except asyncio.CancelledError:
            self._close()
            raise

    @property
    def generation(self) -> Optional[Generation]:
        """The finished generation (None until the stream is exhausted)."""
        return self._stream.generation if self._stream is not None else None

    def _close(self) -> None:
        if self._stream is not None:
            self._stream.close()

    async def aclose(self) -> None:
        """Aborts the request if it has not finished."""
        self._close()

    def __del__(self) -> None:
        self._close()


async def _drain(engine: AsyncEngine, stream: Stream) -> None:
    """Reads ``stream`` to its end; a cancelled wait aborts the request."""
    try:
        while await engine._call(stream.next_batch):
            pass
    except asyncio.CancelledError:
        stream.close()
        raise


def _close_when_submitted(future: "asyncio.Future[Stream]") -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()
