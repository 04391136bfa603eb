"""The standalone matcher: ``fingerprint``, ``Prompt`` and ``PrefixIndex``."""

from __future__ import annotations

import numpy as np
import pytest

import omniprefix
from conftest import IMAGE_LAYOUT, IMAGE_TOKENS, image_content, image_embeddings, model_dir, unexpanded_image

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
#: Placeholder ids of a prompt built without a model: Qwen3-Omni's.
IMAGE_PAD, VISION_START, VISION_END = 151655, 151652, 151653


def fp(content, layout=IMAGE_LAYOUT, key=KEY, **kw):
    return omniprefix.fingerprint(content, layout, key=key, **kw)


# ------------------------------------------------------------------ fingerprint


def test_fingerprint_is_a_128_bit_keyed_digest_of_the_content():
    a = image_content(0)
    value = fp(a)
    assert isinstance(value, int) and 0 <= value < 2**128
    assert fp(a.copy()) == value  # equal content, another buffer
    assert fp(a) == value  # deterministic
    b = a.copy()
    b[3, 4, 1] ^= 1
    assert fp(b) != value  # one bit of content
    assert fp(a, key=OTHER_KEY) != value  # another key
    assert fp(a, layout={"kind": "image", "grid_thw": [1, 2, 8]}) != value  # another layout
    assert fp(a, params={"max_pixels": "1024"}) != value  # processor params
    assert fp(a, params={"max_pixels": "1024"}) == fp(a.copy(), params={"max_pixels": "1024"})
    assert fp(a.reshape(16, 48)) != value  # the shape is part of the identity
    assert fp(a.astype(np.int32)) != value  # so is the dtype


def test_fingerprint_modality_comes_from_the_layout_kind():
    a = image_content(1)
    video = {"kind": "video", "grid_thw": [1, 4, 4], "seconds_per_grid": 1.0}
    assert fp(a, layout=video) != fp(a)
    audio = np.linspace(-1, 1, 1600, dtype=np.float32)
    assert fp(audio, layout={"kind": "audio", "mel_frames": 120}) != fp(audio, layout={"kind": "audio", "mel_frames": 100})


def test_fingerprint_bad_input():
    a = image_content(2)
    with pytest.raises(ValueError):
        fp(a, key=b"short")
    with pytest.raises(TypeError):
        omniprefix.fingerprint(a, IMAGE_LAYOUT)  # the key is required
    with pytest.raises(TypeError):
        fp(a.astype(np.float64))
    with pytest.raises(TypeError):
        fp(a.astype(bool))
    nan = np.zeros((4, 6, 3), np.float32)
    nan[1, 1, 1] = np.nan
    with pytest.raises(omniprefix.RequestError):
        fp(nan)
    with pytest.raises(omniprefix.RequestError):
        fp(np.zeros((0, 3), np.uint8))
    with pytest.raises((ValueError, omniprefix.RequestError)):
        fp(a, layout={"kind": "image", "grid_thw": [1, 3, 5]})


# ------------------------------------------------------------------ array forms


def test_non_contiguous_views_fingerprint_like_their_contiguous_copy():
    base = np.random.default_rng(3).integers(0, 256, size=(12, 20, 3), dtype=np.uint8)
    views = {
        "transposed": base.transpose(2, 0, 1),
        "strided": base[::2, 1::3],
        "reversed": base[::-1],
        "fortran": np.asfortranarray(base),
        "channel slice": base[..., 1],
    }
    for label, view in views.items():
        assert fp(view) == fp(np.ascontiguousarray(view)), label
    floats = np.random.default_rng(4).standard_normal((8, 10, 4)).astype(np.float32)
    assert fp(floats.T) == fp(np.ascontiguousarray(floats.T))
    assert fp(floats[:, ::3]) == fp(np.ascontiguousarray(floats[:, ::3]))


@pytest.mark.parametrize("dtype", ["<f4", "<i4", "<i8", "<f2"])
def test_big_endian_content_fingerprints_like_native(dtype):
    native = (np.random.default_rng(5).standard_normal((6, 7, 3)) * 50).astype(dtype)
    big = native.astype(native.dtype.newbyteorder(">"))
    assert big.dtype.byteorder == ">" and np.array_equal(big, native)
    assert fp(big) == fp(native)


