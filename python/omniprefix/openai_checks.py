"""What the fleet's edge (:mod:`omniprefix.edge`) refuses in an OpenAI request before Dynamo's
frontend sees it: plain functions of the body's bytes, no network, no aiohttp.

Dynamo 1.6.1's frontend accepts some bodies it cannot serve well: invalid UTF-8 (replaced, then
answered), ``tools`` and ``logit_bias`` (dropped: a reply the client did not ask for), a remote
image URL (a bare "Invalid request"), and it tokenizes a huge prompt before any check. Each
check here raises :class:`Rejected`, answered in OpenAI's error shape with the field in
``param``. What only the token request shows (a text prompt's tokens against the context,
penalties, logprobs) stays with the worker (:func:`omniprefix.worker.sampling_options`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

__all__ = ["Limits", "Rejected", "parse_body", "check_request", "max_token_bytes", "CHECKED_PATHS", "SPEECH_FIELDS"]

#: The endpoints whose bodies are checked; every other path is only size-limited.
CHECKED_PATHS = ("/v1/chat/completions", "/v1/completions")

#: Stop strings per request (OpenAI's limit is 4; we allow more, but not unbounded: each one is
#: matched against every decoded token by the frontend).
MAX_STOP = 16
#: The largest seed both Dynamo's frontend (an i64) and the engine (a u64) carry unchanged.
MAX_SEED = 2**63 - 1

#: Fields the engine cannot honour, with the values that mean "not used" (null, [] and {} always do).
UNSUPPORTED = {
    "tools": (), "tool_choice": ("none",), "functions": (), "function_call": ("none",),
    "logit_bias": (), "response_format": ({"type": "text"},), "audio": (), "modalities": (["text"],),
    "prediction": (), "web_search_options": (), "logprobs": (False,), "top_logprobs": (), "echo": (False,),
    "suffix": (), "guided_json": (), "guided_regex": (), "guided_grammar": (), "guided_choice": (),
    "talker": (),
}
#: What a spoken chat (``"audio"`` in ``modalities``) sets, checked by :func:`omniprefix.speech.check_speech`
#: instead (the edge answers such a chat itself).
SPEECH_FIELDS = ("audio", "modalities", "talker")
#: Content part types the worker takes (input_audio: the worker answers why Dynamo drops it).
PART_TYPES = {"text", "image_url", "audio_url", "video_url", "input_audio"}
MEDIA_PARTS = ("image_url", "audio_url", "video_url")
ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


class Rejected(Exception):
    """A request the edge answers itself: ``status`` and OpenAI's ``{"error": {...}}`` body."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400, code: Optional[str] = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": self.param,
                          "code": self.code}}


@dataclass
class Limits:
    """What a fleet serves: body size, context, and the bound on a prompt's text.

    ``max_prompt_bytes``: no prompt text over this many UTF-8 bytes can fit the context (the
    context times the longest token's bytes, :func:`max_token_bytes`), so such a prompt is
    refused without tokenizing it; None: no bound.
    """

    max_body_bytes: int
    context_length: Optional[int] = None
    max_prompt_bytes: Optional[int] = None
    models: set[str] = field(default_factory=set)


def max_token_bytes(tokenizer_json: Path) -> int:
    """The most UTF-8 bytes one token of ``tokenizer.json`` stands for (its vocabulary's and
    added tokens' spellings, which are at least as long as the text they cover: byte-level
    ``Ġ`` is 2 bytes for 1, ``▁`` 3 for 1), so N bytes of text are at least N / this tokens."""
    data = json.loads(Path(tokenizer_json).read_text())
    vocab = (data.get("model") or {}).get("vocab") or {}
    names = list(vocab) if isinstance(vocab, dict) else [entry[0] for entry in vocab]
    names += [t.get("content", "") for t in data.get("added_tokens") or []]
    return max(len(name.encode()) for name in names)


def too_large(size: Optional[int], limit: int) -> Rejected:
    got = f"{size} bytes" if size is not None else "more than that"
    return Rejected(f"the request body is over the limit of {limit} bytes ({got})", status=413,
                    code="request_too_large")


