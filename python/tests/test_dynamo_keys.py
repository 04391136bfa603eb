"""The engine's own KV events with Dynamo's image keys: the bytes Dynamo's relay reads.

Dynamo 1.6.1's ``parse_mm_hash_from_extra_key`` reads only the frontend's marker form (16 hex
digits, then 48 ``"0"``), and assigns a block's image run the hash of the *first* key it can
parse; our own ``(64-hex identity, first row, ...)`` keys must follow unchanged. A key writer
that put the marker second still passed every fleet test (issue 35, item 9.6), so these check
the engine's payloads byte for byte, for items that carry a ``routing_hash``: no Dynamo.
"""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import zmq

import omniprefix
from omniprefix.dynamo_keys import MARKER_TAIL, marker, routed_items
from omniprefix.router import BlockStored, decode_batch
from conftest import IMAGE_LAYOUT, image_item, model_dir, random_ids, unexpanded_image

KEY = bytes(range(32))
LOOPBACK = "tcp://127.0.0.1:0"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
TIMEOUT_S = 5.0
#: Two images' frontend hashes (``extra_args["mm_hashes"]`` entries).
THEIRS_A = "00112233445566ff"
THEIRS_B = "8899aabbccddeeff"


def mp_str(s: str) -> bytes:
    """msgpack's shortest form of a str (fixstr or str8: all these are under 256 bytes)."""
    b = s.encode()
    assert len(b) < 256
    return (bytes([0xA0 | len(b)]) if len(b) < 32 else bytes([0xD9, len(b)])) + b


def mp_uint(n: int) -> bytes:
    assert 0 <= n < 128
    return bytes([n])


def mp_array(items: list[bytes]) -> bytes:
    assert len(items) < 16
    return bytes([0x90 | len(items)]) + b"".join(items)


def mp_keys(keys) -> bytes:
    """One block's extra keys (``None`` or a flat tuple of str / small uint), as msgpack."""
    if keys is None:
        return b"\xc0"
    return mp_array([mp_str(k) if isinstance(k, str) else mp_uint(k) for k in keys])


def engine(block_size: int = 4) -> omniprefix.Engine:
    return omniprefix.Engine.from_dir(model_dir("omni_thinker"), block_size=block_size, kv_events=LOOPBACK,
                                      kv_replay=LOOPBACK, fingerprint_key=KEY.hex())


