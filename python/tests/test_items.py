"""Multimodal requests through ``Item``s and an encoder callable; the encoder cache;
what the engine keeps of a caller's arrays (nothing)."""

from __future__ import annotations

import gc
import sys
import zlib

import numpy as np
import pytest

import omniprefix
from conftest import (
    BLOCK_SIZE,
    IMAGE_LAYOUT,
    IMAGE_TOKENS,
    assert_bit_equal,
    image_content,
    image_embeddings,
    image_item,
    model_dir,
    unexpanded_image,
)


class CountingEncoder:
    """Stands in for a vision encoder: deterministic rows from the item's content, calls counted."""

    def __init__(self, deepstack: bool = False):
        self.calls: list[omniprefix.Item] = []
        self.returned: list[np.ndarray] = []
        self.deepstack = deepstack

    def rows(self, item) -> np.ndarray:
        content = np.ascontiguousarray(item.content)
        seed = zlib.crc32(content.tobytes())
        return np.random.default_rng(seed).standard_normal((item.num_tokens, 64)).astype(np.float32)

    def __call__(self, item):
        self.calls.append(item)
        rows = self.rows(item)
        self.returned.append(rows)
        if self.deepstack:
            return rows, [0.5 * rows]
        return rows


def omni(**options) -> omniprefix.Engine:
    return omniprefix.Engine.from_dir(model_dir("omni_thinker"), block_size=BLOCK_SIZE, capture="all", **options)


def test_item_attributes():
    content = image_content(0)
    emb = image_embeddings(0)
    item = omniprefix.Item("image", content, IMAGE_LAYOUT, embeddings=emb, params={"max_pixels": "1024"})
    assert item.modality == "image"
    assert item.layout == IMAGE_LAYOUT
    assert item.content is content
    assert item.num_tokens == IMAGE_TOKENS
    assert item.embeddings.dtype == np.float32
    assert np.array_equal(item.embeddings, emb)
    assert omniprefix.Item("image", content, IMAGE_LAYOUT).embeddings is None
    audio = omniprefix.Item("audio", np.zeros(1600, np.float32), {"kind": "audio", "mel_frames": 120})
    assert audio.num_tokens == 16
    video = omniprefix.Item("video", content, {"kind": "video", "grid_thw": [2, 4, 4], "seconds_per_grid": 1.0})
    assert video.num_tokens == 8


def test_encoder_runs_once_for_an_image_sent_twice():
    engine = omni()
    encoder = CountingEncoder()
    content = image_content(5)
    first_ids = [1, 2, 3] + unexpanded_image() + [7]
    # Other text before the image: no prefix hit reaches it, so its rows must come from somewhere.
    second_ids = [9, 8] + unexpanded_image() + [6, 5]

    a = engine.prefill(first_ids, [omniprefix.Item("image", content, IMAGE_LAYOUT)], encoder=encoder)
    assert len(encoder.calls) == 1
    assert encoder.calls[0].modality == "image"
    assert encoder.calls[0].num_tokens == IMAGE_TOKENS
    assert np.array_equal(np.asarray(encoder.calls[0].content), content)
    hits = engine.stats()["encoder_cache_hits"]

    b = engine.prefill(second_ids, [omniprefix.Item("image", content.copy(), IMAGE_LAYOUT)], encoder=encoder)
    assert len(encoder.calls) == 1, "the second request must hit the encoder cache"
    assert engine.stats()["encoder_cache_hits"] == hits + 1
    assert engine.stats()["encoder_calls"] == 1
    assert b.num_cached_tokens == 0

    # The same outputs as an engine that was handed the embeddings.
    rows = encoder.rows(encoder.calls[0])
    given = omni(cache=False)
    assert_bit_equal("encoder a", a.hidden, given.prefill(first_ids, [image_item(embeddings=rows, content=content)]).hidden)
    assert_bit_equal("encoder b", b.hidden, given.prefill(second_ids, [image_item(embeddings=rows, content=content)]).hidden)

    # Another image misses the encoder cache.
    engine.prefill(second_ids, [omniprefix.Item("image", image_content(6), IMAGE_LAYOUT)], encoder=encoder)
    assert len(encoder.calls) == 2
    engine.validate()


def test_encoder_runs_once_for_the_same_image_twice_in_one_request():
    engine = omni()
    encoder = CountingEncoder()
    content = image_content(8)
    ids = [1, 2] + unexpanded_image() + [3] + unexpanded_image() + [4]
    items = [omniprefix.Item("image", content, IMAGE_LAYOUT), omniprefix.Item("image", content.copy(), IMAGE_LAYOUT)]
    out = engine.prefill(ids, items, encoder=encoder)
    assert out.prompt_len == 2 + (IMAGE_TOKENS + 2) + 1 + (IMAGE_TOKENS + 2) + 1
    assert len(encoder.calls) == 1


def test_items_with_embeddings_do_not_call_the_encoder():
    engine = omni()
    encoder = CountingEncoder()
    engine.prefill([1, 2] + unexpanded_image() + [3], [image_item(2)], encoder=encoder)
    assert encoder.calls == []


