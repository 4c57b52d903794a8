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


def _scenario_child(scenario: Callable[[int], dict], rank: int, world: int, port: int, out_dir: str) -> None:
    """One rank: a gloo process group on 127.0.0.1, ``scenario(rank)``, its result saved (or its traceback)."""
    import os
    import traceback
    from pathlib import Path

    import torch

    from components import distributed

    try:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))  # fmt: skip
        torch.set_num_threads(1)
        distributed.init_distributed(backend="gloo", timeout_s=60)
        result = scenario(rank)
        distributed.cleanup_distributed()
        torch.save(result, Path(out_dir, f"rank{rank}.pt"))
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)  # do not wait for the other ranks' collectives


def run_scenario(scenario: Callable[[int], dict], out_dir: Any, world: int = 2, timeout: float = 240) -> list[dict]:
    """Runs the module-level function ``scenario(rank) -> dict`` on ``world`` spawned gloo ranks (process-group
    timeout 60 s) and returns each rank's result; fails with the ranks' tracebacks when one of them failed."""
    import multiprocessing
    from pathlib import Path

    import torch

    out = Path(out_dir)
    args = lambda rank, port: (scenario, rank, world, port, str(out))  # noqa: E731
    codes = run_ranks(multiprocessing.get_context("spawn"), _scenario_child, args, world, timeout)
    errors = "\n".join(f"--- {p.name} ---\n{p.read_text()}" for p in sorted(out.glob("*.err")))
    assert codes == [0] * world, errors or f"exit codes {codes} (timeout {timeout} s)"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
