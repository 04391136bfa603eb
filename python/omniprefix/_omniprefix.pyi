"""Type stubs of ``omniprefix._omniprefix``, the Rust extension (PyO3) re-exported by ``omniprefix``.

Prefix caching for multimodal ("Omni") LLM inference: an :class:`Engine` runs a thinker model
(Qwen2 / Qwen3 / Qwen3-Omni thinker, CPU or wgpu backend) over prompts that mix text token ids
with image, audio and video :class:`Item` s, reuses the longest cached prefix (matched by the
items' *content*, validated), and still returns the **full** hidden states of every prompt
position. The standalone matcher (:func:`fingerprint`, :class:`Prompt`, :class:`PrefixIndex`)
exposes the index without a model. With ``kv_events=`` an engine publishes what it caches as
vLLM's KV events (msgpack over ZMQ) for cache-aware routers; :func:`block_hashes` is the
router's side, the hashes of a request's blocks without a model.

Memory rules: item content is read through the buffer protocol, without a copy, at call time
only; nothing keeps a reference to a caller's buffer after a call returns (what must be kept,
such as embeddings, is copied). The GIL is released while fingerprinting, prefilling and
generating. See ``docs/python.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from os import PathLike
from typing import Any, Generic, Literal, Optional, Tuple, TypedDict, Union, final, overload, type_check_only

from typing_extensions import Required, TypeVar, Unpack

import numpy as np
import numpy.typing as npt

__all__ = [
    "AudioChunk",
    "CacheError",
    "DEFAULT_BLOCK_SIZE",
    "CheckpointError",
    "ConfigError",
    "Engine",
    "EngineDeadError",
    "Error",
    "EventPump",
    "Generation",
    "GpuError",
    "InsertOutcome",
    "InternalError",
    "Item",
    "Match",
    "Output",
    "PrefixIndex",
    "Prompt",
    "RequestError",
    "Stream",
    "__version__",
    "block_hashes",
    "checkpoint_context_len",
    "fingerprint",
    "vllm_uuids",
]

#: The package version.
__version__: str
#: Tokens per KV block where a call or an engine option does not say (the engine's default: 16).
DEFAULT_BLOCK_SIZE: int

# ---------------------------------------------------------------------------------------- types

#: Token ids: a sequence of Python ints or a 1-D numpy integer array (any integer dtype, any
#: strides). Each id must be an ``int`` in ``0 .. 2**32 - 1`` (else ``TypeError`` /
#: ``ValueError``) and below the model's vocabulary (else :class:`RequestError`).
_TokenIds = Union[Sequence[int], npt.NDArray[np.integer[Any]]]

#: ``"image"``, ``"audio"`` or ``"video"``.
_Modality = Literal["image", "audio", "video"]

#: An item's placeholder layout, as in ``docs/request-format.md``:
#: ``{"kind": "image", "grid_thw": [t, h, w]}``,
#: ``{"kind": "video", "grid_thw": [t, h, w], "seconds_per_grid": s}``,
#: ``{"kind": "audio", "mel_frames": n}``. Grids are patch grids before the 2x2 merge.
_Layout = Mapping[str, Any]

#: Any buffer-protocol object of dtype uint8, int32, int64, float16, bfloat16 (ml_dtypes) or
#: float32, any shape and strides; converted with ``numpy.asarray`` (no copy).
_ArrayLike = Any

#: What an encoder returns: embeddings ``[num_tokens, hidden]``, or ``(embeddings, deepstack)``.
_EncoderOutput = Union[_ArrayLike, Tuple[_ArrayLike, Union[_ArrayLike, Sequence[_ArrayLike]]]]

#: ``encoder(item) -> embeddings``: called only when an item without embeddings misses the
#: engine's encoder cache, at most once per distinct content; what it raises propagates unchanged.
_Encoder = Callable[["Item"], _EncoderOutput]

#: Capture points: ``"default"`` (``hidden.0``, ``hidden.<L/2>``, ``hidden.final``), ``"all"``
#: (``hidden.0 .. hidden.<L>`` and ``hidden.final``), or a list of layer ints, ``"final"`` and
#: ``"hidden.<L>"`` names, e.g. ``[0, 2, "final"]``.
_Capture = Union[Literal["default", "all"], Sequence[Union[int, str]]]

_Placeholders = Literal["unexpanded", "expanded", "audio_in_video"]
_Validation = Literal["second_digest", "exact_bytes", "unvalidated"]
_Backend = Literal["cpu", "wgpu", "auto"]

#: A fleet key: 32 bytes, or a str of 64 hex digits (what ``--fingerprint-key`` takes).
_Key = Union[bytes, str]

#: A ZMQ TCP endpoint, ``"tcp://host:port"`` (``*`` binds every interface; port 0 picks a free one).
_Endpoint = str

#: One token of a stream: ``(token, {capture: row [hidden]})``.
_TokenRows = Tuple[int, dict[str, npt.NDArray[np.float32]]]

#: What a :class:`Stream` yields: ``(token, rows)`` tuples, and :class:`AudioChunk` s too when
#: the request asked for audio (``Engine.stream(..., audio=True)``).
_StreamItem = TypeVar("_StreamItem", default=_TokenRows)

# ----------------------------------------------------------------------------------- exceptions

class Error(Exception):
    """Base class of every error the engine raises; the message is the Rust error's text.

    Python-side type and value problems raise ``TypeError`` (floats as token ids, wrong
    argument types, unsupported content dtypes such as float64 or bool) or ``ValueError``
    (negative ids, ids past ``2**32 - 1``, unknown option strings, a fingerprint key that is not
    32 bytes or 64 hex digits, a ``kv_*`` option without ``kv_events``, ``tier_bytes`` without
    ``tier_dir``). A call that raises changes nothing: same ``stats()``, same cache.
    """

class RequestError(Error):
    """A request that cannot be served: token ids past the vocabulary, items that do not match
    the placeholders, layouts, NaN/Inf content, embeddings of the wrong shape, bad sampling
    settings (``max_tokens=0``, ``top_p`` outside (0, 1], ...), an unknown tenant, a prompt
    larger than the pool or the model's context."""

