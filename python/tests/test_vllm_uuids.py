"""omniprefix.vllm_uuids: what a vLLM user passes as ``multi_modal_uuids`` (docs/vllm.md).

vLLM trusts a uuid without looking at the media, so the string has to be the item's identity:
64 lowercase hex digits whose first 32 are the keyed fingerprint and whose last 32 are derived
from it (not padding), grouped by modality in the items' order, independent of strides and
byte order, dependent on the key, the layout and the processor params. Needs no vLLM.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import omniprefix

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
HEX64 = re.compile(r"[0-9a-f]{64}\Z")

IMAGE = {"kind": "image", "grid_thw": [1, 4, 6]}
AUDIO = {"kind": "audio", "mel_frames": 120}
VIDEO = {"kind": "video", "grid_thw": [2, 4, 4], "seconds_per_grid": 1.0}


def image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (48, 64, 3), dtype=np.uint8)


def audio(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(19_200).astype(np.float32)


def video(seed: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)


def uuid_of(content, layout, key=KEY, params=None) -> str:
    item = omniprefix.Item(layout["kind"], content, layout, params=params)
    (uuid,) = omniprefix.vllm_uuids([item], key=key)[layout["kind"]]
    return uuid


def test_format_and_prefix_is_the_fingerprint():
    for content, layout in [(image(), IMAGE), (audio(), AUDIO), (video(), VIDEO)]:
        uuid = uuid_of(content, layout)
        assert HEX64.match(uuid), uuid
        assert uuid[:32] == f"{omniprefix.fingerprint(content, layout, key=KEY):032x}"
        assert uuid[32:] != "0" * 32


def test_suffix_is_derived_not_padding():
    a, b = uuid_of(image(0), IMAGE), uuid_of(image(1), IMAGE)
    assert a[:32] != b[:32]
    assert a[32:] != b[32:]
    assert a[32:] != a[:32]
    # Deterministic: the same item under the same key is the same string.
    assert uuid_of(image(0), IMAGE) == a


def test_grouped_by_modality_in_order():
    items = [
        omniprefix.Item("audio", audio(10), AUDIO),
        omniprefix.Item("image", image(11), IMAGE),
        omniprefix.Item("video", video(12), VIDEO),
        omniprefix.Item("image", image(13), IMAGE),
        omniprefix.Item("audio", audio(14), AUDIO),
    ]
    uuids = omniprefix.vllm_uuids(items, key=KEY)
    assert isinstance(uuids, dict)
    assert set(uuids) == {"image", "audio", "video"}
    assert all(isinstance(v, list) for v in uuids.values())
    assert uuids["audio"] == [uuid_of(audio(10), AUDIO), uuid_of(audio(14), AUDIO)]
    assert uuids["image"] == [uuid_of(image(11), IMAGE), uuid_of(image(13), IMAGE)]
    assert uuids["video"] == [uuid_of(video(12), VIDEO)]
    flat = [u for v in uuids.values() for u in v]
    assert len(set(flat)) == len(flat)
    assert omniprefix.vllm_uuids([], key=KEY) == {}


def test_threads_do_not_change_the_uuid():
    items = [omniprefix.Item("video", video(), VIDEO), omniprefix.Item("image", image(), IMAGE)]
    assert omniprefix.vllm_uuids(items, key=KEY, threads=2) == omniprefix.vllm_uuids(items, key=KEY)


def test_strides_and_byte_order_do_not_matter():
    frames = video()
    expected = uuid_of(frames, VIDEO)
    fortran = np.asfortranarray(frames)
    assert not fortran.flags.c_contiguous
    assert uuid_of(fortran, VIDEO) == expected
    # A strided view of a bigger buffer holding the same values.
    padded = np.zeros((4, 32, 40, 3), np.uint8)
    padded[:, :, :32] = frames
    assert uuid_of(padded[:, :, :32], VIDEO) == expected

    wave = audio()
    expected = uuid_of(wave, AUDIO)
    big_endian = wave.astype(">f4")
    assert big_endian.dtype.byteorder == ">"
    assert uuid_of(big_endian, AUDIO) == expected
    assert uuid_of(np.repeat(wave, 2)[::2], AUDIO) == expected

    # The same bytes as another dtype or shape are another item.
    assert uuid_of(frames.reshape(4, 32 * 32 * 3), VIDEO) != uuid_of(frames, VIDEO)


def test_content_key_layout_and_params_change_it():
    base = uuid_of(image(), IMAGE)
    changed = image().copy()
    changed[0, 0, 0] ^= 1
    assert uuid_of(changed, IMAGE) != base
    assert uuid_of(image(), IMAGE, key=OTHER_KEY) != base
    assert uuid_of(image(), IMAGE, key=KEY.hex()) == base  # 64 hex digits name the same key
    assert uuid_of(image(), {"kind": "image", "grid_thw": [1, 6, 4]}) != base
    with_params = uuid_of(image(), IMAGE, params={"max_pixels": "1003520"})
    assert with_params != base
    assert uuid_of(image(), IMAGE, params={"max_pixels": "1003520"}) == with_params
    assert uuid_of(image(), IMAGE, params={"max_pixels": "12845056"}) != with_params


@pytest.mark.parametrize("key", [b"short", bytes(33), "zz" * 32, "ab" * 31, 7])
def test_bad_key_is_a_value_error(key):
    items = [omniprefix.Item("image", image(), IMAGE)]
    with pytest.raises((ValueError, TypeError)) as info:
        omniprefix.vllm_uuids(items, key=key)
    if not isinstance(key, int):
        assert info.type is ValueError


@pytest.mark.parametrize("items", [[image()], ["image"], [None], image(), 3])
def test_not_items_is_a_type_error(items):
    with pytest.raises(TypeError):
        omniprefix.vllm_uuids(items, key=KEY)


def test_key_is_required():
    with pytest.raises(TypeError):
        omniprefix.vllm_uuids([omniprefix.Item("image", image(), IMAGE)])  # type: ignore[call-arg]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_content_is_a_request_error(bad):
    wave = audio()
    wave[100] = bad
    items = [omniprefix.Item("image", image(), IMAGE), omniprefix.Item("audio", wave, AUDIO)]
    with pytest.raises(omniprefix.RequestError):
        omniprefix.vllm_uuids(items, key=KEY)