def test_supported_dtypes_and_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    values = np.random.default_rng(6).standard_normal((4, 6, 3)).astype(np.float32)
    digests = {
        name: fp(values.astype(dtype))
        for name, dtype in {
            "f32": np.float32,
            "f16": np.float16,
            "bf16": ml_dtypes.bfloat16,
        }.items()
    }
    digests["u8"] = fp((values * 10).astype(np.uint8))
    digests["i32"] = fp((values * 10).astype(np.int32))
    digests["i64"] = fp((values * 10).astype(np.int64))
    assert len(set(digests.values())) == len(digests), digests
    bf = values.astype(ml_dtypes.bfloat16)
    assert fp(bf[:, ::2]) == fp(np.ascontiguousarray(bf[:, ::2]))


def test_negative_zero_is_canonical():
    a = np.zeros((4, 6, 3), np.float32)
    b = a.copy()
    b[0, 0, 0] = -0.0
    assert np.signbit(b[0, 0, 0])
    assert fp(a) == fp(b)


def test_buffer_protocol_objects_are_accepted():
    raw = bytes(range(256)) * 4
    assert fp(bytearray(raw)) == fp(np.frombuffer(raw, dtype=np.uint8))
    assert fp(memoryview(raw)) == fp(np.frombuffer(raw, dtype=np.uint8))


def test_float64_embeddings_are_converted_like_float32():
    emb = np.random.default_rng(7).standard_normal((IMAGE_TOKENS, 64)).astype(np.float32)
    a = omniprefix.Item("image", image_content(7), IMAGE_LAYOUT, embeddings=emb)
    b = omniprefix.Item("image", image_content(7), IMAGE_LAYOUT, embeddings=emb.astype(np.float64))
    c = omniprefix.Item("image", image_content(7), IMAGE_LAYOUT, embeddings=np.asfortranarray(emb))
    for item in (a, b, c):
        assert item.embeddings.dtype == np.float32
        assert np.array_equal(item.embeddings, emb)
    ids = [1, 2] + unexpanded_image() + [3]
    outs = [omniprefix.Engine.from_dir(model_dir("omni_thinker"), cache=False).prefill(ids, [item]) for item in (a, b, c)]
    for out in outs[1:]:
        for name in out.hidden:
            assert np.array_equal(out.hidden[name], outs[0].hidden[name]), name


def test_engine_hits_the_cache_for_a_strided_view_of_the_same_image():
    engine = omniprefix.Engine.from_dir(model_dir("omni_thinker"), block_size=4)
    base = np.random.default_rng(8).integers(0, 256, size=(3, 16, 16), dtype=np.uint8)
    view = base.transpose(1, 2, 0)  # HWC view of a CHW buffer
    ids = [1, 2, 3] + unexpanded_image() + [4]
    emb = image_embeddings(8)
    engine.prefill(ids, [omniprefix.Item("image", np.ascontiguousarray(view), IMAGE_LAYOUT, embeddings=emb)])
    again = engine.prefill(ids, [omniprefix.Item("image", view, IMAGE_LAYOUT, embeddings=emb)])
    assert again.num_cached_tokens == again.prompt_len - 1
    # Big-endian int32 content is the same image as native int32 (and another one than uint8).
    native = engine.prefill(ids, [omniprefix.Item("image", view.astype("<i4"), IMAGE_LAYOUT, embeddings=emb)])
    assert native.num_cached_tokens == 4  # text and vision_start: the dtype is part of the identity
    big = engine.prefill(ids, [omniprefix.Item("image", view.astype(">i4"), IMAGE_LAYOUT, embeddings=emb)])
    assert big.num_cached_tokens == big.prompt_len - 1
    engine.validate()


