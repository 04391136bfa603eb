"""In-process parity with Hugging Face transformers on the tiny fixtures.

The committed references were made by transformers (``fixtures/make_tiny_models.py``):
``reference.safetensors`` (one forward: every hidden state, the final norm, every row's
logits) and ``generate_reference.safetensors`` (greedy ``generate``, 12 tokens, no eos).
Every tensor must match within 1e-4 relative error, ``max|ours - ref| / max(|ref|)``,
as ``tests/engine/hf_parity.rs`` and ``tests/engine/hf_generate.rs`` require of the Rust engine.
"""

from __future__ import annotations

import numpy as np
import pytest

import omniprefix
from conftest import (
    BF16_PRODUCTS_TOLERANCE,
    BLOCK_SIZE,
    GEN_TOKENS,
    MODELS,
    TOLERANCE,
    all_captures,
    assert_bit_equal,
    assert_close,
    load_reference,
    mm_items,
    model_dir,
    reference_name,
)

PREFILL_CASES = [(m, p) for m, (_, prompts, _) in MODELS.items() for p in prompts]
GENERATE_CASES = [(m, p) for m, (_, _, prompts) in MODELS.items() for p in prompts]


def open_engine(model: str, **options) -> omniprefix.Engine:
    return omniprefix.Engine.from_dir(model_dir(model), block_size=BLOCK_SIZE, capture="all", **options)


def request_of(model: str, prompt: str, ids: np.ndarray):
    """Token ids and items of a recorded prompt (``mm`` prompts: expanded placeholders + item embeddings)."""
    if prompt.startswith("mm"):
        return dict(token_ids=ids, items=mm_items(), placeholders="expanded")
    return dict(token_ids=ids)


@pytest.mark.parametrize("model,prompt", PREFILL_CASES)
def test_prefill_matches_transformers(model, prompt):
    num_layers = MODELS[model][0]
    ref = load_reference(model)
    ids = ref[f"{prompt}.input_ids"]
    engine = open_engine(model)
    assert engine.capture == all_captures(num_layers)
    assert engine.num_layers == num_layers
    assert engine.hidden_size == 64
    assert engine.vocab_size == 256
    assert engine.block_size == BLOCK_SIZE

    out = engine.prefill(**request_of(model, prompt, ids))
    assert out.prompt_len == len(ids)
    assert out.num_cached_tokens == 0
    assert list(out.hidden) == all_captures(num_layers)
    for name, hidden in out.hidden.items():
        assert hidden.dtype == np.float32
        assert hidden.shape == (len(ids), 64), name
        assert_close(f"{model}/{prompt} {name}", hidden, ref[reference_name(prompt, name)])
    assert out.last_logits.dtype == np.float32
    assert out.last_logits.shape == (256,)
    assert_close(f"{model}/{prompt} last_logits", out.last_logits, ref[f"{prompt}.logits"][-1])
    for key in ("preprocess", "schedule", "forward", "total"):
        assert out.timings[key] >= 0.0, key


@pytest.mark.parametrize("dtype,tol", [("bf16", BF16_PRODUCTS_TOLERANCE), ("f16", TOLERANCE)])
@pytest.mark.parametrize("model", ["qwen3_dense", "omni_thinker"])
def test_half_precision_weights_match_transformers_over_the_same_rounded_weights(model, dtype, tol):
    """``dtype=`` stores the matrices rounded to bf16 / f16 and computes in f32 between products
    (bf16 products read their input rounded to bf16): transformers over the same rounded weights
    (and, for bf16, inputs; ``fixtures/make_half_references.py``) within ``TOLERANCE``
    (``BF16_PRODUCTS_TOLERANCE`` for bf16), and a cached rerun bit-identical."""
    ref = load_reference(model, f"{dtype}_weights_reference.safetensors")
    engine = open_engine(model, dtype=dtype)
    assert engine.dtype == dtype
    assert open_engine(model).dtype == "f32", "auto is the checkpoint's own dtype"
    for prompt in ("text_a", "text_b"):
        ids = ref[f"{prompt}.input_ids"]
        out = engine.prefill(ids)
        for name, hidden in out.hidden.items():
            assert_close(f"{model}/{prompt} {dtype} {name}", hidden, ref[reference_name(prompt, name)], tol)
        again = engine.prefill(ids)
        assert again.num_cached_tokens > 0
        assert_bit_equal(f"{model}/{prompt} {dtype} cached", again.hidden, out.hidden)


