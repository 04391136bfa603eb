"""Bad input raises the right exception and changes nothing.

Every case: the call raises ``TypeError`` / ``ValueError`` (Python-side type and value
problems) or the ``omniprefix.Error`` subclass of its family, with a message; afterwards the
engine's ``stats()`` are unchanged, ``validate()`` passes and the warm-up request still hits
the cache exactly as before (the cache is intact).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import omniprefix
from conftest import (
    BLOCK_SIZE,
    IMAGE_LAYOUT,
    IMAGE_TOKENS,
    image_content,
    image_embeddings,
    image_item,
    model_dir,
    random_ids,
    small_config,
    unexpanded_image,
)

E = omniprefix


class Guarded:
    """An engine with a warm request cached; ``reject`` checks one bad call against it."""

    def __init__(self, engine, warm: dict, warm_len: int):
        self.engine = engine
        self.warm = warm
        self.warm_len = warm_len
        first = engine.prefill(**warm)
        assert first.num_cached_tokens == 0
        self.want = first.hidden

    def reject(self, exc, call):
        before = self.engine.stats()
        with pytest.raises(exc) as info:
            call(self.engine)
        assert str(info.value), "the exception carries no message"
        assert self.engine.stats() == before, "a rejected call changed the engine's stats"
        self.engine.validate()
        again = self.engine.prefill(**self.warm)
        assert again.num_cached_tokens == self.warm_len - 1, "the cache lost the warm request"
        for name, h in again.hidden.items():
            assert np.array_equal(h, self.want[name]), name
        return info.value


WARM_TEXT = random_ids(100, 13)


@pytest.fixture()
def text_engine():
    engine = omniprefix.Engine.random(small_config(), 1, block_size=BLOCK_SIZE, num_blocks=32, tenants=[0, 1])
    return Guarded(engine, dict(token_ids=WARM_TEXT), len(WARM_TEXT))


IDS = [5, 6, 7, 8]

TEXT_CASES = {
    "negative id": (ValueError, lambda e: e.prefill([1, -1, 2])),
    "negative id in an array": (ValueError, lambda e: e.prefill(np.array([1, -3, 2], dtype=np.int64))),
    "float id": (TypeError, lambda e: e.prefill([1, 2.5, 3])),
    "integral float id": (TypeError, lambda e: e.prefill([1.0, 2.0])),
    "float array": (TypeError, lambda e: e.prefill(np.array([1.0, 2.0], dtype=np.float32))),
    "string id": (TypeError, lambda e: e.prefill([1, "2"])),
    "id at the vocab size": (E.RequestError, lambda e: e.prefill([1, 256, 2])),
    "id at u32::MAX": (E.RequestError, lambda e: e.prefill([1, 2**32 - 1])),
    "id past u32": (ValueError, lambda e: e.prefill([1, 2**32 + 1])),
    "huge id": (ValueError, lambda e: e.prefill([1, 2**70])),
    "id past u32 in an array": (ValueError, lambda e: e.prefill(np.array([1, 2**40], dtype=np.int64))),
    "2-D id array": ((TypeError, ValueError), lambda e: e.prefill(np.ones((2, 3), dtype=np.int64))),
    "empty prompt": (E.RequestError, lambda e: e.prefill([])),
    "prompt larger than the pool": (E.RequestError, lambda e: e.prefill(random_ids(9, 200))),
    "unknown tenant": (E.RequestError, lambda e: e.prefill(IDS, tenant=7)),
    "unknown placeholder form": (ValueError, lambda e: e.prefill(IDS, placeholders="sideways")),
    "max_tokens=0": (E.RequestError, lambda e: e.generate(IDS, max_tokens=0)),
    "top_p=2": (E.RequestError, lambda e: e.generate(IDS, max_tokens=4, temperature=1.0, top_p=2.0)),
    "top_p=0": (E.RequestError, lambda e: e.generate(IDS, max_tokens=4, temperature=1.0, top_p=0.0)),
    "top_k=0": (E.RequestError, lambda e: e.generate(IDS, max_tokens=4, temperature=1.0, top_k=0)),
    "negative temperature": (E.RequestError, lambda e: e.generate(IDS, max_tokens=4, temperature=-1.0)),
    "NaN temperature": (E.RequestError, lambda e: e.generate(IDS, max_tokens=4, temperature=float("nan"))),
    "stop id past the vocab": (E.RequestError, lambda e: e.generate(IDS, max_tokens=4, stop=[300])),
    "generation past the context": (E.RequestError, lambda e: e.generate(IDS, max_tokens=5000, ignore_eos=True)),
    "generate without max_tokens": (TypeError, lambda e: e.generate(IDS)),
    "bad id in generate": (ValueError, lambda e: e.generate([1, -2], max_tokens=2)),
    "stream with max_tokens=0": (E.RequestError, lambda e: next(iter(e.stream(IDS, max_tokens=0)))),
    "stream with top_p=2": (E.RequestError, lambda e: list(e.stream(IDS, max_tokens=3, temperature=1.0, top_p=2.0))),
    "stream with an id past the vocab": (E.RequestError, lambda e: list(e.stream([1, 999], max_tokens=3))),
}


@pytest.mark.parametrize("case", list(TEXT_CASES))
def test_bad_text_request_is_rejected_and_changes_nothing(text_engine, case):
    exc, call = TEXT_CASES[case]
    text_engine.reject(exc, call)


# ------------------------------------------------------------------ items (Omni thinker)

WARM_MM = [1, 2, 3] + unexpanded_image() + [4, 5]
MM_IDS = [7, 8] + unexpanded_image() + [9]


@pytest.fixture()
def mm_engine():
    engine = omniprefix.Engine.from_dir(model_dir("omni_thinker"), block_size=BLOCK_SIZE)
    return Guarded(engine, dict(token_ids=WARM_MM, items=[image_item(0)]), len(WARM_MM) + IMAGE_TOKENS - 1)


def float_content(value: float) -> np.ndarray:
    content = np.random.default_rng(3).standard_normal((4, 6, 3)).astype(np.float32)
    content[1, 2, 0] = value
    return content


def item_with(content=None, embeddings=None, layout=IMAGE_LAYOUT, modality="image", deepstack=None):
    content = image_content(1) if content is None else content
    embeddings = image_embeddings(1) if embeddings is None else embeddings
    return omniprefix.Item(modality, content, layout, embeddings=embeddings, deepstack=deepstack)


def send(*builders, ids=MM_IDS, **kw):
    """A prefill of the items ``builders`` make. Items are built inside the call: a check may
    fire at ``Item()`` or at the request, either way before anything changes."""
    return lambda e: e.prefill(ids, [build() for build in builders], **kw)


def bare(seed: int = 1):
    return lambda: omniprefix.Item("image", image_content(seed), IMAGE_LAYOUT)


MM_CASES = {
    "placeholder without an item": (E.RequestError, lambda e: e.prefill(MM_IDS, [])),
    "placeholder without items=None": (E.RequestError, lambda e: e.prefill(MM_IDS)),
    "item without a placeholder": (E.RequestError, send(item_with, lambda: item_with(content=image_content(2)))),
    "items for a text prompt": (E.RequestError, send(item_with, ids=[1, 2, 3])),
    "audio item at an image placeholder": (
        E.RequestError,
        send(lambda: omniprefix.Item("audio", np.zeros(1600, np.float32), {"kind": "audio", "mel_frames": 120}, embeddings=np.zeros((16, 64), np.float32))),
    ),
    "expanded run shorter than the layout": (
        E.RequestError,
        send(item_with, ids=[7, 250] + [254] * (IMAGE_TOKENS - 1) + [251], placeholders="expanded"),
    ),
    "embeddings with too few rows": (E.RequestError, send(lambda: item_with(embeddings=image_embeddings(1, rows=IMAGE_TOKENS - 1)))),
    "embeddings of the wrong width": (E.RequestError, send(lambda: item_with(embeddings=image_embeddings(1, hidden=32)))),
    "no embeddings and no encoder": (E.RequestError, send(bare())),
    "NaN in the content": (E.RequestError, send(lambda: item_with(content=float_content(np.nan)))),
    "Inf in the content": (E.RequestError, send(lambda: item_with(content=float_content(np.inf)))),
    "NaN in the embeddings": (
        (ValueError, E.RequestError),
        send(lambda: item_with(embeddings=np.where(np.arange(64) == 5, np.nan, image_embeddings(1)).astype(np.float32))),
    ),
    "Inf in the embeddings": (
        (ValueError, E.RequestError),
        send(lambda: item_with(embeddings=np.where(np.arange(64) == 5, np.inf, image_embeddings(1)).astype(np.float32))),
    ),
    "float64 content": (TypeError, send(lambda: item_with(content=np.zeros((4, 6, 3), np.float64)))),
    "bool content": (TypeError, send(lambda: item_with(content=np.zeros((4, 6, 3), bool)))),
    "complex content": (TypeError, send(lambda: item_with(content=np.zeros((4, 6, 3), np.complex64)))),
    "empty content": (E.RequestError, send(lambda: item_with(content=np.zeros((0, 6, 3), np.uint8)))),
    "unknown modality": (ValueError, send(lambda: item_with(modality="smell"))),
    "unknown layout kind": ((ValueError, E.RequestError), send(lambda: item_with(layout={"kind": "hologram", "grid_thw": [1, 4, 4]}))),
    "layout missing its grid": ((TypeError, ValueError, E.RequestError), send(lambda: item_with(layout={"kind": "image"}))),
    "grid that does not merge": ((ValueError, E.RequestError), send(lambda: item_with(layout={"kind": "image", "grid_thw": [1, 3, 5]}))),
    "layout of another modality": ((ValueError, E.RequestError), send(lambda: item_with(layout={"kind": "audio", "mel_frames": 120}))),
    "processed patches of the wrong row count": (
        E.RequestError,
        send(lambda: item_with(content=np.zeros((15, 8), np.float32))),
    ),
    "two DeepStack levels where the checkpoint has one": (
        E.RequestError,
        send(lambda: item_with(deepstack=[image_embeddings(1), image_embeddings(2)])),
    ),
    "DeepStack level of the wrong shape": (
        (ValueError, E.RequestError),
        send(lambda: item_with(deepstack=[image_embeddings(1, rows=IMAGE_TOKENS + 1)])),
    ),
    "encoder that is not callable": (TypeError, send(bare(), encoder=42)),
    "encoder returning the wrong shape": (
        E.RequestError,
        send(bare(), encoder=lambda item: np.zeros((IMAGE_TOKENS + 2, 64), np.float32)),
    ),
    "encoder returning NaN": (
        E.RequestError,
        send(bare(), encoder=lambda item: np.full((IMAGE_TOKENS, 64), np.nan, np.float32)),
    ),
    "encoder returning no array": (
        TypeError,
        send(bare(), encoder=lambda item: "rows"),
    ),
}


@pytest.mark.parametrize("case", list(MM_CASES))
def test_bad_multimodal_request_is_rejected_and_changes_nothing(mm_engine, case):
    exc, call = MM_CASES[case]
    mm_engine.reject(exc, call)


class EncoderFailure(Exception):
    pass


def test_encoder_exception_propagates_unchanged_and_nothing_is_cached(mm_engine):
    failure = EncoderFailure("the vision tower is down")
    calls = []

    def broken(item):
        calls.append(item)
        raise failure

    item = omniprefix.Item("image", image_content(21), IMAGE_LAYOUT)
    raised = mm_engine.reject(EncoderFailure, lambda e: e.prefill(MM_IDS, [item], encoder=broken))
    assert raised is failure
    assert len(calls) == 1

    # Nothing of the failed request was cached: the encoder runs again for the same image,
    # and the request's own prefix is new.
    rows = image_embeddings(21)
    good = []

    def working(item):
        good.append(item)
        return rows

    out = mm_engine.engine.prefill(MM_IDS, [item], encoder=working)
    assert len(good) == 1
    assert out.num_cached_tokens == 0
    mm_engine.engine.validate()


def test_encoder_exception_inside_generate_and_stream_propagates(mm_engine):
    failure = EncoderFailure("boom")

    def broken(item):
        raise failure

    item = omniprefix.Item("image", image_content(22), IMAGE_LAYOUT)
    assert mm_engine.reject(EncoderFailure, lambda e: e.generate(MM_IDS, [item], max_tokens=3, encoder=broken)) is failure
    assert mm_engine.reject(EncoderFailure, lambda e: list(e.stream(MM_IDS, [item], max_tokens=3, encoder=broken))) is failure


# ------------------------------------------------------------------ engine construction


def test_error_families_are_subclasses_of_omniprefix_error():
    families = [E.RequestError, E.CheckpointError, E.ConfigError, E.CacheError, E.GpuError, E.InternalError]
    assert issubclass(E.Error, Exception)
    for family in families:
        assert issubclass(family, E.Error), family
    assert len(set(families)) == len(families)
    for a in families:
        for b in families:
            assert a is b or not issubclass(a, b), (a, b)


@pytest.fixture()
def bystander():
    """An engine that must not notice other engines failing to open."""
    engine = omniprefix.Engine.random(small_config(), 3, block_size=BLOCK_SIZE)
    engine.prefill(WARM_TEXT)
    return engine


def broken_checkpoint(tmp_path, what: str) -> str:
    folder = tmp_path / what
    folder.mkdir()
    src = model_dir("qwen3_dense")
    if what == "no_weights":
        shutil.copy(f"{src}/config.json", folder / "config.json")
    elif what == "bad_config":
        (folder / "config.json").write_text("{ not json")
        shutil.copy(f"{src}/model.safetensors", folder / "model.safetensors")
    elif what == "bad_weights":
        shutil.copy(f"{src}/config.json", folder / "config.json")
        (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}garbage")
    elif what == "wrong_shapes":
        config = json.loads(open(f"{src}/config.json").read())
        config["hidden_size"] = 96
        (folder / "config.json").write_text(json.dumps(config))
        shutil.copy(f"{src}/model.safetensors", folder / "model.safetensors")
    return str(folder)


@pytest.mark.parametrize("what", ["no_weights", "bad_config", "bad_weights", "wrong_shapes"])
def test_broken_checkpoint_raises_checkpoint_error(tmp_path, bystander, what):
    before = bystander.stats()
    with pytest.raises(E.CheckpointError) as info:
        omniprefix.Engine.from_dir(broken_checkpoint(tmp_path, what))
    assert str(info.value)
    assert bystander.stats() == before
    assert bystander.prefill(WARM_TEXT).num_cached_tokens == len(WARM_TEXT) - 1


def test_missing_checkpoint_path_raises_checkpoint_error(tmp_path, bystander):
    with pytest.raises(E.CheckpointError) as info:
        omniprefix.Engine.from_dir(str(tmp_path / "no_such_model"))
    assert str(info.value)
    # A path that was there and is gone (a closed checkpoint).
    gone = tmp_path / "gone"
    shutil.copytree(model_dir("qwen3_dense"), gone)
    shutil.rmtree(gone)
    with pytest.raises(E.CheckpointError):
        omniprefix.Engine.from_dir(str(gone))
    bystander.validate()
    assert bystander.prefill(WARM_TEXT).num_cached_tokens == len(WARM_TEXT) - 1


QWEN3 = model_dir("qwen3_dense")

OPTION_CASES = {
    "unknown backend": (ValueError, dict(backend="tpu")),
    "unknown dtype": (ValueError, dict(dtype="f64")),
    # Element types of content tensors, never a weight or page precision.
    "integer dtype": (ValueError, dict(dtype="u8")),
    "integer kv_dtype": (ValueError, dict(kv_dtype="i32")),
    "fingerprint_key of 31 bytes": (ValueError, dict(fingerprint_key=b"k" * 31)),
    "fingerprint_key of 33 bytes": (ValueError, dict(fingerprint_key=b"k" * 33)),
    "empty fingerprint_key": (ValueError, dict(fingerprint_key=b"")),
    "fingerprint_key as a str of 32 non-hex characters": (ValueError, dict(fingerprint_key="k" * 32)),
    "fingerprint_key of 63 hex digits": (ValueError, dict(fingerprint_key="a" * 63)),
    "fingerprint_key as an int": (TypeError, dict(fingerprint_key=7)),
    "kv_replay without kv_events": (ValueError, dict(kv_replay="tcp://127.0.0.1:0")),
    "kv_linger_s without kv_events": (ValueError, dict(kv_linger_s=1.0)),
    "kv_events not a str": (TypeError, dict(kv_events=5557)),
    "kv_events not tcp": (E.ConfigError, dict(kv_events="inproc://kv")),
    "negative kv_linger_s": (ValueError, dict(kv_events="tcp://127.0.0.1:0", kv_linger_s=-1.0)),
    "infinite kv_linger_s": (ValueError, dict(kv_events="tcp://127.0.0.1:0", kv_linger_s=float("inf"))),
    "negative kv_buffer_steps": (ValueError, dict(kv_events="tcp://127.0.0.1:0", kv_buffer_steps=-1)),
    "capture layer past the model": (E.ConfigError, dict(capture=[0, 4, "final"])),
    "capture name past the model": (E.ConfigError, dict(capture=["hidden.9"])),
    "unknown capture preset": (ValueError, dict(capture="everything")),
    "malformed capture name": ((ValueError, E.ConfigError), dict(capture=["hidden.x"])),
    "negative capture layer": ((ValueError, E.ConfigError), dict(capture=[-1])),
    "block_size 0": (E.ConfigError, dict(block_size=0)),
    "num_blocks 0": (E.ConfigError, dict(num_blocks=0)),
    "unknown validation policy": ((ValueError, E.ConfigError), dict(validation="trust_me")),
    "tenants of strings": (TypeError, dict(tenants=["a"])),
}


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_bad_engine_option_raises(bystander, case):
    exc, options = OPTION_CASES[case]
    before = bystander.stats()
    with pytest.raises(exc) as info:
        omniprefix.Engine.from_dir(QWEN3, **options)
    assert str(info.value)
    with pytest.raises(exc):
        omniprefix.Engine.random(small_config(), 1, **options)
    assert bystander.stats() == before
    bystander.validate()


def test_bad_random_config_raises_checkpoint_error():
    with pytest.raises(E.CheckpointError):
        omniprefix.Engine.random({}, 1)
    with pytest.raises(TypeError):
        omniprefix.Engine.random("qwen3", 1)