class CheckpointError(Error):
    """A checkpoint folder that is missing or cannot be loaded: ``config.json``, the safetensors
    files, a weight missing or of the wrong shape (also a bad ``Engine.random`` config dict)."""

class ConfigError(Error):
    """An engine option value that cannot work: ``block_size=0``, a capture layer past the
    model's layers, a validation policy name that does not exist, a ``kv_events`` /
    ``kv_replay`` endpoint that is not ``tcp://host:port`` or cannot be bound (a port in use);
    the message names the endpoint. A ``tier_dir`` that is a file, group- or world-writable or
    cannot be created, or set with ``cache=False``, and a ``tier_bytes`` of 0 or below one
    block's file are errors on that field, named in the message."""

class CacheError(Error):
    """A cache used against its contract: a standalone :class:`PrefixIndex` given a block id
    already cached under other content (or repeated), more blocks than the prompt's full
    blocks; :meth:`Engine.reset_cache` while requests hold blocks."""

class GpuError(Error):
    """The GPU device failed, is missing (``backend="wgpu"`` without an adapter) or cannot run
    the kernels."""

class InternalError(Error):
    """A scheduler, index or pool invariant broken, a backend failure, or a Rust panic (which
    never crosses into Python as anything else)."""

class EngineDeadError(Error):
    """The engine died: one of its steps panicked, so its state is not trusted. Every pending
    and later call raises this (:attr:`Engine.is_dead` says so); a server should withdraw the
    engine (its KV events already said ``AllBlocksCleared``) and start a new one."""

# ----------------------------------------------------------------------------------------- Item

@final
class Item:
    """One image, audio or video of a prompt.

    ``Item(modality, content, layout, embeddings=None, deepstack=None, params=None, routing_hash=None)``

    * ``content``: what the fingerprint covers (raw media or processed features): any buffer of
      dtype uint8, int32, int64, float16, bfloat16 or float32, any shape the layout allows, any
      strides; big-endian arrays are read as their values (converted to native order). Other
      dtypes raise ``TypeError``. The item holds the array as given; the engine reads it at each
      call, without a copy, and keeps nothing of it (``validation="exact_bytes"`` keeps its own
      copy of the canonical bytes).
    * ``layout``: the placeholder layout (see ``Layout`` above); it fixes the token count and the
      M-RoPE positions.
    * ``embeddings``: the encoder output ``[num_tokens, hidden]``; float32 (other float dtypes
      and any strides are converted); **copied** when the item is made.
    * ``deepstack``: DeepStack levels ``[levels, num_tokens, hidden]`` or a list of
      ``[num_tokens, hidden]`` arrays; copied.
    * ``params``: processor parameters (``dict[str, str]``), part of the fingerprint.
    * ``routing_hash``: the frontend's name of the item for KV-aware routing, 16 hex digits
      (Dynamo's frontend: one ``extra_args["mm_hashes"]`` entry, ``xxh3_64`` of the image URL).
      The engine's KV events then put Dynamo's marker form of it (the 16 digits lowercase, then
      48 ``"0"``) first in the ``extra_keys`` of every block holding the item's rows, before the
      item's 64-hex identity. Not part of the fingerprint: the same content under another hash
      is a cache hit, and its blocks keep the marker of the request that first published them.
      A ``str`` that is not 16 hex digits raises ``RequestError`` naming the item when a request
      carries it, before anything is cached; another type raises ``TypeError`` here.
    """

    def __new__(
        cls,
        modality: _Modality,
        content: _ArrayLike,
        layout: _Layout,
        embeddings: Optional[_ArrayLike] = None,
        deepstack: Optional[Union[_ArrayLike, Sequence[_ArrayLike]]] = None,
        params: Optional[Mapping[str, str]] = None,
        routing_hash: Optional[str] = None,
    ) -> Item: ...
    def with_routing_hash(self, routing_hash: Optional[str]) -> Item:
        """The same item (content, layout, embeddings, params shared, nothing copied) with
        ``routing_hash`` (``None``: without one)."""
    @property
    def routing_hash(self) -> Optional[str]:
        """The routing hash as given, or ``None``."""
    @property
    def modality(self) -> _Modality: ...
    @property
    def layout(self) -> dict[str, Any]: ...
    @property
    def content(self) -> Any:
        """The content object as given (not a copy)."""
    @property
    def embeddings(self) -> Optional[npt.NDArray[np.float32]]:
        """The item's own float32 copy of the embeddings, or ``None``."""
    @property
    def deepstack(self) -> Optional[list[npt.NDArray[np.float32]]]:
        """The item's own float32 copies of the DeepStack levels, or ``None``."""
    @property
    def num_tokens(self) -> int:
        """Placeholder tokens the layout implies (after the 2x2 merge, or the audio formula)."""

# --------------------------------------------------------------------------------------- outputs

@final
class Output:
    """What :meth:`Engine.prefill` returns."""

    @property
    def hidden(self) -> dict[str, npt.NDArray[np.float32]]:
        """Capture name (``"hidden.<L>"``, ``"hidden.final"``) -> ``[prompt_len, hidden]`` for
        **every** position, cached ones included. ``hidden.0`` is the embeddings after the item
        merge, ``hidden.<L>`` the residual stream entering layer L (``hidden.<num_layers>`` the
        last layer's output before the final norm), ``hidden.final`` the final-norm output.
        The arrays own the engine's output buffers (no extra copy)."""
    @property
    def last_logits(self) -> npt.NDArray[np.float32]:
        """The last position's logits ``[vocab]``."""
    @property
    def num_cached_tokens(self) -> int:
        """Leading positions reused from the cache (at most ``prompt_len - 1``: the last one
        always runs)."""
    @property
    def prompt_len(self) -> int:
        """Positions of the prompt, placeholders expanded."""
    @property
    def timings(self) -> dict[str, float]:
        """Milliseconds: ``preprocess``, ``schedule``, ``forward``, ``total``."""

