"""The checkpoint's own processor and towers as the engine's encoder (``omniprefix.encoder``).

The references are transformers' own: ``fixtures/make_mm_reference.py`` ran the processor and the
thinker's greedy ``generate`` on an image chat (two images of one size) and an audio chat, and
recorded the processor's tensors' sha256 and the replies. Here the same media go through
:class:`CheckpointEncoder` and our engine, which must give the same tensors and the same replies;
a repeated item must cost no encoder call; bad media must be a :class:`MediaError` naming the
item, with nothing cached.

Needs torch, transformers and torchvision (the fleet venv: ``scripts/test_fleet.sh`` runs this
file with ``OMNIPREFIX_REQUIRE_FLEET=1``, so they must be there).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import wave

import numpy as np
import pytest

import omniprefix
from conftest import FIXTURES, REPO_ROOT, importable

pytestmark = pytest.mark.skipif(
    not importable("torch", "transformers", "torchvision", "PIL", required_by="OMNIPREFIX_REQUIRE_FLEET"),
    reason="the checkpoint encoder needs torch, transformers and torchvision (scripts/install_fleet.sh)")

MODEL = FIXTURES / "omni_thinker"
REFERENCE = json.loads((MODEL / "mm_chat_reference.json").read_text())
CASES = {case["name"]: case for case in REFERENCE["cases"]}


@pytest.fixture(scope="module")
def encoder():
    from omniprefix.encoder import CheckpointEncoder

    return CheckpointEncoder.from_dir(MODEL)


def media(case: dict) -> bytes:
    return (REPO_ROOT / case["media"]["file"]).read_bytes()


def data_url(case: dict) -> str:
    mime = "image/png" if case["name"].startswith("image") else "audio/wav"
    return f"data:{mime};base64," + base64.b64encode(media(case)).decode()


def item_of(encoder, case: dict) -> omniprefix.Item:
    modality = "image" if case["name"].startswith("image") else "audio"
    return encoder.from_data_url(data_url(case), modality, f"{modality} 0")


def sha256(tensor) -> str:
    return hashlib.sha256(np.ascontiguousarray(tensor.numpy(), dtype=np.float32).tobytes()).hexdigest()


@pytest.mark.parametrize("name", ["image_a", "image_b"])
def test_an_image_item_has_the_processors_grid_and_feeds_the_tower_its_tensor(encoder, name):
    from PIL import Image

    case = CASES[name]
    item = item_of(encoder, case)
    assert item.layout == {"kind": "image", "grid_thw": case["image_grid_thw"]}
    assert item.num_tokens == case["image_tokens"]
    assert np.asarray(item.content).shape == (case["image_size_wh"][1], case["image_size_wh"][0], 3)
    # The pixels the encoder hands the image processor give transformers' pixel_values bit for bit.
    inputs = encoder.processor.image_processor(images=[Image.fromarray(np.asarray(item.content))], return_tensors="pt")
    assert sha256(inputs["pixel_values"]) == case["pixel_values"]["sha256"]


def test_an_audio_item_has_the_feature_extractors_frames_and_tensor(encoder):
    case = CASES["audio"]
    item = item_of(encoder, case)
    assert item.layout == {"kind": "audio", "mel_frames": case["audio_mel_frames"]}
    assert item.num_tokens == case["audio_tokens"]
    # The samples the encoder hands the feature extractor are the reference's (16-bit PCM / 32768)
    # bit for bit. The features' own digest is not compared: numpy's FFT picks its SIMD code by
    # CPU, so the log-mel bits differ between machines (AVX2 against AVX-512) for the same samples.
    with wave.open(io.BytesIO(media(case)), "rb") as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    np.testing.assert_array_equal(np.asarray(item.content), pcm.astype(np.float32) / np.float32(32768.0))
    assert np.asarray(item.content).shape == (case["audio_samples"],)
    fe = encoder.processor.feature_extractor
    inputs = fe([np.asarray(item.content)], sampling_rate=fe.sampling_rate, padding=True, truncation=False,
                return_attention_mask=True, return_tensors="pt")
    assert list(inputs["input_features"].shape) == case["input_features"]["shape"]


@pytest.mark.parametrize("name", ["image_a", "image_b", "audio"])
def test_greedy_replies_equal_transformers_and_a_repeat_runs_no_encoder(encoder, name):
    case = CASES[name]
    engine = omniprefix.Engine.from_dir(MODEL)
    ids = case["prompt_ids_unexpanded"]
    calls = dict(encoder.calls)
    first = engine.generate(ids, [item_of(encoder, case)], encoder=encoder, max_tokens=16, ignore_eos=True)
    # The engine never samples a placeholder id (a reply holding one could not be sent back), so the
    # reference is transformers' generate with those ids suppressed (equal to the free one for image_a).
    assert first.tokens == case["generated_pads_suppressed"]["ids"]
    modality = "image" if name.startswith("image") else "audio"
    assert encoder.calls[modality] == calls[modality] + 1
    # The same media again, decoded afresh: no encoder call, and the prompt is cached past the item.
    again = engine.generate(ids, [item_of(encoder, case)], encoder=encoder, max_tokens=16, ignore_eos=True)
    assert again.tokens == first.tokens
    assert encoder.calls[modality] == calls[modality] + 1
    stats = engine.stats()
    assert (stats["encoder_calls"], stats["encoder_cache_hits"]) == (1, 1)
    pad = engine.image_token_id if modality == "image" else engine.audio_token_id
    item_end = case["prompt_ids"].index(pad) + case["prompt_ids"].count(pad)
    assert again.num_cached_tokens >= item_end


def test_two_images_of_one_size_are_two_items(encoder):
    a, b = item_of(encoder, CASES["image_a"]), item_of(encoder, CASES["image_b"])
    assert a.layout == b.layout
    key = bytes(range(32))
    assert omniprefix.vllm_uuids([a], key=key) != omniprefix.vllm_uuids([b], key=key)


def wav_bytes(samples: np.ndarray, rate: int, width: int = 2) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes((samples * 32767).astype("<i2").tobytes())
    return out.getvalue()


def bad_media_cases() -> list[tuple[str, str, str]]:
    png = base64.b64encode((REPO_ROOT / CASES["image_a"]["media"]["file"]).read_bytes()).decode()
    tone = np.sin(np.arange(16000) / 10.0).astype(np.float32)
    return [
        ("image", "https://example.com/cat.png", "only data URLs"),
        ("image", "data:image/png," + png, "not base64"),
        ("image", "data:image/png;base64,%%%", "does not decode"),
        ("image", "data:image/png;base64," + png[:400], "not a readable image"),
        ("image", "data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), "not a readable image"),
        ("audio", "data:audio/wav;base64," + base64.b64encode(wav_bytes(tone, 8000)).decode(), "8000 Hz"),
        ("audio", "data:audio/wav;base64," + base64.b64encode(wav_bytes(tone, 16000)[:-100]).decode(), "truncated"),
        ("video", "data:video/mp4;base64,AAAA", "not supported"),
    ]


@pytest.mark.parametrize("modality,url,message", bad_media_cases())
def test_bad_media_is_a_media_error_naming_the_item(encoder, modality, url, message):
    from omniprefix.encoder import MediaError

    with pytest.raises(MediaError, match=message) as raised:
        encoder.from_data_url(url, modality, f"{modality} 3")
    assert str(raised.value).startswith(f"{modality} 3: ")


def test_limits_are_media_errors(encoder):
    from omniprefix.encoder import CheckpointEncoder, MediaError

    small = CheckpointEncoder(encoder.processor, encoder.visual, encoder.audio_tower, max_image_pixels=1000,
                              max_media_bytes=4096)
    url = data_url(CASES["image_a"])
    with pytest.raises(MediaError, match="over the limit of 4096"):
        small.from_data_url(url, "image", "image 0")
    with pytest.raises(MediaError, match="56x40 pixels, over the limit of 1000"):
        small.image(np.zeros((40, 56, 3), np.uint8))


def test_an_encoder_returning_nan_is_the_engines_typed_error_and_caches_nothing(encoder):
    case = CASES["image_a"]
    engine = omniprefix.Engine.from_dir(MODEL)

    def poisoned(item):
        embeddings, deepstack = encoder(item)
        embeddings = embeddings.copy()
        embeddings[3, 7] = np.nan
        return embeddings, deepstack

    before = engine.stats()
    with pytest.raises(omniprefix.RequestError, match="item 0"):
        engine.generate(case["prompt_ids_unexpanded"], [item_of(encoder, case)], encoder=poisoned, max_tokens=4)
    after = engine.stats()
    assert (after["encoder_cache_hits"], after["blocks_cached"], after["hits"]) == (
        before["encoder_cache_hits"], before["blocks_cached"], before["hits"])
    # The real encoder then runs (nothing poisoned was cached) and the reply is transformers'.
    good = engine.generate(case["prompt_ids_unexpanded"], [item_of(encoder, case)], encoder=encoder, max_tokens=16,
                           ignore_eos=True)
    assert good.tokens == case["generated_pads_suppressed"]["ids"]
