"""The local fleet for real: ``python -m omniprefix.fleet`` starts Dynamo's OpenAI frontend and
omniprefix workers as processes on loopback, and these tests talk to it over HTTP.

Needs Dynamo (``bash scripts/install_fleet.sh VENV``); skipped without it unless
``OMNIPREFIX_REQUIRE_FLEET=1`` (``scripts/test_fleet.sh``, run by CI), which makes a missing
Dynamo a failure. Every fleet is stopped by a finalizer; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable

import pytest

import omniprefix
from conftest import FIXTURES, importable


pytestmark = pytest.mark.skipif(
    not importable("dynamo.frontend", "transformers", "jinja2", "prometheus_client.parser",
                   required_by="OMNIPREFIX_REQUIRE_FLEET"),
    reason="Dynamo is not installed (scripts/install_fleet.sh)")

MODEL = FIXTURES / "qwen3_dense"
READY_S = 90.0
REQUEST_S = 60.0


class RunningFleet:
    """``python -m omniprefix.fleet`` as a child process (its own process group) and its ready line."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "omniprefix.fleet", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True)
        self.started = time.monotonic()
        line = read_line(self.proc, READY_S)
        self.ready_s = time.monotonic() - self.started
        if not line:
            self.stop()
            pytest.fail(f"the fleet printed no ready line; stderr:\n{self.proc.stderr.read().decode(errors='replace')}")
        self.info = json.loads(line)
        self.url = self.info["frontend"]
        self.replaced: list[int] = []  # pids of the workers the fleet replaced

    def pids(self) -> list[int]:
        """The fleet's pid and its workers' now."""
        return [self.proc.pid] + [w["pid"] for w in self.info["workers"]]

    def replacement(self, timeout_s: float) -> dict:
        """The fleet's next stdout line: a replacement worker's, which takes its place in
        ``info["workers"]`` (fails after ``timeout_s``)."""
        line = read_line(self.proc, timeout_s)
        assert line, f"no replacement worker within {timeout_s:.0f} s"
        new = json.loads(line)
        index = new.pop("worker")
        self.replaced.append(self.info["workers"][index]["pid"])
        self.info["workers"][index] = new
        return new

    def stop(self) -> None:
        """SIGTERM, and SIGKILL to the whole group if it is not gone in time (a finalizer's duty)."""
        from omniprefix.fleet import terminate

        terminate(self.proc)
        for pid in self.pids()[1:] + self.replaced if hasattr(self, "info") else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=REQUEST_S) as r:
            return json.loads(r.read())

    def metrics(self) -> list[dict[str, float]]:
        """Each worker's samples, by name (label-less sums), parsed by the Prometheus client."""
        from omniprefix.fleet import worker_metrics

        return [worker_metrics(worker["metrics"]) for worker in self.info["workers"]]


def read_line(proc: subprocess.Popen, timeout_s: float) -> bytes:
    """One line of ``proc``'s stdout, or b"" if it exits or the time runs out first."""
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=0.2):
                return proc.stdout.readline()
            if proc.poll() is not None:
                return b""
    return b""


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it only waits to be reaped)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def leave_mid_stream(fleet: RunningFleet, path: str, body: dict, marker: bytes,
                     running: Callable[[], float], timeout_s: float = 10.0) -> None:
    """Streams ``body`` to ``path`` on a raw socket until ``marker`` arrives, checks that one
    request runs, hangs up, and waits (up to ``timeout_s``) for the workers to run none."""
    data = json.dumps(body).encode()
    port = urllib.parse.urlsplit(fleet.url).port
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        got = b""
        while marker not in got:
            more = s.recv(65536)
            assert more, f"the stream ended before {marker!r}"
            got += more
        assert running() == 1
    deadline = time.monotonic() + timeout_s
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)


def fleet_fixtures(model: Path, fleet_name: str, tier: bool = False):
    """A fleet suite's module fixtures over checkpoint ``model``: a 2-worker fleet with kv routing
    (named ``fleet_name``; with ``tier``, over a disk tier in a fresh directory), and the ``engine``
    and ``tokenizer`` its replies are checked against."""

    @pytest.fixture(scope="module", name=fleet_name)
    def fleet(tmp_path_factory):
        tier_args = ["--tier-dir", str(tmp_path_factory.mktemp("tier") / "tier")] if tier else []
        running = RunningFleet("--model", str(model), "--workers", "2", "--router", "kv", "--port", "0", *tier_args)
        yield running
        running.stop()

    @pytest.fixture(scope="module", name="engine")
    def engine():
        return omniprefix.Engine.from_dir(model)

    @pytest.fixture(scope="module", name="tokenizer")
    def tokenizer():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model))

    return fleet, engine, tokenizer


