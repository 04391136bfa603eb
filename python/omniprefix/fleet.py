"""A local fleet in one command: Dynamo's OpenAI frontend and N omniprefix workers.

    python -m omniprefix.fleet --model DIR --workers N [--router kv|round-robin] [--port P]
        [--talker-temperature T] [--talker-max-tokens M] [--tier-dir DIR [--tier-bytes SIZE]]
        [--fingerprint-key HEX]

Starts ``python -m dynamo.frontend`` and N ``python -m omniprefix.worker`` processes on loopback,
with no etcd and no NATS: file discovery under a temporary directory, the TCP request plane and
the ZMQ event plane. Clients talk to the edge (:mod:`omniprefix.edge`, on ``--port``), which
refuses bad or oversized bodies (``--max-body-bytes``) and forwards the rest to the frontend (on
a free port). Once the frontend lists the model with N instances it prints one JSON line and
flushes::

    {"frontend": "http://127.0.0.1:P", "dynamo_frontend": "http://127.0.0.1:F", "model": NAME,
     "workers": [{"pid": ..., "metrics": "http://127.0.0.1:Q/metrics"}, ...]}

(``frontend``: the edge, what clients use; ``dynamo_frontend``: Dynamo's own, unchecked.)

Each worker's engine computes on its share of the cores (:func:`worker_threads`).

On a checkpoint with a talker, the edge also answers spoken chats (``"modalities": ["text",
"audio"]``): it routes them with Dynamo's KV router (``dynamo.llm.KvRouter``, in this process,
over the workers' KV events; Dynamo's round-robin client under ``--router round-robin``) to the
workers, which speak them (:mod:`omniprefix.speech_route`). ``--talker-temperature`` and
``--talker-max-tokens`` are the workers' defaults for the talker options a request leaves out.

``--tier-dir DIR`` gives every worker (replacements too) one disk tier, ``--tier-bytes SIZE``
(default 8 GiB) bounding the whole directory: a block one worker's pool evicted is loaded by any
of them. A tier hit needs the key that hashed the block: with ``--fingerprint-key`` every worker
gets that one, else each takes the key kept in ``DIR/fleet.key`` (created once, 0600), never put
on a command line, and the same after a restart of the fleet. Dynamo's router files the
workers' ``"DISK"`` events under its disk tier; the fleet gives that tier no weight
(``--router-disk-cache-hit-weight 0``), since the directory is every worker's alike.

then supervises until SIGINT or SIGTERM (exit status 0) or until the frontend exits (reported on
stderr, exit status 1):

* A worker that exits or is killed is restarted, after 0.5 s, doubling at each quick death up to
  8 s (a worker that served 30 s starts again at 0.5 s); stderr says why (``worker1 (pid N)
  exited with status -9; ... restarting in 0.5 s``) with its log's last lines. The others keep
  serving. Once the frontend lists a replacement (and the model), the fleet prints one more JSON
  line on stdout, its entry with its index: ``{"worker": 1, "pid": ..., "metrics": ...}``.
* The dead worker's entries in Dynamo's file discovery are deleted when it is reaped
  (:func:`withdraw`), so the frontend stops routing to it at once instead of after their 10 s
  lease; and the frontend runs with ``--migration-limit 3``, so a request whose worker died
  goes on where it was cut, on another worker.

A worker that cannot start in the first place is not retried: the fleet reports it and exits 1.
Either way it stops everything it started: SIGTERM to each process group, SIGKILL after a
timeout. The processes' logs go to the temporary directory, and their last lines to stderr when
something fails. ``--port 0`` picks a free port. Needs ``bash scripts/install_fleet.sh VENV``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Optional, Sequence, cast

from .ports import LOOPBACK, check_listenable, free_port
from .router_weights import DISK_CACHE_HIT_WEIGHT, HOST_CACHE_HIT_WEIGHT
from .sizes import byte_size
from .speech import MAX_TALKER_TOKENS

if TYPE_CHECKING:
    from .edge import Edge
    from .speech_route import SpeechRoute

__all__ = ["Fleet", "main", "terminate", "worker_metrics"]

#: Seconds the fleet waits for its processes to serve, and for them to stop once told to.
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
#: The edge's default body limit: room for a few photos as base64 data URLs (a 12-megapixel
#: JPEG is 3-5 MB, 4-7 MB encoded) and far over any text a context holds, while a body this big
#: is refused before it is read. Dynamo's frontend gets the same limit, rounded up to its MiB.
MAX_BODY_BYTES = 16 * 1024 * 1024
#: A worker that exits is restarted after RESTART_MIN_S, doubled at each quick death up to
#: RESTART_MAX_S; one that served STABLE_S before it died starts the count again.
RESTART_MIN_S = 0.5
RESTART_MAX_S = 8.0
STABLE_S = 30.0
#: How many times the frontend moves a request whose worker died to another one (its
#: ``--migration-limit``; 0 would end the request with an error).
MIGRATION_LIMIT = 3


#: Dynamo's environment for a loopback fleet: every listener on 127.0.0.1.
LOOPBACK_ENV = {
    "DYN_DISCOVERY_BACKEND": "file",
    "DYN_REQUEST_PLANE": "tcp",
    "DYN_EVENT_PLANE": "zmq",
    "DYN_TCP_RPC_HOST": LOOPBACK,
    "DYN_TCP_RESPONSE_STREAM_HOST": LOOPBACK,
    "DYN_EVENT_PLANE_HOST": LOOPBACK,
    "DYN_SYSTEM_HOST": LOOPBACK,
}


#: The log level the fleet sets for Dynamo's runtime in its own process (the edge's router) when
#: the environment sets none; noted, so that the children of a later fleet do not inherit it.
_OWN_DYN_LOG = "warn"
_set_dyn_log: list[bool] = []


def worker_threads(workers: int) -> int:
    """Compute threads each of `workers` engines on this machine gets: its cores split evenly, at
    least one. Each engine's pool would otherwise take every core, and at load the workers' pools
    fight over them (2 workers on 2 cores of an AMD EPYC with AVX2, bench size: TTFA p50 at c=8
    347 ms with 2 threads each against 294 ms with 1, c=1 143 against 145). `RAYON_NUM_THREADS` set
    for the fleet wins."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, workers))