def test_encoder_may_return_deepstack_levels():
    engine = omni()
    encoder = CountingEncoder(deepstack=True)
    content = image_content(9)
    ids = [1, 2, 3] + unexpanded_image() + [4, 5]
    out = engine.prefill(ids, [omniprefix.Item("image", content, IMAGE_LAYOUT)], encoder=encoder)
    assert len(encoder.calls) == 1
    rows = encoder.rows(encoder.calls[0])

    given = omni(cache=False)
    direct = given.prefill(ids, [omniprefix.Item("image", content, IMAGE_LAYOUT, embeddings=rows, deepstack=[0.5 * rows])])
    assert_bit_equal("deepstack from the encoder vs given", out.hidden, direct.hidden)
    stacked = given.prefill(ids, [omniprefix.Item("image", content, IMAGE_LAYOUT, embeddings=rows, deepstack=(0.5 * rows)[None])])
    assert_bit_equal("deepstack as a [levels, rows, hidden] array", stacked.hidden, direct.hidden)
    plain = given.prefill(ids, [omniprefix.Item("image", content, IMAGE_LAYOUT, embeddings=rows)])
    # DeepStack level 0 is added after layer 0: hidden.1 is recorded before the add, hidden.2 moves.
    assert np.array_equal(plain.hidden["hidden.1"], direct.hidden["hidden.1"])
    assert not np.array_equal(plain.hidden["hidden.2"], direct.hidden["hidden.2"])


def test_embeddings_are_copied_at_construction():
    ids = [1, 2, 3] + unexpanded_image() + [4]
    emb = image_embeddings(4)
    want = omni(cache=False).prefill(ids, [image_item(4, embeddings=emb.copy())])
    before = sys.getrefcount(emb)
    item = image_item(4, embeddings=emb)
    after = sys.getrefcount(emb)  # outside the assert: pytest's rewriting holds references
    assert after == before, "Item kept a reference to the caller's embeddings"
    emb[:] = 0.0  # the caller reuses its buffer
    got = omni(cache=False).prefill(ids, [item])
    assert_bit_equal("embeddings mutated after Item()", got.hidden, want.hidden)


def test_content_is_read_at_call_time_and_never_retained():
    engine = omni()
    ids = [1, 2, 3] + unexpanded_image() + [4]
    content = image_content(11)
    item = omniprefix.Item("image", content, IMAGE_LAYOUT, embeddings=image_embeddings(11))
    refs = sys.getrefcount(content)
    engine.prefill(ids, [item])
    gc.collect()
    after = sys.getrefcount(content)
    assert after == refs, "the engine kept a reference to the item content"
    assert engine.prefill(ids, [item]).num_cached_tokens == len(ids) + IMAGE_TOKENS - 2
    # The caller changes its buffer in place: the next request sees the new bytes, a miss at the image.
    content[0, 0, 0] ^= 0xFF
    assert engine.prefill(ids, [item]).num_cached_tokens == 4  # text and vision_start only
    engine.validate()


def test_encoder_output_is_not_retained():
    engine = omni()
    encoder = CountingEncoder()
    engine.prefill([1] + unexpanded_image() + [2], [omniprefix.Item("image", image_content(12), IMAGE_LAYOUT)], encoder=encoder)
    gc.collect()
    # The list in the encoder holds one reference, getrefcount's argument the other (counted
    # outside the assert: pytest's assertion rewriting keeps references to subexpressions).
    refs = sys.getrefcount(encoder.returned[0])
    assert refs == 2, "the engine kept the encoder's array"
    encoder.calls.clear()
    gc.collect()


def test_video_and_audio_items_through_the_encoder():
    engine = omni()
    encoder = CountingEncoder()
    ids = (
        [1, 2]
        + [250, 255, 251]  # vision_start video_pad vision_end
        + [3]
        + [252, 249, 253]  # audio_start audio_pad audio_end
        + [4]
    )
    video = omniprefix.Item("video", np.ones((2, 8, 8, 3), np.uint8), {"kind": "video", "grid_thw": [2, 4, 4], "seconds_per_grid": 1.0})
    audio = omniprefix.Item("audio", np.linspace(-1, 1, 1600, dtype=np.float32), {"kind": "audio", "mel_frames": 120})
    out = engine.prefill(ids, [video, audio], encoder=encoder)
    assert out.prompt_len == 2 + 3 - 1 + 8 + 1 + 3 - 1 + 16 + 1
    assert [c.modality for c in encoder.calls] == ["video", "audio"]
    again = engine.prefill(ids, [video, audio], encoder=encoder)
    assert again.num_cached_tokens == out.prompt_len - 1
    assert len(encoder.calls) == 2


@pytest.mark.parametrize("placeholders", ["unexpanded", "expanded"])
def test_placeholder_forms_give_the_same_prompt(placeholders):
    engine = omni(cache=False)
    if placeholders == "unexpanded":
        ids = [1, 2] + unexpanded_image() + [3]
    else:
        ids = [1, 2, 250] + [254] * IMAGE_TOKENS + [251, 3]
    out = engine.prefill(ids, [image_item(1)], placeholders=placeholders)
    ref = omni(cache=False).prefill([1, 2] + unexpanded_image() + [3], [image_item(1)])
    assert out.prompt_len == 2 + 1 + IMAGE_TOKENS + 1 + 1
    assert_bit_equal(placeholders, out.hidden, ref.hidden)
