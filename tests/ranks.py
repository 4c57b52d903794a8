"""Running a function on several local processes, one per rank, as the multi-process tests and benchmarks do.

The rendezvous cannot race: the launching process hosts the ranks' TCP store on a port the OS picks (port 0) and
keeps it bound until the ranks are done, then hands that port to them. Asking for a free port, closing it and
letting rank 0 bind it later (what this module did before) leaves a window in which another process can take the
port; a CI run once failed two tests there. The ranks connect as clients, as torchrun's workers do with the
agent's store (``TORCHELASTIC_USE_AGENT_STORE``), so ``components.init_distributed`` runs its ``env://`` path
unchanged.

The ranks start from :func:`rank_context`: a fork server that imports torch, MONAI and ignite once for the session,
so that a rank does not spend seconds importing them again, as a spawned one did.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
#: what the ranks' fork server imports once (the modules every rank of these tests imports first)
PRELOAD = ["torch", "torch.distributed", "monai", "monai.data", "monai.engines", "ignite.engine",
           "components.distributed"]


def rank_context() -> Any:
    """The multiprocessing context of the ranks: ``forkserver``, whose server imports :data:`PRELOAD` when it starts
    (once for the session). Each rank is a fork of that server's one thread, never of the test process (whose
    threads and held locks a fork would copy); as a spawned rank, it gets its parent's ``sys.path`` and working
    folder, and from :func:`run_ranks` its environment of the moment (the server's is that of its start)."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


@contextmanager
def hosted_store(timeout_s: float = 300) -> Iterator[int]:
    """A ``TCPStore`` server on 127.0.0.1 at a port the OS chose, bound for the whole ``with`` block; yields the
    port. Processes reach it as clients: ranks through :func:`run_ranks`, torchrun launchers through
    ``--rdzv_endpoint=127.0.0.1:PORT --rdzv_conf=is_host=false``."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    try:
        yield store.port
    finally:
        del store


def _as_client_rank(target: Callable, environ: dict[str, str], *args: Any) -> None:
    """``target(*args)`` in a rank that has the launcher's ``environ`` and reaches its store as a client (see the
    module docstring), with the platform's default start method for its own processes (its loader workers), as a
    rank that torchrun starts has it: a spawned or fork-server child inherits its parent's method instead."""
    import multiprocessing

    multiprocessing.set_start_method(None, force=True)
    os.environ.clear()
    os.environ.update(environ)
    os.environ[AGENT_STORE_ENV] = str(True)
    target(*args)


def run_ranks(ctx: Any, target: Callable, rank_args: Callable[[int, int], Sequence], world: int, timeout: float) -> list:
    """Starts ``world`` processes of ``ctx`` (a multiprocessing context) running ``target(*rank_args(rank, port))``
    and returns their exit codes (None: still running at ``timeout`` seconds, then killed).

    ``port`` is that of the store this process hosts for the ranks (:func:`hosted_store`); ``target`` sets it as
    ``MASTER_PORT`` (with ``MASTER_ADDR=127.0.0.1``) before ``init_distributed``. When one rank fails the others are
    killed at once instead of waiting for their process-group timeout, so a failing test reports in seconds.
    """
    with hosted_store(timeout) as port:
        environ = dict(os.environ)
        procs = [ctx.Process(target=_as_client_rank, args=(target, environ, *rank_args(rank, port)))
                 for rank in range(world)]  # fmt: skip
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
    """Runs the module-level function ``scenario(rank) -> dict`` on ``world`` gloo ranks of :func:`rank_context`
    (process-group timeout 60 s) and returns each rank's result; fails with the ranks' tracebacks when one of them
    failed."""
    from pathlib import Path

    import torch

    out = Path(out_dir)
    args = lambda rank, port: (scenario, rank, world, port, str(out))  # noqa: E731
    codes = run_ranks(rank_context(), _scenario_child, args, world, timeout)
    errors = "\n".join(f"--- {p.name} ---\n{p.read_text()}" for p in sorted(out.glob("*.err")))
    assert codes == [0] * world, errors or f"exit codes {codes} (timeout {timeout} s)"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