# Over a disk tier: every reply below must be the same with it (and test_the_workers_share_... uses it).
kv_fleet, engine, tokenizer = fleet_fixtures(MODEL, "kv_fleet", tier=True)


def test_the_fleet_is_ready_within_30_s_and_names_its_processes(kv_fleet):
    assert kv_fleet.ready_s < 30, f"ready after {kv_fleet.ready_s:.1f} s"
    assert len(kv_fleet.info["workers"]) == 2
    assert all(alive(pid) for pid in kv_fleet.pids())
    with urllib.request.urlopen(kv_fleet.url + "/v1/models", timeout=10) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == [MODEL.name]


def completion(fleet: RunningFleet, prompt, **options) -> dict:
    """A /v1/completions request that also asks for the reply's token ids and the worker's id."""
    body = {"model": fleet.info["model"], "prompt": prompt, "nvext": {"extra_fields": ["completion_token_ids", "worker_id"]},
            **options}
    return fleet.post("/v1/completions", body)


def reply_ids(response: dict) -> list[int]:
    return response["nvext"]["completion_token_ids"]


def worker_of(response: dict) -> int:
    return response["nvext"]["worker_id"]["decode_worker_id"]


def prompts(seed: int, count: int, length: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(200) for _ in range(length + k)] for k in range(count)]


def test_greedy_replies_through_the_frontend_equal_engine_generate(kv_fleet, engine):
    for ids in prompts(seed=1, count=4, length=20):
        want = engine.generate(ids, max_tokens=12, temperature=0.0, ignore_eos=True)
        got = completion(kv_fleet, ids, max_tokens=12, temperature=0, ignore_eos=True)
        assert reply_ids(got) == want.tokens
        assert got["choices"][0]["finish_reason"] == "length"
        assert got["usage"]["prompt_tokens"] == len(ids)


def test_stop_conditions_reach_the_engine(kv_fleet, engine, tokenizer):
    ids = prompts(seed=2, count=1, length=30)[0]
    eos = [tokenizer.eos_token_id]
    free = engine.generate(ids, max_tokens=10, temperature=0.0, stop=eos).tokens
    assert len(free) == 10
    # A stop id: the reply ends at its first occurrence (included), with finish_reason "stop".
    # (Not with ignore_eos: Dynamo 1.6.1's frontend then drops the request's stop_token_ids.)
    first = free.index(free[3])
    before = kv_fleet.metrics()
    got = completion(kv_fleet, ids, max_tokens=10, temperature=0, stop_token_ids=[free[3]])
    assert (reply_ids(got), got["choices"][0]["finish_reason"]) == (free[:first + 1], "stop")
    # The frontend cuts the text at a stop id by itself: the engine must have stopped there too
    # (first + 1 tokens, so `first` gaps between tokens), not run on to max_tokens.
    gaps = "omniprefix_inter_token_latency_seconds_count"
    assert sum(a[gaps] - b[gaps] for a, b in zip(kv_fleet.metrics(), before)) == first
    # max_tokens.
    got = completion(kv_fleet, ids, max_tokens=3, temperature=0)
    assert (reply_ids(got), got["choices"][0]["finish_reason"]) == (free[:3], "length")


def test_sampling_options_reach_the_engine(kv_fleet, engine):
    ids = prompts(seed=3, count=1, length=25)[0]
    # Values a float32 holds exactly: the frontend passes them on as float32.
    options = dict(max_tokens=12, temperature=1.5, top_k=50, top_p=0.75, seed=1234)
    want = engine.generate(ids, ignore_eos=True, **options).tokens
    got = [reply_ids(completion(kv_fleet, ids, ignore_eos=True, **options)) for _ in range(2)]
    assert got == [want, want]
    assert reply_ids(completion(kv_fleet, ids, ignore_eos=True, **{**options, "seed": 99})) != want


def test_chat_goes_through_the_checkpoints_template(kv_fleet, engine, tokenizer):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])
    want = engine.generate(ids, max_tokens=8, temperature=0.0, ignore_eos=True).tokens
    got = kv_fleet.post("/v1/chat/completions", {"model": kv_fleet.info["model"], "messages": messages, "max_tokens": 8,
                                                 "temperature": 0, "ignore_eos": True,
                                                 "nvext": {"extra_fields": ["completion_token_ids"]}})
    assert got["usage"]["prompt_tokens"] == len(ids)
    assert reply_ids(got) == want
    assert got["choices"][0]["message"]["content"] == tokenizer.decode(want, skip_special_tokens=True)


