"""The edge's spoken path: an OpenAI chat with ``"modalities": ["text", "audio"]``, routed by
Dynamo's KV router to a worker, answered in OpenAI's audio output shape.

Why not Dynamo's frontend: 1.6.1 cannot carry audio to a client (docs/scale-out.md, "Speech
through the front door"). Its preprocessor drops ``modalities`` and ``audio`` before a token-in
worker sees the request and refuses a top-level ``talker``; its delta generator builds
``delta`` from a worker's text only, and its aggregator sets ``message.audio`` to None
(``lib/llm/src/protocols/openai/chat_completions/aggregator.rs``, ``From<DeltaChoice> for
ChatChoice``); a Python chat engine (the ``chat_engine_factory`` hook of
``--dyn-chat-processor``) returns chunks the frontend parses into its typed delta, which has no
``audio`` field. So the edge does the frontend's part for these requests:

* renders the checkpoint's chat template and tokenizes (transformers' ``AutoTokenizer``, as the
  fleet tests check the frontend does), and forwards the media URLs as ``multi_modal_data`` in
  the form the frontend sends (an ``input_audio`` part becomes an ``audio_url`` data URL);
* routes with **Dynamo's own KV router** (``dynamo.llm.KvRouter`` over the workers' KV events,
  the same events the frontend's router reads), or Dynamo's round-robin client under
  ``--router round-robin``, to the workers' endpoint;
* turns the worker's chunks (tokens; audio chunks as PCM16 in ``extra_args``) into OpenAI's
  ``message.audio`` or, streamed, ``delta.audio`` chunks, as they come.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncGenerator, AsyncIterator, Optional, cast

from .openai_checks import Rejected
from .router_weights import DISK_CACHE_HIT_WEIGHT, HOST_CACHE_HIT_WEIGHT
from .speech import (CHUNK_KEY, DONE_KEY, REQUEST_KEY, SpeechRequest, audio_id, b64, expires_at, wav_bytes)

__all__ = ["SpeechRoute", "SpeechReply", "UpstreamError", "DEFAULT_ENDPOINT"]

#: The workers' Dynamo endpoint (``omniprefix.worker``'s default).
DEFAULT_ENDPOINT = "omniprefix.worker.generate"
#: Sampling fields a spoken request may set, and the worker's names for them.
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "seed": "seed", "presence_penalty": "presence_penalty",
            "frequency_penalty": "frequency_penalty"}
#: Chat fields the spoken path does not serve (the frontend's detokenizer handles them for text).
NOT_WITH_AUDIO = ("stop", "logprobs", "top_logprobs", "tools", "response_format")
#: A chat part's media and the ``multi_modal_data`` key the worker reads it from.
MEDIA_PARTS = {"image_url": "image_url", "audio_url": "audio_url", "video_url": "video_url",
               "input_audio": "audio_url"}


class UpstreamError(Exception):
    """A worker refused the request (``status`` 400, its message) or failed (500 / 502)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass
class SpeechReply:
    """What a spoken request produced so far: the transcript's tokens and text, the PCM16 bytes,
    and at the end why it stopped, the usage and the speech summary."""

    tokens: list[int] = field(default_factory=list)
    text: str = ""
    pcm: bytearray = field(default_factory=bytearray)
    finish_reason: Optional[str] = None
    usage: Optional[dict[str, Any]] = None
    speech: dict[str, Any] = field(default_factory=dict)


