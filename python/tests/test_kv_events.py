"""KV events: what a cache-aware router subscribing to an engine sees.

A consumer written only against vLLM's wire format (a msgspec schema of vLLM's
``KVEventBatch``, pyzmq SUB + DEALER replay) rebuilds the set of cached block
hashes from an engine's stream and must end up with ``engine.cached_block_hashes()``.
Everything runs on loopback with ports chosen by the OS; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from typing import Optional

import msgspec
import numpy as np
import pytest
import zmq

import omniprefix
from omniprefix.router import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from conftest import (
    IMAGE_LAYOUT,
    REPO_ROOT,
    image_item,
    load_config,
    model_dir,
    random_ids,
    small_config,
    unexpanded_image,
)

VECTORS = REPO_ROOT / "fixtures" / "vllm_kv_events_vectors.json"
KEY = bytes(range(32))
LOOPBACK = "tcp://127.0.0.1:0"
#: The replay end marker's seq: -1 as a big-endian i64.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: The longest any single wait of this file may take.
TIMEOUT_S = 5.0


# ------------------------------------------------------------------ vLLM's schema
# The package's (omniprefix.router), checked against the vectors below.
DECODER = msgspec.msgpack.Decoder(KVEventBatch)
ENCODER = msgspec.msgpack.Encoder()


def test_schema_re_encodes_every_vector_byte_identically():
    cases = json.loads(VECTORS.read_text())["cases"]
    assert len(cases) == 5
    for case in cases:
        payload = bytes.fromhex(case["payload_hex"])
        batch = DECODER.decode(payload)
        assert ENCODER.encode(batch) == payload, case["name"]
        assert msgspec.json.decode(msgspec.json.encode(batch)) == case["decoded_as_python"], case["name"]

    # One field fewer and BlockStored gets a fixmap header: the 15 declared fields are the point.
    fields = msgspec.structs.fields(BlockStored)[:-1]
    short = msgspec.defstruct(
        "BlockStored", [(f.name, f.type) if f.required else (f.name, f.type, f.default) for f in fields], tag=True, omit_defaults=True
    )
    stored = ([1], None, [0] * 16, 16, None, "CPU", None)
    assert ENCODER.encode(BlockStored(*stored))[0] == 0xDE and ENCODER.encode(short(*stored))[0] == 0x88


# ------------------------------------------------------------------ the consumer
class Consumer:
    """A router's view of one engine: SUB for the live stream, DEALER for replay.

    Batches are applied in seq order; a gap (a missed batch, a late join)
    replays from the first missing seq. ``cached`` is the set of block hashes the
    events say the engine holds.
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, replay: Optional[str], topic: bytes = b""):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(endpoint)
        self.ctx, self.replay_endpoint, self.topic = ctx, replay, topic
        self.next_seq = 0
        self.cached: set[int] = set()
        #: (seq, "sub" | "replay", batch) in the order applied.
        self.applied: list[tuple[int, str, KVEventBatch]] = []
        self.stored: list[BlockStored] = []
        self.removed = 0
        self.replays = 0

    def close(self) -> None:
        self.sub.close(0)

    def receive(self, timeout_s: float) -> bool:
        """Applies what the SUB socket has within ``timeout_s``; False if nothing came."""
        if not self.sub.poll(int(timeout_s * 1000)):
            return False
        while True:
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic
            self.offer(int.from_bytes(seq, "big"), payload, "sub")
            if not self.sub.poll(0):
                return True

    def offer(self, seq: int, payload: bytes, via: str) -> None:
        if seq < self.next_seq:
            return  # already applied (from a replay)
        if seq > self.next_seq and self.replay_endpoint is None and not self.applied:
            self.next_seq = seq  # without replay, a subscriber starts where it joined
        if seq > self.next_seq:
            self.replay(self.next_seq)
            if seq < self.next_seq:
                return
        assert seq == self.next_seq, f"seq {seq} after a replay up to {self.next_seq}"
        self.apply(seq, payload, via)

    def apply(self, seq: int, payload: bytes, via: str) -> None:
        batch = DECODER.decode(payload)
        # The engine's bytes are what msgspec itself would write for vLLM's classes.
        assert ENCODER.encode(batch) == payload
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert len(event.token_ids) == event.block_size * len(event.block_hashes)
                assert (event.lora_id, event.lora_name, event.medium) == (None, None, "CPU")
                self.cached.update(event.block_hashes)
                self.stored.append(event)
            elif isinstance(event, BlockRemoved):
                assert event.medium == "CPU"
                self.cached.difference_update(event.block_hashes)
                self.removed += 1
            else:
                self.cached.clear()
        self.applied.append((seq, via, batch))
        self.next_seq = seq + 1

    def replay(self, start: int) -> None:
        """Asks the replay socket for every buffered batch from ``start`` on."""
        assert self.replay_endpoint, f"a gap before seq {start} and no replay endpoint"
        self.replays += 1
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            for empty, topic, seq, payload in replies(dealer):
                assert empty == b"" and topic == self.topic
                seq = int.from_bytes(seq, "big")
                if seq >= self.next_seq:
                    assert seq == self.next_seq, f"replay from {start} skipped to {seq}"
                    self.apply(seq, payload, "replay")
        finally:
            dealer.close(0)

    def sync(self, engine: omniprefix.Engine) -> None:
        """Receives until every batch the engine published is applied."""
        deadline = time.monotonic() + TIMEOUT_S
        while self.next_seq < published(engine):
            assert time.monotonic() < deadline, f"at seq {self.next_seq} of {published(engine)} after {TIMEOUT_S} s"
            if not self.receive(0.2):
                self.replay(self.next_seq)  # the SUB socket lost the tail: fill it

    def wait_joined(self, engine: omniprefix.Engine) -> None:
        """Slow joiner: the subscription reaches the PUB socket a moment after
        connect. Until a batch arrives, empty resets publish `AllBlocksCleared`;
        whatever was missed comes from replay."""
        deadline = time.monotonic() + TIMEOUT_S
        while not any(via == "sub" for _, via, _ in self.applied):
            assert time.monotonic() < deadline, "the subscriber never joined"
            engine.reset_cache()
            self.receive(0.05)


