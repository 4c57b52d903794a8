"""Running a function on several local processes, one per rank, as the multi-process tests and benchmarks do."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from typing import Any


def free_port() -> int:
    """A TCP port that was free a moment ago, for a process group's rendezvous on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(ctx: Any, target: Callable, rank_args: Callable[[int, int], Sequence], world: int, timeout: float) -> list:
    """Starts ``world`` processes of ``ctx`` (a multiprocessing context) running ``target(*rank_args(rank, port))``
    and returns their exit codes (None: still running at ``timeout`` seconds, then killed).

    When one rank fails the others are killed at once instead of waiting for their process-group timeout, so a
    failing test reports in seconds.
    """
    port = free_port()
    procs = [ctx.Process(target=target, args=tuple(rank_args(rank, port))) for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    codes: list = [None] * world
    try:
        while time.monotonic() < deadline and any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.05)
        codes = [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
    return codes
