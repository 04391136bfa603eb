"""Image routing keys for Dynamo 1.6.1's KV router: the worker's bridge between two names of an image.

Dynamo's frontend, when it routes a chat with images (``--router-mode kv`` and a model directory
with a Qwen2-VL-style ``preprocessor_config.json``), names each image by ``xxh3_64`` of its URL's
bytes, expands its placeholder to N copies of ``pad_value(h) = 1_000_000 + (h & (2**30 - 1))``
and matches the blocks of that sequence against its index. It forwards the names to the worker as
``extra_args["mm_hashes"]`` (16 hex digits each, in prompt order).

The index is fed by the worker's KV events. For a block with image rows, Dynamo 1.6.1's relay
(``KvEventPublisher(..., image_token_id=...)``, ``lib/kv-router/src/zmq_wire/convert.rs``) rewrites
each run of the image token to ``pad_value(h)`` before hashing, where ``h`` comes from the block's
``extra_keys`` — but ``parse_mm_hash_from_extra_key`` (``zmq_wire/extra_keys.rs``) in 1.6.1 takes
only the frontend's *marker* form: 16 hex digits followed by 48 ``"0"`` (what
``dynamo/vllm/multimodal_utils/request_processor.py`` ``mark_forwarded_mm_hashes_for_routing``
hands vLLM). Our engine names an item by its content (``omniprefix.vllm_uuids``: 64 hex digits
under the fleet's fingerprint key, no zero tail), so 1.6.1 ignores it, hashes the block over the
raw image token, and a request's blocks never match what a worker caches past the image's start.

Without touching the engine, the worker bridges the two names:

* :class:`AliasTable` learns, per request, our item identity → the frontend's hash (the items'
  ``vllm_uuids`` zipped with ``extra_args["mm_hashes"]``), bounded (LRU).
* :class:`KeyBridge` subscribes to the engine's PUB socket, adds ``marker(h)`` to every block's
  ``extra_keys`` that holds rows of an item with a known alias (first, so that a Dynamo which
  also parses our identity assigns the frontend's hash to the block's image run; our own
  ``(identity, first row, ...)`` keys follow unchanged), re-encodes the batch and publishes it,
  topic and seq as received, on its own loopback PUB socket. The Dynamo relay subscribes to that
  one, with ``image_token_id`` set.

Limits: the frontend hashes URL bytes, so the same image sent as a different data URL is a
routing miss (it remains an engine cache hit: the engine keys on decoded content); an item
fingerprinted under one alias keeps the marker its blocks were published with; the frontend's N
must equal the engine's expansion, which it does for Qwen2-VL's resize rule.
"""

from __future__ import annotations

import collections
import re
import threading
from typing import Any, Iterable, Optional, Sequence, cast

__all__ = ["marker", "AliasTable", "KeyBridge", "request_aliases", "MARKER_TAIL"]

#: What Dynamo 1.6.1's ``parse_mm_hash_from_extra_key`` needs after the 16 hex digits.
MARKER_TAIL = "0" * 48
_HEX16 = re.compile(r"[0-9a-f]{16}\Z")
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")


def marker(frontend_hash: str) -> str:
    """The ``extra_keys`` string Dynamo 1.6.1 reads as ``frontend_hash`` (16 hex digits)."""
    h = frontend_hash.lower()
    if not _HEX16.match(h):
        raise ValueError(f"not a 16-hex-digit frontend hash: {frontend_hash!r}")
    return h + MARKER_TAIL


def request_aliases(image_uuids: Sequence[str], mm_hashes: Any) -> list[tuple[str, str]]:
    """``(our identity, frontend hash)`` per image of one request, or ``[]`` when the frontend
    sent no usable hashes (MM routing off, or a count that does not match the images: a pairing
    by position would then be a guess)."""
    if not isinstance(mm_hashes, list) or len(mm_hashes) != len(image_uuids):
        return []
    pairs = []
    for ours, theirs in zip(image_uuids, mm_hashes):
        if not isinstance(theirs, str) or not _HEX16.match(theirs.lower()):
            return []
        pairs.append((ours, theirs.lower()))
    return pairs


class AliasTable:
    """Our 64-hex item identity → the frontend's 16-hex hash, the ``capacity`` most recently
    learned (or used) ones. Thread-safe: requests learn on the event loop, the bridge reads on
    its own thread."""

    def __init__(self, capacity: int = 65536):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._map: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def learn(self, pairs: Iterable[tuple[str, str]]) -> None:
        with self._lock:
            for ours, theirs in pairs:
                self._map[ours] = theirs
                self._map.move_to_end(ours)
            while len(self._map) > self.capacity:
                self._map.popitem(last=False)

    def get(self, ours: str) -> Optional[str]:
        with self._lock:
            theirs = self._map.get(ours)
            if theirs is not None:
                self._map.move_to_end(ours)
            return theirs

    def __len__(self) -> int:
        with self._lock:
            return len(self._map)


def add_markers(batch: Any, aliases: AliasTable) -> int:
    """Puts the markers into ``batch``'s ``BlockStored`` events in place; returns how many
    blocks got one. A block's keys already holding a marker are left alone."""
    from .router import BlockStored

    marked = 0
    for event in batch.events:
        if not isinstance(event, BlockStored) or not event.extra_keys:
            continue
        for i, keys in enumerate(event.extra_keys):
            if not keys:
                continue
            markers = []
            for key in keys:
                if isinstance(key, str) and _HEX64.match(key) and not key.endswith(MARKER_TAIL):
                    theirs = aliases.get(key)
                    if theirs is not None and marker(theirs) not in markers:
                        markers.append(marker(theirs))
            if markers and not any(m in keys for m in markers):
                event.extra_keys[i] = (*markers, *keys)
                marked += 1
    return marked


class KeyBridge:
    """Engine PUB socket in, the same batches with markers out on a loopback PUB socket of its
    own (:attr:`endpoint`), on a daemon thread. Counts: ``batches``, ``marked_blocks``,
    ``errors`` (payloads that did not decode, forwarded unchanged)."""

    def __init__(self, source: str, aliases: AliasTable, bind: str = "tcp://127.0.0.1:0"):
        import msgspec
        import zmq

        from .router import decode_batch

        self.aliases = aliases
        self._decode = decode_batch
        self._encode = msgspec.msgpack.Encoder().encode
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.connect(source)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(bind)
        # LAST_ENDPOINT is a bytes option; pyzmq types every getsockopt as int | bytes.
        self.endpoint: str = cast(bytes, self._pub.getsockopt(zmq.LAST_ENDPOINT)).decode()
        self.batches = self.marked_blocks = self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="omniprefix-dynamo-keys", daemon=True)
        self._thread.start()

    def rewrite(self, payload: bytes) -> bytes:
        """One payload with its markers added (unchanged when no block needs one)."""
        batch = self._decode(payload)
        marked = add_markers(batch, self.aliases)
        self.marked_blocks += marked
        return self._encode(batch) if marked else payload

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = self._sub.recv_multipart()
            try:
                frames[-1] = self.rewrite(frames[-1])
            except Exception:  # a payload we cannot read still reaches Dynamo, as the engine sent it
                self.errors += 1
            self.batches += 1
            self._pub.send_multipart(frames)
        self._sub.close()
        self._pub.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._ctx.term()