def replies(dealer: zmq.Socket):
    """The replay frames up to the end marker (bounded)."""
    while True:
        assert dealer.poll(int(TIMEOUT_S * 1000)), "no replay reply"
        frames = dealer.recv_multipart()
        if frames[2] == END_SEQ:
            assert frames == [b"", b"", END_SEQ, b""]
            return
        yield frames


def published(engine: omniprefix.Engine) -> int:
    stats = engine.kv_events_stats()
    return stats["batches"] - stats["dropped"]


@pytest.fixture()
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def events_engine(**options) -> omniprefix.Engine:
    options = {"kv_events": LOOPBACK, "kv_replay": LOOPBACK, "fingerprint_key": KEY, **options}
    return omniprefix.Engine.random(small_config(), 1, block_size=4, **options)


def wait_for(what: str, condition) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, f"waited {TIMEOUT_S} s for {what}"
        time.sleep(0.01)


# ------------------------------------------------------------------ the stream
def test_soak_with_evictions_the_consumer_follows_the_cache(ctx):
    engine = events_engine(num_blocks=24)
    assert engine.kv_events_endpoint.startswith("tcp://127.0.0.1:") and not engine.kv_events_endpoint.endswith(":0")
    consumer = Consumer(ctx, engine.kv_events_endpoint, engine.kv_replay_endpoint)
    consumer.wait_joined(engine)
    prefixes = [random_ids(100 + p, 8 + 4 * p) for p in range(3)]
    rng = np.random.default_rng(7)
    for i in range(90):
        prefix = prefixes[int(rng.integers(len(prefixes)))]
        suffix = rng.integers(0, 240, size=int(rng.integers(1, 10))).tolist()
        engine.prefill(prefix + suffix, tenant=int(rng.integers(3)))
        consumer.receive(0)
    consumer.sync(engine)
    engine.validate()

    assert engine.stats()["evicted_blocks"] > 0 and consumer.removed > 0
    assert consumer.cached == set(engine.cached_block_hashes()) and consumer.cached
    assert [seq for seq, _, _ in consumer.applied] == list(range(consumer.next_seq))
    # The live stream carried most; replay filled what the subscription missed while joining.
    assert sum(via == "sub" for _, via, _ in consumer.applied) > 2 * len(consumer.applied) // 3
    stats = engine.kv_events_stats()
    assert stats["dropped"] == 0 and stats["published"] == stats["batches"] == consumer.next_seq
    consumer.close()


