"""The wgpu backend through Python: the same hidden states and greedy tokens as the
CPU engine on a tiny checkpoint, and caching invisible on the GPU too.

Runs on whatever adapter wgpu opens (lavapipe in CI, where scripts/test.sh sets
WGPU_BACKEND=vulkan). Without an adapter it skips loudly, unless
OMNIPREFIX_REQUIRE_GPU=1 (CI) makes it fail, as the Rust GPU tests do.
"""

import os
import pathlib

import numpy as np
import pytest

import omniprefix

MODEL = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "tiny" / "qwen3_dense"
# The Rust wgpu parity tests hold the GPU engine to 1e-5 relative against the CPU one.
TOLERANCE = 1e-5


def relative_error(ours, want):
    return float(np.abs(ours - want).max() / max(float(np.abs(want).max()), 1e-30))


@pytest.fixture(scope="module")
def gpu_engine():
    try:
        return omniprefix.Engine.from_dir(MODEL, backend="wgpu", capture="all", block_size=4)
    except omniprefix.GpuError as error:
        if os.environ.get("OMNIPREFIX_REQUIRE_GPU") == "1":
            raise
        pytest.skip(f"!!! no GPU adapter: {error}")


@pytest.fixture(scope="module")
def cpu_engine():
    return omniprefix.Engine.from_dir(MODEL, backend="cpu", capture="all", block_size=4)


def test_wgpu_engine_names_its_adapter(gpu_engine):
    assert gpu_engine.backend.startswith("wgpu on ")


def test_wgpu_prefill_matches_cpu_and_caching_is_invisible(gpu_engine, cpu_engine):
    ids = np.arange(3, 40, dtype=np.int64) % 240
    want = cpu_engine.prefill(ids)
    first = gpu_engine.prefill(ids)
    again = gpu_engine.prefill(ids)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == len(ids) - 1
    assert sorted(first.hidden) == sorted(want.hidden) == sorted(gpu_engine.capture)
    for name, rows in want.hidden.items():
        assert first.hidden[name].shape == rows.shape
        assert relative_error(first.hidden[name], rows) <= TOLERANCE, name
        assert relative_error(again.hidden[name], first.hidden[name]) <= TOLERANCE, name
    assert relative_error(first.last_logits, want.last_logits) <= TOLERANCE


def test_wgpu_greedy_generation_matches_cpu(gpu_engine, cpu_engine):
    ids = list(range(5, 19))
    want = cpu_engine.generate(ids, max_tokens=8, ignore_eos=True)
    got = gpu_engine.generate(ids, max_tokens=8, ignore_eos=True)
    assert got.tokens == want.tokens
    assert got.finish_reason == "length"
    for name, rows in want.hidden.items():
        assert got.hidden[name].shape == (len(ids) + 8 - 1, gpu_engine.hidden_size)
        assert relative_error(got.hidden[name], rows) <= TOLERANCE, name


def test_wgpu_stores_f32_weights_only(gpu_engine):
    assert gpu_engine.dtype == "f32"
    with pytest.raises(omniprefix.ConfigError, match="wgpu"):
        omniprefix.Engine.from_dir(MODEL, backend="wgpu", dtype="bf16")
