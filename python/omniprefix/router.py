"""A cache-aware router over omniprefix replicas, fed by their KV events alone.

This is the reference consumer of the stream ``Engine(kv_events=...)`` publishes
(vLLM's ``KVEventBatch`` over ZMQ) and of ``omniprefix.block_hashes``: what a
router such as Dynamo's kv-router or llm-d does, written out in a page of
Python so the protocol is clear and testable. It needs ``pyzmq`` and
``msgspec`` (``pip install pyzmq msgspec``); the engine itself does not.

* :class:`ReplicaView` subscribes to one replica's PUB socket, rebuilds the set
  of block hashes it caches (``BlockStored`` adds, ``BlockRemoved`` removes,
  ``AllBlocksCleared`` empties), and fills a seq gap through the replica's
  replay socket.
* :class:`Router` follows several replicas and sends a request to the one that
  caches the longest prefix of its block hashes (ties: the least used one), or
  round-robin, for comparison.
* :class:`DynamoIndexer` runs Dynamo's KV indexer on the same streams (PyPI
  ``ai-dynamo-runtime``), a real router to compare against.

Example::

    key = bytes(range(32))
    replicas = [omniprefix.Engine.random(config, 0, fingerprint_key=key,
                                         kv_events="tcp://127.0.0.1:0",
                                         kv_replay="tcp://127.0.0.1:0") for _ in range(2)]
    router = Router([ReplicaView(e.kv_events_endpoint, e.kv_replay_endpoint) for e in replicas],
                    fingerprint_key=key, block_size=replicas[0].block_size)
    choice = router.route(token_ids, items, tenant=7)
    replicas[choice].generate(token_ids, items, tenant=7, max_tokens=16)
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import msgspec
import zmq

from . import block_hashes
from .ports import free_port

if TYPE_CHECKING:
    from ._omniprefix import Item, _Placeholders, _TokenIds

__all__ = [
    "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch", "decode_batch", "ReplicaView", "Router",
    "leading_hits", "DynamoIndexer",
]


# vLLM 0.33's event classes, written from fixtures/vllm_kv_events_vectors.json; with
# them msgspec re-encodes every vector byte for byte (python/tests/test_kv_events.py).
# Events are tagged structs encoded as maps ("type" first, then the fields in order;
# fields equal to their default left out). msgspec writes a map16 header for a struct
# that may write more than 15 entries, the tag included: vLLM's BlockStored has optional
# fields past `extra_keys`, so it does; the reserved fields (always None, never written)
# reproduce that header.
class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    """vLLM's ``BlockStored``: consecutive full blocks of one sequence entered the cache."""

    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    #: Per block: ``None``, or ``(mm_hash, first row, ...)`` of the item rows it holds (``mm_hash``:
    #: the item's 64-hex identity, as :func:`omniprefix.vllm_uuids` gives it).
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    reserved_0: Optional[Any] = None
    reserved_1: Optional[Any] = None
    reserved_2: Optional[Any] = None
    reserved_3: Optional[Any] = None
    reserved_4: Optional[Any] = None
    reserved_5: Optional[Any] = None
    reserved_6: Optional[Any] = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    """vLLM's ``BlockRemoved``: blocks left the cache."""

    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    """vLLM's ``AllBlocksCleared``: the cache was reset."""


class KVEventBatch(msgspec.Struct, array_like=True):
    """vLLM's ``KVEventBatch``: one engine step's events, ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
#: The seq of replay's end marker.
END_SEQ = -1


def decode_batch(payload: bytes) -> KVEventBatch:
    """One published payload, decoded with vLLM's schema."""
    return _DECODER.decode(payload)


