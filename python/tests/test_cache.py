"""Caching is invisible: a cached run returns the same bits as the uncached one."""

from __future__ import annotations

import numpy as np
import pytest

import omniprefix
from conftest import (
    BLOCK_SIZE,
    IMAGE_TOKENS,
    assert_bit_equal,
    image_item,
    model_dir,
    random_ids,
    unexpanded_image,
)


def test_second_prefill_is_cached_and_bit_equal_to_the_first_and_to_a_cache_off_engine(qwen3_config):
    ids = random_ids(1, 30)
    cached = omniprefix.Engine.random(qwen3_config, 7, block_size=BLOCK_SIZE, capture="all")
    uncached = omniprefix.Engine.random(qwen3_config, 7, block_size=BLOCK_SIZE, capture="all", cache=False)

    first = cached.prefill(ids)
    second = cached.prefill(ids)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == len(ids) - 1  # the last position always runs
    assert second.prompt_len == len(ids)
    assert_bit_equal("cached vs first", second.hidden, first.hidden)
    assert np.array_equal(second.last_logits, first.last_logits)

    off1, off2 = uncached.prefill(ids), uncached.prefill(ids)
    assert (off1.num_cached_tokens, off2.num_cached_tokens) == (0, 0)
    assert_bit_equal("cached vs cache=False", second.hidden, off2.hidden)
    assert np.array_equal(second.last_logits, off2.last_logits)

    # A longer prompt reuses every position of the first and still returns every row.
    longer = ids + random_ids(2, 9)
    ext = cached.prefill(longer)
    assert ext.num_cached_tokens == len(ids)
    for hidden in ext.hidden.values():
        assert hidden.shape[0] == len(longer)
    assert_bit_equal("extended vs cache=False", ext.hidden, uncached.prefill(longer).hidden)

    stats = cached.stats()
    assert stats["queries"] == 3
    assert stats["hits"] == 2
    assert stats["hit_tokens"] == len(ids) - 1 + len(ids)
    assert stats["finished"] == 3
    # One key per counter of the engine (the scheduler's flattened in), none hand-picked.
    assert stats["query_tokens"] == 2 * len(ids) + len(longer)
    assert (stats["waiting"], stats["running"], stats["blocks_in_use"]) == (0, 0, 0)
    assert set(stats) == {
        "queries", "query_tokens", "hits", "hit_tokens", "evicted_blocks", "preemptions", "block_copies",
        "blocks_free", "blocks_in_use", "blocks_cached", "waiting", "running", "encoder_cache_hits", "encoder_calls", "finished",
    }
    cached.validate()
    uncached.validate()


def test_generation_with_caching_equals_generation_without(qwen3_config):
    ids = random_ids(3, 21)
    on = omniprefix.Engine.random(qwen3_config, 5, block_size=BLOCK_SIZE)
    off = omniprefix.Engine.random(qwen3_config, 5, block_size=BLOCK_SIZE, cache=False)
    params = dict(max_tokens=9, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    a = on.generate(ids, **params)
    b = on.generate(ids, **params)
    c = off.generate(ids, **params)
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == len(ids) - 1 and c.num_cached_tokens == 0
    assert a.tokens == b.tokens == c.tokens
    assert_bit_equal("generate cached", b.hidden, a.hidden)
    assert_bit_equal("generate cache=False", c.hidden, a.hidden)
    # The next round re-sends prompt + reply: every position that ran is reused.
    nxt = on.prefill(ids + a.tokens + [5, 6])
    assert nxt.num_cached_tokens == len(ids) + len(a.tokens) - 1


def test_multimodal_prompt_is_cached_by_content_and_bit_equal_to_uncached():
    on = omniprefix.Engine.from_dir(model_dir("omni_thinker"), block_size=BLOCK_SIZE, capture="all")
    off = omniprefix.Engine.from_dir(model_dir("omni_thinker"), block_size=BLOCK_SIZE, capture="all", cache=False)
    ids = [1, 2, 3, 4, 5] + unexpanded_image() + [20, 21, 22]
    length = 5 + 1 + IMAGE_TOKENS + 1 + 3

    first = on.prefill(ids, [image_item(0)])
    # Another array object with the same bytes: the fingerprint, not the object, is the key.
    again = on.prefill(ids, [image_item(0, content=image_item(0).content.copy())])
    assert first.prompt_len == length
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, length - 1)
    assert_bit_equal("mm cached", again.hidden, first.hidden)
    assert_bit_equal("mm cache=False", off.prefill(ids, [image_item(0)]).hidden, first.hidden)

    # Another image with the same token ids: the cache stops where the image starts.
    other = on.prefill(ids, [image_item(1)])
    assert other.num_cached_tokens == 6  # text and vision_start only
    assert_bit_equal("mm other image", other.hidden, off.prefill(ids, [image_item(1)]).hidden)
    on.validate()