class SpeechRoute:
    """Spoken chats from the edge to the workers, on the edge's event loop.

    ``router``: ``"kv"`` (Dynamo's ``KvRouter`` over the workers' KV events, with the host tier
    weighted as the device's, like the fleet's frontend) or ``"round-robin"`` (Dynamo's client).
    Dynamo's runtime reads its planes from the environment (``DYN_DISCOVERY_BACKEND``,
    ``DYN_FILE_KV``, ...), as the fleet sets them; :meth:`start` connects, once, on first use.
    """

    def __init__(self, model_dir: Path, model_name: str, router: str, block_size: int,
                 endpoint: str = DEFAULT_ENDPOINT):
        self.model_dir = Path(model_dir)
        self.model_name = model_name
        self.router_mode = router
        self.block_size = block_size
        self.endpoint_name = endpoint
        self._started: Optional[asyncio.Future[None]] = None
        self._tokenizer: Any = None
        self._loading: Optional[threading.Thread] = None
        self._image_processor: Optional[dict[str, Any]] = None
        self._image_pad: Optional[int] = None
        self._router: Any = None
        self._client: Any = None
        self._runtime: Any = None

    def preload(self) -> None:
        """Starts loading the tokenizer on a thread of its own (transformers' import takes
        seconds), so that :meth:`start` finds it loaded: the fleet calls it while its workers boot."""
        if self._loading is None:
            self._loading = threading.Thread(target=self._load_tokenizer, name="omniprefix-tokenizer", daemon=True)
            self._loading.start()

    async def start(self) -> None:
        """Connects to Dynamo and loads the tokenizer (once; concurrent callers wait for it)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        await asyncio.shield(self._started)

    async def _start(self) -> None:
        from dynamo.llm import KvRouter, KvRouterConfig
        from dynamo.runtime import DistributedRuntime

        loop = asyncio.get_running_loop()
        self.preload()
        await asyncio.to_thread(cast(threading.Thread, self._loading).join)
        if self._tokenizer is None:
            raise RuntimeError(f"could not load the tokenizer of {self.model_dir} (transformers' AutoTokenizer)")
        self._runtime = DistributedRuntime(loop, os.environ.get("DYN_DISCOVERY_BACKEND", "file"),
                                           os.environ.get("DYN_REQUEST_PLANE", "tcp"),
                                           event_plane=os.environ.get("DYN_EVENT_PLANE", "zmq"))
        endpoint = self._runtime.endpoint(self.endpoint_name)
        if self.router_mode == "kv":
            # The frontend's tier weights (our CPU blocks as device hits, a shared disk tier as nothing).
            weights = KvRouterConfig(host_cache_hit_weight=HOST_CACHE_HIT_WEIGHT,
                                     disk_cache_hit_weight=DISK_CACHE_HIT_WEIGHT)
            self._router = KvRouter(endpoint, self.block_size, weights)
        else:
            self._client = await endpoint.client()
            await self._client.wait_for_instances()

    def _load_tokenizer(self) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        # Image routing keys, as the frontend makes them for a checkpoint with a Qwen2-VL-style
        # preprocessor_config.json (its condition for MM-aware routing).
        try:
            self._image_processor = json.loads((self.model_dir / "preprocessor_config.json").read_text())
        except (OSError, ValueError):
            self._image_processor = None
        name = json.loads((self.model_dir / "tokenizer_config.json").read_text()).get("image_token", "<|image_pad|>") \
            if (self.model_dir / "tokenizer_config.json").is_file() else "<|image_pad|>"
        self._image_pad = tokenizer.convert_tokens_to_ids(name)
        self._tokenizer = tokenizer

    def close(self) -> None:
        if self._runtime is not None:
            self._runtime.shutdown()

    # -- the request ---------------------------------------------------------------------------

    def preprocess(self, body: dict[str, Any], speech: SpeechRequest) -> dict[str, Any]:
        """The worker's request (Dynamo's ``PreprocessedRequest``) for a checked chat body."""
        for name in NOT_WITH_AUDIO:
            if body.get(name) not in (None, False, [], {}):
                raise Rejected(f"{name} is not supported with audio output (leave it out, or leave \"audio\" out "
                               f"of modalities)", name, code="unsupported_parameter")
        messages, media = _messages_and_media(body["messages"])
        try:
            ids = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
        except Exception as e:  # noqa: BLE001 (the template's own error: a role or part it refuses)
            raise Rejected(f"messages: the chat template refused them ({type(e).__name__}: {e})", "messages") from None
        eos = [self._tokenizer.eos_token_id] if self._tokenizer.eos_token_id is not None else []
        stop: dict[str, Any] = {"stop_token_ids_hidden": eos}
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None:
            stop["max_tokens"] = max_tokens
        sampling = {ours: body[theirs] for theirs, ours in SAMPLING.items() if body.get(theirs) is not None}
        request: dict[str, Any] = {
            "model": self.model_name, "token_ids": list(ids), "stop_conditions": stop,
            "sampling_options": sampling, "output_options": {}, "eos_token_ids": eos,
            "extra_args": {REQUEST_KEY: speech.worker_args()}, "annotations": [],
        }
        if media:
            request["multi_modal_data"] = media
            routing = self.image_routing(list(ids), [m["Url"] for m in media.get("image_url", [])])
            if routing is not None:
                request["extra_args"]["mm_hashes"], request["mm_routing_info"] = routing
        return request

    def image_routing(self, ids: list[int], urls: list[str]) -> Optional[tuple[list[str], dict[str, Any]]]:
        """The frontend's image routing keys for a prompt (``omniprefix.dynamo_keys``): each
        image named ``xxh3_64`` of its URL's bytes, its placeholder expanded to the engine's N rows
        of ``pad_value(h) = 1_000_000 + (h & (2**30 - 1))``; returned as ``extra_args.mm_hashes``
        (the worker writes them into its KV events) and ``mm_routing_info`` (what the router
        matches), so a spoken chat's images route as the frontend routes a text chat's. None
        without images, on a checkpoint without an image processor, or when the placeholders and
        the images disagree (the worker answers that)."""
        if not urls or self._image_processor is None:
            return None
        pad = self._image_pad
        if sum(1 for t in ids if t == pad) != len(urls):
            return None
        import xxhash

        hashes: list[str] = []
        routing: list[int] = []
        images = iter(urls)
        for token in ids:
            if token != pad:
                routing.append(token)
                continue
            url = next(images)
            rows = self._image_rows(url)
            if rows is None:
                return None
            h = xxhash.xxh3_64_intdigest(url.encode())
            hashes.append(f"{h:016x}")
            routing.extend([1_000_000 + (h & (2**30 - 1))] * rows)
        return hashes, {"routing_token_ids": routing, "block_mm_infos": [], "expanded_prompt_len": len(routing)}

    def _image_rows(self, url: str) -> Optional[int]:
        """The placeholder rows of an image (a data URL) after the processor's ``smart_resize``
        and the 2x2 merge, as the engine expands it; None if it does not decode."""
        from PIL import Image, UnidentifiedImageError
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        from .encoder import MediaError, decode_data_url

        config = cast(dict[str, Any], self._image_processor)
        try:
            _, data = decode_data_url(url, "image")
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
            factor = int(config["patch_size"]) * int(config["merge_size"])
            size = config.get("size") or {}
            h, w = smart_resize(height, width, factor=factor, min_pixels=size.get("shortest_edge", config.get("min_pixels")),
                                max_pixels=size.get("longest_edge", config.get("max_pixels")))
        except (MediaError, UnidentifiedImageError, OSError, ValueError, KeyError):
            return None
        return int((h // factor) * (w // factor))

    def decode(self, tokens: list[int]) -> str:
        """The transcript of ``tokens``: the tokenizer's text, special tokens left out."""
        return str(self._tokenizer.decode(tokens, skip_special_tokens=True))

    async def chunks(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The worker's output chunks for ``request``, as the router hands them on. Closing the
        iterator (a client gone) drops the stream, which cancels the request on the worker."""
        try:
            if self._router is not None:
                stream = await self._router.generate_from_request(request)
            else:
                stream = await self._client.round_robin(request)
        except Exception as e:  # noqa: BLE001 (Dynamo's errors: no worker, a refused request)
            raise _upstream(e) from None
        iterator = stream.__aiter__()
        while True:
            try:
                item = await iterator.__anext__()
            except StopAsyncIteration:
                return
            except Exception as e:  # noqa: BLE001
                raise _upstream(e) from None
            data = item.data() if hasattr(item, "data") and callable(item.data) else item
            if data is None:
                continue
            if not isinstance(data, dict) or "token_ids" not in data:
                raise UpstreamError(f"the worker answered {json.dumps(data)[:200]}", 502)
            yield data

    async def reply(self, request: dict[str, Any], speech: SpeechRequest) -> dict[str, Any]:
        """The whole reply (``stream`` false): OpenAI's chat completion with ``message.audio``."""
        out = SpeechReply()
        async for chunk in self.chunks(request):
            _take(out, chunk)
        out.text = self.decode(out.tokens)
        rate = int(out.speech.get("sample_rate") or 24000)
        data = wav_bytes(bytes(out.pcm), rate) if speech.format == "wav" else bytes(out.pcm)
        message = {"role": "assistant", "content": None, "refusal": None,
                   "audio": {"id": audio_id(), "data": b64(data), "transcript": out.text, "expires_at": expires_at()}}
        return {"id": f"chatcmpl-{uuid.uuid4()}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, "message": message, "finish_reason": out.finish_reason, "logprobs": None}],
                "usage": out.usage}

    async def stream(self, request: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """The streamed reply: OpenAI ``chat.completion.chunk`` objects, a ``delta.audio`` with
        ``transcript`` text as the thinker's tokens come and one with ``data`` (raw PCM16, base64)
        per audio chunk as code2wav makes it; the last with ``finish_reason`` and the usage."""
        out = SpeechReply()
        chat_id, created, audio = f"chatcmpl-{uuid.uuid4()}", int(time.time()), audio_id()
        first = True

        def chunk(delta: dict[str, Any], finish: Optional[str] = None,
                  usage: Optional[dict[str, Any]] = None) -> dict[str, Any]:
            nonlocal first
            if first:
                delta = {"role": "assistant", **delta}
                first = False
            body: dict[str, Any] = {"id": chat_id, "object": "chat.completion.chunk", "created": created,
                                    "model": self.model_name,
                                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                                 "logprobs": None}]}
            if usage is not None:
                body["usage"] = usage
            return body

        async for data in self.chunks(request):
            before = len(out.pcm)
            _take(out, data)
            if len(out.pcm) > before:
                piece = bytes(out.pcm[before:])
                yield chunk({"audio": {"id": audio, "data": b64(piece), "expires_at": expires_at()}})
            if data.get("token_ids"):
                # Decoded whole each time (replies are short), held while a character is split.
                text = self.decode(out.tokens)
                if len(text) > len(out.text) and not text.endswith("\ufffd"):
                    yield chunk({"audio": {"id": audio, "transcript": text[len(out.text):]}})
                    out.text = text
        text = self.decode(out.tokens)
        tail = {"audio": {"id": audio, "transcript": text[len(out.text):]}} if len(text) > len(out.text) else {}
        yield chunk(tail, out.finish_reason or "stop", out.usage)