def test_late_subscriber_replays_from_seq_0_and_ends_with_the_same_set(ctx):
    engine = events_engine(num_blocks=16, kv_topic="kv@replica-0", kv_buffer_steps=1000)
    for i in range(12):
        engine.prefill(random_ids(i % 5, 14), tenant=i % 2)
    assert published(engine) >= 5 and engine.stats()["evicted_blocks"] > 0

    late = Consumer(ctx, engine.kv_events_endpoint, engine.kv_replay_endpoint, topic=b"kv@replica-0")
    late.replay(0)
    assert [seq for seq, _, _ in late.applied] == list(range(published(engine)))
    assert late.cached == set(engine.cached_block_hashes())
    # Then it follows live (or fills a gap while its subscription joins).
    for i in range(6):
        engine.prefill(random_ids(50 + i, 10), tenant=1)
    late.sync(engine)
    assert late.cached == set(engine.cached_block_hashes())
    assert [seq for seq, _, _ in late.applied] == list(range(published(engine)))
    late.close()


def test_linger_answers_replay_after_the_engine_is_dropped_without_holding_the_gil(ctx):
    engine = events_engine(kv_linger_s=1.5)
    engine.prefill(random_ids(3, 12))
    expected = set(engine.cached_block_hashes())
    replay_at = engine.kv_replay_endpoint
    consumer = Consumer(ctx, engine.kv_events_endpoint, replay_at)
    holder = [engine]
    del engine
    dropper = threading.Thread(target=holder.clear)  # the last reference goes in that thread
    start = time.monotonic()
    dropper.start()
    time.sleep(0.2)
    consumer.replay(0)  # runs while the drop lingers: the drop released the GIL
    replied = time.monotonic() - start
    dropper.join(TIMEOUT_S)
    dropped = time.monotonic() - start
    assert not dropper.is_alive() and consumer.cached == expected
    assert dropped >= 1.4 and replied < dropped - 0.5, (replied, dropped)
    consumer.close()


def six_blocks_followed(ctx, seed: int) -> tuple[omniprefix.Engine, Consumer]:
    """An events engine that cached three 11-token prompts (6 full blocks), and a consumer
    that has applied all of it."""
    engine = events_engine()
    consumer = Consumer(ctx, engine.kv_events_endpoint, engine.kv_replay_endpoint)
    consumer.wait_joined(engine)
    for i in range(3):
        engine.prefill(random_ids(seed + i, 11))
    consumer.sync(engine)
    return engine, consumer


def test_reset_cache_publishes_all_blocks_cleared(ctx):
    engine, consumer = six_blocks_followed(ctx, 20)
    before = set(engine.cached_block_hashes())
    assert consumer.cached == before and len(before) == 6

    # Long enough that it cannot finish before reset_cache below: an unread stream holds
    # once 256 events are buffered, still admitted (4 tokens could all be generated first).
    stream = engine.stream(random_ids(30, 9), max_tokens=1000, ignore_eos=True)
    next(stream)
    with pytest.raises(omniprefix.CacheError, match="reset"):
        engine.reset_cache()  # a request holds blocks: refused, nothing changed
    assert set(engine.cached_block_hashes()) >= before
    stream.close()

    freed = engine.reset_cache()
    assert freed >= len(before)
    consumer.sync(engine)
    assert isinstance(consumer.applied[-1][2].events[-1], AllBlocksCleared)
    assert consumer.cached == set() and engine.cached_block_hashes() == []
    assert engine.reset_cache() == 0
    assert engine.prefill(random_ids(20, 11)).num_cached_tokens == 0
    consumer.close()


def test_an_engine_that_dies_withdraws_every_published_block(ctx, monkeypatch):
    """A step that panics kills the engine (debug builds' step fault): its last batch is
    ``AllBlocksCleared``, so a router following the stream holds nothing of it any more."""
    monkeypatch.setenv("OMNIPREFIX_FAULT_STEP_PANIC", "4")
    engine, consumer = six_blocks_followed(ctx, 40)
    assert len(consumer.cached) == 6
    with pytest.raises(omniprefix.EngineDeadError):
        engine.prefill(random_ids(50, 11))
    deadline = time.monotonic() + TIMEOUT_S
    while consumer.cached:
        assert time.monotonic() < deadline, f"still {len(consumer.cached)} blocks after the engine died"
        consumer.receive(0.1)
    assert isinstance(consumer.applied[-1][2].events[-1], AllBlocksCleared)
    consumer.close()