@pytest.mark.parametrize("kv_dtype,tol", [("f16", 5e-3), ("bf16", 3e-2)])
def test_half_precision_kv_pages_stay_close_to_transformers_and_caching_stays_invisible(kv_dtype, tol):
    """``kv_dtype=`` rounds the K/V pages only: within the rounding of transformers' f32 run,
    and a cached rerun bit-identical."""
    ref = load_reference("qwen3_dense")
    ids = ref["text_c.input_ids"]
    engine = open_engine("qwen3_dense", kv_dtype=kv_dtype)
    out = engine.prefill(ids)
    for name, hidden in out.hidden.items():
        assert_close(f"kv {kv_dtype} {name}", hidden, ref[reference_name("text_c", name)], tol=tol)
    again = engine.prefill(ids)
    assert again.num_cached_tokens > 0
    assert_bit_equal(f"kv {kv_dtype} cached", again.hidden, out.hidden)
    with pytest.raises(ValueError, match="kv_dtype"):
        open_engine("qwen3_dense", kv_dtype="auto")


@pytest.mark.parametrize("model,prompt", GENERATE_CASES)
def test_generate_matches_transformers_and_the_cached_rounds_are_bit_identical(model, prompt):
    num_layers = MODELS[model][0]
    ref = load_reference(model, "generate_reference.safetensors")
    ids = ref[f"{prompt}.input_ids"]
    hf_tokens = ref[f"{prompt}.gen.tokens"].tolist()
    assert len(hf_tokens) == GEN_TOKENS
    length = len(ids)
    engine = open_engine(model)

    first = engine.generate(**request_of(model, prompt, ids), max_tokens=GEN_TOKENS, ignore_eos=True)
    assert (first.prompt_len, first.num_cached_tokens) == (length, 0)
    assert first.finish_reason == "length"
    assert first.tokens == hf_tokens, "tokens differ from transformers' generate"
    assert all(type(t) is int for t in first.tokens)
    assert list(first.hidden) == all_captures(num_layers)
    for name, hidden in first.hidden.items():
        assert hidden.shape == (length + GEN_TOKENS - 1, 64), name
        assert_close(f"{model}/{prompt} generate {name}", hidden, ref[reference_name(prompt, name, gen=True)])
    for key in ("preprocess", "ttft", "total"):
        assert first.timings[key] >= 0.0, key
    assert first.decode_tokens_per_s > 0.0
    assert len(first.timings["itl"]) == GEN_TOKENS - 1

    # The same prompt again: everything but its last position is cached, outputs unchanged.
    again = engine.generate(**request_of(model, prompt, ids), max_tokens=GEN_TOKENS, ignore_eos=True)
    assert again.num_cached_tokens == length - 1
    assert again.tokens == first.tokens
    assert_bit_equal(f"{model}/{prompt} again", again.hidden, first.hidden)

    # Prompt + reply as the next round: every position that ran is reused, and the one
    # token generated is transformers' 12th.
    resent = np.concatenate([np.asarray(ids, dtype=np.int64), np.asarray(hf_tokens[:-1], dtype=np.int64)])
    nxt = engine.generate(**request_of(model, prompt, resent), max_tokens=1, ignore_eos=True)
    assert nxt.prompt_len == length + GEN_TOKENS - 1
    assert nxt.num_cached_tokens == length + GEN_TOKENS - 2
    assert nxt.tokens == hf_tokens[-1:]
    assert_bit_equal(f"{model}/{prompt} follow-up", nxt.hidden, first.hidden)
    engine.validate()