def payloads(e: omniprefix.Engine) -> list[bytes]:
    """Every batch ``e`` published so far, from its replay socket (once its publisher sent them)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        stats = e.kv_events_stats()
        assert stats is not None
        if stats["published"] + stats["dropped"] == stats["batches"]:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.01)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(e.kv_replay_endpoint)
    out = []
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            assert dealer.poll(int(TIMEOUT_S * 1000)), "no replay reply"
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                return out
            out.append(frames[3])
    finally:
        dealer.close(0)
        ctx.term()


def stored(batches: list[bytes]) -> list[BlockStored]:
    return [ev for p in batches for ev in decode_batch(p).events if isinstance(ev, BlockStored)]


def identity(item: omniprefix.Item) -> str:
    return omniprefix.vllm_uuids([item], key=KEY)["image"][0]


def test_marker_is_the_16_hex_digits_then_48_zeros():
    m = marker(THEIRS_A.upper())
    assert m == THEIRS_A + "0" * 48 and MARKER_TAIL == "0" * 48
    assert len(m) == 64 and m.encode() == b"00112233445566ff" + b"0" * 48
    for bad in ["00112233445566f", "00112233445566fff", "00112233445566fg", "a1" * 32]:
        with pytest.raises(ValueError):
            marker(bad)


def test_the_engine_writes_the_marker_first_and_our_identity_after_it_byte_for_byte():
    e = engine()
    ids = random_ids(60, 6) + unexpanded_image() + random_ids(61, 9)
    # Upper case in, the marker's lower case out (the frontend sends lower case).
    image = image_item(5).with_routing_hash(THEIRS_A.upper())
    assert image.routing_hash == THEIRS_A.upper() and "routing_hash=" in repr(image)
    e.prefill(ids, [image])
    sent = payloads(e)
    ours = identity(image)
    # 6 ids, vision_start, 4 image rows (positions 7..10), vision_end, 9 ids: blocks 1 and 2 hold the image.
    want = [None, (marker(THEIRS_A), ours, 0), (marker(THEIRS_A), ours, 1), None, None]
    (event,) = stored(sent)
    assert event.extra_keys == want
    # The bytes the relay reads, written out by hand: block 1 is [str8 marker, str8 identity, 0].
    section = b"\xaaextra_keys" + mp_array([mp_keys(k) for k in want])
    (payload,) = [p for p in sent if b"BlockStored" in p]
    assert section in payload
    block1 = b"\x93\xd9\x40" + (THEIRS_A + "0" * 48).encode() + b"\xd9\x40" + ours.encode() + b"\x00"
    assert block1 in payload
    # The engine's bytes are what msgspec writes for vLLM's classes, with the marker first.
    assert msgspec.msgpack.encode(decode_batch(payload)) == payload
    # The routing hash names blocks for the router only: the same prompt without one caches the same hashes.
    plain = engine()
    plain.prefill(ids, [image_item(5)])
    assert plain.cached_block_hashes() == e.cached_block_hashes()
    assert [ev.extra_keys for ev in stored(payloads(plain))] == [[None, (ours, 0), (ours, 1), None, None]]


def test_a_block_with_two_images_has_each_routed_ones_marker_once_first():
    e = engine(block_size=8)
    # 6 ids, [vs A A A A ve], [vs B B B B ve], 4 ids = 22: block 1 (positions 8..15) holds A's
    # rows 1..3 and B's rows 0..2; block 2 B's last row.
    ids = random_ids(62, 6) + unexpanded_image() + unexpanded_image() + random_ids(63, 4)
    a, b, c = image_item(1).with_routing_hash(THEIRS_A), image_item(2), image_item(3)
    e.prefill(ids, [a, b])
    ka, kb = identity(a), identity(b)
    assert [ev.extra_keys for ev in stored(payloads(e))] == [[(marker(THEIRS_A), ka, 0), (marker(THEIRS_A), ka, 1, kb, 0)]]
    # Both routed: both markers, in row order, before every pair.
    e2 = engine(block_size=8)
    e2.prefill(ids, [a, c.with_routing_hash(THEIRS_B)])
    kc = identity(c)
    assert [ev.extra_keys for ev in stored(payloads(e2))] == [
        [(marker(THEIRS_A), ka, 0), (marker(THEIRS_A), marker(THEIRS_B), ka, 1, kc, 0)]
    ]


def test_the_same_image_under_another_routing_hash_is_a_cache_hit_and_keeps_the_first_marker():
    e = engine()
    ids = random_ids(60, 6) + unexpanded_image() + random_ids(61, 9)
    e.prefill(ids, [image_item(5).with_routing_hash(THEIRS_A)])
    cached = e.cached_block_hashes()
    again = e.prefill(ids, [image_item(5).with_routing_hash(THEIRS_B)])
    assert again.num_cached_tokens >= 20 and e.cached_block_hashes() == cached
    sent = payloads(e)
    assert sum(marker(THEIRS_A).encode() in p for p in sent) == 1
    assert not any(marker(THEIRS_B).encode() in p for p in sent)


def test_a_malformed_routing_hash_raises_request_error_naming_the_item_and_changes_nothing():
    e = engine()
    ids = random_ids(60, 6) + unexpanded_image() + random_ids(61, 9)
    e.prefill(ids, [image_item(5).with_routing_hash(THEIRS_A)])
    cached, stats, events = e.cached_block_hashes(), e.stats(), e.kv_events_stats()
    two = ids + unexpanded_image()
    for bad in ["00112233445566f", "00112233445566fff", "00112233445566fg", "+0112233445566ff", ""]:
        items = [image_item(7).with_routing_hash(THEIRS_B), image_item(8).with_routing_hash(bad)]
        with pytest.raises(omniprefix.RequestError, match=r"item 1: routing hash"):
            e.prefill(two, items)
        assert e.cached_block_hashes() == cached and e.stats() == stats
        assert e.kv_events_stats()["batches"] == events["batches"]
    # Not a str: a TypeError when the item is made.
    for bad in [0x00112233445566FF, b"00112233445566ff"]:
        with pytest.raises(TypeError, match="routing_hash"):
            omniprefix.Item("image", image_item(7).content, IMAGE_LAYOUT, routing_hash=bad)
        with pytest.raises(TypeError, match="routing_hash"):
            image_item(7).with_routing_hash(bad)
    assert image_item(7).with_routing_hash(THEIRS_A).with_routing_hash(None).routing_hash is None


def test_routed_items_pairs_the_frontends_hashes_with_the_images_in_prompt_order():
    audio = omniprefix.Item("audio", np.zeros(1600, np.float32), {"kind": "audio", "mel_frames": 120})
    items = [image_item(1), audio, image_item(2)]
    routed = routed_items(items, [THEIRS_A, THEIRS_B])
    assert [i.routing_hash for i in routed] == [THEIRS_A, None, THEIRS_B]
    assert routed[0].content is items[0].content and routed[1] is audio
    # No hashes, or a count that does not match the images: unchanged (no pairing by guess).
    for mm_hashes in [None, [], [THEIRS_A], [THEIRS_A, THEIRS_B, THEIRS_A], "00112233445566ff"]:
        assert [i.routing_hash for i in routed_items(items, mm_hashes)] == [None, None, None]
