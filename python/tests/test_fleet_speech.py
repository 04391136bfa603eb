"""Spoken replies through the fleet: OpenAI's audio output from ``/v1/chat/completions`` with
``"modalities": ["text", "audio"]`` (the edge routes them with Dynamo's KV router to a worker,
``omniprefix.speech_route``), on 2 workers of the tiny full Qwen3-Omni checkpoint
(``fixtures/tiny/omni_audio``), over HTTP on loopback.

* Greedy (thinker and ``talker.temperature`` 0), the WAV's samples equal
  ``Engine.generate(..., audio=True)`` on the same ids after PCM16 quantisation, the transcript
  equals the engine's text, and a stream's ``delta.audio`` chunks concatenate to the same
  samples, the first of them before the thinker's last token.
* Bad spoken requests are a 400 naming the field, and reach no engine.
* A client that disconnects mid-stream stops both stages: the worker's running requests go back
  to 0.
"""

from __future__ import annotations

import base64
import io
import json
import time
import urllib.error
import urllib.parse
import urllib.request
import wave

import numpy as np
import pytest

from conftest import FIXTURES
from test_fleet import REQUEST_S, RunningFleet, alive, fleet_fixtures, leave_mid_stream, pytestmark  # noqa: F401  (the module's skip mark)

from omniprefix.fleet import worker_metrics
from omniprefix.speech import pcm16

MODEL = FIXTURES / "omni_audio"
CHAT = "/v1/chat/completions"
TALKER = {"temperature": 0, "max_tokens": 64}
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Say hello to me."}]
QUERIES = "omniprefix_prefix_cache_queries_total"
RUNNING = "omniprefix_num_requests_running"


fleet, engine, tokenizer = fleet_fixtures(MODEL, "fleet")


def spoken(fmt: str = "wav", **fields) -> dict:
    return {"model": MODEL.name, "messages": MESSAGES, "modalities": ["text", "audio"],
            "audio": {"voice": "ethan", "format": fmt}, "talker": TALKER, "max_tokens": 16, "temperature": 0,
            **fields}


