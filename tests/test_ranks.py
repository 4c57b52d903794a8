"""tests/ranks.py: the ranks' rendezvous cannot race with another process for its port."""

from __future__ import annotations

import errno
import multiprocessing
import socket
from pathlib import Path

from tests.ranks import run_ranks, run_scenario


def _try_to_take_the_port(rank: int, port: int, out_dir: str) -> None:
    """What another process could do between the launcher choosing the port and rank 0 binding it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
            outcome = "bound"
        except OSError as err:
            outcome = "in use" if err.errno == errno.EADDRINUSE else f"error {err.errno}"
    Path(out_dir, f"rank{rank}.txt").write_text(outcome)


def test_the_rendezvous_port_is_held_by_the_launcher_until_the_ranks_are_done(tmp_path):
    """Before, the launcher asked the OS for a free port, closed it and handed its number over: any process could
    take it before rank 0 bound it. Now the launcher's store holds the port while the ranks run."""
    args = lambda rank, port: (rank, port, str(tmp_path))  # noqa: E731
    codes = run_ranks(multiprocessing.get_context("spawn"), _try_to_take_the_port, args, world=2, timeout=60)
    assert codes == [0, 0]
    assert [Path(tmp_path, f"rank{r}.txt").read_text() for r in (0, 1)] == ["in use", "in use"]


def _sum_of_ranks(rank: int) -> dict:
    import torch

    from components import distributed

    value = torch.tensor([float(rank + 1)])
    return {"mean": float(distributed.all_reduce_mean(value))}


def test_ranks_meet_through_the_launchers_store(tmp_path):
    """Two gloo ranks initialised by components.init_distributed (env://, clients of the launcher's store) reduce
    together: the mean of 1 and 2 on both."""
    results = run_scenario(_sum_of_ranks, tmp_path, world=2, timeout=120)
    assert [r["mean"] for r in results] == [1.5, 1.5]
