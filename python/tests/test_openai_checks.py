"""The edge's request checks (``omniprefix.openai_checks``) as plain functions: what passes
(neutral values of unsupported fields, every prompt form) and the corners test_edge.py's fleet
run does not reach. No Dynamo, no network."""

from __future__ import annotations

import pytest

from conftest import FIXTURES
from omniprefix.openai_checks import Limits, Rejected, check_request, max_token_bytes, parse_body

LIMITS = Limits(max_body_bytes=1 << 20, context_length=64, max_prompt_bytes=64 * 4, models={"m"})
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def completion(**fields) -> dict:
    return {"model": "m", "prompt": "hi", **fields}


@pytest.mark.parametrize("path, body", [
    (CHAT, chat(tool_choice="none", tools=[], logit_bias={}, response_format={"type": "text"}, logprobs=False,
                modalities=["text"], stop=None, seed=0, n=1, top_p=1, temperature=0, max_tokens=64)),
    (CHAT, chat(messages=[{"role": "system", "content": "be terse"}, {"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": None}])),
    (COMPLETIONS, completion(prompt=["a", "b"], stop=["x"] * 16, echo=False, seed=2**63 - 1)),
    (COMPLETIONS, completion(prompt=list(range(60)), max_tokens=4)),
    (COMPLETIONS, completion(prompt=[[1, 2], [3]], max_tokens=62)),
])
def test_what_the_engine_serves_passes(path, body):
    check_request(path, body, LIMITS)


@pytest.mark.parametrize("path, body, param, message", [
    (CHAT, chat(max_tokens=True), "max_tokens", "must be an integer, not boolean"),
    (CHAT, chat(temperature=float("nan")), "temperature", "must be in [0, 2]"),
    (CHAT, chat(stream="yes"), "stream", "stream must be boolean"),
    (CHAT, chat(logit_bias={"1": 5}), "logit_bias", "not supported"),
    (CHAT, chat(tool_choice="auto"), "tool_choice", "not supported"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "file:///x.wav"}}]}]),
     "messages[0].content[0].audio_url.url", "not file URLs"),
    (CHAT, chat(messages=[{"role": "user", "content": None}]), "messages[0].content", "must be a string"),
    (CHAT, chat(messages=[{"role": "user", "content": "x" * 257}]), "messages", "cannot fit the context"),
    (COMPLETIONS, completion(prompt=list(range(60)), max_tokens=5), "prompt", "over the context of 64 tokens"),
    (COMPLETIONS, completion(prompt=[1, "a"]), "prompt", "prompt must be a string"),
    (COMPLETIONS, completion(prompt=[-1]), "prompt", "integers >= 0"),
    (COMPLETIONS, completion(model=7), "model", "model must be a string"),
])
def test_what_it_cannot_serve_is_named(path, body, param, message):
    with pytest.raises(Rejected) as e:
        check_request(path, body, LIMITS)
    assert (e.value.status, e.value.param) == (400, param)
    assert message in e.value.message


@pytest.mark.parametrize("raw, message", [
    (b"\xc3\x28", "not valid UTF-8"), (b"{", "not valid JSON"), (b'"text"', "must be a JSON object, not str"),
    (b'{"temperature": NaN}', "NaN is not a JSON value"),
])
def test_a_body_must_be_utf8_json_and_an_object(raw, message):
    with pytest.raises(Rejected, match=message):
        parse_body(raw)


def test_the_longest_token_bounds_the_text_a_context_holds():
    # The tiny Qwen3's longest spelling is an added token (<|vision_start|> and the like).
    assert max_token_bytes(FIXTURES / "qwen3_dense" / "tokenizer.json") == 14
