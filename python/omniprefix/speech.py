"""OpenAI's audio output for the fleet: what a spoken chat request asks for, and the bytes of
its reply. Plain functions (numpy and the standard library; no network, no aiohttp, no Dynamo),
shared by the edge (:mod:`omniprefix.edge`, :mod:`omniprefix.speech_route`) and the worker
(:mod:`omniprefix.worker`).

A request speaks when ``"modalities"`` holds ``"audio"``::

    {"model": "omni_audio", "messages": [...], "modalities": ["text", "audio"],
     "audio": {"voice": "ethan", "format": "wav"}, "talker": {"temperature": 0, "max_tokens": 512}}

* ``audio.voice``: one of the checkpoint's speakers (``talker_config.speaker_id`` of its
  ``config.json``); ``audio.format``: ``"wav"`` (a whole WAV file, PCM16 mono at the
  checkpoint's rate) or ``"pcm16"`` (raw little-endian PCM16 samples, no header). A stream
  (``"stream": true``) takes ``pcm16`` only, as OpenAI's API: a WAV header states a length the
  first chunk cannot know.
* ``talker`` (not OpenAI's: ours): the talker's ``temperature`` (0 to 2; 0: greedy) and
  ``max_tokens`` (codec frames, 1 to :data:`MAX_TALKER_TOKENS`); a key left out takes the
  worker's default (``--talker-temperature``, ``--talker-max-tokens``), else the checkpoint's.

Each problem is a :class:`~omniprefix.openai_checks.Rejected` (an HTTP 400) naming the field.
"""

from __future__ import annotations

import base64
import io
import json
import math
import time
import uuid
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np
import numpy.typing as npt

from .openai_checks import Rejected

__all__ = ["FORMATS", "MAX_TALKER_TOKENS", "SpeechCaps", "SpeechRequest", "speech_caps", "wants_audio",
           "check_speech", "pcm16", "wav_bytes", "audio_id", "REQUEST_KEY", "CHUNK_KEY", "DONE_KEY"]

#: The reply formats served; a stream takes ``pcm16`` only.
FORMATS = ("wav", "pcm16")
#: The most codec frames a request may ask the talker for (the checkpoint's default cap).
MAX_TALKER_TOKENS = 4096
#: The talker options a request may set, with their bounds.
TALKER_OPTIONS = {"temperature": (0.0, 2.0), "max_tokens": (1, MAX_TALKER_TOKENS)}
#: How long a reply's audio id is said to be valid (OpenAI's ``expires_at``; nothing is stored
#: here, so a follow-up turn re-sends the reply as text, which the engine caches anyway).
EXPIRES_S = 3600

#: The key of ``extra_args`` that asks a worker to speak (the edge's request to a worker), and
#: the keys of a worker's output chunk ``extra_args``: an audio chunk, and the speech summary
#: on the last chunk.
REQUEST_KEY = "omniprefix_speech"
CHUNK_KEY = "audio_chunk"
DONE_KEY = "speech"


@dataclass(frozen=True)
class SpeechCaps:
    """What a checkpoint can say: its voices (the talker's speakers), in ``config.json`` order."""

    voices: tuple[str, ...]


@dataclass(frozen=True)
class SpeechRequest:
    """A checked spoken request: the voice, the format, whether it streams, and the talker
    options it set (the others take the worker's defaults)."""

    voice: str
    format: str
    stream: bool
    talker: dict[str, Any] = field(default_factory=dict)

    def worker_args(self) -> dict[str, Any]:
        """What the worker reads from the request's ``extra_args[REQUEST_KEY]``."""
        return {"voice": self.voice, "talker": dict(self.talker)}