class ReplicaView:
    """The block hashes one replica caches, rebuilt from its KV events.

    Call :meth:`poll` (or let a :class:`Router` do it) to apply what arrived. A
    gap in the seq numbers is filled from the replay endpoint, so a view that
    connects late or drops a batch still converges: at the next batch, or at
    :meth:`catch_up` when none follows (a :class:`Router` calls it once a view has
    been quiet for :data:`CATCH_UP_S`); ``replays`` counts how often the replay
    endpoint was asked.
    """

    def __init__(self, endpoint: str, replay_endpoint: Optional[str] = None, topic: str = "",
                 context: Optional[zmq.Context[zmq.Socket[bytes]]] = None) -> None:
        self._context = context or zmq.Context.instance()
        self.sub = self._context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.cached: set[int] = set()
        #: The seq expected next (``None`` until the first batch is applied).
        self.next_seq: Optional[int] = None
        self.batches = 0
        self.replays = 0

    def close(self) -> None:
        self.sub.close(linger=0)

    def apply(self, batch: KVEventBatch) -> None:
        """Applies one batch's events to :attr:`cached`."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.cached.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.cached.difference_update(event.block_hashes)
            else:
                self.cached.clear()
        self.batches += 1

    def poll(self, timeout_ms: int = 0) -> int:
        """Applies every batch that arrived within ``timeout_ms``; returns how many."""
        applied = 0
        while self.sub.poll(timeout_ms if applied == 0 else 0):
            _topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if self.next_seq is not None and seq < self.next_seq:
                continue  # already applied through replay
            if self.next_seq is not None and seq > self.next_seq:
                applied += self.replay_from(self.next_seq, upto=seq)
            elif self.next_seq is None and seq > 0 and self.replay_endpoint:
                applied += self.replay_from(0, upto=seq)
            self.apply(decode_batch(payload))
            self.next_seq = seq + 1
            applied += 1
        return applied

    def catch_up(self, timeout_ms: int = 5000) -> int:
        """Applies whatever the replay endpoint holds from :attr:`next_seq` on; returns how many.

        A view finds a gap only when a later batch arrives: batches published before its
        subscription took effect, or dropped last before a quiet spell, would stay unseen.
        """
        return self.replay_from(self.next_seq or 0, timeout_ms=timeout_ms)

    def replay_from(self, start: int, upto: Optional[int] = None, timeout_ms: int = 5000) -> int:
        """Applies the buffered batches ``start <= seq < upto`` from the replay endpoint."""
        if not self.replay_endpoint:
            return 0
        dealer = self._context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        applied = 0
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while dealer.poll(timeout_ms):
                # (b"", topic, seq, payload) per batch; (b"", b"", -1, b"") at the end.
                frames = dealer.recv_multipart()
                seq = int.from_bytes(frames[2], "big", signed=True) if len(frames) == 4 else END_SEQ
                if seq == END_SEQ:
                    break
                if upto is not None and seq >= upto:
                    continue
                if self.next_seq is None or seq >= self.next_seq:
                    self.apply(decode_batch(frames[3]))
                    self.next_seq = seq + 1
                    applied += 1
        finally:
            dealer.close(linger=0)
        self.replays += 1
        return applied


#: How long a :class:`Router`'s view is quiet (no batch) before it asks its replay endpoint,
#: once, for what it may have missed.
CATCH_UP_S = 0.25
#: How long that ask may wait for a replica's answer (the router's lock is held meanwhile).
CATCH_UP_TIMEOUT_MS = 200


def wait_until(done: Callable[[], object], timeout_s: float, interval_s: float) -> bool:
    """Polls ``done()`` every ``interval_s`` until it is true (``True``) or ``timeout_s`` passed (``False``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return True
        time.sleep(interval_s)
    return False


def leading_hits(hashes: Sequence[int], cached: set[int]) -> int:
    """How many of ``hashes``, from the first, are cached: the reusable prefix in blocks."""
    n = 0
    for h in hashes:
        if h not in cached:
            break
        n += 1
    return n


class Router:
    """Picks a replica per request from the replicas' KV events.

    ``policy="kv"`` scores each replica by the leading blocks of the request it
    caches (the hashes come from :func:`omniprefix.block_hashes` under the
    fleet key) and takes the best, the least used one on a tie;
    ``policy="round_robin"`` ignores the cache. A background thread applies the
    events as they arrive, and asks a view's replay endpoint once after each
    :data:`CATCH_UP_S` of quiet, so that what a view missed last (or before it
    subscribed) is scored without waiting for the replica's next batch
    (:meth:`close` stops it).
    """

    def __init__(self, replicas: Sequence[ReplicaView], *, fingerprint_key: Union[bytes, str], block_size: int,
                 policy: str = "kv", tokens: Optional[dict[str, Any]] = None) -> None:
        if policy not in ("kv", "round_robin"):
            raise ValueError(f"policy must be 'kv' or 'round_robin', not {policy!r}")
        self.replicas = list(replicas)
        self.fingerprint_key = fingerprint_key
        self.block_size = block_size
        self.policy = policy
        self.tokens = tokens
        self.routed = [0] * len(self.replicas)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="omniprefix-router", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        # Per view: when its last batch (or the router's start) was, and whether the
        # replay endpoint was asked since.
        quiet_since = [time.monotonic()] * len(self.replicas)
        caught_up = [False] * len(self.replicas)
        while not self._stop.is_set():
            busy = False
            for r, view in enumerate(self.replicas):
                with self._lock:
                    now = time.monotonic()
                    if view.poll(0) > 0:
                        busy, quiet_since[r], caught_up[r] = True, now, False
                    elif not caught_up[r] and now - quiet_since[r] >= CATCH_UP_S:
                        view.catch_up(CATCH_UP_TIMEOUT_MS)
                        caught_up[r] = True
            if not busy:
                time.sleep(0.001)

    def scores(self, token_ids: _TokenIds, items: Optional[Sequence[Item]] = None, *, tenant: int = 0,
               placeholders: _Placeholders = "unexpanded") -> list[int]:
        """The cached leading blocks of the request on each replica."""
        hashes = block_hashes(token_ids, items, fingerprint_key=self.fingerprint_key, block_size=self.block_size,
                              tenant=tenant, placeholders=placeholders, tokens=self.tokens)
        with self._lock:
            return [leading_hits(hashes, view.cached) for view in self.replicas]

    def route(self, token_ids: _TokenIds, items: Optional[Sequence[Item]] = None, *, tenant: int = 0,
              placeholders: _Placeholders = "unexpanded") -> int:
        """The index of the replica the request should go to (counted as routed there)."""
        if self.policy == "round_robin":
            choice = sum(self.routed) % len(self.replicas)
        else:
            scores = self.scores(token_ids, items, tenant=tenant, placeholders=placeholders)
            choice = max(range(len(self.replicas)), key=lambda r: (scores[r], -self.routed[r], -r))
        self.routed[choice] += 1
        return choice

    def wait_for(self, replica: int, hashes: Sequence[int], timeout_s: float = 5.0) -> bool:
        """Waits until replica ``replica``'s view caches every hash of ``hashes`` (bounded)."""
        wanted = set(hashes)
        view = self.replicas[replica]

        def cached() -> bool:
            with self._lock:
                return wanted <= view.cached

        return wait_until(cached, timeout_s, 0.002)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for view in self.replicas:
            view.close()


class DynamoIndexer:
    """Dynamo's standalone KV indexer (``python -m dynamo.indexer`` from PyPI
    ``ai-dynamo-runtime``, no etcd or NATS) on a free loopback port, following omniprefix
    engines' KV events, and its routing decision.

    It hashes each block's ``token_ids`` itself (not the ``block_hashes`` published), so
    it cannot tell images apart: kept here to compare against :class:`Router`.
    """

    def __init__(self, python: str = sys.executable, timeout_s: float = 30.0) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen([python, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.routed: list[int] = []
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.call("GET", "/workers")
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError("dynamo.indexer did not start")
                time.sleep(0.05)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """One request to its HTTP API (JSON in and out)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read() or b"null")

    def register(self, engines: Sequence[Any], block_size: int, model_name: str = "m") -> None:
        """Subscribes it to each engine's PUB and replay endpoints (instance ids 0, 1, ...)."""
        for k, engine in enumerate(engines):
            self.call("POST", "/register", {"instance_id": k, "endpoint": engine.kv_events_endpoint,
                                            "replay_endpoint": engine.kv_replay_endpoint,
                                            "model_name": model_name, "block_size": block_size})
        self.routed = [0] * len(engines)

    def matched(self, token_ids: list[int], instances: int, model_name: str = "m") -> list[int]:
        """Matched prefix tokens per instance (expanded token ids). Dynamo files blocks whose
        medium is "CPU" (the CPU backend's) under its host tier, which ``scores`` (device tier)
        leaves out; ``instances[id].longest_matched`` counts every tier."""
        got = self.call("POST", "/query", {"token_ids": token_ids, "model_name": model_name}).get("instances", {})
        return [got.get(str(k), {}).get("longest_matched", 0) for k in range(instances)]

    def route(self, token_ids: list[int], instances: int) -> int:
        """The instance with the longest match (the least used on a tie), counted as routed there."""
        scores = self.matched(token_ids, instances)
        self.routed += [0] * (instances - len(self.routed))
        choice = max(range(instances), key=lambda r: (scores[r], -self.routed[r], -r))
        self.routed[choice] += 1
        return choice

    def wait_for(self, instance: int, token_ids: list[int], tokens: int, instances: int, timeout_s: float = 5.0) -> bool:
        """Waits until ``instance`` matches at least ``tokens`` of ``token_ids`` (bounded)."""
        return wait_until(lambda: self.matched(token_ids, instances)[instance] >= tokens, timeout_s, 0.005)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
