"""A Dynamo worker over :class:`~omniprefix.AsyncEngine`: one replica of a fleet.

    python -m omniprefix.worker --model DIR [engine options]

* **Registration.** The model directory (``config.json``, the weights, ``tokenizer.json`` and a
  chat template in ``tokenizer_config.json``) is registered with Dynamo as a token-in model
  (``ModelInput.Tokens``, chat and completions): Dynamo's frontend applies the template,
  tokenizes, routes, and detokenizes; this worker sees token ids only.
* **Requests.** Dynamo's stop conditions and sampling options become the engine's sampling
  keywords (:func:`sampling_options`); tokens stream back one chunk each as the engine makes
  them; a request that cannot be served is answered with an HTTP 400 naming why, and the worker
  keeps serving. A cancelled request (client gone) aborts its generation.
* **Images and audio.** A chat's images and audio arrive as Dynamo forwards them: the prompt's
  ids with one placeholder per item (``<|vision_start|><|image_pad|><|vision_end|>``) and
  ``multi_modal_data`` with the client's data URLs. The worker decodes them into items with the
  checkpoint's own processor (:class:`~omniprefix.encoder.CheckpointEncoder`), whose towers the
  engine runs only on an encoder-cache miss. A URL that is not a data URL, media that does not
  decode or is over the limits (``--max-image-pixels``, ``--max-media-bytes``) is an HTTP 400
  naming the item, and nothing is cached.
* **KV events.** The engine publishes vLLM-format KV events on a loopback ZMQ PUB socket; a
  Dynamo ``KvEventPublisher`` subscribed to it relays them to the frontend's KV router. For a
  checkpoint with images (``--dynamo-mm-keys on``, the default), each image item carries the
  frontend's hash of it (``extra_args.mm_hashes``, in prompt order) as its ``routing_hash``, and
  the engine writes it into its blocks' ``extra_keys`` in the form Dynamo 1.6.1 routes on, so a
  repeated image goes to the worker that caches it (see ``omniprefix.dynamo_keys``).
* **Speech.** On a checkpoint with a talker, a request whose ``extra_args`` hold
  ``omniprefix_speech: {"voice": V, "talker": {...}}`` (the fleet's edge sends it for an OpenAI
  chat with ``"modalities": ["text", "audio"]``, :mod:`omniprefix.speech_route`) is spoken:
  its tokens stream as usual and, between them, each audio chunk as code2wav makes it, as PCM16
  in the chunk's ``extra_args.audio_chunk`` (``{"offset", "pcm16"}``, base64); the last chunk
  carries ``finish_reason``, the usage and ``extra_args.speech`` (the sample rate, why the
  talker stopped, its rows and cached rows). Talker options the request leaves out take
  ``--talker-temperature`` and ``--talker-max-tokens``, else the checkpoint's defaults.
* **Metrics.** ``Engine.metrics()`` (Prometheus text) at ``http://HOST:PORT/metrics``.
* **Disk tier.** ``--tier-dir DIR`` (``--tier-bytes SIZE``) keeps the blocks the pool evicts in
  DIR; workers sharing DIR load each other's, and without ``--fingerprint-key`` they all take the
  key kept in ``DIR/fleet.key``, which a tier hit needs. Blocks going down to the tier are KV
  events on ``medium`` ``"DISK"``.
* **Engine death.** When an engine step panics, every pending and later call raises
  ``EngineDeadError``: each request in flight ends with an error the client sees (an HTTP 500,
  or an error event in a stream; not one Dynamo migrates, see ``Worker.generate``), the worker
  unregisters its instance and model from discovery, lets Dynamo shut down, and exits with
  status 1, for ``omniprefix.fleet`` (or whatever supervises it) to start a fresh one.

When it serves, the worker prints one JSON line on stdout, ``{"pid": ..., "metrics": URL,
"kv_events": ENDPOINT, "model": NAME, "instance": ID, "block_size": N}`` (``ID``: its Dynamo
instance id, as ``/health`` lists it), which ``python -m omniprefix.fleet`` reads.
Dynamo's planes come from ``--discovery-backend``, ``--request-plane`` and ``--event-plane``
(defaults: Dynamo's own environment variables, ``DYN_DISCOVERY_BACKEND`` etc.).
Needs ``ai-dynamo`` 1.6.1: ``bash scripts/install_fleet.sh VENV``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import http.server
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator, Mapping, Optional, cast

from . import AudioChunk, EngineDeadError, Error, Generation, RequestError
from .aio import AsyncEngine
from .dynamo_keys import routed_items
from .encoder import MAX_IMAGE_PIXELS, MAX_MEDIA_BYTES, encoder_for
from .sizes import byte_size
from .speech import CHUNK_KEY, DONE_KEY, MAX_TALKER_TOKENS, REQUEST_KEY, b64, pcm16

__all__ = ["sampling_options", "MetricsServer", "main"]

#: Dynamo namespace, component and endpoint the worker serves (``NAMESPACE.COMPONENT.ENDPOINT``).
DEFAULT_ENDPOINT = "omniprefix.worker.generate"

#: The engine options a worker takes as flags (``--block-size`` sets ``block_size``): each
#: name's value type and choices. The names are ``Engine.from_dir``'s (test_worker checks them
#: against the extension's own list), and an unset flag leaves the engine's default.
ENGINE_FLAGS: dict[str, tuple[Callable[[str], Any], Optional[list[str]]]] = {
    "block_size": (int, None),
    "num_blocks": (int, None),
    "max_tokens_per_step": (int, None),
    "max_seqs_per_step": (int, None),
    "prefill_cap": (int, None),
    "backend": (str, ["cpu", "wgpu", "auto"]),
    "dtype": (str, ["auto", "f32", "bf16", "f16"]),
    "kv_dtype": (str, ["f32", "bf16", "f16"]),
    "audio_yield_s": (float, None),
}


class UnsupportedRequest(ValueError):
    """A request option the engine cannot honour (answered as an HTTP 400)."""


def sampling_options(request: Mapping[str, Any], eos_token_ids: list[int], context_length: int) -> dict[str, Any]:
    """The keywords of ``Engine.stream`` for one of Dynamo's token requests.

    ``stop_conditions``: ``max_tokens`` (default: what is left of the context), ``ignore_eos``,
    ``stop_token_ids`` and the frontend's ``stop_token_ids_hidden`` / ``_visible`` (stop strings stay
    with the frontend, which detokenizes), ``min_tokens`` (0 only); the request's ``eos_token_ids``
    (the tokenizer's) with the checkpoint's. ``sampling_options``: ``temperature`` (unset:
    1.0, as OpenAI), ``top_p``, ``top_k`` (0 or -1: off), ``seed``; penalties, ``min_p``, ``n``,
    beam search and guided decoding only at their neutral values. Anything else raises
    :class:`UnsupportedRequest`: a reply the caller did not ask for is worse than an error.
    """
    prompt_len = len(request.get("token_ids") or [])
    stop = request.get("stop_conditions") or {}
    sampling = request.get("sampling_options") or {}
    out: dict[str, Any] = {}

    max_tokens = stop.get("max_tokens")
    left = context_length - prompt_len
    if left <= 0:
        raise UnsupportedRequest(f"the prompt of {prompt_len} tokens fills the context of {context_length} tokens")
    if max_tokens is None:
        max_tokens = left
    if max_tokens > left:
        raise UnsupportedRequest(f"prompt of {prompt_len} tokens + max_tokens {max_tokens} exceeds the context of "
                                 f"{context_length} tokens")
    out["max_tokens"] = int(max_tokens)

    if stop.get("min_tokens"):
        raise UnsupportedRequest("min_tokens is not supported")
    # Stop ids: the request's own (`stop_token_ids`) and the frontend's (hidden / visible ones);
    # eos: the tokenizer's (the request's `eos_token_ids`, empty with ignore_eos) and the
    # checkpoint's. The engine stops at `stop` (replacing its eos ids) unless ignore_eos, which
    # empties every stop id: so "ignore eos but stop at these ids" is `stop` without the eos ids.
    ids: set[int] = set()
    for name in ("stop_token_ids", "stop_token_ids_hidden", "stop_token_ids_visible"):
        ids.update(stop.get(name) or [])
    eos = set(request.get("eos_token_ids") or []) | set(eos_token_ids)
    if stop.get("ignore_eos"):
        if ids - eos:
            out["stop"] = sorted(ids - eos)
        else:
            out["ignore_eos"] = True
    elif ids | eos:
        out["stop"] = sorted(ids | eos)

    temperature = sampling.get("temperature")
    out["temperature"] = 1.0 if temperature is None else float(temperature)
    if sampling.get("top_p") is not None and float(sampling["top_p"]) < 1.0:
        out["top_p"] = float(sampling["top_p"])
    if sampling.get("top_k") is not None and int(sampling["top_k"]) > 0:
        out["top_k"] = int(sampling["top_k"])
    if sampling.get("seed") is not None:
        # The engine's seed is a u64: a negative or larger one is the client's error, not an OverflowError.
        if not 0 <= int(sampling["seed"]) < 2**64:
            raise UnsupportedRequest(f"seed must be between 0 and {2**64 - 1}, not {sampling['seed']}")
        out["seed"] = int(sampling["seed"])

    neutral = {"n": 1, "best_of": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
               "min_p": 0.0, "use_beam_search": False, "guided_decoding": None}
    for name, value in neutral.items():
        got = sampling.get(name)
        if got is not None and got != value:
            raise UnsupportedRequest(f"{name}={got!r} is not supported (only {value!r})")
    output = request.get("output_options") or {}
    if output.get("logprobs") is not None or output.get("prompt_logprobs") is not None:
        raise UnsupportedRequest("logprobs are not supported")
    return out


class MetricsServer:
    """``metrics()`` of an engine on ``http://host:port/metrics`` (stdlib HTTP server on its own
    thread; port 0 picks a free one)."""

    def __init__(self, metrics: Callable[[], str], host: str = "127.0.0.1", port: int = 0):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = metrics().encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/openmetrics-text; version=1.0.0; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://{host}:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, name="omniprefix-metrics", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


#: ``multi_modal_data`` keys Dynamo's frontend forwards, and the modality each holds.
MEDIA_KEYS = {"image_url": "image", "audio_url": "audio", "input_audio": "audio", "video_url": "video"}


def media_urls(request: Mapping[str, Any]) -> dict[str, list[str]]:
    """Per modality, the URLs of ``multi_modal_data`` in prompt order (``{"Url": ...}`` entries,
    as Dynamo's frontend sends them, or plain strings)."""
    urls: dict[str, list[str]] = {}
    for key, entries in (request.get("multi_modal_data") or {}).items():
        if key not in MEDIA_KEYS:
            raise UnsupportedRequest(f"multi_modal_data.{key} is not supported (only {sorted(MEDIA_KEYS)})")
        for entry in entries or []:
            url = entry.get("Url", entry.get("url")) if isinstance(entry, Mapping) else entry
            if not isinstance(url, str):
                raise UnsupportedRequest(f"multi_modal_data.{key}: an entry without a URL ({str(entry)[:60]})")
            urls.setdefault(MEDIA_KEYS[key], []).append(url)
    return urls


def request_items(encoder: Any, token_ids: list[int], urls: Mapping[str, list[str]],
                  pads: Mapping[str, int]) -> list[Any]:
    """The items of one request in the order their placeholders appear in ``token_ids`` (one pad
    id per item, unexpanded), each decoded by ``encoder``; the counts must agree."""
    from .encoder import MediaError

    order = {pad: modality for modality, pad in pads.items()}
    wanted = [order[t] for t in token_ids if t in order]
    if not urls and not wanted:
        return []
    if encoder is None:
        raise UnsupportedRequest("this model takes no images or audio (its checkpoint has no processor)")
    for modality in sorted(set(wanted) | set(urls)):
        have, need = len(urls.get(modality, [])), wanted.count(modality)
        if have != need:
            raise UnsupportedRequest(f"the prompt holds {need} {modality} placeholder(s) but {have} {modality} item(s) "
                                     f"came (send images as image_url and audio as audio_url data URLs: Dynamo's "
                                     f"frontend does not forward input_audio parts)")
    taken = {modality: 0 for modality in urls}
    items = []
    for modality in wanted:
        index = taken[modality]
        taken[modality] += 1
        try:
            items.append(encoder.from_data_url(urls[modality][index], modality, f"{modality} {index}"))
        except MediaError as e:
            raise UnsupportedRequest(str(e)) from None
    return items


class Worker:
    """The request handler: one engine (and the checkpoint's encoder, if it has towers),
    Dynamo's requests in, token chunks out."""

    def __init__(self, engine: AsyncEngine, context_len: int, encoder: Any = None, mm_routing: bool = False,
                 talker_defaults: Optional[dict[str, Any]] = None):
        self.engine = engine
        # The talker options a spoken request leaves out (--talker-temperature, --talker-max-tokens).
        self.talker_defaults = dict(talker_defaults or {})
        # Set when a call finds the engine dead (a step panicked): `serve` then withdraws the
        # worker and exits.
        self.dead = asyncio.Event()
        # On: each request's images carry the frontend's hashes of them (`extra_args.mm_hashes`)
        # as routing hashes, which the engine writes into its KV events for Dynamo's router.
        self.mm_routing = mm_routing
        self.context_len = context_len
        self.encoder = encoder
        self.eos = list(engine.eos_token_ids)
        self.pads = {"image": engine.image_token_id, "audio": engine.audio_token_id, "video": engine.video_token_id}

    async def generate(self, request: dict[str, Any], context: Any) -> AsyncIterator[dict[str, Any]]:
        from dynamo.llm.exceptions import InvalidArgument

        token_ids = request.get("token_ids") or []
        try:
            options = sampling_options(request, self.eos, self.context_len)
            # Decoding media is CPU work: off the event loop, like the engine's own preparation.
            items = await asyncio.to_thread(request_items, self.encoder, token_ids, media_urls(request), self.pads)
            if items and self.mm_routing:
                items = routed_items(items, (request.get("extra_args") or {}).get("mm_hashes"))
        except (UnsupportedRequest, TypeError, ValueError) as e:
            raise InvalidArgument(str(e)) from None
        if items:
            options.update(encoder=self.encoder)
        speech = (request.get("extra_args") or {}).get(REQUEST_KEY)
        if speech is not None:
            async for chunk in self._speak(token_ids, items, options, speech, context):
                yield chunk
            return
        # The frontend ends a reply by itself at max_tokens or a stop id, possibly before a
        # separate closing chunk arrives: so the last token (the engine marks it, with why)
        # carries finish_reason and the usage (the engine's cached tokens included), sent once
        # the engine finished the request.
        stream = self.engine.stream(token_ids, items or None, **options)
        reply: list[Optional[int]] = []  # None last: the stream ended after a token already sent
        try:
            with self._engine_errors():
                async for token, _rows in stream:
                    if context.is_stopped():
                        return
                    reply.append(token)
                    if stream.finish_reason is not None:
                        async for _ in stream:
                            pass
                        break
                    yield {"token_ids": [token], "index": 0}
                else:
                    reply.append(None)  # the stream ended after a token already sent
        finally:
            await stream.aclose()
        # Set: the stream was read to its end (the early returns above leave before this).
        generation = cast(Generation, stream.generation)
        last = reply.pop()
        produced = len(reply) + (last is not None)
        yield {
            "token_ids": [] if last is None else [last],
            "index": 0,
            "finish_reason": generation.finish_reason,
            "completion_usage": completion_usage(len(token_ids), produced, generation),
        }

    @contextlib.contextmanager
    def _engine_errors(self, *bad_input: type[Exception]) -> Iterator[None]:
        """Dynamo's error for what the engine raised inside: ``InvalidArgument`` for a bad
        request (a :class:`RequestError`, or one of ``bad_input``), ``Unknown`` for the rest; a
        dead engine also marks the worker dead."""
        from dynamo.llm.exceptions import InvalidArgument, Unknown

        try:
            yield
        except RequestError as e:
            raise InvalidArgument(str(e)) from None
        except bad_input as e:
            raise InvalidArgument(str(e)) from None
        except EngineDeadError as e:
            # Unknown, not EngineShutdown: the frontend migrates EngineShutdown to another
            # worker, and a request that made this engine panic could take each one down.
            self.dead.set()
            raise Unknown(f"the worker's engine died ({e}); retry: the fleet replaces the worker") from None
        except Error as e:
            raise Unknown(f"{type(e).__name__}: {e}") from None


    async def _speak(self, token_ids: list[int], items: list[Any], options: dict[str, Any], speech: Any,
                     context: Any) -> AsyncIterator[dict[str, Any]]:
        """A spoken request (the edge's, :mod:`omniprefix.speech_route`): each token and each
        audio chunk (PCM16, base64, in ``extra_args.audio_chunk``) as the engine makes it, then a
        last chunk with ``finish_reason``, the usage and ``extra_args.speech``."""
        from dynamo.llm.exceptions import InvalidArgument

        if not isinstance(speech, dict) or not isinstance(speech.get("voice"), str) \
                or not isinstance(speech.get("talker", {}), dict):
            raise InvalidArgument(f"extra_args.{REQUEST_KEY} must be {{\"voice\": str, \"talker\": {{...}}}}")
        talker = {**self.talker_defaults, **speech.get("talker", {})}
        stream = self.engine.stream(token_ids, items or None, audio=True, speaker=speech["voice"], talker=talker,
                                    **options)
        produced = 0
        try:
            # TypeError: a talker option of the wrong type (the edge checks them first).
            with self._engine_errors(TypeError):
                async for item in stream:
                    if context.is_stopped():
                        return
                    if isinstance(item, AudioChunk):
                        yield {"token_ids": [], "index": 0,
                               "extra_args": {CHUNK_KEY: {"offset": item.offset, "pcm16": b64(pcm16(item.samples))}}}
                    else:
                        produced += 1
                        yield {"token_ids": [item[0]], "index": 0}
        finally:
            await stream.aclose()
        generation = cast(Generation, stream.generation)
        yield {
            "token_ids": [],
            "index": 0,
            "finish_reason": generation.finish_reason,
            "completion_usage": completion_usage(len(token_ids), produced, generation),
            "extra_args": {DONE_KEY: {
                "sample_rate": generation.sample_rate,
                "samples": 0 if generation.audio is None else int(generation.audio.shape[0]),
                "audio_finish_reason": generation.audio_finish_reason,
                "ttfa_s": generation.ttfa_s,
                "talker_prompt_rows": generation.talker_prompt_rows,
                "talker_cached_rows": generation.talker_cached_rows,
            }},
        }


def completion_usage(prompt: int, produced: int, generation: Generation) -> dict[str, Any]:
    """A reply's usage as Dynamo's ``completion_usage``: the engine's cached tokens included."""
    return {"prompt_tokens": prompt, "completion_tokens": produced, "total_tokens": prompt + produced,
            "prompt_tokens_details": {"cached_tokens": generation.num_cached_tokens}}


def talker_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """The talker options of ``--talker-temperature`` and ``--talker-max-tokens`` (unset: the
    checkpoint's)."""
    out: dict[str, Any] = {}
    if args.talker_temperature is not None:
        out["temperature"] = args.talker_temperature
    if args.talker_max_tokens is not None:
        out["max_tokens"] = args.talker_max_tokens
    return out


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m omniprefix.worker", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="checkpoint directory with tokenizer.json and a chat template")
    p.add_argument("--model-name", help="the name clients send (default: the directory's name)")
    p.add_argument("--endpoint", default=DEFAULT_ENDPOINT, help="Dynamo NAMESPACE.COMPONENT.ENDPOINT (default %(default)s)")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--metrics-port", type=int, default=0, help="0: a free port (printed on the ready line)")
    p.add_argument("--kv-events", default="tcp://127.0.0.1:0", help="the engine's KV event PUB endpoint (default %(default)s)")
    p.add_argument("--discovery-backend", default=os.environ.get("DYN_DISCOVERY_BACKEND", "etcd"),
                   choices=["etcd", "file", "kubernetes", "mem"])
    p.add_argument("--request-plane", default=os.environ.get("DYN_REQUEST_PLANE", "tcp"), choices=["tcp", "nats"])
    p.add_argument("--event-plane", default=os.environ.get("DYN_EVENT_PLANE", "zmq"), choices=["zmq", "nats"])
    # Unset flags leave the engine's own defaults (Engine.from_dir), which the engine checks.
    engine = p.add_argument_group("engine options (Engine.from_dir; unset: the engine's default)")
    for name, (kind, choices) in ENGINE_FLAGS.items():
        engine.add_argument("--" + name.replace("_", "-"), type=kind, choices=choices)
    engine.add_argument("--fingerprint-key",
                        help="the fleet key, 64 hex digits (default: the --tier-dir's key with a tier, else a random one)")
    engine.add_argument("--tier-dir", metavar="DIR",
                        help="a disk tier under the KV pool: evicted blocks are kept in DIR (created 0700), which "
                             "the workers of a host may share; without --fingerprint-key, the key in DIR/fleet.key")
    engine.add_argument("--tier-bytes", metavar="SIZE", type=byte_size,
                        help="the tier's bound in bytes of its files, across every worker on DIR (512MiB, 8GiB, "
                             "10GB; default 8GiB)")
    engine.add_argument("--cache", choices=["on", "off"],
                        help="prefix caching (both stages; default on): off recomputes every prompt (benchmarks)")
    p.add_argument("--dynamo-mm-keys", default="on", choices=["on", "off"],
                   help="add the frontend's image hashes to the KV events Dynamo routes on (default %(default)s)")
    media = p.add_argument_group("media (checkpoints with a processor and towers)")
    media.add_argument("--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS,
                       help="largest decoded image, in pixels (default %(default)s)")
    media.add_argument("--max-media-bytes", type=int, default=MAX_MEDIA_BYTES,
                       help="largest encoded image or audio (default %(default)s)")
    speech = p.add_argument_group("speech (checkpoints with a talker)")
    speech.add_argument("--talker-temperature", type=float,
                        help="the talker's temperature when a request sets none (0: greedy; default: the checkpoint's)")
    speech.add_argument("--talker-max-tokens", type=int,
                        help=f"codec frames a reply speaks at most when a request sets none (1 to {MAX_TALKER_TOKENS})")
    args = p.parse_args(argv)
    if args.tier_bytes is not None and args.tier_dir is None:
        p.error("--tier-bytes needs --tier-dir")
    if args.talker_temperature is not None and not 0.0 <= args.talker_temperature <= 2.0:
        p.error(f"--talker-temperature must be in [0, 2], not {args.talker_temperature}")
    if args.talker_max_tokens is not None and not 1 <= args.talker_max_tokens <= MAX_TALKER_TOKENS:
        p.error(f"--talker-max-tokens must be in [1, {MAX_TALKER_TOKENS}], not {args.talker_max_tokens}")
    if not (args.model / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there")
    if not (args.model / "tokenizer.json").is_file():
        p.error(f"--model {args.model}: no tokenizer.json there (Dynamo's frontend tokenizes with it)")
    return args


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    # No hidden states are captured: Dynamo's token-out responses carry none, so gathering them
    # for every position would be work no one reads.
    options: dict[str, Any] = {"kv_events": args.kv_events, "capture": []}
    for name in (*ENGINE_FLAGS, "fingerprint_key", "tier_dir", "tier_bytes"):
        if getattr(args, name) is not None:
            options[name] = getattr(args, name)
    if args.cache is not None:
        options["cache"] = args.cache == "on"
    return options


async def engine_death(worker: Worker, poll_s: float = 0.5) -> None:
    """Returns once the engine is dead: a request saw :class:`EngineDeadError`, or
    ``Engine.is_dead`` (checked every ``poll_s``: a step can panic with no request left to see it)."""
    while not worker.engine.is_dead:
        try:
            await asyncio.wait_for(worker.dead.wait(), poll_s)
            return
        except asyncio.TimeoutError:
            pass


async def withdraw(runtime: Any, endpoint: Any, serving: "asyncio.Future[None]", timeout_s: float = 10.0) -> None:
    """After an engine death: out of discovery first (the instance, then the model card), so
    the frontend routes nothing more here, then Dynamo's shutdown, which lets the requests in
    flight end (each with the engine's error) before ``serve_endpoint`` returns."""
    from dynamo.llm import unregister_model

    print("omniprefix.worker: the engine died (a step panicked); withdrawing and exiting", file=sys.stderr,
          flush=True)
    for what, call in (("instance", endpoint.unregister_endpoint_instance),
                       ("model", lambda: unregister_model(endpoint))):
        try:
            await asyncio.wait_for(call(), timeout_s)
        except Exception as e:  # noqa: BLE001 (the shutdown below withdraws it too; say why this did not)
            print(f"omniprefix.worker: unregistering the {what}: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
    runtime.shutdown()
    try:
        await asyncio.wait_for(serving, timeout_s)
    except Exception as e:  # noqa: BLE001 (exiting anyway)
        print(f"omniprefix.worker: shutting down: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


async def serve(args: argparse.Namespace) -> int:
    """Serves until SIGINT or SIGTERM (exit status 0) or the engine's death (1)."""
    from dynamo.llm import KvEventPublisher, ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model
    from dynamo.runtime import DistributedRuntime

    model_dir = args.model.resolve()
    name = args.model_name or model_dir.name
    engine = AsyncEngine.from_dir(model_dir, **engine_options(args))
    encoder = encoder_for(model_dir, max_image_pixels=args.max_image_pixels, max_media_bytes=args.max_media_bytes)
    # Images carry the frontend's hashes, which the engine writes as Dynamo's markers.
    mm_routing = encoder is not None and args.dynamo_mm_keys == "on"
    # The HTTP server's own threads read the sync engine's metrics (AsyncEngine.metrics is a coroutine).
    metrics = MetricsServer(engine.engine.metrics, args.metrics_host, args.metrics_port)
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, args.discovery_backend, args.request_plane, event_plane=args.event_plane)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, runtime.shutdown)
    worker: Optional[Worker] = None
    try:
        endpoint = runtime.endpoint(args.endpoint)
        # The relay subscribes to the engine's PUB socket before the model is announced, so
        # no request's events go out before someone listens. With image_token_id it hashes a
        # block's image rows under the marker the engine wrote first in its extra_keys.
        image_keys = {"image_token_id": engine.image_token_id} if mm_routing else {}
        relay = KvEventPublisher(endpoint, kv_block_size=engine.block_size, zmq_endpoint=engine.kv_events_endpoint,
                                 **image_keys)
        runtime_config = ModelRuntimeConfig()
        if engine.context_len is None:
            raise SystemExit(f"{model_dir / 'config.json'} has no max_position_embeddings")
        runtime_config.context_length = engine.context_len
        runtime_config.total_kv_blocks = engine.num_blocks
        runtime_config.kv_event_publishing_enabled = True
        await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, endpoint, str(model_dir),
                             name, worker_type=WorkerType.Aggregated, kv_cache_block_size=engine.block_size,
                             runtime_config=runtime_config)
        worker = Worker(engine, runtime_config.context_length, encoder, mm_routing, talker_defaults(args))
        print(json.dumps({"pid": os.getpid(), "metrics": metrics.url, "kv_events": engine.kv_events_endpoint,
                          "model": name, "instance": endpoint.connection_id(), "block_size": engine.block_size}),
              flush=True)
        serving = asyncio.ensure_future(endpoint.serve_endpoint(worker.generate))
        died = asyncio.ensure_future(engine_death(worker))
        await asyncio.wait({serving, died}, return_when=asyncio.FIRST_COMPLETED)
        if not died.done():
            died.cancel()
            await serving
            return 0
        await withdraw(runtime, endpoint, serving)
        del relay
        return 1
    finally:
        metrics.close()
        engine.close()
        if worker is not None:
            # Dynamo's runtime keeps `worker.generate`, so the worker, referenced past its
            # shutdown: the engine must not stay reachable from it, or it is never dropped, and
            # its drop is what spills the pool to a disk tier for the next worker on it.
            del worker.engine


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    try:
        import uvloop
    except ImportError:
        sys.exit("error: Dynamo is not installed here: bash scripts/install_fleet.sh VENV")
    status = uvloop.run(serve(args))
    # The engine's last references are in reference cycles (the metrics handler's class):
    # collected now, so it drops (spilling its cache to a tier, waiting for the writes) before
    # the interpreter exits, which would not drop it.
    gc.collect()
    sys.exit(status)


if __name__ == "__main__":
    main()
