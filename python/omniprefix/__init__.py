"""omniprefix: prefix caching for multimodal (Omni) LLM inference.

The engine (``Engine``, and ``AsyncEngine`` under asyncio) finds the longest cached prefix of a prompt that mixes
text with image, audio and video items, keyed on the items' content, and
returns the full hidden states of every position, cached ones included. The
standalone matcher (``fingerprint``, ``Prompt``, ``PrefixIndex``) serves a
Python scheduler that owns its own KV blocks. With ``kv_events=`` an engine
publishes vLLM's KV events for cache-aware routers, and ``block_hashes`` gives
a router the hashes of a request's blocks without a model.

See docs/python.md for the API and what each call costs.
"""

from . import _omniprefix
from ._omniprefix import *  # noqa: F403  (the extension's names: its __all__, typed in _omniprefix.pyi)
from .aio import AsyncEngine, AsyncStream

__all__ = ["AsyncEngine", "AsyncStream"]
__all__ += _omniprefix.__all__
