"""Loopback ports: the one place the package picks a free one or checks a given one."""

from __future__ import annotations

import socket

__all__ = ["LOOPBACK", "free_port", "check_listenable"]

#: Every server the package starts (fleet, edge, workers' metrics, the Dynamo indexer) binds here.
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick; another process may still take it)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        port: int = s.getsockname()[1]
        return port


def check_listenable(port: int) -> None:
    """Raises the ``OSError`` that listening on ``port`` at :data:`LOOPBACK` would meet."""
    with socket.socket() as s:
        s.bind((LOOPBACK, port))