# ------------------------------------------------------------------ block_hashes
def stored_by(consumer: Consumer, start: int) -> list[int]:
    """The hashes of the BlockStored events from the ``start``-th on, in order."""
    return [h for event in consumer.stored[start:] for h in event.block_hashes]


def test_block_hashes_of_a_text_request_equal_the_published_ones(ctx):
    engine = events_engine(kv_replay=None)
    assert engine.kv_replay_endpoint is None
    consumer = Consumer(ctx, engine.kv_events_endpoint, None)
    consumer.wait_joined(engine)  # without replay, it must join before the request's batch goes out
    ids = random_ids(40, 22)
    engine.prefill(ids, tenant=2)
    consumer.sync(engine)
    frontend = omniprefix.block_hashes(ids, fingerprint_key=KEY, block_size=4, tenant=2)
    assert len(frontend) == 5 and frontend == stored_by(consumer, 0)
    assert set(frontend) <= set(engine.cached_block_hashes())
    first = consumer.stored[0]
    assert first.parent_block_hash is None and first.token_ids == ids[:20] and first.extra_keys is None
    # A longer prompt adds blocks under the cached chain.
    engine.prefill(ids + random_ids(41, 6), tenant=2)
    consumer.sync(engine)
    longer = omniprefix.block_hashes(np.array(ids + random_ids(41, 6)), fingerprint_key=KEY, block_size=4, tenant=2)
    assert longer[:5] == frontend and stored_by(consumer, 1) == longer[5:]
    assert consumer.stored[1].parent_block_hash == frontend[-1]
    consumer.close()


def test_block_hashes_of_a_multimodal_request_equal_the_published_ones(ctx):
    engine = omniprefix.Engine.from_dir(
        model_dir("omni_thinker"), block_size=4, kv_events=LOOPBACK, kv_replay=LOOPBACK, fingerprint_key=KEY.hex()
    )
    consumer = Consumer(ctx, engine.kv_events_endpoint, engine.kv_replay_endpoint)
    consumer.wait_joined(engine)
    ids = random_ids(60, 6) + unexpanded_image() + random_ids(61, 9)
    engine.prefill(ids, [image_item(5)])
    consumer.sync(engine)

    # The frontend has the image's content, not its embeddings, and the checkpoint's special ids.
    image = image_item(5, with_embeddings=False)
    tokens = load_config("omni_thinker")
    frontend = omniprefix.block_hashes(ids, [image], fingerprint_key=KEY, block_size=4, tokens=tokens)
    assert len(frontend) == 5  # 6 + 1 + 4 image rows + 1 + 9 = 21 positions
    assert frontend == stored_by(consumer, 0) and set(frontend) <= set(engine.cached_block_hashes())
    # The image rows (positions 7..10) are in blocks 1 and 2; extra_keys name the item and its first row
    # there, by its 64-hex identity (what vllm_uuids gives, the fingerprint first).
    fp = omniprefix.vllm_uuids([image], key=KEY)["image"][0]
    assert fp.startswith(f"{omniprefix.fingerprint(image.content, IMAGE_LAYOUT, key=KEY):032x}")
    extra = [k for event in consumer.stored for k in event.extra_keys]
    assert extra == [None, (fp, 0), (fp, 1), None, None]
    # Qwen3-Omni's ids (the default) do not expand the tiny checkpoint's placeholders.
    with pytest.raises(omniprefix.RequestError):
        omniprefix.block_hashes(ids, [image], fingerprint_key=KEY, block_size=4)
    consumer.close()


