"""Speech through the Python API on the tiny full Qwen3-Omni fixture (``fixtures/tiny/omni_audio``).

``generate(..., audio=True)`` against transformers' ``generate(return_audio=True)`` (the
committed ``audio_reference.safetensors``, case ``text``, greedy thinker and talker): codes
equal, waveform within 1e-4, as ``tests/engine/speech_parity.rs`` requires of the Rust engine;
streamed ``AudioChunk`` s concatenate to the final audio, sync and async; bad speech requests
are ``RequestError`` s that change nothing.
"""

from __future__ import annotations

import ast
import asyncio
import json
import pathlib
import re

import numpy as np
import pytest

import omniprefix
from conftest import FIXTURES, REPO_ROOT, load_reference, model_dir

MODEL = "omni_audio"
#: HF's kwargs of the fixture: the thinker's reply length and suppressed ids, the talker's cap.
RECORDED = json.loads((FIXTURES / MODEL / "audio_reference.json").read_text())
KWARGS = RECORDED["generate_kwargs"]
TALKER = {"temperature": 0, "max_tokens": RECORDED["cases"]["text"]["talker_max_new_tokens"]}


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    return load_reference(MODEL, "audio_reference.safetensors")


@pytest.fixture(scope="module")
def engine() -> omniprefix.Engine:
    return omniprefix.Engine.from_dir(model_dir(MODEL))


def request(ref):
    """Case ``text``'s prompt and HF's thinker settings (greedy, its suppress list)."""
    return dict(token_ids=ref["text.input_ids"], max_tokens=KWARGS["thinker_max_new_tokens"],
                suppress_ids=KWARGS["thinker_suppress_tokens"])


def speak(ref):
    return dict(request(ref), audio=True, speaker="ethan", talker=TALKER)


def assert_equals_hf(gen: omniprefix.Generation, ref) -> None:
    ids = ref["text.input_ids"]
    assert gen.tokens == ref["text.thinker_sequences"][len(ids):].tolist(), "thinker reply"
    assert gen.codes is not None and gen.audio is not None
    assert gen.codes.dtype == np.int64
    assert gen.codes.shape == ref["text.codes"].shape  # [16 code groups, frames]
    np.testing.assert_array_equal(gen.codes, ref["text.codes"])
    assert gen.audio.dtype == np.float32
    assert gen.audio.shape == ref["text.waveform"].shape
    worst = float(np.max(np.abs(gen.audio - ref["text.waveform"])))
    assert worst <= 1e-4, f"waveform differs by {worst}"
    assert gen.sample_rate == RECORDED["sample_rate"]
    assert gen.talker_prompt_rows == RECORDED["cases"]["text"]["talker_prefill_rows"]
    assert gen.talker_cached_rows is not None and 0 <= gen.talker_cached_rows <= gen.talker_prompt_rows
    assert gen.audio_finish_reason in ("stop", "length")
    assert gen.ttfa_s is not None and 0 < gen.ttfa_s <= gen.timings["total"] / 1000 + 1e-6


def test_greedy_audio_equals_transformers(engine, ref):
    gen = engine.generate(**speak(ref))
    assert_equals_hf(gen, ref)
    assert "audio_frames=" in repr(gen)
    # Asked again: the same speech (the thinker's prompt now cached).
    again = engine.generate(**speak(ref))
    np.testing.assert_array_equal(again.codes, gen.codes)
    np.testing.assert_array_equal(again.audio, gen.audio)


def test_without_audio_the_speech_fields_are_none(engine, ref):
    gen = engine.generate(**request(ref))
    for field in ("codes", "audio", "sample_rate", "ttfa_s", "talker_prompt_rows", "talker_cached_rows",
                  "audio_finish_reason"):
        assert getattr(gen, field) is None, field
    # A stream that asked for no audio yields (token, rows) tuples only, as always.
    items = list(engine.stream(**request(ref)))
    assert all(isinstance(i, tuple) for i in items)
    assert [t for t, _ in items] == gen.tokens


def split(items):
    tokens = [i[0] for i in items if not isinstance(i, omniprefix.AudioChunk)]
    chunks = [i for i in items if isinstance(i, omniprefix.AudioChunk)]
    return tokens, chunks


def assert_chunks_make(chunks, gen) -> None:
    assert len(chunks) > 1, "audio came in chunks"
    offset = 0
    for chunk in chunks:
        assert chunk.offset == offset
        assert chunk.sample_rate == gen.sample_rate
        assert chunk.samples.dtype == np.float32
        assert len(chunk) == len(chunk.samples) > 0
        offset += len(chunk)
    np.testing.assert_array_equal(np.concatenate([c.samples for c in chunks]), gen.audio)


def test_streamed_audio_chunks_concatenate_to_the_final_audio(engine, ref):
    stream = engine.stream(**speak(ref))
    tokens, chunks = split(list(stream))
    gen = stream.generation
    assert gen is not None
    assert_equals_hf(gen, ref)
    assert tokens == gen.tokens
    assert_chunks_make(chunks, gen)
    assert "AudioChunk(offset=0" in repr(chunks[0])


