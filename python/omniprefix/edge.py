"""The fleet's HTTP edge: a thin aiohttp proxy on loopback in front of Dynamo's OpenAI frontend.

    python -m omniprefix.edge --upstream http://127.0.0.1:8001 [--port 8000] [--max-body-bytes N]
        [--model-dir DIR [--speech-router kv|round-robin --block-size N]]

Why it exists: Dynamo 1.6.1's frontend limits a body only by ``DYN_HTTP_BODY_LIMIT_MB`` (whole
MiB, default 45 MiB; lib/llm/src/http/service/openai.rs ``get_body_limit``), so a multi-MB
prompt is tokenized before any check; and it answers some bodies it cannot serve
(:mod:`omniprefix.openai_checks`). The edge:

* refuses a body over ``max_body_bytes`` with a 413 before reading it (Content-Length, also at
  ``Expect: 100-continue``) or as soon as a chunked body's read passes the limit, and closes the
  connection (dropping what the client still sends for at most ``LINGER_S``);
* checks a ``/v1/chat/completions`` or ``/v1/completions`` body (UTF-8, JSON, fields) and answers
  a bad one in OpenAI's error shape naming the field;
* answers a spoken chat (``"modalities": ["text", "audio"]``) itself, since Dynamo 1.6.1's
  frontend cannot carry audio to a client: it checks the voice, format and talker options
  (:mod:`omniprefix.speech`), then routes the request with Dynamo's own KV router to a worker
  and streams the worker's text and audio back in OpenAI's ``message.audio`` / ``delta.audio``
  shape (:mod:`omniprefix.speech_route`);
* otherwise forwards the request unchanged, and the response chunk by chunk as the frontend
  writes it (SSE streams are not buffered). A client that goes away cancels the handler, which
  closes the upstream request, so Dynamo cancels the generation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, cast

from ._omniprefix import DEFAULT_BLOCK_SIZE
from .openai_checks import CHECKED_PATHS, Limits, Rejected, check_request, max_token_bytes, parse_body, too_large
from .speech import SpeechCaps, check_speech, wants_audio

if TYPE_CHECKING:
    from .speech_route import SpeechRoute

__all__ = ["Edge", "limits_for", "main"]

#: Headers that belong to one connection, never forwarded (RFC 9110 7.6.1), and those aiohttp
#: sets itself from the forwarded body.
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
              "transfer-encoding", "upgrade", "host", "content-length", "expect"}
READ_CHUNK = 64 * 1024
LINGER_S = 2.0
#: How often an unknown model name may trigger a fresh look at the frontend's ``/v1/models``.
MODELS_REFRESH_S = 1.0


def limits_for(model_dir: Path, max_body_bytes: int) -> Limits:
    """A fleet's limits from its checkpoint: the context (``max_position_embeddings``) and the
    prompt-text bound it implies with the tokenizer's longest token."""
    from . import checkpoint_context_len

    context = checkpoint_context_len(str(model_dir))
    if context is None:
        raise ValueError(f"{model_dir / 'config.json'} has no max_position_embeddings")
    return Limits(max_body_bytes, context, context * max_token_bytes(model_dir / "tokenizer.json"))