@final
class Generation:
    """What :meth:`Engine.generate` returns (and :attr:`Stream.generation`)."""

    @property
    def tokens(self) -> list[int]:
        """The generated ids, a stop id included."""
    @property
    def hidden(self) -> dict[str, npt.NDArray[np.float32]]:
        """Capture name -> ``[prompt_len + len(tokens) - 1, hidden]``: every position that ran
        (the prompt, then each generated token but the last)."""
    @property
    def num_cached_tokens(self) -> int: ...
    @property
    def prompt_len(self) -> int: ...
    @property
    def finish_reason(self) -> Literal["stop", "length"]: ...
    @property
    def seed(self) -> int:
        """The sampler's seed (the one given, or the random one chosen): pass it to replay."""
    @property
    def timings(self) -> dict[str, Any]:
        """Milliseconds: ``preprocess``, ``ttft`` (submit to first token), ``total``, and
        ``itl`` (list of inter-token gaps)."""
    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the first."""
    @property
    def codes(self) -> Optional[npt.NDArray[np.int64]]:
        """With ``audio=True``: the talker's codec codes, ``[code groups, frames]``; else ``None``."""
    @property
    def audio(self) -> Optional[npt.NDArray[np.float32]]:
        """With ``audio=True``: the spoken reply, mono float32 at :attr:`sample_rate` (the
        stream's :class:`AudioChunk` s, concatenated); else ``None``."""
    @property
    def sample_rate(self) -> Optional[int]:
        """Samples per second of :attr:`audio` (24000 for Qwen3-Omni); ``None`` without audio."""
    @property
    def ttfa_s(self) -> Optional[float]:
        """Seconds from submission to the first audio sample; ``None`` without audio (or when
        the reply made none)."""
    @property
    def talker_prompt_rows(self) -> Optional[int]:
        """Rows of the talker's prefill (its user rows and assistant rows); ``None`` without audio."""
    @property
    def talker_cached_rows(self) -> Optional[int]:
        """Rows of the talker's prefill whose KV was reused; ``None`` without audio."""
    @property
    def audio_finish_reason(self) -> Optional[Literal["stop", "length"]]:
        """Why the talker stopped: ``"stop"`` at the codec's end, ``"length"`` at its
        ``max_tokens``; ``None`` without audio."""

@final
class AudioChunk:
    """A chunk of a spoken reply, yielded by a stream of a request with ``audio=True`` as soon
    as code2wav made it (final: never revised). A request's chunks, in order, concatenate to
    its :attr:`Generation.audio`."""

    @property
    def offset(self) -> int:
        """Index of the chunk's first sample in the reply's audio."""
    @property
    def samples(self) -> npt.NDArray[np.float32]:
        """Mono samples at :attr:`sample_rate`."""
    @property
    def sample_rate(self) -> int:
        """Samples a second (the generation's :attr:`~Generation.sample_rate`, known from the
        first chunk on)."""
    def __len__(self) -> int:
        """Samples in the chunk."""

@final
class Stream(Iterator[_StreamItem], Generic[_StreamItem]):
    """Iterator of ``(token, {capture: row [hidden]})``, one per generated token, from
    :meth:`Engine.stream`. The row is the hidden state of the position that produced the token
    (token ``i`` comes from position ``prompt_len - 1 + i``), equal to that row of the
    :class:`Generation`'s ``hidden``. Several streams of one engine may be interleaved
    (continuous batching); each ``next()`` releases the GIL while the engine steps.

    A stream of a request with ``audio=True`` (a ``Stream[Union[tuple, AudioChunk]]``) also
    yields an :class:`AudioChunk` for each chunk of audio, in the order the engine made tokens
    and chunks: tell them apart with ``isinstance(item, AudioChunk)``. Chunks keep coming after
    the last token (the talker speaks behind the thinker) until the stream ends."""

    def __iter__(self) -> Stream[_StreamItem]: ...
    def __next__(self) -> _StreamItem: ...
    @property
    def finish_reason(self) -> Optional[str]:
        """Why the generation stops (``"stop"`` or ``"length"``), set as soon as its last token
        has been read, before the stream's end; ``None`` until then. A reader can end a reply
        on it without restating the engine's stop rule (max_tokens, stop ids, ``ignore_eos``)."""
    @property
    def generation(self) -> Optional[Generation]:
        """The finished :class:`Generation` once the stream is exhausted, else ``None``."""
    @property
    def output(self) -> Optional[Output]:
        """The finished :class:`Output` of :meth:`Engine.submit_prefill` once exhausted, else ``None``."""
    @property
    def done(self) -> bool:
        """True once the request ended (finished, failed or closed); never waits, even while
        another thread waits in ``next()``."""
    @property
    def request_id(self) -> int:
        """The engine's id of the request (what :meth:`EventPump.wait` names it by)."""
    def next_batch(self) -> list[_StreamItem]:
        """Wait (GIL released) for the next event and return every buffered item (tokens, and
        audio chunks of an ``audio=True`` request); ``[]`` once the stream ended."""
    def close(self) -> None:
        """Abort the generation (also done when the stream is garbage collected); the engine
        keeps no block or lock of it. Safe from another thread while one waits in ``next()``."""