def test_block_hashes_differ_across_tenants_and_fleet_keys():
    ids = random_ids(70, 16)
    base = omniprefix.block_hashes(ids, fingerprint_key=KEY, block_size=4)
    assert len(base) == 4 and len(set(base)) == 4
    assert omniprefix.block_hashes(ids, fingerprint_key=KEY.hex(), block_size=4) == base
    assert omniprefix.block_hashes(ids, fingerprint_key=KEY.hex().upper(), block_size=4) == base
    other_tenant = omniprefix.block_hashes(ids, fingerprint_key=KEY, block_size=4, tenant=1)
    other_key = omniprefix.block_hashes(ids, fingerprint_key=bytes(32), block_size=4)
    assert not set(base) & set(other_tenant) and not set(base) & set(other_key)
    # Other block sizes chain other hashes; a text config dict (no special ids) means Qwen3-Omni's ids.
    assert len(omniprefix.block_hashes(ids, fingerprint_key=KEY)) == 1  # block_size 16
    assert omniprefix.block_hashes(ids, fingerprint_key=KEY, block_size=8)[0] not in base
    assert omniprefix.block_hashes(ids, fingerprint_key=KEY, block_size=4, tokens=small_config()) == base
    assert omniprefix.block_hashes(ids[:3], fingerprint_key=KEY, block_size=4) == []

    with pytest.raises(ValueError, match="fingerprint_key"):
        omniprefix.block_hashes(ids, fingerprint_key=b"short")
    with pytest.raises(ValueError, match="fingerprint_key"):
        omniprefix.block_hashes(ids, fingerprint_key="ab" * 31)
    with pytest.raises(TypeError):
        omniprefix.block_hashes(ids, fingerprint_key=KEY, tokens="qwen3")
    with pytest.raises(omniprefix.ConfigError):
        omniprefix.block_hashes(ids, fingerprint_key=KEY, block_size=0)
    with pytest.raises(ValueError):
        omniprefix.block_hashes(ids, fingerprint_key=KEY, placeholders="folded")


# ------------------------------------------------------------------ bad input
def test_bad_endpoints_raise_config_error_naming_the_endpoint():
    for options in ({"kv_events": "tcp//127.0.0.1:5557"}, {"kv_events": LOOPBACK, "kv_replay": "ipc:///tmp/kv"}):
        bad = options.get("kv_replay", options["kv_events"])
        with pytest.raises(omniprefix.ConfigError, match=bad):
            omniprefix.Engine.random(small_config(), 1, **options)

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
    try:
        for options in ({"kv_events": endpoint}, {"kv_events": LOOPBACK, "kv_replay": endpoint}):
            with pytest.raises(omniprefix.ConfigError, match="cannot bind") as info:
                omniprefix.Engine.random(small_config(), 1, **options)
            assert endpoint in str(info.value)
    finally:
        taken.close()


def test_a_malformed_replay_request_is_ignored_and_counted(ctx):
    engine = events_engine()
    engine.prefill(random_ids(80, 9))
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(engine.kv_replay_endpoint)
    dealer.send_multipart([b"", b"\x00\x00\x01"])  # a 3-byte seq
    wait_for("the malformed request to be counted", lambda: engine.kv_events_stats()["malformed_replays"] == 1)
    assert not dealer.poll(100)  # no answer to it
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    batches = list(replies(dealer))
    assert [int.from_bytes(f[2], "big") for f in batches] == [0]
    assert sorted(DECODER.decode(batches[0][3]).events[0].block_hashes) == engine.cached_block_hashes()
    stats = engine.kv_events_stats()
    assert (stats["malformed_replays"], stats["replays"]) == (1, 1)
    dealer.close(0)


def test_the_docs_example_runs(capsys):
    text = (REPO_ROOT / "docs" / "python.md").read_text()
    section = text.split("## KV events for cache-aware routers", 1)[1].split("\n## ", 1)[0]
    [example] = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    cwd = os.getcwd()
    os.chdir(REPO_ROOT)
    try:
        exec(compile(example, "docs/python.md", "exec"), {"__name__": "docs"})
    finally:
        os.chdir(cwd)
    assert capsys.readouterr().out == "[True, True, False]\n"


def test_no_kv_events_by_default(engine):
    assert engine.kv_events_endpoint is None and engine.kv_replay_endpoint is None
    assert engine.kv_events_stats() is None
    engine.prefill(random_ids(90, 9))
    assert engine.cached_block_hashes() == []
    assert engine.reset_cache() == 3
    assert engine.prefill(random_ids(90, 9)).num_cached_tokens == 0