def test_hidden_states_come_back_as_float32_arrays(qwen3_config):
    engine = omniprefix.Engine.random(qwen3_config, 1)
    out = engine.prefill(list(range(10)))
    for h in out.hidden.values():
        assert isinstance(h, np.ndarray) and h.dtype == np.float32 and h.ndim == 2
        assert h.flags.c_contiguous
    assert isinstance(out.last_logits, np.ndarray)


# ------------------------------------------------------------------ Prompt


def test_prompt_expands_items_and_carries_their_fingerprints():
    content = image_content(9)
    item = omniprefix.Item("image", content, IMAGE_LAYOUT)
    ids = [1, 2, VISION_START, IMAGE_PAD, VISION_END, 3]
    prompt = omniprefix.Prompt(ids, [item], key=KEY)
    assert len(prompt) == len(ids) - 1 + IMAGE_TOKENS
    assert prompt.token_ids == [1, 2, VISION_START] + [IMAGE_PAD] * IMAGE_TOKENS + [VISION_END, 3]
    assert prompt.fingerprints == [fp(content)]
    expanded = omniprefix.Prompt(prompt.token_ids, [item], key=KEY, placeholders="expanded")
    assert expanded.token_ids == prompt.token_ids and expanded.fingerprints == prompt.fingerprints
    text = omniprefix.Prompt(np.arange(10, dtype=np.int64))
    assert len(text) == 10 and text.fingerprints == []
    with pytest.raises(omniprefix.RequestError):
        omniprefix.Prompt([1, IMAGE_PAD, 2], [], key=KEY)
    with pytest.raises(ValueError):
        omniprefix.Prompt([1, -2, 3])
    with pytest.raises(TypeError):
        omniprefix.Prompt([1, 2.5, 3])


# ------------------------------------------------------------------ PrefixIndex


def text_prompt(ids, **kw):
    return omniprefix.Prompt(ids, key=KEY, **kw)


def test_insert_two_full_blocks_then_match_returns_them():
    index = omniprefix.PrefixIndex(block_size=4)
    prompt = text_prompt(list(range(10)))  # two full blocks and a partial one
    miss = index.match(prompt)
    assert (miss.tokens, miss.aligned_tokens, miss.blocks) == (0, 0, [])
    outcome = index.insert(prompt, [7, 3])
    assert outcome.adopted == [7, 3] and outcome.duplicates == [] and outcome.released == []
    assert outcome.cached.blocks == [7, 3] and outcome.cached.tokens == 8
    hit = index.match(prompt)
    assert (hit.tokens, hit.aligned_tokens, hit.blocks) == (8, 8, [7, 3])
    longer = index.match(text_prompt(list(range(10)) + [50, 51]))
    assert longer.blocks == [7, 3]
    partial = index.match(text_prompt([0, 1, 2, 3, 4, 5, 99]))
    assert partial.tokens == 6 and partial.aligned_tokens == 4 and partial.blocks == [7, 3]
    other = index.match(text_prompt([9, 9, 9, 9, 9]))
    assert other.tokens == 0
    stats = index.stats()
    assert stats["queries"] == 5
    assert stats["hits"] == 3
    assert stats["cached_blocks"] == 2
    index.validate()


def test_duplicate_insert_reports_duplicates():
    index = omniprefix.PrefixIndex(block_size=4)
    prompt = text_prompt(list(range(8)))
    index.insert(prompt, [1, 2])
    again = index.insert(prompt, [5, 6])
    assert again.adopted == [] and again.duplicates == [5, 6]
    assert again.cached.blocks == [1, 2]


def test_insert_partial_caches_a_partly_filled_last_block():
    index = omniprefix.PrefixIndex(block_size=4)
    prompt = text_prompt(list(range(10)))
    out = index.insert_partial(prompt, [4, 5, 6], 10)
    assert out.adopted == [4, 5, 6]
    assert index.match(prompt).tokens == 10
    with pytest.raises(omniprefix.CacheError):
        index.insert_partial(text_prompt(list(range(20, 30))), [8, 9], 10)  # ceil(10 / 4) = 3 blocks
    index.validate()