def post(fleet: RunningFleet, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(fleet.url + CHAT, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def events(fleet: RunningFleet, body: dict) -> list[dict]:
    """The SSE events of a streamed reply, in order, up to ``[DONE]``."""
    req = urllib.request.Request(fleet.url + CHAT, data=json.dumps({**body, "stream": True}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    out = []
    with urllib.request.urlopen(req, timeout=REQUEST_S) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r:
            line = line.strip()
            if line == b"data: [DONE]":
                return out
            if line.startswith(b"data: "):
                out.append(json.loads(line[6:]))
    raise AssertionError("the stream ended without [DONE]")


def test_a_greedy_spoken_reply_equals_engine_generate(fleet, engine, tokenizer):
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    eos = [tokenizer.eos_token_id]
    gen = engine.generate(ids, audio=True, speaker="ethan", talker=TALKER, max_tokens=16, temperature=0, stop=eos)
    want_pcm = pcm16(gen.audio)
    want_text = tokenizer.decode(gen.tokens, skip_special_tokens=True)
    assert len(want_pcm) > 0 and want_text

    status, reply = post(fleet, spoken())
    assert status == 200, reply
    choice = reply["choices"][0]
    audio = choice["message"]["audio"]
    assert set(audio) == {"id", "data", "transcript", "expires_at"}
    assert audio["expires_at"] > time.time()
    with wave.open(io.BytesIO(base64.b64decode(audio["data"]))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, gen.sample_rate)
        assert w.readframes(w.getnframes()) == want_pcm, "the WAV's samples differ from Engine.generate's"
    assert audio["transcript"] == want_text
    assert choice["finish_reason"] == gen.finish_reason
    assert reply["usage"]["completion_tokens"] == len(gen.tokens)
    assert reply["usage"]["prompt_tokens"] == len(ids)

    # pcm16: the same samples without a header.
    status, raw = post(fleet, spoken("pcm16"))
    assert status == 200 and base64.b64decode(raw["choices"][0]["message"]["audio"]["data"]) == want_pcm

    # Streamed: chunks of raw PCM16 and transcript pieces, forwarded as they come.
    chunks = events(fleet, spoken("pcm16"))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    data = [i for i, d in enumerate(deltas) if d.get("audio", {}).get("data")]
    text = [i for i, d in enumerate(deltas) if d.get("audio", {}).get("transcript")]
    assert len(data) >= 2, "the audio came in one piece"
    assert b"".join(base64.b64decode(deltas[i]["audio"]["data"]) for i in data) == want_pcm
    assert "".join(deltas[i]["audio"]["transcript"] for i in text) == want_text
    assert data[0] < text[-1], "the first audio left after the thinker's last token"
    assert len({c["id"] for c in chunks}) == 1 and len({deltas[i]["audio"]["id"] for i in data + text}) == 1
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == gen.finish_reason
    assert last["usage"]["completion_tokens"] == len(gen.tokens)
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_kv_routing_sends_a_repeated_image_to_the_worker_that_caches_it(fleet):
    """The edge names a spoken chat's images as the frontend does (``mm_hashes``, the routing
    tokens): Dynamo's router matches the image's blocks, so every repeat lands where it is cached
    (without the keys, ties between 2 workers break at random)."""
    image = "data:image/png;base64," + base64.b64encode((FIXTURES.parent / "media" / "image_a.png").read_bytes()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                             {"type": "text", "text": "Describe this aloud."}]}]
    cached = []
    for _ in range(5):
        status, reply = post(fleet, spoken("pcm16", messages=messages, max_tokens=4))
        assert status == 200, reply
        cached.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
    # The image's 35 rows end at prompt position 40: a repeat reuses it all.
    assert cached[0] < 40 and all(c >= 40 for c in cached[1:]), cached


#: (case, the request's changed fields, the param the 400 names, a part of its message).
BAD = [
    ("unknown voice", {"audio": {"voice": "alloy", "format": "wav"}}, "audio.voice", "voices: aiden, chelsie, ethan"),
    ("unknown format", {"audio": {"voice": "ethan", "format": "mp3"}}, "audio.format", "formats: wav, pcm16"),
    ("wav streamed", {"stream": True}, "audio.format", "ask for \"pcm16\""),
    ("no audio object", {"audio": None}, "audio", "audio is required"),
    ("talker temperature < 0", {"talker": {"temperature": -1}}, "talker.temperature", "in [0, 2]"),
    ("talker temperature a string", {"talker": {"temperature": "0"}}, "talker.temperature", "in [0, 2]"),
    ("talker max_tokens 0", {"talker": {"max_tokens": 0}}, "talker.max_tokens", "an integer in [1, 4096]"),
    ("talker max_tokens a float", {"talker": {"max_tokens": 8.5}}, "talker.max_tokens", "an integer"),
    ("an unknown talker option", {"talker": {"top_k": 5}}, "talker.top_k", "talker takes temperature, max_tokens"),
    ("video out", {"modalities": ["text", "audio", "video"]}, "modalities", "answers in text and audio"),
]


def test_bad_spoken_requests_are_400s_naming_the_field_and_reach_no_engine(fleet):
    before = [worker_metrics(w["metrics"])[QUERIES] for w in fleet.info["workers"]]
    wrong = []
    for name, fields, param, message in BAD:
        status, reply = post(fleet, spoken(**fields))
        error = reply.get("error") or {}
        if status != 400 or error.get("param") != param or message not in error.get("message", ""):
            wrong.append(f"{name}: {status} {reply}")
    assert not wrong, "\n".join(wrong)
    assert [worker_metrics(w["metrics"])[QUERIES] for w in fleet.info["workers"]] == before, \
        "a rejected request reached an engine"
    assert all(alive(pid) for pid in fleet.pids())


def test_a_client_that_leaves_mid_stream_stops_both_stages(fleet):
    def running() -> float:
        return sum(worker_metrics(w["metrics"])[RUNNING] for w in fleet.info["workers"])

    # 3000 tokens (about 2 s here), cut after the first audio chunk. (The tiny random talker ends
    # its speech after a few frames by itself, so the thinker is what still runs.)
    body = spoken("pcm16", stream=True, max_tokens=3000, talker={"max_tokens": 4000})
    leave_mid_stream(fleet, CHAT, body, b'"data":', running)
    assert running() == 0, "the spoken request kept running after its client went away"