OMNI = FIXTURES / "omni_thinker"
#: transformers' own processor + thinker greedy generate on image and audio chats
#: (fixtures/make_mm_reference.py).
MM_CASES = {case["name"]: case for case in json.loads((OMNI / "mm_chat_reference.json").read_text())["cases"]}


@pytest.fixture(scope="module")
def omni_fleet():
    fleet = RunningFleet("--model", str(OMNI), "--workers", "2", "--router", "kv", "--port", "0")
    yield fleet
    fleet.stop()


def media_part(case: dict) -> dict:
    """The case's media as an OpenAI content part with a data URL (audio as ``audio_url``: Dynamo
    1.6.1 forwards that, not ``input_audio``)."""
    import base64

    data = base64.b64encode((FIXTURES.parent.parent / case["media"]["file"]).read_bytes()).decode()
    if case["name"].startswith("image"):
        return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + data}}
    return {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + data}}


def media_chat(fleet: RunningFleet, part: dict, text: str = "Describe this briefly.", **options) -> dict:
    body = {"model": fleet.info["model"], "messages": [{"role": "user", "content": [part, {"type": "text", "text": text}]}],
            "max_tokens": 16, "temperature": 0, "nvext": {"extra_fields": ["completion_token_ids", "worker_id"]},
            **options}
    return fleet.post("/v1/chat/completions", body)


@pytest.mark.parametrize("name", ["image_a", "audio"])
def test_an_image_or_audio_chat_through_the_fleet_equals_transformers(omni_fleet, name):
    case = MM_CASES[name]
    got = media_chat(omni_fleet, media_part(case))
    # The frontend renders the checkpoint's template with one placeholder per item; the worker's
    # encoder (the checkpoint's processor and towers) and the engine do the rest.
    assert got["usage"]["prompt_tokens"] == len(case["prompt_ids_unexpanded"])
    assert reply_ids(got) == case["generated_pads_suppressed"]["ids"]
    assert got["choices"][0]["message"]["content"] == case["generated_pads_suppressed"]["text_skip_special"]


def test_bad_media_is_a_400_naming_the_item_and_the_worker_keeps_serving(omni_fleet):
    part = media_part(MM_CASES["image_a"])
    url = part["image_url"]["url"]
    # A remote URL: the edge names the part (omniprefix.edge); the rest reach the worker.
    for bad, why in [("https://example.com/cat.png", "messages[0].content[0].image_url.url: only data URLs"),
                     (url[:len("data:image/png;base64,") + 400], "image 0: not a readable image"),  # truncated
                     ("data:image/png;base64,@@@@", "image 0: the data URL's base64 does not decode")]:
        with pytest.raises(urllib.error.HTTPError) as e:
            media_chat(omni_fleet, {"type": "image_url", "image_url": {"url": bad}})
        assert e.value.code == 400
        assert why in e.value.read().decode()
    # An input_audio part: the template renders its placeholder, but Dynamo forwards no audio for it.
    with pytest.raises(urllib.error.HTTPError) as e:
        media_chat(omni_fleet, {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}})
    assert e.value.code == 400
    assert "1 audio placeholder(s) but 0 audio item(s)" in e.value.read().decode()
    assert reply_ids(media_chat(omni_fleet, part)) == MM_CASES["image_a"]["generated_pads_suppressed"]["ids"]
    assert all(alive(pid) for pid in omni_fleet.pids())


def test_a_bad_request_is_a_400_naming_why_and_the_worker_keeps_serving(kv_fleet):
    ids = prompts(seed=4, count=1, length=10)[0]
    for options, why in [({"max_tokens": 4090}, "the context of 4096 tokens"),
                         ({"max_tokens": 4, "frequency_penalty": 0.5}, "frequency_penalty"),
                         ({"max_tokens": 4, "n": 2}, "n=2")]:
        with pytest.raises(urllib.error.HTTPError) as e:
            kv_fleet.post("/v1/completions", {"model": kv_fleet.info["model"], "prompt": ids, **options})
        assert e.value.code == 400
        assert why in e.value.read().decode()
    assert len(reply_ids(completion(kv_fleet, ids, max_tokens=4, ignore_eos=True))) == 4
    assert all(alive(pid) for pid in kv_fleet.pids())


def test_metrics_parse_and_count_the_prompt_tokens(kv_fleet):
    before = kv_fleet.metrics()
    sent = 0
    for ids in prompts(seed=5, count=3, length=17):
        got = completion(kv_fleet, ids, max_tokens=2, ignore_eos=True)
        sent += got["usage"]["prompt_tokens"]
    after = kv_fleet.metrics()
    queries = "omniprefix_prefix_cache_queries_total"
    assert sum(a[queries] - b[queries] for a, b in zip(after, before)) == sent
    assert all("omniprefix_time_to_first_token_seconds_count" in m for m in after)