class FleetError(RuntimeError):
    """The fleet could not start, or a process of it died."""


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m omniprefix.fleet", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path, help="checkpoint directory with tokenizer.json and a chat template")
    p.add_argument("--workers", required=True, type=int, help="worker processes (>= 1)")
    p.add_argument("--router", default="kv", choices=["kv", "round-robin"], help="the frontend's router (default kv)")
    p.add_argument("--port", type=int, default=8000, help="the edge's HTTP port on 127.0.0.1 (default 8000; 0: a free one)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help="the largest request body the edge reads (default %(default)s: 16 MiB)")
    p.add_argument("--talker-temperature", type=float,
                   help="the talker's temperature when a spoken request sets none (0: greedy; default: the checkpoint's)")
    p.add_argument("--talker-max-tokens", type=int,
                   help="codec frames a spoken reply takes at most when the request sets none")
    p.add_argument("--tier-dir", type=Path, metavar="DIR",
                   help="one disk tier under every worker's KV pool, shared by them (created 0700)")
    p.add_argument("--tier-bytes", type=byte_size, metavar="SIZE",
                   help="the tier's bound in bytes of its files, for the whole directory (512MiB, 8GiB; default 8GiB)")
    p.add_argument("--fingerprint-key", metavar="HEX",
                   help="every worker's fleet key, 64 hex digits (default: the tier's DIR/fleet.key with "
                        "--tier-dir, else a random one per worker)")
    # Tests: an environment variable for the first process of worker K only (a fault to inject
    # that its replacement must not inherit). Not in --help.
    p.add_argument("--first-env", action="append", default=[], dest="first_env_specs", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.first_env = {}
    for spec in args.first_env_specs:
        index, _, assignment = spec.partition(":")
        name, eq, value = assignment.partition("=")
        if not (index.isdigit() and int(index) < args.workers and name and eq):
            p.error(f"--first-env {spec!r}: not K:NAME=VALUE with K < --workers")
        args.first_env.setdefault(int(index), {})[name] = value
    if args.workers < 1:
        p.error(f"--workers must be at least 1, not {args.workers}")
    if args.tier_bytes is not None and args.tier_dir is None:
        p.error("--tier-bytes needs --tier-dir")
    if args.tier_dir is not None and args.tier_dir.exists() and not args.tier_dir.is_dir():
        p.error(f"--tier-dir {args.tier_dir}: not a directory")
    if args.max_body_bytes < 1024:
        p.error(f"--max-body-bytes must be at least 1024, not {args.max_body_bytes}")
    if not (0 <= args.port <= 65535):
        p.error(f"--port {args.port} is not a TCP port")
    for needed in ("config.json", "tokenizer.json"):
        if not (args.model / needed).is_file():
            p.error(f"--model {args.model}: no {needed} there")
    if args.talker_temperature is not None and not 0.0 <= args.talker_temperature <= 2.0:
        p.error(f"--talker-temperature must be in [0, 2], not {args.talker_temperature}")
    if args.talker_max_tokens is not None and not 1 <= args.talker_max_tokens <= MAX_TALKER_TOKENS:
        p.error(f"--talker-max-tokens must be in [1, {MAX_TALKER_TOKENS}], not {args.talker_max_tokens}")
    if args.port == 0:
        args.port = free_port()
    else:
        try:
            check_listenable(args.port)
        except OSError as e:
            p.error(f"--port {args.port}: cannot listen on {LOOPBACK}:{args.port} ({e.strerror})")
    return args


def worker_metrics(url: str) -> dict[str, float]:
    """A worker's ``/metrics`` (the ``metrics`` URL of its ready line), parsed by the Prometheus
    client: each sample's value by name, summed over its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


def _die_with_parent() -> None:
    """In the child: its own process group, and SIGTERM when the fleet dies (even by SIGKILL)."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Slot:
    """One worker of the fleet: its current process (None while it waits to be restarted), its
    ready line once it printed one, and its restart schedule."""

    def __init__(self, index: int):
        self.index = index
        self.label = f"worker{index}"
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.info: Optional[dict[str, Any]] = None
        self.instance: Optional[int] = None  # its Dynamo instance id (the ready line's "instance")
        self.block_size: Optional[int] = None  # its engine's KV block size (the ready line's "block_size")
        self.announced = False  # whether the frontend listed it (and its model) since it started
        self.started = 0.0
        self.spawns = 0
        self.backoff = RESTART_MIN_S
        self.restart_at: Optional[float] = None


class Fleet:
    """The frontend and the workers, started, supervised and stopped together."""

    def __init__(self, model: Path, workers: int, router: str, port: int, python: str = sys.executable,
                 worker_args: Sequence[str] = (), first_env: Optional[dict[int, dict[str, str]]] = None,
                 max_body_bytes: int = MAX_BODY_BYTES):
        self.model = model.resolve()
        self.name = self.model.name
        self.count = workers
        self.router = router
        self.port = port
        self.python = python
        # More `python -m omniprefix.worker` options for every worker (engine options: a benchmark's pool size).
        self.worker_args = list(worker_args)
        # Environment for the first process of a worker only, not its replacements (a test's fault).
        self.first_env = first_env or {}
        self.dir = Path(tempfile.mkdtemp(prefix="omniprefix-fleet-"))
        self.discovery = self.dir / "discovery"
        self.env = {**os.environ, **LOOPBACK_ENV, "DYN_FILE_KV": str(self.discovery)}
        # Each worker's share of the cores, unless the fleet's environment sets its own.
        self.worker_env = {} if "RAYON_NUM_THREADS" in os.environ else {"RAYON_NUM_THREADS": str(worker_threads(workers))}
        self.env.pop("DYN_SYSTEM_PORT", None)
        if _set_dyn_log and self.env.get("DYN_LOG") == _OWN_DYN_LOG:  # an earlier fleet's, not for children
            del self.env["DYN_LOG"]
        self.frontend: Optional[subprocess.Popen[bytes]] = None
        self.slots = [Slot(k) for k in range(workers)]
        # The edge listens on `port`; Dynamo's frontend behind it on a free one, with its own
        # body limit (whole MiB) as a backstop.
        self.max_body_bytes = max_body_bytes
        self.frontend_port = free_port()
        self.env["DYN_HTTP_BODY_LIMIT_MB"] = str(-(-max_body_bytes // (1024 * 1024)))
        self.edge: Optional[Edge] = None
        self.speech_route: Optional[SpeechRoute] = None

    @property
    def url(self) -> str:
        """Dynamo's frontend (behind the edge)."""
        return f"http://{LOOPBACK}:{self.frontend_port}"

    @property
    def workers(self) -> list[dict[str, Any]]:
        """The ready lines of the workers serving now."""
        return [slot.info for slot in self.slots if slot.info is not None]

    def _spawn(self, label: str, argv: list[str], stdout: Any,
               env: Optional[dict[str, str]] = None) -> subprocess.Popen[bytes]:
        # Appended: a replacement's log follows its predecessor's last lines.
        log = open(self.dir / f"{label}.log", "ab")
        proc = subprocess.Popen(argv, stdout=stdout, stderr=log, stdin=subprocess.DEVNULL,
                                env={**self.env, **(env or {})}, preexec_fn=_die_with_parent)
        log.close()
        return proc

    def _spawn_worker(self, slot: Slot) -> None:
        argv = [self.python, "-m", "omniprefix.worker", "--model", str(self.model), "--discovery-backend", "file",
                "--request-plane", "tcp", "--event-plane", "zmq", *self.worker_args]
        env = {**self.worker_env, **(self.first_env.get(slot.index, {}) if slot.spawns == 0 else {})}
        slot.proc = self._spawn(slot.label, argv, subprocess.PIPE, env)
        slot.info, slot.restart_at, slot.announced = None, None, False
        slot.started = time.monotonic()
        slot.spawns += 1

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> dict[str, Any]:
        """Starts every process and returns the ready line's object once the frontend lists the
        model with one instance per worker; raises :class:`FleetError` (after stopping what it
        started) when a process exits or the time runs out: a worker that cannot start once is
        a mistake to report, not to retry."""
        deadline = time.monotonic() + timeout_s
        frontend = [self.python, "-m", "dynamo.frontend", "--http-host", LOOPBACK, "--http-port", str(self.frontend_port),
                    "--router-mode", self.router, "--discovery-backend", "file", "--request-plane", "tcp",
                    "--event-plane", "zmq", "--migration-limit", str(MIGRATION_LIMIT)]
        if self.router == "kv":
            frontend += ["--router-host-cache-hit-weight", repr(HOST_CACHE_HIT_WEIGHT),
                         "--router-disk-cache-hit-weight", repr(DISK_CACHE_HIT_WEIGHT)]
        self.frontend = self._spawn("frontend", frontend, subprocess.DEVNULL)
        self._prepare_speech()
        for slot in self.slots:
            self._spawn_worker(slot)
        for slot in self.slots:
            slot.info = self._ready_line(slot, deadline)
        while not self.serving():
            self.check()
            if time.monotonic() > deadline:
                raise FleetError(f"the frontend did not list {self.count} instances of {self.name} within {timeout_s:.0f} s")
            time.sleep(0.1)
        for slot in self.slots:
            slot.announced = True
        return {"frontend": self._start_edge(), "dynamo_frontend": self.url, "model": self.name,
                "workers": self.workers}

    def _prepare_speech(self) -> None:
        """On a checkpoint that speaks: the edge's route for spoken chats, its tokenizer loading
        while the workers boot. Dynamo's runtime in this process (the route's router) reads the
        fleet's planes from the environment, as the children do."""
        from .speech import speech_caps

        if speech_caps(self.model) is None:
            return
        from .speech_route import SpeechRoute

        os.environ.update({k: v for k, v in self.env.items() if k.startswith("DYN_")})
        if "DYN_LOG" not in os.environ:  # its runtime logs on the fleet's stderr: warnings only
            os.environ["DYN_LOG"] = _OWN_DYN_LOG
            _set_dyn_log.append(True)
        # The block size is the workers' (their ready lines), set before the edge starts.
        self.speech_route = SpeechRoute(self.model, self.name, self.router, block_size=0)
        self.speech_route.preload()

    def _start_edge(self) -> str:
        from .edge import Edge, limits_for
        from .speech import speech_caps

        limits = limits_for(self.model, self.max_body_bytes)
        limits.models = {self.name}
        caps = speech_caps(self.model)
        route = self.speech_route
        if route is not None:
            block_size = next((slot.block_size for slot in self.slots if slot.block_size is not None), None)
            if block_size is None:
                raise FleetError("the workers did not say their KV block size (the ready line's block_size)")
            route.block_size = block_size
        edge = self.edge = Edge(self.url, limits, LOOPBACK, self.port, speech_caps=caps, speech_route=route)
        try:
            # Longer with a spoken route: it loads the tokenizer and connects Dynamo's router first.
            return edge.start(timeout_s=10.0 if route is None else 60.0)
        except RuntimeError as e:
            raise FleetError(str(e)) from None

    def _ready_line(self, slot: Slot, deadline: float) -> dict[str, Any]:
        """The worker's JSON line (it prints nothing else on stdout), waited for until ``deadline``."""
        proc = cast("subprocess.Popen[bytes]", slot.proc)  # start() just spawned it
        while not self._readable(proc, 0.1):
            self.check()
            if time.monotonic() > deadline:
                raise FleetError(f"{slot.label} did not start in time")
        line = _stdout(proc).readline()
        if not line:
            self.check()
            raise FleetError(f"{slot.label} closed its stdout before it served")
        return self._parse_ready(slot, line)

    @staticmethod
    def _readable(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(_stdout(proc), selectors.EVENT_READ)
            return bool(sel.select(timeout=timeout_s))

    @staticmethod
    def _parse_ready(slot: Slot, line: bytes) -> dict[str, Any]:
        """The fleet's entry for a worker's ready line; notes its Dynamo instance id in ``slot``."""
        try:
            ready = json.loads(line)
            slot.instance = int(ready["instance"])
            slot.block_size = int(ready["block_size"]) if ready.get("block_size") is not None else None
            return {"pid": int(ready["pid"]), "metrics": str(ready["metrics"])}
        except (ValueError, KeyError, TypeError):
            raise FleetError(f"{slot.label} printed {line[:200]!r} instead of its ready line") from None

    def serving(self) -> bool:
        """Whether the frontend serves the model with one instance per worker."""
        return len(self.listed()) == self.count

    def listed(self) -> set[int]:
        """The worker instances the frontend lists (``/health``) if it lists the model
        (``/v1/models``), else none: it lists instances as soon as they are discovered, the model
        only once it loaded the model card (tokenizer and template); a request in between is a 404."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                health = json.loads(r.read())
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
                models = json.loads(r.read())
        except (OSError, ValueError):
            return set()
        if self.name not in [m.get("id") for m in models.get("data", [])]:
            return set()
        return {i.get("instance_id") for i in health.get("instances", []) if i.get("component") == "worker"}

    def check(self) -> None:
        """Raises :class:`FleetError` naming the first process that exited (while starting)."""
        for label, proc in [("frontend", self.frontend)] + [(slot.label, slot.proc) for slot in self.slots]:
            if proc is not None and proc.poll() is not None:
                raise FleetError(f"{label} (pid {proc.pid}) exited with status {proc.returncode}\n{self.log_tail(label)}")

    def supervise(self) -> list[dict[str, Any]]:
        """One round of watching the running fleet: raises :class:`FleetError` if the frontend
        exited; reaps a worker that exited, withdraws it from discovery and schedules its
        restart; starts those whose time came; returns the ready lines (with ``"worker"``, the
        worker's index) of replacements the frontend began to list since the last round."""
        frontend = cast("subprocess.Popen[bytes]", self.frontend)  # start() spawned it
        if frontend.poll() is not None:
            raise FleetError(f"frontend (pid {frontend.pid}) exited with status {frontend.returncode}\n"
                             f"{self.log_tail('frontend')}")
        now = time.monotonic()
        ready = []
        listed: Optional[set[int]] = None  # asked of the frontend once a round, if needed
        for slot in self.slots:
            if slot.proc is None:
                if now >= cast(float, slot.restart_at):  # _reap set it with proc = None
                    self._spawn_worker(slot)
            elif _exited(slot.proc):
                self._reap(slot, now)
            elif slot.info is None and self._readable(slot.proc, 0):
                line = _stdout(slot.proc).readline()
                if not line:
                    continue  # it is exiting: a next round reaps it and says why
                try:
                    slot.info = self._parse_ready(slot, line)
                except FleetError as e:
                    print(f"omniprefix.fleet: {e}; killing it", file=sys.stderr, flush=True)
                    _signal_group(slot.proc, signal.SIGKILL)  # a next round reaps and restarts it
                    continue
            if slot.info is not None and not slot.announced:
                listed = self.listed() if listed is None else listed
                if slot.instance not in listed:
                    continue
                slot.announced = True
                ready.append({"worker": slot.index, **slot.info})
        return ready

    def _reap(self, slot: Slot, now: float) -> None:
        """A worker exited: its group killed (what it started goes with it), its discovery
        entries withdrawn so the frontend stops routing to it now rather than after Dynamo's
        lease expires (10 s), and its restart scheduled after the backoff."""
        proc = cast("subprocess.Popen[bytes]", slot.proc)  # supervise() reaps running workers only
        _signal_group(proc, signal.SIGKILL)  # safe: the unreaped zombie still holds the pgid
        status = proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        withdrawn = withdraw(self.discovery, slot.instance) if slot.instance is not None else 0
        if now - slot.started >= STABLE_S:
            slot.backoff = RESTART_MIN_S
        delay, slot.backoff = slot.backoff, min(2 * slot.backoff, RESTART_MAX_S)
        slot.proc, slot.info, slot.instance, slot.restart_at = None, None, None, now + delay
        print(f"omniprefix.fleet: {slot.label} (pid {proc.pid}) exited with status {status}; withdrew {withdrawn} "
              f"discovery entries; restarting in {delay:g} s\n{self.log_tail(slot.label, 5)}",
              file=sys.stderr, flush=True)

    def log_tail(self, label: str, lines: int = 20) -> str:
        try:
            text = (self.dir / f"{label}.log").read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(f"  {label}| {line}" for line in text[-lines:])

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to every process group, SIGKILL to those still there after ``timeout_s``."""
        if self.edge is not None:
            self.edge.stop()
        procs = [slot.proc for slot in self.slots if slot.proc is not None]
        procs += [self.frontend] if self.frontend is not None else []
        for proc in procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in procs:
            # The group too: a process may have left children behind.
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


def withdraw(discovery: Path, instance: int) -> int:
    """Deletes a dead worker's entries from Dynamo's file discovery; returns how many.

    Dynamo 1.6.1's file store (``lib/runtime/src/storage/kv/file.rs``, ``FileStore``) keeps one
    JSON file per key under ``DYN_FILE_KV``, alive while its owner touches it; any process
    deletes those untouched for 10 s (``DEFAULT_TTL``), and the frontend's watch turns a removed
    file into a removed instance. A worker owns its endpoint instance (``v1/instances``) and
    model card (``v1/mdc``), both with its ``instance_id``, and the KV-event source and channel
    of its relay (``v1/event_sources``, ``v1/event_channels``), named by a publisher id that the
    source's ``metadata.worker.worker_id`` ties to the instance."""
    entries = {}
    for path in discovery.rglob("*"):
        if path.is_file() and not path.name.startswith(".tmp_"):  # FileStore's half-written files
            try:
                entry = json.loads(path.read_bytes())
            except (OSError, ValueError):
                continue
            if isinstance(entry, dict):
                entries[path] = entry
    ids = {instance} | {e.get("publisher_id") for e in entries.values()
                        if ((e.get("metadata") or {}).get("worker") or {}).get("worker_id") == instance}
    removed = 0
    for path, entry in entries.items():
        if entry.get("instance_id") in ids or entry.get("publisher_id") in ids:
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                pass  # expired meanwhile
    return removed


def _exited(proc: subprocess.Popen[Any]) -> bool:
    """Whether ``proc`` exited, leaving it unreaped: until it is reaped its pid, and so its
    process group's id, cannot be reused, so signalling the group is safe."""
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _stdout(proc: subprocess.Popen[bytes]) -> IO[bytes]:
    """A worker's stdout: set, since workers are spawned with ``stdout=subprocess.PIPE``."""
    return cast(IO[bytes], proc.stdout)


def _signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate(proc: subprocess.Popen[Any], timeout_s: float = 30.0) -> None:
    """Stops a process started in a session of its own (a fleet, for a test or a benchmark):
    SIGTERM, then SIGKILL to its whole group if it is not gone within ``timeout_s``, so nothing
    it left behind survives; waits for it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc, signal.SIGKILL)
    proc.wait()


def worker_args(args: argparse.Namespace) -> list[str]:
    """The ``python -m omniprefix.worker`` options the fleet's command line gives every worker,
    replacements included: the talker's defaults, the fleet key, the shared tier (its directory
    absolute, as every worker must name the same one)."""
    out = []
    if args.talker_temperature is not None:
        out += ["--talker-temperature", repr(args.talker_temperature)]
    if args.talker_max_tokens is not None:
        out += ["--talker-max-tokens", str(args.talker_max_tokens)]
    if args.fingerprint_key is not None:
        out += ["--fingerprint-key", args.fingerprint_key]
    if args.tier_dir is not None:
        out += ["--tier-dir", str(args.tier_dir.resolve())]
    if args.tier_bytes is not None:
        out += ["--tier-bytes", str(args.tier_bytes)]
    return out


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    fleet = Fleet(args.model, args.workers, args.router, args.port, worker_args=worker_args(args),
                  first_env=args.first_env, max_body_bytes=args.max_body_bytes)
    stopping = []

    def on_signal(signum: int, _frame: Any) -> None:
        stopping.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        ready = fleet.start()
        _say(ready)
        while True:
            for line in fleet.supervise():
                _say(line)
            time.sleep(0.1)
    except KeyboardInterrupt:
        return 0
    except FleetError as e:
        print(f"omniprefix.fleet: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        fleet.stop()


def _say(obj: dict[str, Any]) -> None:
    """One JSON line on stdout; a reader that went away does not stop the fleet."""
    try:
        print(json.dumps(obj), flush=True)
    except BrokenPipeError:
        sys.stdout = open(os.devnull, "w")


if __name__ == "__main__":
    sys.exit(main())
