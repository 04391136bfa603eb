"""The disk tier from Python (``tier_dir`` / ``tier_bytes``): blocks one engine evicted are loaded
by another engine on the same directory, under the key kept there, with the outputs of an engine
that caches nothing; bad options are typed errors naming the field."""

from __future__ import annotations

import pytest

import omniprefix
from conftest import BLOCK_SIZE, assert_bit_equal, random_ids

#: A pool of 8 blocks of 4 tokens: a second 24-token prompt evicts the first one's blocks.
TINY_POOL = dict(block_size=BLOCK_SIZE, num_blocks=8, capture="all")


def test_a_second_engine_on_the_directory_loads_what_the_first_evicted(qwen3_config, tmp_path):
    tier = tmp_path / "tier"
    a, b = random_ids(5, 24), random_ids(6, 24)
    first = omniprefix.Engine.random(qwen3_config, 2, tier_dir=tier, **TINY_POOL)
    first.prefill(a)
    first.prefill(b)  # evicts a's blocks: down to the tier
    assert first.stats()["evicted_blocks"] > 0
    del first  # dropping an engine spills its cache and waits for the writes
    assert (tier / "fleet.key").is_file(), "no fingerprint_key: the key kept in the directory"

    # No key given here either: the directory's, so the first engine's files are found.
    second = omniprefix.Engine.random(qwen3_config, 2, tier_dir=str(tier), **TINY_POOL)
    off = omniprefix.Engine.random(qwen3_config, 2, block_size=BLOCK_SIZE, capture="all", cache=False)
    out_a = second.prefill(a)
    assert out_a.num_cached_tokens == len(a) - 1  # every full block from the tier, the last position runs
    assert_bit_equal("tier a vs cache=False", out_a.hidden, off.prefill(a).hidden)
    params = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    gen_b, want_b = second.generate(b, **params), off.generate(b, **params)
    assert gen_b.num_cached_tokens > 0
    assert gen_b.tokens == want_b.tokens
    assert_bit_equal("tier b vs cache=False", gen_b.hidden, want_b.hidden)

    tier_stats = second.stats()["tier"]
    assert tier_stats["hits"] > 0 and tier_stats["hit_tokens"] >= len(a) - 1, tier_stats
    assert set(tier_stats) == {"hits", "misses", "errors", "written", "write_drops", "evicted", "bytes",
                               "query_tokens", "hit_tokens"}
    assert f"omniprefix_tier_hits_total {tier_stats['hit_tokens']}\n" in second.metrics()
    second.validate()

    # A key given is kept: under another key the same directory's files are not this engine's.
    other = omniprefix.Engine.random(qwen3_config, 2, tier_dir=tier, fingerprint_key=bytes(range(32)), **TINY_POOL)
    assert other.prefill(a).num_cached_tokens == 0
    assert other.stats()["tier"]["hits"] == 0


def test_an_engine_without_a_tier_has_no_tier_stats(qwen3_config):
    assert "tier" not in omniprefix.Engine.random(qwen3_config, 0).stats()


def test_bad_tier_options_are_typed_errors_naming_the_field(qwen3_config, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_bytes(b"")
    cases = [
        (dict(tier_bytes=1 << 20), ValueError, "tier_bytes needs tier_dir"),
        (dict(tier_dir=tmp_path / "t0", tier_bytes=0), omniprefix.ConfigError, "tier_bytes"),
        (dict(tier_dir=tmp_path / "t1", tier_bytes=1), omniprefix.ConfigError, "tier_bytes"),
        (dict(tier_dir=tmp_path / "t2", tier_bytes=-1), ValueError, "tier_bytes"),
        (dict(tier_dir=tmp_path / "t3", tier_bytes="8GiB"), TypeError, "tier_bytes"),
        (dict(tier_dir=a_file), omniprefix.ConfigError, "tier_dir"),
        (dict(tier_dir=tmp_path / "t4", cache=False), omniprefix.ConfigError, "tier_dir"),
        (dict(tier_dir=5), TypeError, "tier_dir"),
    ]
    for options, error, field in cases:
        with pytest.raises(error, match=field):
            omniprefix.Engine.random(qwen3_config, 0, block_size=BLOCK_SIZE, **options)