def parse_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object: strict UTF-8 (the frontend would replace bad bytes and answer
    a prompt the client never sent), then JSON."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Rejected(f"the request body is not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})",
                       code="invalid_encoding") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise Rejected(f"the request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise Rejected(f"the request body must be a JSON object, not {type(body).__name__}", code="invalid_json")
    return body


def _no_constant(name: str) -> None:
    """NaN and Infinity: Python's json reads them, JSON has no such values."""
    raise Rejected(f"the request body is not valid JSON ({name} is not a JSON value)", code="invalid_json")


def _kind(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
            type(None): "null"}.get(type(value), type(value).__name__)


def _integer(body: dict[str, Any], name: str, lo: int, hi: Optional[int] = None) -> Optional[int]:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int:
        raise Rejected(f"{name} must be an integer, not {_kind(value)} {json.dumps(value)[:40]}", name)
    if value < lo or (hi is not None and value > hi):
        bound = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise Rejected(f"{name} must be {bound}, not {value}", name)
    return value


def _number(body: dict[str, Any], name: str, lo: float, hi: float, lo_open: bool = False) -> None:
    value = body.get(name)
    if value is None:
        return
    if type(value) not in (int, float):
        raise Rejected(f"{name} must be a number, not {_kind(value)} {json.dumps(value)[:40]}", name)
    if not lo <= value <= hi or (lo_open and value == lo):  # NaN fails too
        raise Rejected(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], not {value}", name)


def _type(body: dict[str, Any], name: str, *types: type) -> None:
    value = body.get(name)
    if value is not None and type(value) not in types:
        want = " or ".join(_kind(t()) for t in types)
        raise Rejected(f"{name} must be {want}, not {_kind(value)}", name)


def _unused(value: Any, neutral: tuple[Any, ...]) -> bool:
    return value is None or value == [] or value == {} or any(type(value) is type(n) and value == n for n in neutral)


def check_request(path: str, body: dict[str, Any], limits: Limits) -> None:
    """Raises :class:`Rejected` for the first problem of a chat or completions body."""
    model = body.get("model")
    if not isinstance(model, str):
        raise Rejected("model is required (a string)" if model is None else f"model must be a string, not {_kind(model)}",
                       "model")
    if limits.models and model not in limits.models:
        raise Rejected(f"the model {model!r} does not exist (served: {', '.join(sorted(limits.models))})", "model",
                       status=404, code="model_not_found")
    spoken = path == "/v1/chat/completions" and isinstance(body.get("modalities"), list) \
        and "audio" in body["modalities"]
    for name, neutral in UNSUPPORTED.items():
        if spoken and name in SPEECH_FIELDS:
            continue
        if name == "talker" and body.get(name) is not None:
            raise Rejected("talker sets the spoken reply's talker: it needs \"modalities\": [\"text\", \"audio\"]"
                           + (" on /v1/chat/completions" if path != "/v1/chat/completions" else ""), name,
                           code="unsupported_parameter")
        if not _unused(body.get(name), neutral):
            raise Rejected(f"{name} is not supported by this server (the engine cannot honour it; leave it out)",
                           name, code="unsupported_parameter")
    _type(body, "stream", bool)
    _type(body, "stream_options", dict)
    _number(body, "temperature", 0.0, 2.0)
    _number(body, "top_p", 0.0, 1.0, lo_open=True)
    _number(body, "presence_penalty", -2.0, 2.0)
    _number(body, "frequency_penalty", -2.0, 2.0)
    _integer(body, "seed", 0, MAX_SEED)
    n = _integer(body, "n", 1)
    if n is not None and n > 1:
        raise Rejected(f"n={n} is not supported: one choice per request (send n requests)", "n")
    _integer(body, "best_of", 1, 1)
    _stop(body.get("stop"))
    max_tokens = None
    for name in ("max_tokens", "max_completion_tokens"):
        got = _integer(body, name, 1, limits.context_length)
        max_tokens = got if got is not None else max_tokens
    if path == "/v1/chat/completions":
        text_bytes = _messages(body.get("messages"))
        _text_fits(text_bytes, "messages", limits)
    else:
        _prompt(body.get("prompt"), max_tokens, limits)


def _stop(stop: Any) -> None:
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise Rejected(f"stop must be a string or an array of strings, not {_kind(stop)}", "stop")
    if len(stop) > MAX_STOP:
        raise Rejected(f"stop holds {len(stop)} strings, over the limit of {MAX_STOP}", "stop")


def _messages(messages: Any) -> int:
    """Checks a chat's messages and content parts; returns the UTF-8 bytes of their text."""
    if not isinstance(messages, list):
        raise Rejected("messages is required (an array)" if messages is None else
                       f"messages must be an array, not {_kind(messages)}", "messages")
    if not messages:
        raise Rejected("messages must hold at least one message", "messages")
    text = 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise Rejected(f"{where} must be an object, not {_kind(message)}", where)
        role = message.get("role")
        if role not in ROLES:
            raise Rejected(f"{where}.role must be one of {sorted(ROLES)}, not {json.dumps(role)[:40]}", f"{where}.role")
        content = message.get("content")
        if isinstance(content, str):
            text += len(content.encode())
        elif isinstance(content, list):
            for j, part in enumerate(content):
                text += _part(part, f"{where}.content[{j}]")
        elif content is not None or role not in ("assistant", "function"):
            raise Rejected(f"{where}.content must be a string or an array of parts, not {_kind(content)}",
                           f"{where}.content")
    return text


def _part(part: Any, where: str) -> int:
    if not isinstance(part, dict) or part.get("type") not in PART_TYPES:
        got = part.get("type") if isinstance(part, dict) else _kind(part)
        raise Rejected(f"{where}: a content part's type must be one of {sorted(PART_TYPES)}, not {json.dumps(got)[:40]}",
                       f"{where}.type")
    kind = part["type"]
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise Rejected(f"{where}.text must be a string", f"{where}.text")
        return len(part["text"].encode())
    if kind in MEDIA_PARTS:
        media = part.get(kind)
        url = media.get("url") if isinstance(media, dict) else media
        if not isinstance(url, str):
            raise Rejected(f"{where}.{kind}.url must be a string", f"{where}.{kind}.url")
        if not url.startswith("data:"):
            scheme = url.split(":", 1)[0][:16] if ":" in url else "no scheme"
            raise Rejected(f"{where}.{kind}.url: only data URLs (data:<type>;base64,...) are served, not {scheme} "
                           f"URLs: the workers fetch nothing from the network", f"{where}.{kind}.url",
                           code="invalid_image_url" if kind == "image_url" else "invalid_media_url")
    return 0


def _prompt(prompt: Any, max_tokens: Optional[int], limits: Limits) -> None:
    """A completion's prompt: a string, strings, token ids, or lists of token ids."""
    if prompt is None:
        raise Rejected("prompt is required", "prompt")
    prompts = prompt if isinstance(prompt, list) and prompt and not all(type(t) is int for t in prompt) else [prompt]
    if prompt == []:
        raise Rejected("prompt must not be empty", "prompt")
    for k, one in enumerate(prompts):
        if isinstance(one, str):
            _text_fits(len(one.encode()), "prompt", limits)
        elif isinstance(one, list) and one and all(type(t) is int and t >= 0 for t in one):
            left = None if limits.context_length is None else limits.context_length - len(one)
            if left is not None and (left <= 0 or (max_tokens is not None and max_tokens > left)):
                raise Rejected(f"prompt {k} holds {len(one)} tokens; with max_tokens {max_tokens or 1} that is over "
                               f"the context of {limits.context_length} tokens", "prompt",
                               code="context_length_exceeded")
        else:
            raise Rejected(f"prompt must be a string, an array of strings, an array of token ids (integers >= 0) or "
                           f"an array of such arrays; prompt {k} is {_kind(one)}", "prompt")


def _text_fits(text_bytes: int, param: str, limits: Limits) -> None:
    if limits.max_prompt_bytes is not None and text_bytes > limits.max_prompt_bytes:
        raise Rejected(f"{param}: {text_bytes} bytes of text cannot fit the context of {limits.context_length} tokens "
                       f"(at most {limits.max_prompt_bytes} bytes)", param, code="context_length_exceeded")