def test_tenants_never_share_cache_entries(qwen3_config):
    engine = omniprefix.Engine.random(qwen3_config, 1, block_size=BLOCK_SIZE, tenants=[0, 1])
    ids = random_ids(4, 17)
    a = engine.prefill(ids, tenant=0)
    b = engine.prefill(ids, tenant=1)
    c = engine.prefill(ids, tenant=1)
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens) == (0, 0, len(ids) - 1)
    assert_bit_equal("tenants", b.hidden, a.hidden)


def test_fingerprint_key_and_validation_policies_do_not_change_outputs():
    key = bytes(range(32))
    ids = [1, 2, 3, 4, 5] + unexpanded_image() + [9, 8]
    base = omniprefix.Engine.from_dir(model_dir("omni_thinker"), block_size=BLOCK_SIZE, cache=False)
    want = base.prefill(ids, [image_item(3)])
    for validation in ("second_digest", "exact_bytes", "unvalidated"):
        engine = omniprefix.Engine.from_dir(
            model_dir("omni_thinker"), block_size=BLOCK_SIZE, fingerprint_key=key, validation=validation
        )
        engine.prefill(ids, [image_item(3)])
        got = engine.prefill(ids, [image_item(3)])
        assert got.num_cached_tokens == len(want.hidden["hidden.0"]) - 1, validation
        assert_bit_equal(validation, got.hidden, want.hidden)
        engine.validate()


def test_small_pool_evicts_and_still_returns_the_same_outputs(qwen3_config):
    # 8 blocks of 4 tokens: the second prompt must evict the first one's blocks.
    engine = omniprefix.Engine.random(qwen3_config, 2, block_size=BLOCK_SIZE, num_blocks=8)
    off = omniprefix.Engine.random(qwen3_config, 2, block_size=BLOCK_SIZE, cache=False)
    a, b = random_ids(5, 24), random_ids(6, 24)
    engine.prefill(a)
    out_b = engine.prefill(b)
    out_a = engine.prefill(a)
    assert engine.stats()["evicted_blocks"] > 0
    assert_bit_equal("evicted a", out_a.hidden, off.prefill(a).hidden)
    assert_bit_equal("b", out_b.hidden, off.prefill(b).hidden)
    engine.validate()


@pytest.mark.parametrize("index", ["radix", "hashchain"])
@pytest.mark.parametrize("token_granular_reuse", [True, False])
def test_index_and_token_granular_reuse_are_engine_options(qwen3_config, index, token_granular_reuse):
    """Both indexes reuse a repeated prompt and give the uncached run's rows; a match that ends
    inside a block reuses that block's tokens only with token_granular_reuse (the hash chain
    matches whole blocks only)."""
    engine = omniprefix.Engine.random(qwen3_config, 3, block_size=4, index=index,
                                      token_granular_reuse=token_granular_reuse)
    ids = list(range(1, 15))
    first = engine.prefill(ids)
    again = engine.prefill(ids)
    assert first.num_cached_tokens == 0
    granular = index == "radix" and token_granular_reuse
    assert again.num_cached_tokens == (13 if granular else 12)
    for name, rows in first.hidden.items():
        assert np.array_equal(again.hidden[name], rows), name
    with pytest.raises(ValueError, match="hashchain"):
        omniprefix.Engine.random(qwen3_config, 3, index="trie")
    with pytest.raises(TypeError, match="token_granular_reuse must be a bool"):
        omniprefix.Engine.random(qwen3_config, 3, token_granular_reuse="yes")
