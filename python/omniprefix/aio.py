"""``AsyncEngine``: the engine under asyncio, on one event pump.

The engine steps on its own thread whatever Python does; an ``AsyncEngine``
only waits for it. Each call prepares its request (fingerprints, prompt,
checks, encoder calls) in one of a few submit threads, so the event loop keeps
running other tasks meanwhile. Then one pump thread reads the events of every
request in flight (an :class:`~omniprefix.EventPump`, blocked with the GIL
released while nothing happens) and hands each request's tokens to its asyncio
queue: N concurrent streams cost the same few threads, not one thread each, as
vLLM's ``AsyncLLM`` has one output task feeding per-request queues. Cancelling
a task that awaits a request aborts that request: its blocks go back and
nothing of it is cached.

    engine = AsyncEngine.random(config, seed=0)
    out = await engine.prefill(ids)
    gen = await engine.generate(ids, max_tokens=16)
    async for token, rows in engine.stream(ids, max_tokens=16):
        ...
    # audio=True (a checkpoint with a talker): AudioChunks come between the tokens.
    async for item in engine.stream(ids, max_tokens=16, audio=True):
        if isinstance(item, AudioChunk):
            play(item.samples)

After a step of the engine panicked, every pending and later call raises
:class:`~omniprefix.EngineDeadError` and :attr:`AsyncEngine.errored` is true.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Generic, Literal, Optional, Sequence, TypeVar, Union, cast, overload

from ._omniprefix import AudioChunk, Engine, EventPump, Generation, Output, Stream

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from typing_extensions import TypeVar as DefaultTypeVar

    from ._omniprefix import Error, Item

    # One token of a stream: (token, {capture: row}).
    _Token = tuple[int, dict[str, npt.NDArray[np.float32]]]
    # A token as the pump hands it on: with "stop" / "length" when it is the request's last.
    _PumpedToken = tuple[int, dict[str, npt.NDArray[np.float32]], Optional[str]]
    # What the pump hands a request's queue: its tokens and audio chunks, and None while it
    # runs, True once it ended, or the exception that ended it (EventPump.wait).
    _Event = tuple[list[Union[_PumpedToken, AudioChunk]], Union[None, bool, Error]]
    # What an AsyncStream yields: tokens, and AudioChunks too for an audio=True request.
    _Item = DefaultTypeVar("_Item", default=_Token)
else:
    _Item = TypeVar("_Item")

_T = TypeVar("_T")

__all__ = ["AsyncEngine", "AsyncStream"]

# Threads that prepare and submit requests (fingerprints, encoder calls) off the
# event loop; waiting for events costs none of them.
_DEFAULT_WORKERS = 4
# How long the pump blocks before it looks whether the engine was closed.
_PUMP_WAIT_S = 0.5


class AsyncEngine:
    """An ``Engine`` for asyncio: the same options, ``from_dir`` and ``random``,
    and ``prefill`` / ``generate`` / ``stream`` as coroutines and async iterators."""

    def __init__(self, engine: Engine, *, max_workers: int = _DEFAULT_WORKERS):
        self.engine = engine
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="omniprefix-aio")
        self._pump = EventPump()
        # Request id -> (its loop, its queue): where the pump thread hands that request's events.
        self._queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue[_Event]]] = {}
        self._lock = threading.Lock()
        self._pump_thread: Optional[threading.Thread] = None
        self._closed = False

    @classmethod
    def from_dir(cls, path: Any, **options: Any) -> "AsyncEngine":
        """An engine over the checkpoint in ``path``; the options of ``Engine.from_dir``."""
        return cls(Engine.from_dir(path, **options))

    @classmethod
    def random(cls, config: dict[str, Any], seed: int, **options: Any) -> "AsyncEngine":
        """An engine with seeded random weights; the options of ``Engine.random``."""
        return cls(Engine.random(config, seed, **options))

    def __getattr__(self, name: str) -> Any:
        # Properties and quick calls (capture, vocab_size, image_token_id, validate, ...).
        return getattr(self.engine, name)

    @property
    def errored(self) -> bool:
        """True once a step of the engine panicked (``Engine.is_dead``): every call raises
        :class:`~omniprefix.EngineDeadError`."""
        return self.engine.is_dead

    async def _call(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def _submit(self, submit: Callable[..., Stream[Any]], *args: Any,
                      **kwargs: Any) -> tuple[Stream[Any], asyncio.Queue[_Event]]:
        """Submits in a submit thread and has the pump watch the stream; a stream that
        arrives after its task was cancelled is closed (the request aborted) right away."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, functools.partial(submit, *args, pump=self._pump, **kwargs))
        try:
            stream = await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(_close_when_submitted)
            raise
        queue: asyncio.Queue[_Event] = asyncio.Queue()
        with self._lock:
            self._queues[stream.request_id] = (loop, queue)
        self._start_pump()
        self._pump.watch(stream)
        return stream, queue

    def _start_pump(self) -> None:
        with self._lock:
            if self._pump_thread is None and not self._closed:
                self._pump_thread = threading.Thread(target=_run_pump, args=(weakref.ref(self), self._pump, self._queues,
                                                                              self._lock),
                                                     name="omniprefix-aio-pump", daemon=True)
                self._pump_thread.start()

    async def prefill(self, token_ids: Any, items: Optional[Sequence[Item]] = None, **kwargs: Any) -> Output:
        """``Engine.prefill``, awaited: full hidden states and the last logits."""
        stream, queue = await self._submit(self.engine.submit_prefill, token_ids, items, **kwargs)
        await _drain(stream, queue)
        # Set: _drain returned, so the pump said the request ended (a failure raised instead).
        return cast(Output, stream.output)

    async def generate(self, token_ids: Any, items: Optional[Sequence[Item]] = None, **kwargs: Any) -> Generation:
        """``Engine.generate``, awaited: the tokens and every position's hidden rows."""
        stream, queue = await self._submit(self.engine.stream, token_ids, items, **kwargs)
        await _drain(stream, queue)
        # Set, as in prefill.
        return cast(Generation, stream.generation)

    @overload
    def stream(self, token_ids: Any, items: Optional[Sequence[Item]] = None, *, audio: Literal[False] = False,
               **kwargs: Any) -> "AsyncStream[_Token]": ...

    @overload
    def stream(self, token_ids: Any, items: Optional[Sequence[Item]] = None, *, audio: Literal[True],
               **kwargs: Any) -> "AsyncStream[Union[_Token, AudioChunk]]": ...

    @overload
    def stream(self, token_ids: Any, items: Optional[Sequence[Item]] = None, *, audio: bool = False,
               **kwargs: Any) -> "AsyncStream[Union[_Token, AudioChunk]]": ...

    def stream(self, token_ids: Any, items: Optional[Sequence[Item]] = None, *, audio: bool = False,
               **kwargs: Any) -> "AsyncStream[Any]":
        """``Engine.stream`` as an async iterator of ``(token, {capture: row})`` and, with
        ``audio=True``, :class:`~omniprefix.AudioChunk` s in the order they were made;
        submitted when first iterated. ``.generation`` holds the result at the end."""
        return AsyncStream(self, functools.partial(self.engine.stream, token_ids, items, audio=audio, **kwargs))

    async def stats(self) -> dict[str, Any]:
        """``Engine.stats``, answered between two engine steps without blocking the event loop."""
        return await self._call(self.engine.stats)

    async def metrics(self) -> str:
        """``Engine.metrics``: the Prometheus text, without blocking the event loop."""
        return await self._call(self.engine.metrics)

    def close(self) -> None:
        """Stops the submit threads and the pump (requests in flight are aborted when their
        streams drop)."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __repr__(self) -> str:
        return f"Async{self.engine!r}"


class AsyncStream(Generic[_Item]):
    """The tokens of one generation, awaited: ``async for token, rows in stream``; with
    ``audio=True`` the :class:`~omniprefix.AudioChunk` s too, between them (tell them apart with
    ``isinstance``). Leaving the loop early (``break``, an exception, a cancelled task) or
    ``await stream.aclose()`` aborts the request."""

    def __init__(self, engine: AsyncEngine, submit: Callable[..., Stream[Any]]):
        self._engine = engine
        self._submit = submit
        self._stream: Optional[Stream[Any]] = None
        self._queue: Optional[asyncio.Queue[_Event]] = None
        self._buffer: collections.deque[Union[_PumpedToken, AudioChunk]] = collections.deque()
        self._ended = False
        self._finish_reason: Optional[str] = None

    def __aiter__(self) -> "AsyncStream[_Item]":
        return self

    async def __anext__(self) -> _Item:
        try:
            queue = self._queue
            if queue is None:  # the first call: submit (the stream and its queue are set together)
                self._stream, queue = await self._engine._submit(self._submit)
                self._queue = queue
            while not self._buffer:
                if self._ended:
                    raise StopAsyncIteration
                tokens, end = await queue.get()
                self._buffer.extend(tokens)
                self._ended = _ended(end)
            item = self._buffer.popleft()
            if isinstance(item, AudioChunk):
                return cast(_Item, item)
            token, rows, finish_reason = item
            self._finish_reason = finish_reason
            return cast(_Item, (token, rows))
        except asyncio.CancelledError:
            self._close()
            raise

    @property
    def finish_reason(self) -> Optional[str]:
        """Why the generation stops (``"stop"`` or ``"length"``), set with the last token
        the loop received, before the stream's end; None until then (``Stream.finish_reason``)."""
        return self._finish_reason

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