@final
class EventPump:
    """One reader for many streams: N concurrent streams cost one thread (what
    :class:`AsyncEngine` runs on). Submit each with ``pump=`` this pump, ``watch`` it, and call
    ``wait`` in a loop from one thread."""

    def __init__(self) -> None: ...
    def watch(self, stream: Stream[Any]) -> None:
        """Start reading ``stream`` (submitted with ``pump=`` this pump); events that came
        before are read at the next :meth:`wait`."""
    def wait(self, timeout_s: float) -> list[Tuple[int, list[Union[Tuple[int, dict[str, npt.NDArray[np.float32]], Optional[str]], AudioChunk]], Union[None, bool, Error]]]:
        """Wait up to ``timeout_s`` (GIL released) until a watched stream has events; then
        ``[(request_id, [(token, {capture: row}, finish_reason) | AudioChunk, ...], end)]`` for
        each that had some: ``finish_reason`` is ``"stop"`` / ``"length"`` on the request's last
        token, else None; an :class:`AudioChunk` comes for each chunk of an ``audio=True``
        request, in order with the tokens; ``end`` is None while it runs, True once it ended (its ``generation`` / ``output``
        is set), or the exception that ended it. ``[]`` when the time ran out."""
    def __len__(self) -> int:
        """Streams watched that have not ended."""

# ----------------------------------------------------------------------------------------- Engine


# The options' TypedDicts exist for the checker only (the extension parses a kwargs dict):
# @type_check_only says so, and stubtest does not look for them at runtime.
@type_check_only
class RequestOptions(TypedDict, total=False):
    """The keyword options of every request (:meth:`Engine.prefill`, :meth:`Engine.submit_prefill`,
    :meth:`Engine.generate`, :meth:`Engine.stream`); :meth:`Engine.prefill` says what they do."""

    tenant: int  # default 0
    encoder: Optional[_Encoder]  # default None
    placeholders: _Placeholders  # default "unexpanded"


@type_check_only
class SamplingOptions(TypedDict, total=False):
    """The sampling keywords of :meth:`Engine.generate` and :meth:`Engine.stream`: the library's
    ``SamplingParams`` fields (``python/tests`` checks this list against them);
    :meth:`Engine.generate` says what they do."""

    max_tokens: Required[int]
    temperature: float  # default 0.0
    top_k: Optional[int]  # default None
    top_p: Optional[float]  # default None
    seed: Optional[int]  # default None
    stop: Optional[Sequence[int]]  # default None
    ignore_eos: bool  # default False
    run_last_token: bool  # default False
    allow_special_ids: bool  # default False
    suppress_ids: Sequence[int]  # default []


@type_check_only
class GenerateOptions(RequestOptions, SamplingOptions, total=False):
    """:class:`RequestOptions` plus :class:`SamplingOptions`: the keywords of
    :meth:`Engine.generate` and :meth:`Engine.stream` (besides the speech ones)."""


@type_check_only
class TalkerOptions(TypedDict, total=False):
    """The ``talker`` dict of ``audio=True`` requests: the library's ``TalkerSampling`` fields,
    ``max_new_tokens`` spelled ``max_tokens`` as the thinker's (``python/tests`` checks this list
    against the extension's). Missing keys take the checkpoint's (transformers') defaults; an
    unknown key, or a value out of range, is a :class:`RequestError` naming it."""

    temperature: float  # default 0.9; 0 = greedy; finite and >= 0
    top_k: int  # default 50; 0 = off
    top_p: float  # default 1.0; in (0, 1]
    repetition_penalty: float  # default 1.05; finite and > 0
    max_tokens: int  # default 4096: codes the talker samples at most, >= 1
    seed: int  # default 0: the talker's and the code predictor's samplers
    predictor_temperature: float  # default 1.0; finite and > 0
    predictor_top_k: int  # default 50; 0 = off
    predictor_top_p: float  # default 0.8; in (0, 1]


@type_check_only
class EngineOptions(TypedDict, total=False):
    """The keyword options of :meth:`Engine.from_dir` and :meth:`Engine.random` (and of
    :class:`~omniprefix.AsyncEngine`'s), each optional; :meth:`Engine.from_dir` says what they do.
    An unknown option is a ``TypeError`` naming the known ones (``python/tests`` checks this list
    against the extension's)."""

    block_size: int  # default 16
    num_blocks: Optional[int]  # default None
    capture: _Capture  # default "default"
    cache: bool  # default True
    backend: _Backend  # default "cpu"
    dtype: Literal["auto", "f32", "bf16", "f16"]  # default "auto"
    kv_dtype: Literal["f32", "bf16", "f16"]  # default "f32"
    fingerprint_key: Optional[_Key]  # default None
    validation: _Validation  # default "second_digest"
    tenants: Optional[Sequence[int]]  # default None
    max_tokens_per_step: Optional[int]  # default None
    max_seqs_per_step: Optional[int]  # default None
    prefill_cap: Optional[int]  # default None
    token_granular_reuse: bool  # default True
    index: Literal["radix", "hashchain"]  # default "radix"
    fingerprint_threads: Optional[int]  # default None
    encoder_cache_bytes: Optional[int]  # default None
    kv_events: Optional[_Endpoint]  # default None
    kv_replay: Optional[_Endpoint]  # default None
    kv_topic: str  # default ""
    kv_buffer_steps: int  # default 10000
    kv_linger_s: float  # default 0.0
    tier_dir: Optional[Union[str, PathLike[str]]]  # default None
    tier_bytes: int  # default 8 GiB (8589934592)
    speech: bool  # default True
    talker_num_blocks: int  # default 1024
    talker_block_size: int  # default 16
    audio_yield_s: float  # default 1.0