def test_kv_routing_sends_a_repeated_prefix_to_the_worker_that_caches_it(kv_fleet):
    # Distinct prompts spread over both workers: Dynamo breaks ties at random, so routing
    # that ignored the cache could not keep the repeats below on one worker by chance.
    spread = {worker_of(completion(kv_fleet, ids, max_tokens=1)) for ids in prompts(seed=6, count=10, length=40)}
    assert len(spread) == 2, "the router never used the second worker"
    prefix = prompts(seed=7, count=1, length=64)[0]
    home = worker_of(completion(kv_fleet, prefix, max_tokens=1))
    time.sleep(0.5)  # the prefix's BlockStored events reach the router
    before = kv_fleet.metrics()
    tails = prompts(seed=8, count=8, length=3)
    routed = [completion(kv_fleet, prefix + tail, max_tokens=1) for tail in tails]
    after = kv_fleet.metrics()
    assert [worker_of(r) for r in routed] == [home] * len(tails)
    # ... and found it cached there: every full block of the prefix (64 tokens, 4 blocks of 16).
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64 for r in routed)
    hits = "omniprefix_prefix_cache_hits_total"
    assert sum(a[hits] - b[hits] for a, b in zip(after, before)) >= 64 * len(tails)


def test_sigterm_stops_every_process_and_round_robin_uses_every_worker():
    fleet = RunningFleet("--model", str(MODEL), "--workers", "2", "--router", "round-robin", "--port", "0")
    try:
        served = {worker_of(completion(fleet, ids, max_tokens=2)) for ids in prompts(seed=9, count=4, length=8)}
        assert len(served) == 2
        started = children(fleet.proc.pid)
        assert set(fleet.pids()[1:]) < set(started), "the frontend and the workers are the fleet's children"
        fleet.proc.send_signal(signal.SIGTERM)
        assert fleet.proc.wait(timeout=30) == 0
        # Each child led its own process group: none of them, nor anything they started, is left.
        left = [pid for pid in started if alive(pid) or group_members(pid)]
        assert not left, f"processes left behind: {left}"
    finally:
        fleet.stop()


def processes() -> list[tuple[int, str, int, int]]:
    """(pid, state, parent pid, process group) of every process, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out.append((int(entry.name), fields[0], int(fields[1]), int(fields[2])))
    return out


def children(pid: int) -> list[int]:
    return [p for p, _, parent, _ in processes() if parent == pid]


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of the process group ``pgid``."""
    return [p for p, state, _, group in processes() if group == pgid and state != "Z"]


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent/model", "--workers", "1"], "no config.json there"),
    (["--model", str(MODEL), "--workers", "0"], "--workers must be at least 1"),
    (["--model", str(MODEL), "--workers", "1", "--router", "random"], "invalid choice: 'random'"),
])
def test_bad_input_is_a_clear_error_before_anything_starts(argv, message):
    proc = subprocess.run([sys.executable, "-m", "omniprefix.fleet", *argv], capture_output=True, timeout=60)
    assert proc.returncode == 2
    assert message in proc.stderr.decode()
    assert proc.stdout == b""


def test_a_port_in_use_is_a_clear_error():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "omniprefix.fleet", "--model", str(MODEL), "--workers", "1",
                               "--port", str(port)], capture_output=True, timeout=60)
    assert proc.returncode == 2
    assert f"--port {port}: cannot listen" in proc.stderr.decode()


def test_a_streamed_reply_arrives_token_by_token_and_equals_the_whole_one(kv_fleet):
    ids = prompts(seed=10, count=1, length=12)[0]
    body = {"model": kv_fleet.info["model"], "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    whole = kv_fleet.post("/v1/completions", body)["choices"][0]["text"]
    req = urllib.request.Request(kv_fleet.url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=REQUEST_S) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):])["choices"])
    texts = [c[0]["text"] for c in chunks if c and c[0].get("text")]
    assert "".join(texts) == whole
    assert len(texts) >= 4, f"{len(texts)} chunks for 8 tokens"


def test_the_frontend_dying_is_reported_and_the_fleet_stops_everything():
    # A worker that dies is restarted (test_fleet_faults.py); without the frontend there is no fleet.
    fleet = RunningFleet("--model", str(MODEL), "--workers", "2", "--port", "0")
    try:
        started = children(fleet.proc.pid)
        frontend = (set(started) - set(fleet.pids())).pop()
        os.kill(frontend, signal.SIGKILL)
        assert fleet.proc.wait(timeout=30) == 1
        assert f"frontend (pid {frontend}) exited" in fleet.proc.stderr.read().decode()
        left = [pid for pid in started if alive(pid) or group_members(pid)]
        assert not left, f"processes left behind: {left}"
    finally:
        fleet.stop()


