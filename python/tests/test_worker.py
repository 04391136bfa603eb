"""omniprefix.worker's mapping of Dynamo's token requests onto the engine's sampling keywords,
checked by running the engine on what it returns (no Dynamo needed: the fleet itself is
test_fleet.py). Requests are shaped as Dynamo 1.6.1's frontend sends them."""

from __future__ import annotations

from pathlib import Path

import pytest

import omniprefix
from omniprefix.worker import UnsupportedRequest, sampling_options
from conftest import FIXTURES, random_ids

CONTEXT = 4096


def request(ids, stop=None, sampling=None, **extra) -> dict:
    return {"token_ids": ids, "stop_conditions": stop or {}, "sampling_options": sampling or {}, **extra}


@pytest.fixture(scope="module")
def engine():
    return omniprefix.Engine.from_dir(FIXTURES / "qwen3_dense")


def test_greedy_with_stop_ids_and_eos_stops_at_the_first_of_them(engine):
    ids = random_ids(1, 20)
    free = engine.generate(ids, max_tokens=12, temperature=0.0, ignore_eos=True).tokens
    options = sampling_options(request(ids, {"max_tokens": 12, "stop_token_ids": [free[5]],
                                             "stop_token_ids_hidden": [free[7]]}, {"temperature": 0.0},
                                       eos_token_ids=[free[9]]), [], CONTEXT)
    first = min(i for i, token in enumerate(free) if token in (free[5], free[7], free[9]))
    assert first >= 3 and engine.generate(ids, **options).tokens == free[:first + 1]


def test_ignore_eos_keeps_the_requests_own_stop_ids_only(engine):
    ids = random_ids(2, 20)
    free = engine.generate(ids, max_tokens=12, temperature=0.0, ignore_eos=True).tokens
    eos, own = free[2], free[6]
    if own == eos:
        pytest.skip("the reply repeats its token")
    # eos ignored (the checkpoint's and the tokenizer's), the request's own id still stops it.
    options = sampling_options(request(ids, {"max_tokens": 12, "ignore_eos": True, "stop_token_ids": [own, eos]},
                                       {"temperature": 0.0}, eos_token_ids=[]), [eos], CONTEXT)
    assert options["stop"] == [own]
    assert engine.generate(ids, **options).tokens == free[:free.index(own) + 1]
    # Nothing but eos: every stop id ignored.
    options = sampling_options(request(ids, {"max_tokens": 12, "ignore_eos": True}, {"temperature": 0.0}), [eos], CONTEXT)
    assert engine.generate(ids, **options).tokens == free


def test_sampling_defaults_follow_openai_and_off_values_are_dropped():
    options = sampling_options(request([1, 2, 3], sampling={"top_k": -1, "top_p": 1.0, "seed": 7}), [], CONTEXT)
    assert options == {"max_tokens": CONTEXT - 3, "temperature": 1.0, "seed": 7}


@pytest.mark.parametrize("stop, sampling, extra, message", [
    ({"max_tokens": CONTEXT}, {}, {}, "exceeds the context of 4096 tokens"),
    ({"min_tokens": 2}, {}, {}, "min_tokens"),
    ({}, {"n": 2}, {}, "n=2"),
    ({}, {"repetition_penalty": 1.1}, {}, "repetition_penalty"),
    ({}, {"use_beam_search": True}, {}, "use_beam_search"),
    ({}, {}, {"output_options": {"logprobs": 1}}, "logprobs"),
    ({}, {"seed": -1}, {}, "seed must be between 0 and 18446744073709551615, not -1"),
    ({}, {"seed": 2**64}, {}, "seed must be between 0 and"),
])
def test_what_the_engine_cannot_honour_is_refused(stop, sampling, extra, message):
    with pytest.raises(UnsupportedRequest, match=message):
        sampling_options(request([1, 2, 3], stop, sampling, **extra), [], CONTEXT)


class _Context:
    """What the worker reads of Dynamo's request context: a client still there."""

    def is_stopped(self) -> bool:
        return False


def _chunks(worker, request_body) -> list[dict]:
    import asyncio

    async def run():
        return [chunk async for chunk in worker.generate(request_body, _Context())]

    return asyncio.run(run())


@pytest.mark.parametrize("stop_at", [None, 4])
def test_the_last_token_rides_with_the_finish_reason_and_the_usage(stop_at):
    """Dynamo's frontend ends a reply by itself at max_tokens or a stop id, possibly before a
    separate closing chunk arrives: so the chunk that carries the last token must carry
    finish_reason and the usage too (a worker that stops one token late, or that sends them
    in a chunk of their own, loses the usage)."""
    from omniprefix.worker import Worker

    engine = omniprefix.AsyncEngine.from_dir(FIXTURES / "qwen3_dense")
    try:
        ids = random_ids(3, 20)
        free = engine.engine.generate(ids, max_tokens=8, temperature=0.0, ignore_eos=True).tokens
        stop = {"max_tokens": 8, "ignore_eos": True}
        if stop_at is not None:
            stop["stop_token_ids"] = [free[stop_at]]
        want = free if stop_at is None else free[:free.index(free[stop_at]) + 1]
        chunks = _chunks(Worker(engine, CONTEXT), request(ids, stop, {"temperature": 0.0}))
    finally:
        engine.close()
    assert [t for c in chunks for t in c["token_ids"]] == want
    assert len(chunks) == len(want), "one chunk per token, the last one closing the reply"
    assert all("finish_reason" not in c for c in chunks[:-1])
    last = chunks[-1]
    assert last["token_ids"] == [want[-1]]
    assert last["finish_reason"] == ("length" if stop_at is None else "stop")
    assert last["completion_usage"]["completion_tokens"] == len(want)
    assert last["completion_usage"]["prompt_tokens"] == len(ids)