@final
class Engine:
    """A thinker stage: a model on a backend, a prefix cache (radix index + KV block pool),
    an encoder cache, and the scheduler between them.

    The engine steps on its own thread while anything is pending. A call prepares its
    request (fingerprints, prompt, checks, ``encoder`` calls) on the calling thread with the
    GIL released, so a slow encoder in one thread never stalls another thread's stream.
    :class:`AsyncEngine` is the same engine under asyncio."""

    @staticmethod
    def from_dir(
        path: Union[str, PathLike[str]],
        **options: Unpack[EngineOptions],
    ) -> Engine:
        """Load a Hugging Face checkpoint folder (``config.json`` + safetensors; Qwen2, Qwen3,
        or the Qwen3-Omni thinker). Reads and converts every weight: the one expensive call.

        * ``block_size``: tokens per KV block; ``num_blocks``: pool size (default 1024).
        * ``capture``: which hidden states come back (see ``Capture`` above).
        * ``cache=False``: every request runs as if nothing were cached (same code path).
        * ``backend``: ``"cpu"``, ``"wgpu"`` (:class:`GpuError` without an adapter, never a
          silent fallback) or ``"auto"`` (see :attr:`backend` for the choice).
        * ``dtype``: how weight matrices are stored; ``"auto"`` is the checkpoint's own
          (a bf16 checkpoint stays bf16, in about its file size of memory). Products
          accumulate in f32. The wgpu backend stores f32 or f16 (where the adapter can
          convert f16): an explicit bf16 there is a :class:`ConfigError`, ``"auto"`` widens
          a bf16 checkpoint. See :attr:`dtype`.
        * ``kv_dtype``: the element type of the K/V pages (``"f16"`` / ``"bf16"`` halve the KV
          memory; attention widens each tile to f32). f32 or f16 on wgpu.
        * ``fingerprint_key``: 32 bytes or 64 hex digits (default: random per engine). It also
          keys the KV event block hashes: every replica and router of a fleet shares it.
        * ``validation``: how a fingerprint hit is confirmed.
        * ``tenants``: the known tenant ids; a request of any other tenant is a :class:`RequestError`.
        * ``max_tokens_per_step`` / ``max_seqs_per_step``: the scheduler's step budget (2048 / 8);
          ``prefill_cap``: prefill tokens a step that carries decodes may add (default a thirty-second
          of ``max_tokens_per_step``; at most it), so long prompts are chunked instead of
          stalling decodes, and one prompt longer than it that will decode is prefilled at a time;
          ``token_granular_reuse``: reuse a match that ends inside a block by copying that block
          (default True); ``fingerprint_threads`` (1) and ``encoder_cache_bytes`` (256 MiB).
        * ``index``: the prefix index, ``"radix"`` (the validated radix tree, default) or
          ``"hashchain"`` (vLLM's SHA-256 block hash chain: the baseline the benchmarks compare).
        * ``kv_events``: publish KV events on this ZMQ PUB endpoint, in vLLM's wire format (the
          frames ``(topic, seq as 8-byte big-endian, msgpack KVEventBatch)``, one batch per
          engine step that changed the cache: ``BlockStored``, ``BlockRemoved``,
          ``AllBlocksCleared``); ``kv_replay``: a ROUTER endpoint answering replay requests
          (a DEALER sends ``(b"", start seq)``, gets ``(b"", topic, seq, payload)`` per buffered
          batch, then ``(b"", b"", -1, b"")``); ``kv_topic``: the first frame of each message;
          ``kv_buffer_steps``: batches kept for replay; ``kv_linger_s``: how long the sockets stay
          open once the engine is dropped (the GIL is released meanwhile). Port 0 picks a free
          port: see :attr:`kv_events_endpoint`. The scheduler never waits on a subscriber.
        * ``tier_dir``: a disk tier under the pool (a ``str`` or ``os.PathLike``, created 0700):
          blocks the pool evicts are written there, and a later prompt (in this engine, another
          engine on the directory, or one after a restart) loads them instead of recomputing.
          Without ``fingerprint_key`` the engine takes the key kept in ``tier_dir/fleet.key``
          (created once), so every engine on the directory finds the others' blocks.
          ``tier_bytes``: the tier's bound in bytes of its files (default 8 GiB), across every
          engine sharing the directory. CPU backend only. Its KV events put blocks going down to
          the tier on ``medium`` ``"DISK"``.
        * ``speech``: load the checkpoint's talker and code2wav when it has them (default True;
          False serves the thinker alone, and asking it for audio is a :class:`RequestError`);
          ``talker_num_blocks`` / ``talker_block_size``: the talker's own KV pool and prefix
          cache (1024 blocks of 16 rows); ``audio_yield_s``: first audio first, how long past
          its listener's audio a reply already heard may hold its code2wav decodes while
          another request awaits its first audio (default 1.0; 0: only while its audio plays).

        Raises :class:`CheckpointError` (missing or bad folder), :class:`ConfigError` (also an
        endpoint that does not parse or cannot be bound), ``ValueError`` (unknown option
        strings, a key that is not 32 bytes or 64 hex digits, a ``kv_*`` option without
        ``kv_events``, ``tier_bytes`` without ``tier_dir``), :class:`GpuError`.
        """
    @staticmethod
    def random(
        config: Mapping[str, Any],
        seed: int,
        **options: Unpack[EngineOptions],
    ) -> Engine:
        """An engine over seeded random weights; ``config`` is a ``config.json`` as a dict
        (e.g. ``json.load`` of ``fixtures/tiny/qwen3_dense/config.json``). Options as
        :meth:`from_dir`."""
    def prefill(
        self,
        token_ids: _TokenIds,
        items: Optional[Sequence[Item]] = None,
        **options: Unpack[RequestOptions],
    ) -> Output:
        """Run one prompt and return every captured hidden state of every position.

        ``placeholders="unexpanded"``: one pad id per item (e.g. ``vision_start image_pad
        vision_end``), which the engine expands to the item's token count; ``"expanded"``: the
        ids already hold every placeholder; ``"audio_in_video"``: each video placeholder takes
        the next audio item too (Qwen3-Omni ``use_audio_in_video``).

        Cost: fingerprinting the items (about one read of their bytes), a radix match
        (microseconds), the forward of the uncached positions, and one copy of the cached
        hidden rows out of the pages. The GIL is released throughout, except while calling
        ``encoder``. Bad input raises and changes nothing."""
    def generate(
        self,
        token_ids: _TokenIds,
        items: Optional[Sequence[Item]] = None,
        *,
        audio: bool = False,
        speaker: Optional[str] = None,
        talker: Optional[TalkerOptions] = None,
        audio_first_chunk: Optional[int] = None,
        audio_chunk: Optional[int] = None,
        **options: Unpack[GenerateOptions],
    ) -> Generation:
        """Prefill, then decode up to ``max_tokens`` tokens (``temperature=0``: greedy, lowest id
        on ties; ``top_k`` / ``top_p`` as transformers' warpers; ChaCha8 seeded per request, so
        the same seed gives the same tokens cached or not). Stops at a stop id (``stop``, default
        the checkpoint's eos ids) unless ``ignore_eos``. The reply is cached with the prompt: a
        next round that re-sends prompt + reply reuses every position that ran.

        The sampling keywords are the library's ``SamplingParams`` fields, passed as they are
        (an unknown name raises :class:`RequestError`). ``run_last_token`` also runs the last
        token (its KV and hidden row); the placeholder ids (image, audio and video pads) are
        never sampled unless ``allow_special_ids``, since a reply holding one could not be sent
        back; ``suppress_ids`` bans more ids (transformers' ``suppress_tokens``). ``generate`` and :meth:`stream` take the same arguments.

        ``audio=True`` also speaks the reply, on a checkpoint with a talker (the full
        Qwen3-Omni; else :class:`RequestError` ``NoTalker``): the talker runs beside the thinker
        as its tokens come and code2wav turns its codes into audio, in the :class:`Generation`'s
        ``codes``, ``audio``, ``sample_rate``, ``ttfa_s``, ``talker_prompt_rows`` /
        ``talker_cached_rows`` and ``audio_finish_reason``. The prompt must end with an open
        assistant turn. ``speaker`` (default ``"ethan"``; an unknown name is a
        :class:`RequestError` listing the checkpoint's), ``talker`` (:class:`TalkerOptions`:
        the talker's sampling, default the checkpoint's), ``audio_first_chunk`` (frames before
        the first decode, default 1: a short wait for the first audio) and ``audio_chunk``
        (most frames a later decode waits for, default 25; chunks double up to it) need ``audio=True`` (else ``TypeError``)."""
    @overload
    def stream(
        self,
        token_ids: _TokenIds,
        items: Optional[Sequence[Item]] = None,
        *,
        tenant: int = 0,
        encoder: Optional[_Encoder] = None,
        placeholders: _Placeholders = "unexpanded",
        pump: Optional[EventPump] = None,
        audio: Literal[False] = False,
        **options: Unpack[SamplingOptions],
    ) -> Stream[_TokenRows]: ...
    @overload
    def stream(
        self,
        token_ids: _TokenIds,
        items: Optional[Sequence[Item]] = None,
        *,
        tenant: int = 0,
        encoder: Optional[_Encoder] = None,
        placeholders: _Placeholders = "unexpanded",
        pump: Optional[EventPump] = None,
        audio: Literal[True],
        speaker: Optional[str] = None,
        talker: Optional[TalkerOptions] = None,
        audio_first_chunk: Optional[int] = None,
        audio_chunk: Optional[int] = None,
        **options: Unpack[SamplingOptions],
    ) -> Stream[Union[_TokenRows, AudioChunk]]: ...
    @overload
    def stream(
        self,
        token_ids: _TokenIds,
        items: Optional[Sequence[Item]] = None,
        *,
        tenant: int = 0,
        encoder: Optional[_Encoder] = None,
        placeholders: _Placeholders = "unexpanded",
        pump: Optional[EventPump] = None,
        audio: bool = False,
        speaker: Optional[str] = None,
        talker: Optional[TalkerOptions] = None,
        audio_first_chunk: Optional[int] = None,
        audio_chunk: Optional[int] = None,
        **options: Unpack[SamplingOptions],
    ) -> Stream[Union[_TokenRows, AudioChunk]]:
        """:meth:`generate`, yielding ``(token, {capture: row})`` per step (for a talker stage);
        same tokens as :meth:`generate` with the same seed. The engine keeps generating while
        nobody reads, until 256 events are buffered; then the request holds until the reader
        catches up (its blocks go to other requests that need them; it recomputes later).
        With ``pump``, that :class:`EventPump` is told whenever the stream has events (read
        them with ``pump.watch(stream)`` and ``pump.wait()``: what :class:`AsyncEngine` does).
        With ``audio=True`` (and the speech keywords of :meth:`generate`) the stream also yields
        an :class:`AudioChunk` for each chunk of audio as code2wav makes it."""
    def submit_prefill(
        self,
        token_ids: _TokenIds,
        items: Optional[Sequence[Item]] = None,
        *,
        pump: Optional[EventPump] = None,
        **options: Unpack[RequestOptions],
    ) -> Stream:
        """:meth:`prefill` without waiting: the returned stream yields no token and its
        ``output`` holds the result once exhausted (what :class:`AsyncEngine` awaits);
        ``pump`` as in :meth:`stream`."""
    @property
    def is_dead(self) -> bool:
        """True once a step panicked: every pending and later call raises
        :class:`EngineDeadError`."""
    def stats(self) -> dict[str, Any]:
        """Every counter of the engine (ints, but for the ``talker``, ``tier`` and ``item_capture`` dicts): ``queries``, ``query_tokens`` (prompt tokens matched),
        ``hits``, ``hit_tokens``, ``evicted_blocks``, ``preemptions``, ``block_copies``,
        ``blocks_free``, ``blocks_in_use``, ``blocks_cached``, ``waiting``, ``running``,
        ``encoder_cache_hits``, ``encoder_calls`` (items the encoder ran for), ``finished``, and
        ``talker`` (the talker's prefix-cache counters, a dict) on a checkpoint that speaks, and
        ``tier`` (a dict) on an engine with a ``tier_dir``: its files' ``hits``, ``misses``,
        ``errors``, ``written``, ``write_drops``, ``evicted`` and ``bytes`` (blocks, and the
        directory's bytes), and ``query_tokens`` / ``hit_tokens`` (prompt tokens past the pool's
        match looked up in the tier, and those loaded from it), and ``item_capture`` (a dict:
        ``rows`` and ``bytes`` of the talker's accept layer kept at item positions) on an engine
        that speaks."""
    def metrics(self) -> str:
        """The engine's metrics in Prometheus text format (OpenMetrics, ending in ``# EOF``),
        with vLLM's meanings: counters ``omniprefix_prefix_cache_queries_total`` and
        ``omniprefix_prefix_cache_hits_total`` (prompt tokens), ``omniprefix_num_preemptions_total``,
        ``omniprefix_kv_events_dropped_total``; gauges ``omniprefix_num_requests_running``,
        ``omniprefix_num_requests_waiting``, ``omniprefix_kv_cache_usage_ratio`` (blocks in use
        or cached over the pool); histograms ``omniprefix_time_to_first_token_seconds`` and
        ``omniprefix_inter_token_latency_seconds`` (one observation per gap between two tokens)."""
    def validate(self) -> None:
        """Check the scheduler / index / pool invariants; raises :class:`InternalError`."""
    def reset_cache(self) -> int:
        """Drop every cached block (publishing ``AllBlocksCleared``) and return the number of
        blocks freed, partly filled ones included. Raises :class:`CacheError`, changing nothing,
        while requests are pending (an open :class:`Stream`)."""
    def cached_block_hashes(self) -> list[int]:
        """The hashes of the full blocks the index holds, ascending: exactly what a consumer of
        every published event knows (empty without ``kv_events``)."""
    def kv_events_stats(self) -> Optional[dict[str, int]]:
        """The publisher's counters, or ``None`` without ``kv_events``: ``batches`` (handed to
        the publisher), ``published`` (sent on the PUB socket), ``dropped`` (its queue was full;
        the scheduler never waits), ``replays`` (requests answered), ``malformed_replays``
        (requests of another shape, ignored)."""
    @property
    def kv_events_endpoint(self) -> Optional[str]:
        """The PUB endpoint as bound (port 0 resolved), or ``None`` without ``kv_events``."""
    @property
    def kv_replay_endpoint(self) -> Optional[str]:
        """The replay endpoint as bound, or ``None`` without ``kv_replay``."""
    @property
    def capture(self) -> list[str]:
        """The capture names, in output order."""
    @property
    def eos_token_ids(self) -> list[int]: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def backend(self) -> str:
        """The backend in use, in words (``"auto"`` reports its choice here)."""
    @property
    def dtype(self) -> Literal["f32", "bf16", "f16"]:
        """The dtype the weight matrices are stored in (``"auto"`` resolved)."""
    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int:
        """Blocks in the KV pool (what a router is told the engine holds)."""
    @property
    def context_len(self) -> Optional[int]:
        """Longest sequence (prompt + reply) the model attends over (``max_position_embeddings``;
        ``None`` when the checkpoint names none)."""
    @property
    def image_token_id(self) -> int:
        """``<|image_pad|>``: one per image in an unexpanded prompt."""
    @property
    def video_token_id(self) -> int:
        """``<|video_pad|>``: one per video in an unexpanded prompt."""
    @property
    def audio_token_id(self) -> int:
        """``<|audio_pad|>``: one per audio in an unexpanded prompt."""
    @property
    def vision_start_token_id(self) -> int:
        """``<|vision_start|>``: opens an image or a video."""
    @property
    def vision_end_token_id(self) -> int:
        """``<|vision_end|>``: closes an image or a video."""
    @property
    def audio_start_token_id(self) -> int:
        """``<|audio_start|>``: opens an audio."""
    @property
    def audio_end_token_id(self) -> int:
        """``<|audio_end|>``: closes an audio."""

