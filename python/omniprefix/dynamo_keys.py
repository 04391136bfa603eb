"""Image routing keys for Dynamo 1.6.1's KV router: the frontend's name of each image, on the items.

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
hands vLLM), the first key it can parse. Our own name of an item (its 64-hex identity, what
``omniprefix.vllm_uuids`` gives) has no zero tail, so 1.6.1 reads it as no hash at all.

So the worker hands each image item the frontend's hash (:func:`routed_items`, as
``Item.routing_hash``), and the engine writes :func:`marker` of it first in the ``extra_keys`` of
every block holding the item's rows, our ``(identity, first row, ...)`` keys after it. The relay
subscribes straight to the engine's PUB socket. The engine checks each hash (16 hex digits, else
``RequestError`` naming the item, nothing cached).

Limits: the frontend hashes URL bytes, so the same image sent as a different data URL is a
routing miss (it remains an engine cache hit: the engine keys on decoded content, and the blocks
keep the marker of the request that first published them); the frontend's N must equal the
engine's expansion, which it does for Qwen2-VL's resize rule.
"""

from __future__ import annotations

from typing import Any, Sequence

from ._omniprefix import Item

__all__ = ["marker", "routed_items", "MARKER_TAIL"]

#: What Dynamo 1.6.1's ``parse_mm_hash_from_extra_key`` needs after the 16 hex digits.
MARKER_TAIL = "0" * 48
_HEX = frozenset("0123456789abcdef")


def marker(frontend_hash: str) -> str:
    """The ``extra_keys`` string Dynamo 1.6.1 reads as ``frontend_hash`` (16 hex digits): what the
    engine writes for an item with that ``routing_hash`` (a reference for tests and tools)."""
    h = frontend_hash.lower()
    if len(h) != 16 or not set(h) <= _HEX:
        raise ValueError(f"not a 16-hex-digit frontend hash: {frontend_hash!r}")
    return h + MARKER_TAIL


def routed_items(items: Sequence[Item], mm_hashes: Any) -> list[Item]:
    """``items`` with the frontend's hashes as the image items' routing hashes, in prompt order
    (``items`` are in prompt order). Unchanged when the frontend sent no hashes, or a count that
    does not match the images (MM routing off, or a pairing by position that would be a guess).
    The engine checks each hash when the request is submitted."""
    images = [i for i, item in enumerate(items) if item.modality == "image"]
    if not isinstance(mm_hashes, list) or not images or len(mm_hashes) != len(images):
        return list(items)
    routed = list(items)
    for i, h in zip(images, mm_hashes):
        routed[i] = items[i].with_routing_hash(h)
    return routed
