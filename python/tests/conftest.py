"""Shared helpers of the omniprefix Python test suite.

Fixtures are found relative to this file (``python/tests/../../fixtures/tiny``), so the
suite runs from any working directory against the repository it sits in.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import omniprefix

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent.parent
FIXTURES = REPO_ROOT / "fixtures" / "tiny"
EXAMPLES = TESTS_DIR.parent / "examples"

#: Relative error bound of every parity check: max|ours - ref| / max(|ref|).
TOLERANCE = 1e-4
#: The bound for bf16 weights, whose products read their input rounded to bf16: a sum that
#: lands the other side of a rounding tie moves a value a bf16 step (tests/engine/hf_parity.rs's
#: BF16_PRODUCTS_TOLERANCE, which says what it was measured at).
BF16_PRODUCTS_TOLERANCE = 1e-3
#: Tokens the committed ``generate_reference.safetensors`` hold per prompt.
GEN_TOKENS = 12
#: KV block size of the parity and caching tests (every prompt ends inside a block).
BLOCK_SIZE = 4

#: Checkpoints, their decoder layer counts, reference prompts and generate prompts.
MODELS = {
    "qwen3_dense": (3, ["text_a", "text_b", "text_c"], ["text_a", "text_b"]),
    "qwen2_dense": (2, ["text_a", "text_b", "text_c"], ["text_a", "text_b"]),
    "omni_thinker": (3, ["text_a", "text_b", "text_c", "mm"], ["mm_prefix", "text_c"]),
}

#: The layouts the fixture script gave HF's ``get_rope_index`` for the ``mm`` items
#: (``VERSIONS.json``, ``omni_thinker.mm_layout``); item j's rows are ``mm.item.<j>.embeds``.
MM_ITEMS: list[tuple[Any, dict[str, Any]]] = [
    ("image", {"kind": "image", "grid_thw": [1, 4, 6]}),
    ("audio", {"kind": "audio", "mel_frames": 120}),
    ("video", {"kind": "video", "grid_thw": [2, 4, 4], "seconds_per_grid": 1.0}),
]

#: The tiny Omni checkpoint's placeholder and marker ids, read from its ``thinker_config``
#: (``image`` is its ``image_token_id``, and so on).
_OMNI_THINKER = json.loads((FIXTURES / "omni_thinker" / "config.json").read_text())["thinker_config"]
OMNI: dict[str, int] = {
    name: _OMNI_THINKER[f"{name}_token_id"]
    for name in ("audio", "vision_start", "vision_end", "audio_start", "audio_end", "image", "video")
}

#: An image of the tiny Omni checkpoint: grid 1x4x4 patches, 2x2-merged into 4 tokens.
IMAGE_LAYOUT = {"kind": "image", "grid_thw": [1, 4, 4]}
IMAGE_TOKENS = 4


def model_dir(model: str) -> str:
    return str(FIXTURES / model)


def load_config(model: str = "qwen3_dense") -> dict:
    with open(FIXTURES / model / "config.json") as f:
        return json.load(f)


def load_reference(model: str, file: str = "reference.safetensors") -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(FIXTURES / model / file))


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """``max|ours - ref| / max(|ref|)``, as the Rust parity tests compute it."""
    assert ours.shape == ref.shape, f"shape {ours.shape} != reference {ref.shape}"
    assert ours.dtype == np.float32, f"dtype {ours.dtype}"
    scale = max(float(np.max(np.abs(ref))), 1e-6)
    diff = np.abs(ours.astype(np.float64) - ref.astype(np.float64))
    if np.isnan(diff).any():
        return float("inf")
    return float(diff.max()) / scale


def assert_close(label: str, ours: np.ndarray, ref: np.ndarray, tol: float = TOLERANCE) -> float:
    err = relative_error(ours, ref)
    if err > tol:
        bad = np.argwhere(np.abs(ours - ref) > tol * max(float(np.max(np.abs(ref))), 1e-6))
        pytest.fail(f"{label}: relative error {err:.3e} > {tol:.0e} (first at {bad[0].tolist()})")
    return err


def assert_bit_equal(label: str, a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    """The two capture dicts hold the same names, shapes and float bits."""
    assert list(a) == list(b), f"{label}: capture names {list(a)} != {list(b)}"
    for name in a:
        x, y = np.asarray(a[name]), np.asarray(b[name])
        assert x.shape == y.shape, f"{label} {name}: shape {x.shape} != {y.shape}"
        assert x.dtype == y.dtype == np.float32, f"{label} {name}: dtypes {x.dtype}, {y.dtype}"
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), f"{label} {name}: bits differ"


def all_captures(num_layers: int) -> list[str]:
    return [f"hidden.{k}" for k in range(num_layers + 1)] + ["hidden.final"]


def reference_name(prompt: str, capture: str, gen: bool = False) -> str:
    """The reference tensor of ``capture`` (``hidden.<k>`` / ``hidden.final``) for a prompt."""
    what = "final" if capture == "hidden.final" else capture
    return f"{prompt}.gen.{what}" if gen else f"{prompt}.{what}"


def stand_in_content(j: int) -> np.ndarray:
    """Stand-in item bytes (only fingerprinted: the embeddings are given), as the Rust tests use."""
    return np.full((8, 8, 3), j, dtype=np.uint8)


def mm_items(reference: dict[str, np.ndarray] | None = None) -> list:
    """The image, audio and video items of the Omni ``mm`` prompt with their embeddings."""
    reference = reference if reference is not None else load_reference("omni_thinker")
    return [
        omniprefix.Item(modality, stand_in_content(j), layout, embeddings=reference[f"mm.item.{j}.embeds"])
        for j, (modality, layout) in enumerate(MM_ITEMS)
    ]


def image_content(seed: int, shape=(16, 16, 3)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def image_embeddings(seed: int, rows: int = IMAGE_TOKENS, hidden: int = 64) -> np.ndarray:
    return np.random.default_rng(1000 + seed).standard_normal((rows, hidden)).astype(np.float32)


def image_item(seed: int = 0, *, with_embeddings: bool = True, content=None, embeddings=None):
    content = image_content(seed) if content is None else content
    if with_embeddings and embeddings is None:
        embeddings = image_embeddings(seed)
    return omniprefix.Item("image", content, IMAGE_LAYOUT, embeddings=embeddings if with_embeddings else None)


def unexpanded_image() -> list[int]:
    """``vision_start image_pad vision_end``: the engine expands the pad to the image's tokens."""
    return [OMNI["vision_start"], OMNI["image"], OMNI["vision_end"]]


