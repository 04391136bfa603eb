"""A local fleet in one command: Dynamo's OpenAI frontend and N omniprefix workers.

    python -m omniprefix.fleet --model DIR --workers N [--router kv|round-robin] [--port P]

Starts ``python -m dynamo.frontend`` and N ``python -m omniprefix.worker`` processes on loopback,
with no etcd and no NATS: file discovery under a temporary directory, the TCP request plane and
the ZMQ event plane. Clients talk to the edge (:mod:`omniprefix.edge`, on ``--port``), which
refuses bad or oversized bodies (``--max-body-bytes``) and forwards the rest to the frontend (on
a free port). Once the frontend lists the model with N instances it prints one JSON line and
flushes::

    {"frontend": "http://127.0.0.1:P", "dynamo_frontend": "http://127.0.0.1:F", "model": NAME,
     "workers": [{"pid": ..., "metrics": "http://127.0.0.1:Q/metrics"}, ...]}

(``frontend``: the edge, what clients use; ``dynamo_frontend``: Dynamo's own, unchecked.)

then runs until SIGINT or SIGTERM, or until a process it started exits (reported on stderr, exit
status 1). Either way it stops everything it started: SIGTERM to each process group, SIGKILL after
a timeout. The processes' logs go to the temporary directory, and their last lines to stderr when
something fails. ``--port 0`` picks a free port. Needs ``bash scripts/install_fleet.sh VENV``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional, Sequence

__all__ = ["Fleet", "main", "worker_metrics"]

#: Seconds the fleet waits for its processes to serve, and for them to stop once told to.
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
LOOPBACK = "127.0.0.1"
#: The edge's default body limit: room for a few photos as base64 data URLs (a 12-megapixel
#: JPEG is 3-5 MB, 4-7 MB encoded) and far over any text a context holds, while a body this big
#: is refused before it is read. Dynamo's frontend gets the same limit, rounded up to its MiB.
MAX_BODY_BYTES = 16 * 1024 * 1024

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
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers must be at least 1, not {args.workers}")
    if args.max_body_bytes < 1024:
        p.error(f"--max-body-bytes must be at least 1024, not {args.max_body_bytes}")
    if not (0 <= args.port <= 65535):
        p.error(f"--port {args.port} is not a TCP port")
    for needed in ("config.json", "tokenizer.json"):
        if not (args.model / needed).is_file():
            p.error(f"--model {args.model}: no {needed} there")
    if args.port == 0:
        args.port = free_port()
    else:
        try:
            with socket.socket() as s:
                s.bind((LOOPBACK, args.port))
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: its own process group, and SIGTERM when the fleet dies (even by SIGKILL)."""
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class Fleet:
    """The frontend and the workers, started, watched and stopped together."""

    def __init__(self, model: Path, workers: int, router: str, port: int, python: str = sys.executable,
                 worker_args: Sequence[str] = (), max_body_bytes: int = MAX_BODY_BYTES):
        self.model = model.resolve()
        self.name = self.model.name
        self.count = workers
        self.router = router
        self.port = port
        self.python = python
        # More `python -m omniprefix.worker` options for every worker (engine options: a benchmark's pool size).
        self.worker_args = list(worker_args)
        self.dir = Path(tempfile.mkdtemp(prefix="omniprefix-fleet-"))
        self.env = {**os.environ, **LOOPBACK_ENV, "DYN_FILE_KV": str(self.dir / "discovery")}
        self.env.pop("DYN_SYSTEM_PORT", None)
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.workers: list[dict[str, Any]] = []
        # The edge listens on `port`; Dynamo's frontend behind it on a free one, with its own
        # body limit (whole MiB) as a backstop.
        self.max_body_bytes = max_body_bytes
        self.frontend_port = free_port()
        self.env["DYN_HTTP_BODY_LIMIT_MB"] = str(-(-max_body_bytes // (1024 * 1024)))
        self.edge: Any = None

    @property
    def url(self) -> str:
        """Dynamo's frontend (behind the edge)."""
        return f"http://{LOOPBACK}:{self.frontend_port}"

    def _spawn(self, label: str, argv: list[str], stdout: Any) -> subprocess.Popen:
        log = open(self.dir / f"{label}.log", "wb")
        proc = subprocess.Popen(argv, stdout=stdout, stderr=log, stdin=subprocess.DEVNULL, env=self.env,
                                preexec_fn=_die_with_parent)
        log.close()
        self.procs.append((label, proc))
        return proc

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> dict[str, Any]:
        """Starts every process and returns the ready line's object once the frontend lists the
        model with one instance per worker; raises :class:`FleetError` (after stopping what it
        started) when a process exits or the time runs out."""
        deadline = time.monotonic() + timeout_s
        frontend = [self.python, "-m", "dynamo.frontend", "--http-host", LOOPBACK, "--http-port", str(self.frontend_port),
                    "--router-mode", self.router, "--discovery-backend", "file", "--request-plane", "tcp",
                    "--event-plane", "zmq"]
        if self.router == "kv":
            # Our CPU backend's events carry medium "CPU", which Dynamo files in its host tier:
            # here that tier is the working cache, worth as much as a device hit.
            frontend += ["--router-host-cache-hit-weight", "1.0"]
        self._spawn("frontend", frontend, subprocess.DEVNULL)
        for k in range(self.count):
            self._spawn(f"worker{k}", [self.python, "-m", "omniprefix.worker", "--model", str(self.model),
                                       "--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq",
                                       *self.worker_args],
                        subprocess.PIPE)
        for label, proc in self.procs[1:]:
            self.workers.append(self._ready_line(label, proc, deadline))
        while not self.serving():
            self.check()
            if time.monotonic() > deadline:
                raise FleetError(f"the frontend did not list {self.count} instances of {self.name} within {timeout_s:.0f} s")
            time.sleep(0.1)
        return {"frontend": self._start_edge(), "dynamo_frontend": self.url, "model": self.name,
                "workers": self.workers}

    def _start_edge(self) -> str:
        from .edge import Edge, limits_for

        limits = limits_for(self.model, self.max_body_bytes)
        limits.models = {self.name}
        self.edge = Edge(self.url, limits, LOOPBACK, self.port)
        try:
            return self.edge.start()
        except RuntimeError as e:
            raise FleetError(str(e)) from None

    def _ready_line(self, label: str, proc: subprocess.Popen, deadline: float) -> dict[str, Any]:
        """The worker's JSON line (it prints nothing else on stdout)."""
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while not sel.select(timeout=0.1):
                self.check()
                if time.monotonic() > deadline:
                    raise FleetError(f"{label} did not start in time")
        line = proc.stdout.readline()
        if not line:
            self.check()
            raise FleetError(f"{label} closed its stdout before it served")
        try:
            ready = json.loads(line)
            return {"pid": int(ready["pid"]), "metrics": str(ready["metrics"])}
        except (ValueError, KeyError, TypeError):
            raise FleetError(f"{label} printed {line[:200]!r} instead of its ready line") from None

    def serving(self) -> bool:
        """Whether the frontend lists the model (``/v1/models``) and one instance per worker
        (``/health``): it lists instances as soon as they are discovered, the model only once
        it loaded the model card (tokenizer and template)."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                health = json.loads(r.read())
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
                models = json.loads(r.read())
        except (OSError, ValueError):
            return False
        instances = [i for i in health.get("instances", []) if i.get("component") == "worker"]
        return len(instances) == self.count and self.name in [m.get("id") for m in models.get("data", [])]

    def check(self) -> None:
        """Raises :class:`FleetError` naming the first process that exited."""
        for label, proc in self.procs:
            if proc.poll() is not None:
                raise FleetError(f"{label} (pid {proc.pid}) exited with status {proc.returncode}\n{self.log_tail(label)}")

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
        for _, proc in reversed(self.procs):
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for _, proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for _, proc in self.procs:
            # The group too: a process may have left children behind.
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    fleet = Fleet(args.model, args.workers, args.router, args.port, max_body_bytes=args.max_body_bytes)
    stopping = []

    def on_signal(signum: int, _frame: Any) -> None:
        stopping.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        ready = fleet.start()
        print(json.dumps(ready), flush=True)
        while True:
            fleet.check()
            time.sleep(0.2)
    except KeyboardInterrupt:
        return 0
    except FleetError as e:
        print(f"omniprefix.fleet: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        fleet.stop()


if __name__ == "__main__":
    sys.exit(main())
