"""The iterations that log: one ignite event filter shared by the trainer, its stats handlers and the loss check."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["log_filter"]


def log_filter(log_interval: int) -> Callable[[Any, int], bool]:
    """The iterations that log, as an ignite event filter: 1, 1 + n, 1 + 2n, ... for ``log_interval`` n (the first
    iteration always, so a run shows progress at once). The trainer reduces its logged values at exactly these
    iterations; give the same filter to StatsHandler / TensorBoardStatsHandler as ``iteration_log``.

    Raises:
        ValueError: for an interval that is not a positive integer.

    Example:
        >>> [i for i in range(1, 25) if log_filter(10)(None, i)]
        [1, 11, 21]
    """
    try:  # a command line may pass "10"
        interval = int(log_interval)
        valid = not isinstance(log_interval, bool) and float(log_interval) == interval >= 1
    except (TypeError, ValueError):
        valid = False
    if not valid:
        raise ValueError(f"log_interval must be a positive integer, got {log_interval!r}.")
    return lambda engine, iteration: (iteration - 1) % interval == 0