def test_next_batch_and_the_pump_hand_on_audio_chunks(engine, ref):
    stream = engine.stream(**speak(ref))
    items = []
    while batch := stream.next_batch():
        items.extend(batch)
    tokens, chunks = split(items)
    assert tokens == stream.generation.tokens
    assert_chunks_make(chunks, stream.generation)

    pump = omniprefix.EventPump()
    stream = engine.stream(**speak(ref), pump=pump)
    pump.watch(stream)
    items, end = [], None
    while end is None:
        for request_id, found, ended in pump.wait(5.0):
            assert request_id == stream.request_id
            items.extend(found)
            end = ended
    assert end is True
    tokens, chunks = split(items)
    assert tokens == stream.generation.tokens
    assert_chunks_make(chunks, stream.generation)


def test_async_engine_speaks_the_same(ref):
    want = omniprefix.Engine.from_dir(model_dir(MODEL)).generate(**speak(ref))

    async def main():
        engine = omniprefix.AsyncEngine.from_dir(model_dir(MODEL))
        try:
            gen = await engine.generate(**speak(ref))
            stream = engine.stream(**speak(ref))
            items = [item async for item in stream]
            return gen, items, stream.generation
        finally:
            engine.close()

    gen, items, streamed = asyncio.run(main())
    assert_equals_hf(gen, ref)
    np.testing.assert_array_equal(gen.audio, want.audio)
    tokens, chunks = split(items)
    assert tokens == streamed.tokens == want.tokens
    assert_chunks_make(chunks, streamed)


def test_bad_speech_requests_are_request_errors_that_change_nothing(engine, ref):
    before = engine.stats()
    with pytest.raises(omniprefix.RequestError, match="nobody") as info:
        engine.generate(**dict(speak(ref), speaker="nobody"))
    assert "ethan" in str(info.value), "the error lists the known speakers"
    for talker, name in [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_new_tokens"),
        ({"bogus": 1, "max_new_tokens": 3}, "bogus"),
        ({"temperature": "hot"}, "talker options"),
    ]:
        with pytest.raises(omniprefix.RequestError, match=name):
            engine.generate(**dict(speak(ref), talker=talker))
    with pytest.raises(omniprefix.RequestError, match="first_chunk"):
        engine.generate(**speak(ref), audio_first_chunk=0)
    with pytest.raises(omniprefix.RequestError, match='unknown talker option "x"'):
        engine.stream(**dict(speak(ref), talker={"x": 1}))
    with pytest.raises(TypeError, match="need audio=True"):
        engine.generate(**request(ref), speaker="ethan")
    assert engine.stats() == before
    engine.validate()


def test_a_checkpoint_without_a_talker_cannot_speak(ref):
    plain = omniprefix.Engine.from_dir(model_dir("omni_thinker"))
    with pytest.raises(omniprefix.RequestError, match="talker"):
        plain.generate(ref["text.input_ids"], max_tokens=2, audio=True)
    with pytest.raises(omniprefix.RequestError, match="talker"):
        plain.stream(ref["text.input_ids"], max_tokens=2, audio=True)


def test_speech_off_serves_the_thinker_alone_and_the_talker_pool_is_sized_by_its_options(ref):
    silent = omniprefix.Engine.from_dir(model_dir(MODEL), speech=False)
    with pytest.raises(omniprefix.RequestError, match="talker"):
        silent.generate(**speak(ref))
    assert silent.generate(**request(ref)).tokens, "the thinker still answers"
    # A talker pool of 2 blocks of 4 rows cannot hold the reply's talker rows: refused, typed.
    small = omniprefix.Engine.from_dir(model_dir(MODEL), talker_num_blocks=2, talker_block_size=4)
    with pytest.raises(omniprefix.RequestError, match="blocks"):
        small.generate(**speak(ref))
    with pytest.raises(omniprefix.ConfigError, match="block_size"):
        omniprefix.Engine.from_dir(model_dir(MODEL), talker_block_size=0)


def test_audio_yield_s_is_seconds_and_leaves_the_audio_as_it_is(ref):
    """First audio first changes when chunks are decoded, never the samples; its option is a
    non-negative number of seconds, refused otherwise with the option's name."""
    audio = [omniprefix.Engine.from_dir(model_dir(MODEL), audio_yield_s=s).generate(**speak(ref)).audio
             for s in (0.0, 2.5)]
    assert np.array_equal(audio[0], audio[1])
    with pytest.raises(ValueError, match="audio_yield_s"):
        omniprefix.Engine.from_dir(model_dir(MODEL), audio_yield_s=-1.0)
    with pytest.raises(TypeError, match="audio_yield_s"):
        omniprefix.Engine.from_dir(model_dir(MODEL), audio_yield_s="1s")


def test_the_stub_declares_the_talker_options_the_extension_accepts(engine, ref):
    with pytest.raises(omniprefix.RequestError, match="unknown talker option") as info:
        engine.generate(**dict(speak(ref), talker={"no_such_option": 1}))
    accepted = set(re.search(r"the talker options are (.*)$", str(info.value)).group(1).split(", "))
    stub = ast.parse((pathlib.Path(omniprefix.__file__).parent / "_omniprefix.pyi").read_text())
    cls = next(n for n in stub.body if isinstance(n, ast.ClassDef) and n.name == "TalkerOptions")
    assert {f.target.id for f in cls.body if isinstance(f, ast.AnnAssign)} == accepted
    assert "max_tokens" in accepted and "max_new_tokens" not in accepted


def test_the_docs_speech_example_runs(monkeypatch):
    """The python block of docs/python.md's Speech section runs as written (from the repository root)."""
    text = (REPO_ROOT / "docs" / "python.md").read_text()
    section = text.split("\n## Speech\n", 1)[1]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(REPO_ROOT)
    exec(compile(block, "docs/python.md#speech", "exec"), {})