def random_ids(seed: int, n: int, high: int = 240) -> list[int]:
    return np.random.default_rng(seed).integers(0, high, size=n).tolist()


def small_config() -> dict:
    """The tiny Qwen3 checkpoint's config.json (hidden 64, 3 layers, vocab 256)."""
    return load_config("qwen3_dense")


def large_config() -> dict:
    """A larger Qwen3-shaped config whose prefill of ~1-2k tokens takes a noticeable time."""
    config = copy.deepcopy(load_config("qwen3_dense"))
    layers = 4
    config.update(
        vocab_size=512, hidden_size=256, intermediate_size=768, max_position_embeddings=8192,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32,
        num_hidden_layers=layers, layer_types=["full_attention"] * layers,
    )
    return config


@pytest.fixture(scope="session")
def qwen3_config() -> dict:
    return small_config()


@pytest.fixture()
def engine(qwen3_config):
    """A fresh random tiny Qwen3 engine (4-token blocks, caching on)."""
    return omniprefix.Engine.random(qwen3_config, 1, block_size=BLOCK_SIZE)


@pytest.fixture(scope="session")
def omni_reference() -> dict[str, np.ndarray]:
    return load_reference("omni_thinker")


@pytest.fixture()
def omni_engine():
    """A fresh engine on the tiny Omni thinker checkpoint (4-token blocks, caching on)."""
    return omniprefix.Engine.from_dir(model_dir("omni_thinker"), block_size=BLOCK_SIZE)


def importable(*modules: str, required_by: str) -> bool:
    """Whether every module imports, for a ``skipif``. With the environment variable
    ``required_by`` set to 1 (CI), a missing module raises instead: the tests must run."""
    try:
        for name in modules:
            importlib.import_module(name)
    except ImportError:
        if os.environ.get(required_by) == "1":
            raise
        return False
    return True