def checkpoint_context_len(model_dir: str) -> Optional[int]:
    """``max_position_embeddings`` of the checkpoint in ``model_dir``, read by the engine's own
    config parser (what :attr:`Engine.context_len` says once loaded); ``None`` when it names
    none. For a process that runs no engine (the fleet's edge)."""

# ----------------------------------------------------------------------------------- KV events

def block_hashes(
    token_ids: _TokenIds,
    items: Optional[Sequence[Item]] = None,
    *,
    fingerprint_key: _Key,
    block_size: int = ...,
    tenant: int = 0,
    placeholders: _Placeholders = "unexpanded",
    tokens: Optional[Mapping[str, Any]] = None,
) -> list[int]:
    """The hashes an engine under ``fingerprint_key`` publishes in ``BlockStored`` events for
    this request's full blocks (in order; a partly filled last block has none), computed
    without a model: what a cache-aware router matches a new request against. Items need no
    embeddings (only their content is fingerprinted).

    ``tokens``: the model's special ids. ``None`` is Qwen3-Omni's; else a ``config.json`` dict
    (as :meth:`Engine.random` takes, ``thinker_config`` read when present), whose ids an engine
    over that config uses. Each hash chains the block's content onto its parent's, starting
    from the tenant, so tenants and fleet keys never share hashes.

    Raises ``ValueError`` (a bad key or ``placeholders``), :class:`ConfigError`
    (``block_size=0``), :class:`RequestError` (items that do not match the placeholders),
    :class:`CheckpointError` (a ``tokens`` dict without valid ids). Releases the GIL."""

