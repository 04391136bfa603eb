"""Bad HTTP input through a real fleet: every case is a 4xx naming the field, answered by the
edge (``omniprefix.edge``) or, where only the token request shows it, by the worker; afterwards
the workers still serve and none of the rejected requests reached an engine (their prefix-cache
queries are unchanged). One fleet (2 workers, loopback) for every case.

With ``OMNIPREFIX_BAD_INPUT_TABLE=PATH`` the measured statuses and messages are written there as
the Markdown table of docs/security.md.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
import urllib.parse
from pathlib import Path

import pytest

from test_fleet import MODEL, RunningFleet, alive, leave_mid_stream, pytestmark  # noqa: F401  (the module's skip mark)

from omniprefix.fleet import MAX_BODY_BYTES, worker_metrics
from omniprefix.openai_checks import MAX_STOP, max_token_bytes

CONTEXT = 4096
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
QUERIES = "omniprefix_prefix_cache_queries_total"
PAST_THE_EDGE = "worker, past the edge"


@pytest.fixture(scope="module")
def fleet():
    fleet = RunningFleet("--model", str(MODEL), "--workers", "2", "--port", "0")
    yield fleet
    fleet.stop()


def post(url: str, path: str, body, timeout: float = 60) -> tuple[int, dict]:
    """(status, JSON body) of a POST; ``body`` bytes are sent as they are."""
    where = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=timeout)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def raw_exchange(url: str, head: str, body_chunks: list[bytes] = ()) -> tuple[int, dict]:
    """Sends a request head (and chunks) on a bare socket; reads the reply (its Content-Length)."""
    where = urllib.parse.urlsplit(url)
    with socket.create_connection((where.hostname, where.port), timeout=30) as s:
        s.sendall(head.encode())
        for chunk in body_chunks:
            s.sendall(chunk)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < length_of(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    head_bytes, body = data.split(b"\r\n\r\n", 1)
    return int(head_bytes.split(b" ", 2)[1]), json.loads(body)


def length_of(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1 << 30


def chat(**fields) -> dict:
    return {"model": MODEL.name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL.name, "prompt": [1, 2, 3, 4], "max_tokens": 4, **fields}


def over_limit_content_length(url: str) -> tuple[int, dict]:
    # Only the head: the edge must answer from Content-Length, before any byte of the body.
    return raw_exchange(url, f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {MAX_BODY_BYTES + 1}\r\n\r\n")


def over_limit_chunked(url: str) -> tuple[int, dict]:
    # limit + 1 bytes of chunks and no end: the edge reads them all, answers, and closes.
    size, chunks = MAX_BODY_BYTES + 1, []
    while size:
        n = min(size, 1 << 20)
        chunks.append(b"%x\r\n" % n + b"x" * n + (b"\r\n" if size > n else b""))
        size -= n
    return raw_exchange(url, f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             f"Transfer-Encoding: chunked\r\n\r\n", chunks)


def huge_text() -> str:
    # Over the bound that no text of it fits the context: refused without tokenizing.
    return "a" * (CONTEXT * max_token_bytes(MODEL / "tokenizer.json") + 1)


def image(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is this?"}]}]


#: (case, where it goes, path, body, status, a part of the message, param).
CASES = [
    ("malformed JSON", "edge", CHAT, b'{"model": "qwen3_dense", "messages": [', 400, "not valid JSON", None),
    ("NaN (Python's json reads it)", "edge", CHAT, b'{"model": "qwen3_dense", "messages": [], "temperature": NaN}', 400,
     "NaN is not a JSON value", None),
    ("a body that is not an object", "edge", CHAT, b"[1, 2]", 400, "must be a JSON object, not list", None),
    ("invalid UTF-8", "edge", CHAT, b'{"model": "qwen3_dense", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
     400, "not valid UTF-8", None),
    ("wrong type: max_tokens a string", "edge", CHAT, chat(max_tokens="8"), 400, "max_tokens must be an integer",
     "max_tokens"),
    ("wrong type: messages a string", "edge", CHAT, chat(messages="Hello"), 400, "messages must be an array",
     "messages"),
    ("wrong type: temperature a string", "edge", CHAT, chat(temperature="hot"), 400, "temperature must be a number",
     "temperature"),
    ("wrong type: a message without a role", "edge", CHAT, chat(messages=[{"content": "hi"}]), 400,
     "messages[0].role must be one of", "messages[0].role"),
    ("wrong type: prompt an object", "edge", COMPLETIONS, completion(prompt={"text": "hi"}), 400,
     "prompt must be a string", "prompt"),
    ("missing model", "edge", CHAT, {"messages": [{"role": "user", "content": "hi"}]}, 400, "model is required",
     "model"),
    ("empty messages", "edge", CHAT, chat(messages=[]), 400, "at least one message", "messages"),
    ("empty prompt", "edge", COMPLETIONS, completion(prompt=[]), 400, "prompt must not be empty", "prompt"),
    ("max_tokens 0", "edge", CHAT, chat(max_tokens=0), 400, "max_tokens must be between 1 and 4096, not 0",
     "max_tokens"),
    ("max_tokens < 0", "edge", COMPLETIONS, completion(max_tokens=-5), 400, "max_tokens must be between 1 and 4096",
     "max_tokens"),
    ("max_tokens above the context", "edge", CHAT, chat(max_tokens=CONTEXT + 1), 400,
     "max_tokens must be between 1 and 4096, not 4097", "max_tokens"),
    ("max_completion_tokens 0", "edge", CHAT, chat(max_completion_tokens=0), 400,
     "max_completion_tokens must be between 1", "max_completion_tokens"),
    ("temperature < 0", "edge", CHAT, chat(temperature=-0.5), 400, "temperature must be in [0, 2], not -0.5",
     "temperature"),
    ("top_p 0", "edge", CHAT, chat(top_p=0), 400, "top_p must be in (0, 1], not 0", "top_p"),
    ("top_p > 1", "edge", COMPLETIONS, completion(top_p=1.5), 400, "top_p must be in (0, 1], not 1.5", "top_p"),
    ("n > 1", "edge", CHAT, chat(n=2), 400, "n=2 is not supported", "n"),
    ("best_of > 1", "edge", COMPLETIONS, completion(best_of=3), 400, "best_of must be between 1 and 1", "best_of"),
    ("unknown model", "edge", CHAT, chat(model="gpt-4o"), 404, "the model 'gpt-4o' does not exist", "model"),
    ("body over the limit (Content-Length)", "edge", CHAT, over_limit_content_length, 413,
     f"over the limit of {MAX_BODY_BYTES} bytes", None),
    ("body over the limit (chunked)", "edge", CHAT, over_limit_chunked, 413, f"over the limit of {MAX_BODY_BYTES} bytes",
     None),
    ("image part not a data URL", "edge", CHAT, chat(messages=image("https://example.com/cat.png")), 400,
     "messages[0].content[0].image_url.url: only data URLs", "messages[0].content[0].image_url.url"),
    ("an unknown content part", "edge", CHAT, chat(messages=[{"role": "user", "content": [{"type": "file"}]}]), 400,
     "a content part's type must be one of", "messages[0].content[0].type"),
    ("prompt over the context (token ids)", "edge", COMPLETIONS, completion(prompt=[7] * CONTEXT, max_tokens=None),
     400, "prompt 0 holds 4096 tokens", "prompt"),
    ("prompt over the context (text, tokenized)", "worker", COMPLETIONS,
     completion(prompt=" ".join(["hello"] * CONTEXT), max_tokens=16), 400, "tokens fills the context of 4096 tokens", None),
    ("prompt text no context can hold", "edge", CHAT, lambda: chat(messages=[{"role": "user", "content": huge_text()}]),
     400, "cannot fit the context of 4096 tokens", "messages"),
    ("stop list over the limit", "edge", CHAT, chat(stop=[f"s{k}" for k in range(MAX_STOP + 1)]), 400,
     f"over the limit of {MAX_STOP}", "stop"),
    ("wrong type: stop a number", "edge", CHAT, chat(stop=5), 400, "stop must be a string or an array", "stop"),
    ("seed < 0", "edge", CHAT, chat(seed=-1), 400, "seed must be between 0 and 9223372036854775807, not -1", "seed"),
    ("seed over u64", "edge", COMPLETIONS, completion(seed=2**64), 400, "seed must be between 0", "seed"),
    ("seed < 0, past the edge", PAST_THE_EDGE, COMPLETIONS, completion(seed=-1), 400,
     "seed must be between 0 and 18446744073709551615, not -1", None),
    ("tools", "edge", CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), 400,
     "tools is not supported", "tools"),
    ("tool_choice", "edge", CHAT, chat(tool_choice="required"), 400, "tool_choice is not supported", "tool_choice"),
    ("logit_bias", "edge", CHAT, chat(logit_bias={"50256": -100}), 400, "logit_bias is not supported", "logit_bias"),
    ("response_format json", "edge", CHAT, chat(response_format={"type": "json_object"}), 400,
     "response_format is not supported", "response_format"),
    ("logprobs", "edge", CHAT, chat(logprobs=True), 400, "logprobs is not supported", "logprobs"),
    ("frequency_penalty", "worker", CHAT, chat(frequency_penalty=0.5), 400, "frequency_penalty=0.5 is not supported",
     None),
    ("audio from a checkpoint without a talker", "edge", CHAT,
     chat(modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"}), 400, "this model cannot speak",
     "modalities"),
    ("talker options without audio", "edge", CHAT, chat(talker={"temperature": 0}), 400,
     "it needs \"modalities\": [\"text\", \"audio\"]", "talker"),
]


def send(fleet: RunningFleet, where: str, path: str, body) -> tuple[int, dict]:
    if callable(body) and body.__name__.startswith("over_limit"):
        return body(fleet.url)
    body = body() if callable(body) else body
    # "worker, past the edge": what the worker itself answers when a client bypasses the edge.
    return post(fleet.info["dynamo_frontend"] if where == PAST_THE_EDGE else fleet.url, path, body)


def message_of(reply: dict) -> str:
    """The message of an OpenAI-shaped error (the edge's) or of Dynamo's flat one (the worker's)."""
    return reply["error"]["message"] if isinstance(reply.get("error"), dict) else str(reply.get("message"))


def test_every_bad_input_is_a_4xx_naming_it_and_nothing_reaches_an_engine(fleet):
    before = [worker_metrics(w["metrics"])[QUERIES] for w in fleet.info["workers"]]
    rows, wrong = [], []
    for name, where, path, body, status, message, param in CASES:
        started = time.monotonic()
        got_status, reply = send(fleet, where, path, body)
        seconds = time.monotonic() - started
        got = message_of(reply)
        rows.append((name, where, got_status, got, seconds))
        if got_status != status or message not in got:
            wrong.append(f"{name}: {got_status} {got!r} (wanted {status} with {message!r})")
        elif where == "edge" and (reply["error"]["type"] != "invalid_request_error" or reply["error"]["param"] != param):
            wrong.append(f"{name}: error {reply['error']} (wanted param {param!r})")
    assert not wrong, "\n".join(wrong)
    after = [worker_metrics(w["metrics"])[QUERIES] for w in fleet.info["workers"]]
    assert after == before, "a rejected request reached an engine's prefix cache"
    # The workers still serve: a good request through the edge succeeds.
    status, reply = post(fleet.url, COMPLETIONS, completion(ignore_eos=True, temperature=0))
    assert status == 200 and reply["usage"]["completion_tokens"] == 4
    assert all(alive(pid) for pid in fleet.pids())
    if os.environ.get("OMNIPREFIX_BAD_INPUT_TABLE"):
        write_table(Path(os.environ["OMNIPREFIX_BAD_INPUT_TABLE"]), rows)


def write_table(path: Path, rows: list) -> None:
    lines = ["| case | answered by | status | message | seconds |", "|---|---|---|---|---|"]
    for name, where, status, message, seconds in rows:
        text = message if len(message) <= 160 else message[:157] + "..."
        lines.append(f"| {name} | {where} | {status} | {text.replace('|', '&#124;')} | {seconds:.3f} |")
    path.write_text("\n".join(lines) + "\n")


def test_models_and_health_pass_through_the_edge(fleet):
    for path in ("/v1/models", "/health"):
        conn = http.client.HTTPConnection("127.0.0.1", urllib.parse.urlsplit(fleet.url).port, timeout=10)
        conn.request("GET", path)
        r = conn.getresponse()
        assert r.status == 200, path
        body = json.loads(r.read())
        conn.close()
        if path == "/v1/models":
            assert [m["id"] for m in body["data"]] == [MODEL.name]


def test_a_client_that_goes_away_mid_stream_stops_its_generation(fleet):
    """The edge closes its upstream request when the client disconnects: the worker's running
    request ends long before its max_tokens."""
    def running() -> float:
        return sum(worker_metrics(w["metrics"])["omniprefix_num_requests_running"] for w in fleet.info["workers"])

    gaps = "omniprefix_inter_token_latency_seconds_count"
    before = sum(worker_metrics(w["metrics"])[gaps] for w in fleet.info["workers"])
    body = completion(max_tokens=CONTEXT - 8, ignore_eos=True, temperature=0, stream=True)
    leave_mid_stream(fleet, COMPLETIONS, body, b"data: ", running)
    assert running() == 0, "the generation kept running after its client went away"
    made = sum(worker_metrics(w["metrics"])[gaps] for w in fleet.info["workers"]) - before
    assert made < CONTEXT - 8 - 1, f"{made} tokens: the generation ran to max_tokens"