def test_a_prompt_that_fills_the_context_is_refused_without_max_tokens():
    with pytest.raises(UnsupportedRequest, match="the prompt of 4096 tokens fills the context of 4096 tokens"):
        sampling_options(request([1] * CONTEXT), [], CONTEXT)


def test_the_workers_engine_flags_are_engine_options_and_restate_no_default(qwen3_config):
    """The worker's engine flags are named after Engine.from_dir's options (the extension's own
    list, as test_stubs reads it), and flags left unset pass nothing: the engine's defaults hold."""
    import re

    from omniprefix.worker import ENGINE_FLAGS, engine_options, parse_args

    with pytest.raises(TypeError, match="unknown engine option") as info:
        omniprefix.Engine.random(qwen3_config, 0, no_such_option=1)
    accepted = set(re.search(r"options are (.*)$", str(info.value)).group(1).split(", "))
    assert set(ENGINE_FLAGS) <= accepted
    bare = engine_options(parse_args(["--model", str(FIXTURES / "qwen3_dense")]))
    assert set(bare) == {"kv_events", "capture"}, bare
    sized = engine_options(parse_args(["--model", str(FIXTURES / "qwen3_dense"), "--block-size", "4", "--dtype", "bf16"]))
    assert (sized["block_size"], sized["dtype"]) == (4, "bf16")


def test_the_tier_flags_reach_the_engine_options_of_every_worker_of_a_fleet(tmp_path, capsys):
    """``--tier-dir`` / ``--tier-bytes`` (sizes spelled as the CLI's): the worker hands them to the
    engine, and the fleet to every worker it starts, the directory absolute; a bound without a
    directory is refused before anything starts."""
    from omniprefix import fleet, worker

    model = str(FIXTURES / "qwen3_dense")
    options = worker.engine_options(worker.parse_args(["--model", model, "--tier-dir", str(tmp_path),
                                                       "--tier-bytes", "8GiB"]))
    assert (options["tier_dir"], options["tier_bytes"]) == (str(tmp_path), 8 << 30)
    args = fleet.parse_args(["--model", model, "--workers", "2", "--port", "0", "--tier-dir", "rel/tier",
                             "--tier-bytes", "512 MiB", "--fingerprint-key", "ab" * 32])
    argv = fleet.worker_args(args)
    tier_dir = Path(argv[argv.index("--tier-dir") + 1])
    assert tier_dir.is_absolute() and tier_dir == Path("rel/tier").resolve()
    assert argv[argv.index("--tier-bytes") + 1] == str(512 << 20)
    assert argv[argv.index("--fingerprint-key") + 1] == "ab" * 32
    assert "--tier-dir" not in fleet.worker_args(fleet.parse_args(["--model", model, "--workers", "1", "--port", "0"]))
    for parse in (worker.parse_args, lambda a: fleet.parse_args([*a, "--workers", "1", "--port", "0"])):
        for bad, message in ((["--tier-bytes", "1GiB"], "--tier-bytes needs --tier-dir"),
                             (["--tier-dir", str(tmp_path), "--tier-bytes", "lots"], "invalid byte_size value")):
            with pytest.raises(SystemExit):
                parse(["--model", model, *bad])
            assert message in capsys.readouterr().err
    a_file = tmp_path / "a_file"
    a_file.write_bytes(b"")
    with pytest.raises(SystemExit):
        fleet.parse_args(["--model", model, "--workers", "1", "--port", "0", "--tier-dir", str(a_file)])
    assert "not a directory" in capsys.readouterr().err


def test_a_fleet_splits_the_cores_among_its_workers_unless_told(tmp_path, monkeypatch):
    """Each worker's engine gets its share of the cores (``RAYON_NUM_THREADS``), at least one; a
    fleet started with ``RAYON_NUM_THREADS`` set passes that on instead."""
    import shutil

    from omniprefix import fleet

    monkeypatch.setattr(fleet.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3}, raising=False)
    assert [fleet.worker_threads(n) for n in (1, 2, 3, 4, 8)] == [4, 2, 1, 1, 1]
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    split = fleet.Fleet(FIXTURES / "qwen3_dense", 2, "kv", 0)
    monkeypatch.setenv("RAYON_NUM_THREADS", "3")
    told = fleet.Fleet(FIXTURES / "qwen3_dense", 2, "kv", 0)
    try:
        assert split.worker_env == {"RAYON_NUM_THREADS": "2"}
        assert told.worker_env == {} and told.env["RAYON_NUM_THREADS"] == "3"
    finally:
        shutil.rmtree(split.dir), shutil.rmtree(told.dir)