def test_default_capture_is_embeddings_middle_layer_and_final():
    engine = omniprefix.Engine.from_dir(model_dir("qwen3_dense"))
    assert engine.capture == ["hidden.0", "hidden.1", "hidden.final"]
    assert engine.block_size == 16
    assert isinstance(engine.backend, str) and "cpu" in engine.backend.lower()
    assert engine.eos_token_ids == []  # the tiny fixtures carry no eos


def test_capture_list_selects_layers_and_final():
    ref = load_reference("qwen3_dense")
    ids = ref["text_a.input_ids"]
    engine = omniprefix.Engine.from_dir(model_dir("qwen3_dense"), capture=[0, 2, "final"])
    assert engine.capture == ["hidden.0", "hidden.2", "hidden.final"]
    out = engine.prefill(ids)
    assert list(out.hidden) == ["hidden.0", "hidden.2", "hidden.final"]
    for name, hidden in out.hidden.items():
        assert_close(name, hidden, ref[reference_name("text_a", name)])
    named = omniprefix.Engine.from_dir(model_dir("qwen3_dense"), capture=["hidden.3", "final"])
    assert named.capture == ["hidden.3", "hidden.final"]


def test_token_ids_as_list_or_any_integer_array_give_the_same_output():
    ref = load_reference("qwen3_dense")
    ids = ref["text_b.input_ids"]
    outs = []
    for form in (ids.tolist(), ids.astype(np.int64), ids.astype(np.int32), ids.astype(np.uint32), ids.astype(np.uint16), ids[::-1].copy()[::-1]):
        engine = omniprefix.Engine.from_dir(model_dir("qwen3_dense"), cache=False)
        outs.append(engine.prefill(form))
    for out in outs[1:]:
        assert_bit_equal("token id forms", out.hidden, outs[0].hidden)


@pytest.mark.parametrize("model,context", [("qwen3_dense", 4096), ("omni_thinker", 4096)])
def test_the_engine_says_its_context_and_pool_as_the_checkpoint_and_options_do(model, context):
    """What a worker registers with a router comes from the engine, not from its own reading of
    config.json (an Omni checkpoint nests the text config under thinker_config)."""
    engine = omniprefix.Engine.from_dir(model_dir(model), num_blocks=96)
    assert (engine.context_len, engine.num_blocks) == (context, 96)
    assert omniprefix.checkpoint_context_len(model_dir(model)) == context
    assert omniprefix.Engine.from_dir(model_dir(model)).num_blocks == 1024  # SchedulerConfig's default


def test_every_default_block_size_is_the_engines():
    """`DEFAULT_BLOCK_SIZE` is the engine's default, and what the matcher, `block_hashes` and the
    edge's speech router take when not told: a router keyed on another size would hash other blocks."""
    from omniprefix.edge import parse_args

    engine = omniprefix.Engine.from_dir(model_dir("qwen3_dense"))
    assert engine.block_size == omniprefix.DEFAULT_BLOCK_SIZE == 16
    assert omniprefix.PrefixIndex().block_size == omniprefix.DEFAULT_BLOCK_SIZE
    ids = list(range(1, 2 * omniprefix.DEFAULT_BLOCK_SIZE + 1))
    key = bytes(32)
    assert omniprefix.block_hashes(ids, fingerprint_key=key) == omniprefix.block_hashes(
        ids, fingerprint_key=key, block_size=omniprefix.DEFAULT_BLOCK_SIZE)
    assert len(omniprefix.block_hashes(ids, fingerprint_key=key)) == 2
    assert parse_args(["--upstream", "http://127.0.0.1:1"]).block_size == omniprefix.DEFAULT_BLOCK_SIZE
