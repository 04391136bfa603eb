"""``omniprefix.speech`` without a fleet: the checks of a spoken chat request, the PCM16
quantisation and the WAV the edge answers with, the voices of a checkpoint."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest

from conftest import FIXTURES
from omniprefix.openai_checks import Limits, Rejected, check_request
from omniprefix.speech import MAX_TALKER_TOKENS, SpeechCaps, check_speech, pcm16, speech_caps, wants_audio, wav_bytes

CAPS = SpeechCaps(("chelsie", "ethan", "aiden"))


def body(**fields):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"],
            "audio": {"voice": "ethan", "format": "wav"}, **fields}


def test_the_voices_are_the_checkpoints_speakers():
    caps = speech_caps(FIXTURES / "omni_audio")
    assert caps is not None and sorted(caps.voices) == ["aiden", "chelsie", "ethan"]
    assert speech_caps(FIXTURES / "omni_thinker") is None
    assert speech_caps(FIXTURES / "qwen3_dense") is None


def test_a_good_request_and_its_defaults():
    assert wants_audio(body()) and not wants_audio({"modalities": ["text"]}) and not wants_audio({})
    got = check_speech(body(stream=True, audio={"voice": "aiden", "format": "pcm16"},
                            talker={"temperature": 0, "max_tokens": 7}), CAPS)
    assert (got.voice, got.format, got.stream, got.talker) == ("aiden", "pcm16", True,
                                                               {"temperature": 0.0, "max_tokens": 7})
    assert check_speech(body(), CAPS).talker == {}
    # The generic checks let the speech fields through when audio is asked for, and only then.
    check_request("/v1/chat/completions", body(talker={"temperature": 1}), Limits(1 << 20))
    with pytest.raises(Rejected) as e:
        check_request("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                               "talker": {"temperature": 0}}, Limits(1 << 20))
    assert e.value.param == "talker"


@pytest.mark.parametrize("fields, caps, param", [
    ({}, None, "modalities"),
    ({"modalities": ["audio", "image"]}, CAPS, "modalities"),
    ({"audio": "ethan"}, CAPS, "audio"),
    ({"audio": {"voice": "ethan", "format": "wav", "speed": 2}}, CAPS, "audio.speed"),
    ({"audio": {"voice": "Ethan", "format": "wav"}}, CAPS, "audio.voice"),
    ({"audio": {"voice": "ethan", "format": "flac"}}, CAPS, "audio.format"),
    ({"stream": True}, CAPS, "audio.format"),
    ({"talker": [0]}, CAPS, "talker"),
    ({"talker": {"temperature": float("nan")}}, CAPS, "talker.temperature"),
    ({"talker": {"temperature": 2.5}}, CAPS, "talker.temperature"),
    ({"talker": {"temperature": True}}, CAPS, "talker.temperature"),
    ({"talker": {"max_tokens": MAX_TALKER_TOKENS + 1}}, CAPS, "talker.max_tokens"),
    ({"talker": {"max_tokens": 1.0}}, CAPS, "talker.max_tokens"),
    ({"talker": {"seed": 1}}, CAPS, "talker.seed"),
])
def test_each_bad_field_is_named(fields, caps, param):
    with pytest.raises(Rejected) as e:
        check_speech(body(**fields), caps)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_pcm16_rounds_and_clips_and_the_wav_holds_it():
    samples = np.array([0.0, 1.0, -1.0, 2.0, -3.0, 0.5, 1 / 65534, -1e-6], dtype=np.float32)
    ints = np.frombuffer(pcm16(samples), dtype="<i2")
    assert ints.tolist() == [0, 32767, -32767, 32767, -32767, 16384, 0, 0]
    data = wav_bytes(pcm16(samples), 24000)
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, 24000, len(samples))
        assert w.readframes(len(samples)) == pcm16(samples)
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"


def test_the_standalone_edge_routes_speech_only_with_a_checkpoint():
    from omniprefix.edge import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--upstream", "http://127.0.0.1:1", "--speech-router", "kv"])
    args = parse_args(["--upstream", "http://127.0.0.1:1", "--model-dir", str(FIXTURES / "omni_audio"),
                       "--speech-router", "round-robin", "--block-size", "8"])
    assert (args.speech_router, args.block_size, args.endpoint) == ("round-robin", 8, "omniprefix.worker.generate")