# ----------------------------------------------------------------------------- standalone matcher

def fingerprint(
    content: _ArrayLike, layout: _Layout, *, key: _Key, params: Optional[Mapping[str, str]] = None
) -> int:
    """The 128-bit keyed fingerprint of an item (modality from ``layout["kind"]``): covers the
    canonical bytes of ``content`` (row-major, little-endian, dtype and shape tagged, ``-0.0``
    as ``+0.0``), the layout and ``params``. Equal values in any strides or byte order give the
    same fingerprint. ``key`` must be 32 bytes or 64 hex digits (``ValueError``); NaN/Inf content is a
    :class:`RequestError`. Releases the GIL while hashing; costs about one read of the bytes."""

def vllm_uuids(items: Sequence[Item], *, key: _Key, threads: int = 1) -> dict[str, list[str]]:
    """vLLM's ``multi_modal_uuids`` for ``items``: per modality (``"image"``, ``"audio"``,
    ``"video"``), in the items' order, each item's identity under ``key`` as 64 lowercase hex
    digits (the width of vLLM's own ``mm_hash``). The first 32 digits are :func:`fingerprint`,
    the rest derived from it; it is the string our KV events carry in ``extra_keys``, so vLLM,
    Dynamo's router and omniprefix name an item alike. Pass the result as a prompt's
    ``multi_modal_uuids`` and vLLM skips hashing the media (it trusts the uuid without
    validating it: see ``docs/vllm.md``). ``threads`` hash one large item in parallel.

    >>> import numpy as np, omniprefix
    >>> image = omniprefix.Item("image", np.zeros((8, 8, 3), np.uint8), {"kind": "image", "grid_thw": [1, 2, 2]})
    >>> uuids = omniprefix.vllm_uuids([image], key=bytes(32))
    >>> len(uuids["image"][0])
    64

    Raises ``ValueError`` (a bad key), ``TypeError`` (not a sequence of :class:`Item`),
    :class:`RequestError` (NaN/Inf content). Releases the GIL while hashing."""

