"""The byte layout of what ``omniprefix.dynamo_keys.KeyBridge`` hands Dynamo's relay.

Dynamo 1.6.1's ``parse_mm_hash_from_extra_key`` reads only the frontend's marker form (16 hex
digits, then 48 ``"0"``), and assigns a block's image run the hash of the *first* key it can
parse; our own ``(64-hex identity, first row, ...)`` keys must follow unchanged. A bridge that
wrote the marker second still passed every fleet test (issue 35, item 9.6), so these check the
re-encoded payload byte for byte: no model, no extension call, no Dynamo.
"""

from __future__ import annotations

import msgspec
import pytest

from omniprefix.dynamo_keys import MARKER_TAIL, AliasTable, KeyBridge, marker
from omniprefix.router import BlockRemoved, BlockStored, KVEventBatch, decode_batch

#: Two items' 64-hex identities (what ``omniprefix.vllm_uuids`` gives) and their frontend hashes.
OURS_A = "a1" * 32
OURS_B = "b2" * 32
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


def payload(extra_keys, block_size: int = 4) -> bytes:
    """A batch of one ``BlockStored`` over ``len(extra_keys)`` blocks, as the engine publishes it."""
    n = len(extra_keys)
    stored = BlockStored(
        block_hashes=list(range(11, 11 + n)),
        parent_block_hash=7,
        token_ids=list(range(n * block_size)),
        block_size=block_size,
        lora_id=None,
        medium="cpu",
        lora_name=None,
        extra_keys=extra_keys,
    )
    return msgspec.msgpack.encode(KVEventBatch(ts=1.5, events=[stored, BlockRemoved(block_hashes=[3], medium="cpu")]))


@pytest.fixture
def bridge():
    aliases = AliasTable()
    aliases.learn([(OURS_A, THEIRS_A), (OURS_B, THEIRS_B)])
    # Nothing publishes on the source: only `rewrite` is exercised.
    b = KeyBridge("tcp://127.0.0.1:9", aliases)
    yield b
    b.close()


def test_marker_is_the_16_hex_digits_then_48_zeros():
    m = marker(THEIRS_A.upper())
    assert m == THEIRS_A + "0" * 48 and MARKER_TAIL == "0" * 48
    assert len(m) == 64 and m.encode() == b"00112233445566ff" + b"0" * 48
    for bad in ["00112233445566f", "00112233445566fff", "00112233445566fg", OURS_A]:
        with pytest.raises(ValueError):
            marker(bad)


def test_the_marker_comes_first_and_our_keys_follow_unchanged_byte_for_byte(bridge):
    before = [None, (OURS_A, 0), (OURS_A, 4, OURS_B, 0), (OURS_B, 2), None]
    out = bridge.rewrite(payload(before))
    # Markers first (in the order of the keys they stand for, once each), then our keys as sent.
    want = [
        None,
        (marker(THEIRS_A), OURS_A, 0),
        (marker(THEIRS_A), marker(THEIRS_B), OURS_A, 4, OURS_B, 0),
        (marker(THEIRS_B), OURS_B, 2),
        None,
    ]
    # The whole payload: the engine's batch with only the extra keys changed, re-encoded in vLLM's form.
    assert out == payload(want)
    # The extra keys' bytes, written out by hand: block 1 is [str8 marker, str8 identity, 0].
    section = b"\xaaextra_keys" + mp_array([mp_keys(k) for k in want])
    assert section in out
    block1 = b"\x93\xd9\x40" + (THEIRS_A + "0" * 48).encode() + b"\xd9\x40" + OURS_A.encode() + b"\x00"
    assert block1 in out
    assert bridge.marked_blocks == 3
    # What the relay decodes: the marker is each marked block's first key.
    stored = decode_batch(out).events[0]
    assert [k[0] if k else None for k in stored.extra_keys] == [None, marker(THEIRS_A), marker(THEIRS_A), marker(THEIRS_B), None]


def test_blocks_without_a_known_alias_or_already_marked_pass_through_as_sent(bridge):
    unknown = "c3" * 32
    for keys in [[None, (unknown, 0)], [(marker(THEIRS_A), OURS_A, 0)], [None]]:
        sent = payload(keys)
        assert bridge.rewrite(sent) == sent, keys
    assert bridge.marked_blocks == 0
    # A block with one known and one unknown item gets the known one's marker alone, first.
    out = bridge.rewrite(payload([(unknown, 0, OURS_B, 1)]))
    assert out == payload([(marker(THEIRS_B), unknown, 0, OURS_B, 1)])