def speech_caps(model_dir: Path) -> Optional[SpeechCaps]:
    """The voices of a checkpoint that speaks (a ``talker_config`` with speakers and audio
    output not switched off), else None."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    talker = config.get("talker_config") if isinstance(config, dict) else None
    if not isinstance(talker, dict) or config.get("enable_audio_output") is False:
        return None
    speakers = talker.get("speaker_id")
    if not isinstance(speakers, dict) or not speakers:
        return None
    return SpeechCaps(tuple(str(name) for name in speakers))


def wants_audio(body: Mapping[str, Any]) -> bool:
    """Whether a chat body asks for a spoken reply (``"audio"`` in ``modalities``)."""
    modalities = body.get("modalities")
    return isinstance(modalities, list) and "audio" in modalities


def check_speech(body: Mapping[str, Any], caps: Optional[SpeechCaps]) -> SpeechRequest:
    """The spoken request of a chat body that :func:`wants_audio`; raises
    :class:`~omniprefix.openai_checks.Rejected` naming the first bad field."""
    modalities = body["modalities"]
    unknown = [m for m in modalities if m not in ("text", "audio")]
    if unknown:
        raise Rejected(f"modalities holds {json.dumps(unknown[0])[:40]}; this server answers in text and audio "
                       f"(\"text\", \"audio\")", "modalities")
    if caps is None:
        raise Rejected("modalities asks for audio, but this model cannot speak (its checkpoint has no talker); "
                       "leave \"audio\" out of modalities", "modalities", code="unsupported_parameter")
    audio = body.get("audio")
    if not isinstance(audio, dict):
        raise Rejected("audio is required with modalities [\"text\", \"audio\"]: an object "
                       "{\"voice\": ..., \"format\": ...}" if audio is None else
                       f"audio must be an object, not {type(audio).__name__}", "audio")
    extra = sorted(set(audio) - {"voice", "format"})
    if extra:
        raise Rejected(f"audio.{extra[0]} is not supported (audio takes voice and format)", f"audio.{extra[0]}")
    voice = audio.get("voice")
    if not isinstance(voice, str) or voice not in caps.voices:
        raise Rejected(f"audio.voice {json.dumps(voice)[:40]} is not a voice of this model (voices: "
                       f"{', '.join(caps.voices)})", "audio.voice")
    fmt = audio.get("format")
    if fmt not in FORMATS:
        raise Rejected(f"audio.format {json.dumps(fmt)[:40]} is not supported (formats: {', '.join(FORMATS)})",
                       "audio.format")
    stream = body.get("stream") is True
    if stream and fmt != "pcm16":
        raise Rejected("audio.format \"wav\" cannot stream (a WAV header states the length); with \"stream\": true "
                       "ask for \"pcm16\" (raw 16-bit little-endian mono)", "audio.format")
    return SpeechRequest(voice, fmt, stream, _talker(body.get("talker")))


def _talker(talker: Any) -> dict[str, Any]:
    if talker is None:
        return {}
    if not isinstance(talker, dict):
        raise Rejected(f"talker must be an object, not {type(talker).__name__}", "talker")
    out: dict[str, Any] = {}
    for name, value in talker.items():
        if name not in TALKER_OPTIONS:
            raise Rejected(f"talker.{name} is not supported (talker takes {', '.join(TALKER_OPTIONS)})",
                           f"talker.{name}")
        lo, hi = TALKER_OPTIONS[name]
        integer = isinstance(lo, int)
        if type(value) not in ((int,) if integer else (int, float)) or (
                not integer and not math.isfinite(value)) or not lo <= value <= hi:
            kind = "an integer" if integer else "a number"
            raise Rejected(f"talker.{name} must be {kind} in [{lo:g}, {hi:g}], not {json.dumps(value)[:40]}",
                           f"talker.{name}")
        out[name] = int(value) if integer else float(value)
    return out


def pcm16(samples: npt.NDArray[np.float32]) -> bytes:
    """Float samples in [-1, 1] as 16-bit little-endian PCM: clipped, scaled by 32767 and
    rounded to the nearest integer (half to even), as the reply's ``data`` carries them."""
    scaled = np.rint(np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0) * 32767.0)
    return bytes(scaled.astype("<i2").tobytes())


def wav_bytes(pcm: bytes, sample_rate: int) -> bytes:
    """A WAV file (RIFF, PCM16, mono) of :func:`pcm16` bytes, by the standard library's ``wave``."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm)
    return out.getvalue()


def audio_id() -> str:
    """A fresh id for a reply's audio (OpenAI's ``audio.id``)."""
    return f"audio_{uuid.uuid4().hex}"


def expires_at() -> int:
    return int(time.time()) + EXPIRES_S


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