@final
class Prompt:
    """A prompt laid out for the index, without a model: token ids (placeholders expanded),
    atoms and item fingerprints. Special ids default to Qwen3-Omni's (``image_pad`` 151655,
    ``video_pad`` 151656, ``audio_pad`` 151675, ``vision_start`` 151652, ``vision_end`` 151653,
    ``audio_start`` 151669, ``audio_end`` 151670).

    ``key=None``: one random key per process. Items need no embeddings here."""

    def __new__(
        cls,
        token_ids: _TokenIds,
        items: Optional[Sequence[Item]] = None,
        *,
        key: Optional[_Key] = None,
        tenant: int = 0,
        validation: Optional[_Validation] = None,
        placeholders: _Placeholders = "unexpanded",
        special_tokens: Optional[Mapping[str, int]] = None,
    ) -> Prompt:
        """``validation=None`` is ``"second_digest"``. ``special_tokens``: a dict of
        ``image_token_id``, ``video_token_id``, ``audio_token_id``, ``vision_start_token_id``,
        ``vision_end_token_id``, ``audio_start_token_id``, ``audio_end_token_id`` (e.g. a
        checkpoint's ``thinker_config`` entries); ``None`` is Qwen3-Omni's."""
    def __len__(self) -> int: ...
    @property
    def token_ids(self) -> list[int]:
        """The expanded token ids."""
    @property
    def fingerprints(self) -> list[int]:
        """One fingerprint per item, in order."""
    @property
    def tenant(self) -> int: ...
    @property
    def validation(self) -> _Validation: ...

@final
class Match:
    """A lookup result: the cached prefix of a prompt."""

    @property
    def tokens(self) -> int:
        """Leading tokens whose KV is cached (may end inside a block)."""
    @property
    def aligned_tokens(self) -> int:
        """``tokens`` rounded down to whole blocks."""
    @property
    def blocks(self) -> list[int]:
        """``ceil(tokens / block_size)`` block ids; the last is partly valid when not aligned."""

@final
class InsertOutcome:
    """What :meth:`PrefixIndex.insert` did with the blocks it was given."""

    @property
    def adopted(self) -> list[int]:
        """Blocks the index now owns."""
    @property
    def duplicates(self) -> list[int]:
        """Blocks not taken (equal content already cached); still the caller's."""
    @property
    def released(self) -> list[int]:
        """Cached partly filled blocks a longer insert superseded; back to the caller."""
    @property
    def cached(self) -> Match:
        """The inserted prefix as cached now, ready to :meth:`PrefixIndex.lock`."""

@final
class PrefixIndex:
    """The validated radix prefix index on its own: maps prompt prefixes to caller-chosen
    block ids. A :class:`Prompt` made under another validation policy raises ``ValueError``."""

    def __new__(cls, block_size: int = ..., validation: Optional[_Validation] = None) -> PrefixIndex:
        """``validation=None`` is ``"second_digest"``."""
    @property
    def block_size(self) -> int: ...
    @property
    def validation(self) -> _Validation: ...
    def match(self, prompt: Prompt) -> Match:
        """Longest cached prefix (validated); touches LRU clocks and stats only."""
    def insert(self, prompt: Prompt, blocks: Sequence[int]) -> InsertOutcome:
        """Cache the first ``len(blocks)`` full blocks of ``prompt``. :class:`CacheError` when a
        block id is already cached under other content, repeated, or more than the full blocks."""
    def insert_partial(self, prompt: Prompt, blocks: Sequence[int], tokens: int) -> InsertOutcome:
        """Cache the first ``tokens`` positions held by ``ceil(tokens / block_size)`` blocks (the
        last may be partly filled)."""
    def lock(self, m: Match) -> None:
        """Pin what ``m`` reported so eviction cannot take it (reference counted)."""
    def unlock(self, m: Match) -> None:
        """Release one :meth:`lock` of ``m``."""
    def evict(self, n: int) -> list[int]:
        """Give back up to ``n`` blocks of unlocked least-recently-used entries."""
    def stats(self) -> dict[str, int]:
        """``queries``, ``hits``, ``hit_tokens``, ``query_tokens``, ``validation_failures``,
        ``evicted_blocks``, ``cached_blocks``, ``nodes``, ``index_bytes``."""
    def validate(self) -> None:
        """Check every internal invariant; raises :class:`InternalError`."""