class Edge:
    """The proxy, served on its own thread's event loop (:meth:`start`, :meth:`stop`), so a
    synchronous supervisor (``omniprefix.fleet``) can run it beside its processes."""

    def __init__(self, upstream: str, limits: Limits, host: str = "127.0.0.1", port: int = 0,
                 speech_caps: Optional[SpeechCaps] = None, speech_route: Optional[SpeechRoute] = None):
        self.upstream = upstream.rstrip("/")
        self.limits = limits
        # What the fleet's checkpoint can say (None: it has no talker), and the route spoken
        # chats take to the workers (Dynamo's KV router), connected when the edge starts.
        self.speech_caps = speech_caps
        self.speech_route = speech_route
        self.host, self.port = host, port
        self._models_checked = 0.0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- serving -----------------------------------------------------------------------------

    async def _setup(self) -> None:
        import aiohttp
        from aiohttp import web

        # No total timeout (a generation may be long); no decompression (bytes pass unchanged);
        # no cap on connections (aiohttp's default 100 would queue the 101st stream here, unseen
        # by the frontend's own admission and metrics).
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                              auto_decompress=False, connector=aiohttp.TCPConnector(limit=0))
        app = web.Application(client_max_size=self.limits.max_body_bytes)
        app.router.add_route("*", "/{tail:.*}", self._handle, expect_handler=self._expect)
        # handler_cancellation: a client that disconnects cancels its handler, and so its upstream
        # request. lingering_time: after a 413, the rest of the body is read and dropped for at
        # most this long (so a client still sending gets the answer, not a reset), then closed.
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0,
                                     lingering_time=LINGER_S)
        await self._runner.setup()
        if self.speech_route is not None:
            await self.speech_route.start()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        # Started, so the site's server is the asyncio.Server loop.create_server made.
        self.port = cast(asyncio.Server, site._server).sockets[0].getsockname()[1]

    async def _teardown(self) -> None:
        await self._runner.cleanup()
        await self._session.close()
        if self.speech_route is not None:
            self.speech_route.close()

    def start(self, timeout_s: float = 10.0) -> str:
        """Serves on a daemon thread; returns the URL once it listens."""
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._setup())
            except BaseException as e:  # reported to start()'s caller
                failed.append(e)
                ready.set()
                return
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.run_until_complete(self._teardown())
                loop.close()

        self._thread = threading.Thread(target=run, name="omniprefix-edge", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s) or failed:
            raise RuntimeError(f"the edge did not start on {self.host}:{self.port}: {failed[0] if failed else 'timeout'}")
        return self.url

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)

    # -- requests ----------------------------------------------------------------------------

    @staticmethod
    def _reply(rejected: Rejected) -> Any:
        from aiohttp import web

        response = web.json_response(rejected.body(), status=rejected.status)
        if rejected.status == 413:
            response.force_close()  # the connection ends after the answer
        return response

    async def _expect(self, request: Any) -> Any:
        """``Expect: 100-continue``: a 413 instead of "continue" when Content-Length is over."""
        from aiohttp.web_urldispatcher import _default_expect_handler

        if request.content_length is not None and request.content_length > self.limits.max_body_bytes:
            return self._reply(too_large(request.content_length, self.limits.max_body_bytes))
        return await _default_expect_handler(request)

    async def _read_body(self, request: Any) -> bytes:
        limit = self.limits.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise too_large(request.content_length, limit)
        chunks, size = [], 0
        while chunk := await request.content.read(READ_CHUNK):
            size += len(chunk)
            if size > limit:
                raise too_large(None, limit)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _handle(self, request: Any) -> Any:
        try:
            body = await self._read_body(request)
            if request.method == "POST" and request.path in CHECKED_PATHS:
                parsed = parse_body(body)
                await self._refresh_models(parsed.get("model"))
                check_request(request.path, parsed, self.limits)
                if request.path == "/v1/chat/completions" and wants_audio(parsed):
                    return await self._speak(request, parsed)
        except Rejected as e:
            return self._reply(e)
        return await self._proxy(request, body)

    async def _speak(self, request: Any, body: dict[str, Any]) -> Any:
        """A spoken chat: checked, routed by Dynamo's KV router to a worker, answered as OpenAI's
        ``message.audio`` or a stream of ``delta.audio`` chunks forwarded as the worker makes them."""
        from aiohttp import web

        from .speech_route import UpstreamError

        speech = check_speech(body, self.speech_caps)
        if self.speech_route is None:
            raise Rejected("this edge has no route to the workers for spoken replies (start it with the fleet)",
                           "modalities", status=501, code="unsupported_parameter")
        # The template and the tokenizer are CPU work: off the event loop, which serves every stream.
        prepared = await asyncio.to_thread(self.speech_route.preprocess, body, speech)
        if not speech.stream:
            try:
                return web.json_response(await self.speech_route.reply(prepared, speech))
            except UpstreamError as e:
                return web.json_response(_error(e), status=e.status)
        events = self.speech_route.stream(prepared)
        try:
            # The first chunk decides the status: a worker's refusal is still a 400.
            first = await events.__anext__()
        except UpstreamError as e:
            await events.aclose()
            return web.json_response(_error(e), status=e.status)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        try:
            await out.write(_sse(first))
            async for event in events:
                await out.write(_sse(event))
            await out.write(b"data: [DONE]\n\n")
        except UpstreamError as e:
            await out.write(_sse(_error(e)))
        except ConnectionResetError:  # the client went away between two writes
            return out
        finally:
            # A client gone cancels this handler here: closing the events drops the router's
            # stream, which cancels the request on its worker (both stages stop).
            await events.aclose()
        await out.write_eof()
        return out

    async def _refresh_models(self, name: Any) -> None:
        """Learns the served models from the frontend's ``/v1/models`` when a name is new
        (at most once a second: an unknown name must not make every request a lookup)."""
        if not isinstance(name, str) or name in self.limits.models:
            return
        if time.monotonic() - self._models_checked < MODELS_REFRESH_S:
            return
        self._models_checked = time.monotonic()
        try:
            async with self._session.get(self.upstream + "/v1/models") as r:
                if r.status == 200:
                    models = {m.get("id") for m in (await r.json()).get("data", [])}
                    self.limits.models = {m for m in models if isinstance(m, str)} or self.limits.models
        except (OSError, ValueError, asyncio.TimeoutError):
            pass

    async def _proxy(self, request: Any, body: bytes) -> Any:
        import aiohttp
        from aiohttp import web
        from multidict import CIMultiDict

        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP)
        try:
            upstream = await self._session.request(request.method, self.upstream + request.rel_url.path_qs,
                                                   headers=headers, data=body if body or request.method == "POST" else None,
                                                   allow_redirects=False)
        except (aiohttp.ClientError, OSError) as e:
            return web.json_response({"error": {"message": f"the frontend is unreachable: {e}", "type": "server_error",
                                                "param": None, "code": "upstream_unavailable"}}, status=502)
        done = False
        try:
            out = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                     headers=CIMultiDict((k, v) for k, v in upstream.headers.items()
                                                         if k.lower() not in HOP_BY_HOP))
            if upstream.content_length is not None:
                out.content_length = upstream.content_length
            await out.prepare(request)
            async for chunk in upstream.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            done = True
            return out
        finally:
            # Unread (the client went away, or the handler was cancelled): closing the
            # connection tells the frontend to cancel the request. Read: it can serve another.
            upstream.release() if done else upstream.close()


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _error(e: Exception) -> dict[str, Any]:
    status = getattr(e, "status", 500)
    kind = "invalid_request_error" if status == 400 else "server_error"
    return {"error": {"message": str(e), "type": kind, "param": None, "code": None}}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m omniprefix.edge", description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream", required=True, help="Dynamo's frontend, e.g. http://127.0.0.1:8001")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024)
    p.add_argument("--model-dir", type=Path, help="the checkpoint, for the context and the prompt-text bound")
    speech = p.add_argument_group("spoken chats (a --model-dir with a talker); Dynamo's planes from DYN_* / "
                                  "ETCD_ENDPOINTS as for the workers")
    speech.add_argument("--speech-router", choices=["kv", "round-robin"],
                        help="route spoken chats to the workers with Dynamo's KvRouter or round-robin client "
                             "(unset: they are refused with a 501)")
    speech.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                        help="the workers' KV block size (default %(default)s)")
    speech.add_argument("--model-name", help="the name clients send (default: --model-dir's name)")
    speech.add_argument("--endpoint", default="omniprefix.worker.generate",
                        help="the workers' Dynamo NAMESPACE.COMPONENT.ENDPOINT (default %(default)s)")
    args = p.parse_args(argv)
    if args.speech_router and not args.model_dir:
        p.error("--speech-router needs --model-dir (the checkpoint's template, tokenizer and voices)")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    from .speech import speech_caps

    limits = limits_for(args.model_dir, args.max_body_bytes) if args.model_dir else Limits(args.max_body_bytes)
    caps = speech_caps(args.model_dir) if args.model_dir else None
    route = None
    if caps is not None and args.speech_router:
        from .speech_route import SpeechRoute

        route = SpeechRoute(args.model_dir.resolve(), args.model_name or args.model_dir.resolve().name,
                            args.speech_router, args.block_size, args.endpoint)
    # Without --speech-router the edge refuses spoken chats (501): routing them needs Dynamo's planes.
    edge = Edge(args.upstream, limits, args.host, args.port, speech_caps=caps, speech_route=route)
    print(json.dumps({"edge": edge.start(timeout_s=60.0), "upstream": edge.upstream}), flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        edge.stop()


if __name__ == "__main__":
    main()