def _run_pump(engine: "weakref.ref[AsyncEngine]", pump: EventPump,
              queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue[_Event]]], lock: threading.Lock) -> None:
    """The pump thread: waits (GIL released) for any request's events and hands each
    request's batch to its loop's queue as ``(tokens, end)``. It holds its engine weakly:
    it ends once the engine is closed or gone."""
    while (alive := engine()) is not None and not alive._closed:
        del alive
        for request_id, tokens, end in pump.wait(_PUMP_WAIT_S):
            with lock:
                target = queues.pop(request_id, None) if end is not None else queues.get(request_id)
            if target is None:
                continue
            loop, queue = target
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (tokens, end))
            except RuntimeError:
                pass  # that request's event loop is closed: nobody is left to read it


def _ended(end: Any) -> bool:
    """What the pump said of a request: False while it runs, True once it ended;
    the exception that ended it is raised."""
    if isinstance(end, BaseException):
        raise end
    return end is not None


async def _drain(stream: Stream[Any], queue: asyncio.Queue[_Event]) -> None:
    """Reads ``stream``'s events from ``queue`` to its end; a cancelled wait aborts the request."""
    try:
        while True:
            _tokens, end = await queue.get()
            if _ended(end):
                return
    except asyncio.CancelledError:
        stream.close()
        raise


def _close_when_submitted(future: "asyncio.Future[Stream[Any]]") -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()