# Images through Dynamo's kv router (omniprefix.dynamo_keys): the Omni fixture, whose
# preprocessor_config.json makes the frontend route images by content.
OMNI = FIXTURES / "omni_thinker"
#: The image's end in the chat's prompt: 5 template tokens, then a 56x40 image's 35 rows.
IMAGE_END = 5 + 35


@pytest.fixture(scope="module")
def omni_kv_fleet():
    fleet = RunningFleet("--model", str(OMNI), "--workers", "2", "--router", "kv", "--port", "0")
    yield fleet
    fleet.stop()


def image_url(seed: int = -1) -> str:
    """fixtures/media/image_a.png (seed -1), or a seeded 56x40 PNG of random pixels."""
    import base64
    import io
    import random

    if seed < 0:
        data = (FIXTURES.parent / "media" / "image_a.png").read_bytes()
    else:
        from PIL import Image

        rng = random.Random(seed)
        out = io.BytesIO()
        Image.frombytes("RGB", (56, 40), bytes(rng.randrange(256) for _ in range(56 * 40 * 3))).save(out, format="PNG")
        data = out.getvalue()
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_chat(fleet: RunningFleet, url: str) -> dict:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe this briefly."}]
    return fleet.post("/v1/chat/completions", {"model": fleet.info["model"], "max_tokens": 2, "temperature": 0,
                                               "messages": [{"role": "user", "content": content}]})


def encoder_calls(fleet: RunningFleet) -> float:
    return sum(m["omniprefix_encoder_calls_total"] for m in fleet.metrics())


def test_kv_routing_sends_a_repeated_image_to_the_worker_that_caches_it(omni_kv_fleet):
    before = encoder_calls(omni_kv_fleet)
    url = image_url()
    image_chat(omni_kv_fleet, url)
    time.sleep(0.5)  # the image's BlockStored events (with the frontend's hash) reach the router
    again = image_chat(omni_kv_fleet, url)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= IMAGE_END
    assert encoder_calls(omni_kv_fleet) - before == 1


def test_kv_routing_tells_images_of_the_same_size_apart(omni_kv_fleet):
    # Four images with the same placeholders, then each again: every repeat finds its image
    # cached (routing by load alone would miss about half of them).
    urls = [image_url(seed) for seed in range(4)]
    for url in urls:
        image_chat(omni_kv_fleet, url)
        time.sleep(0.2)
    time.sleep(0.3)
    cached = [image_chat(omni_kv_fleet, url)["usage"]["prompt_tokens_details"]["cached_tokens"] for url in urls[::-1]]
    assert all(c >= IMAGE_END for c in cached), cached


def test_the_workers_share_the_fleets_tier_directory_and_key(kv_fleet, engine):
    """``--tier-dir`` reaches every worker, a replacement too, and they share its key: the blocks a
    worker spilled when it stopped are tier hits for whichever worker serves the prompt next."""
    argv = kv_fleet.proc.args
    tier = Path(argv[argv.index("--tier-dir") + 1])
    assert (tier / "fleet.key").is_file()
    assert all("omniprefix_tier_bytes" in m for m in kv_fleet.metrics())
    ids = prompts(seed=9, count=1, length=48)[0]
    want = engine.generate(ids, max_tokens=4, temperature=0.0, ignore_eos=True).tokens
    before = kv_fleet.metrics()
    assert reply_ids(completion(kv_fleet, ids, max_tokens=4, temperature=0, ignore_eos=True)) == want
    queried = "omniprefix_prefix_cache_queries_total"
    served = next(k for k, (a, b) in enumerate(zip(kv_fleet.metrics(), before)) if a[queried] > b[queried])
    # A stopped worker's engine spills its pool to the tier; the fleet starts another in its place.
    os.kill(kv_fleet.info["workers"][served]["pid"], signal.SIGTERM)
    kv_fleet.replacement(timeout_s=30)
    metrics = kv_fleet.metrics()
    assert "omniprefix_tier_bytes" in metrics[served], "the replacement has no tier"
    hits = "omniprefix_tier_hits_total"
    assert reply_ids(completion(kv_fleet, ids, max_tokens=4, temperature=0, ignore_eos=True)) == want
    assert sum(m[hits] for m in kv_fleet.metrics()) > sum(m[hits] for m in metrics)