def _take(out: SpeechReply, chunk: dict[str, Any]) -> None:
    """Adds a worker chunk to ``out``: its token, its audio (in order), or its summary."""
    out.tokens.extend(int(t) for t in chunk.get("token_ids") or [])
    extra = chunk.get("extra_args") or {}
    audio = extra.get(CHUNK_KEY)
    if audio is not None:
        import base64

        pcm = base64.b64decode(audio["pcm16"])
        if int(audio["offset"]) * 2 != len(out.pcm):
            raise UpstreamError(f"an audio chunk at sample {audio['offset']} after {len(out.pcm) // 2} samples", 502)
        out.pcm.extend(pcm)
    if DONE_KEY in extra:
        out.speech = dict(extra[DONE_KEY])
    if chunk.get("finish_reason") is not None:
        out.finish_reason = _finish_reason(chunk["finish_reason"])
    if chunk.get("completion_usage") is not None:
        out.usage = dict(chunk["completion_usage"])


def _finish_reason(reason: Any) -> str:
    """Dynamo's finish reasons in OpenAI's words."""
    return {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}.get(str(reason), str(reason))


def _messages_and_media(messages: list[Any]) -> tuple[list[Any], dict[str, list[dict[str, str]]]]:
    """The messages for the template, and each media part's URL by ``multi_modal_data`` key in
    prompt order (``{"Url": ...}``, as Dynamo's frontend forwards them); an ``input_audio`` part
    becomes an ``audio_url`` data URL of its base64 ``data``."""
    media: dict[str, list[dict[str, str]]] = {}
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in MEDIA_PARTS:
                continue
            if kind == "input_audio":
                audio = part.get("input_audio") or {}
                if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
                    raise Rejected("an input_audio part needs input_audio.data (base64)", "messages")
                url: Any = f"data:audio/{audio.get('format') or 'wav'};base64,{audio['data']}"
            else:
                value = part.get(kind)
                url = value.get("url") if isinstance(value, dict) else value
            media.setdefault(MEDIA_PARTS[kind], []).append({"Url": str(url)})
    return messages, media


def _upstream(e: BaseException) -> UpstreamError:
    """Dynamo's error for a request, as the status the client gets: a worker's
    ``InvalidArgument`` is the client's mistake (400), no worker a 503, the rest a 502."""
    name, text = type(e).__name__, str(e)
    if "InvalidArgument" in name or "InvalidArgument" in text or "invalid_argument" in text.lower():
        return UpstreamError(text, 400)
    if "no instances" in text.lower() or "unavailable" in name.lower():
        return UpstreamError(f"no worker serves the model now ({text})", 503)
    return UpstreamError(f"{name}: {text}", 502)