def test_locked_blocks_are_not_evicted():
    index = omniprefix.PrefixIndex(block_size=4)
    a, b = text_prompt(list(range(8))), text_prompt(list(range(100, 108)))
    index.insert(a, [1, 2])
    index.insert(b, [3, 4])
    m = index.match(a)
    index.lock(m)
    evicted = index.evict(100)
    assert sorted(evicted) == [3, 4]
    assert index.match(a).blocks == [1, 2]
    assert index.match(b).blocks == []
    index.unlock(m)
    assert sorted(index.evict(100)) == [1, 2]
    assert index.evict(100) == []
    assert index.stats()["evicted_blocks"] == 4
    assert index.stats()["cached_blocks"] == 0
    index.validate()


def test_evict_takes_least_recently_used_first():
    index = omniprefix.PrefixIndex(block_size=4)
    a, b = text_prompt([1] * 4), text_prompt([2] * 4)
    index.insert(a, [10])
    index.insert(b, [20])
    index.match(a)  # a is now the most recently used
    assert index.evict(1) == [20]
    assert index.evict(1) == [10]


def test_inserting_a_block_id_twice_under_other_content_is_a_cache_error():
    index = omniprefix.PrefixIndex(block_size=4)
    index.insert(text_prompt(list(range(8))), [1, 2])
    before = index.stats()
    with pytest.raises(omniprefix.CacheError) as info:
        index.insert(text_prompt(list(range(50, 58))), [2, 9])
    assert str(info.value)
    with pytest.raises(omniprefix.CacheError):
        index.insert(text_prompt(list(range(60, 68))), [5, 5])
    with pytest.raises(omniprefix.CacheError):
        index.insert(text_prompt(list(range(70, 78))), [6, 7, 8])  # more blocks than full blocks
    assert index.stats()["cached_blocks"] == before["cached_blocks"]
    index.validate()


def test_validation_policy_mismatch_is_a_value_error():
    index = omniprefix.PrefixIndex(block_size=4, validation="second_digest")
    exact = text_prompt(list(range(8)), validation="exact_bytes")
    with pytest.raises(ValueError):
        index.match(exact)
    with pytest.raises(ValueError):
        index.insert(exact, [1, 2])
    assert index.stats()["cached_blocks"] == 0
    for policy in ("second_digest", "exact_bytes", "unvalidated"):
        idx = omniprefix.PrefixIndex(block_size=4, validation=policy)
        p = text_prompt(list(range(8)), validation=policy)
        idx.insert(p, [1, 2])
        assert idx.match(p).blocks == [1, 2]
    with pytest.raises((ValueError, omniprefix.ConfigError)):
        omniprefix.PrefixIndex(block_size=4, validation="trust_me")
    with pytest.raises((ValueError, omniprefix.ConfigError, omniprefix.CacheError)):
        omniprefix.PrefixIndex(block_size=0)


def test_items_are_matched_by_content_not_token_ids():
    index = omniprefix.PrefixIndex(block_size=4)
    ids = [1, 2, 3, VISION_START, IMAGE_PAD, VISION_END, 4, 5, 6, 7, 8]  # 14 tokens expanded
    a = omniprefix.Prompt(ids, [omniprefix.Item("image", image_content(1), IMAGE_LAYOUT)], key=KEY)
    index.insert(a, [1, 2, 3])
    same = omniprefix.Prompt(ids, [omniprefix.Item("image", image_content(1).copy(), IMAGE_LAYOUT)], key=KEY)
    assert index.match(same).tokens == 12
    other = omniprefix.Prompt(ids, [omniprefix.Item("image", image_content(2), IMAGE_LAYOUT)], key=KEY)
    assert index.match(other).tokens == 4  # the text and vision_start only
    other_key = omniprefix.Prompt(ids, [omniprefix.Item("image", image_content(1), IMAGE_LAYOUT)], key=OTHER_KEY)
    assert index.match(other_key).tokens == 4
    tenant = omniprefix.Prompt(ids, [omniprefix.Item("image", image_content(1), IMAGE_LAYOUT)], key=KEY, tenant=3)
    assert index.match(tenant).tokens == 0
