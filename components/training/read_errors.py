"""The stored volumes a run could not read and skipped (``loader#on_read_error`` "skip"), told once per epoch with the
run's total over loader workers and ranks, and capped by ``loader#max_read_errors``.

A :class:`~components.data.store.StoreDataset` counts its skips in memory shared with its loader workers
(:class:`~components.data.store.read_errors.ReadErrors`) and names each unreadable volume once, where it fails.
:class:`SkippedReads` reads those counts in the training process: at the end of every epoch it sums them over the
ranks (one ``all_reduce`` of two numbers, on every rank), logs one line on rank 0 when any read was skipped so far,
and keeps the totals in the trainer's metrics (``store_skipped_reads``, ``store_unreadable_volumes``: the
TensorBoard / MLflow handlers and the epoch's metrics line show them). The cap is checked after every iteration
against this rank's own count (a rank over the cap is a run over it) and at the end of every epoch against the run's.
"""

from __future__ import annotations

import logging
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events

from ..data.store import StoreError
from ..errors import ConfigError

__all__ = ["SkippedReads"]

logger = logging.getLogger("components.data")  # the store's log lines under one name

#: the trainer's metrics that hold the run's totals
READS_METRIC, VOLUMES_METRIC = "store_skipped_reads", "store_unreadable_volumes"
_EXAMPLES = 3  # volumes a refusal names


class SkippedReads:
    """Tells and caps the reads of stored volumes a training run skipped (see the module docstring).

    Args:
        dataset: the training dataset (``train#dataset``). Anything but a ``StoreDataset`` that skips unreadable
            volumes (``on_read_error`` "skip") attaches nothing: there is nothing to count.
        max_read_errors: the most stored volumes that may fail to read over the run (each counted once, however
            often it is drawn) before the run stops with a ``StoreError`` in one line; None: no limit.

    Raises:
        ConfigError: ``max_read_errors`` neither None nor an integer >= 0.

    Example (a bundle's ``train#handlers``, on every rank)::

        {"_target_": "components.SkippedReads", "dataset": "@train#dataset",
         "max_read_errors": "@loader#max_read_errors"}
    """

    def __init__(self, dataset: Any, max_read_errors: int | None = None) -> None:
        if max_read_errors is not None and (isinstance(max_read_errors, bool) or not isinstance(max_read_errors, int)
                                            or max_read_errors < 0):  # fmt: skip
            raise ConfigError(f"loader#max_read_errors must be null or an integer >= 0, got {max_read_errors!r}.")
        self.dataset = dataset
        self.max_read_errors = max_read_errors
        self._seen = 0  # this rank's count at its last check
        self._run_reads = 0  # the run's total at the end of the last epoch

    @property
    def active(self) -> bool:
        """Whether the dataset skips unreadable stored volumes, so that there is something to count."""
        return getattr(self.dataset, "on_read_error", None) == "skip" and hasattr(self.dataset, "skipped_reads")

    def attach(self, engine: Engine) -> None:
        if not self.active:
            return
        engine.add_event_handler(Events.ITERATION_COMPLETED, self.check_rank)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self.epoch_completed)

    def check_rank(self, engine: Engine) -> None:
        """Stops the run once this rank alone has more unreadable volumes than the cap."""
        reads = self.dataset.skipped_reads
        if reads == self._seen or self.max_read_errors is None:
            return
        self._seen = reads
        volumes = self.dataset.unreadable_volumes()
        if len(volumes) > self.max_read_errors:
            raise self._exceeded(len(volumes), f"on rank {idist.get_rank()}", volumes)

    def epoch_completed(self, engine: Engine) -> None:
        """Sums the counts over the ranks, logs the epoch's line on rank 0, sets the metrics, checks the cap."""
        volumes = self.dataset.unreadable_volumes()
        counts = idist.all_reduce(torch.tensor([self.dataset.skipped_reads, len(volumes)]))  # summed over the ranks
        run_reads, run_volumes = (int(n) for n in counts.tolist())
        epoch_reads, self._run_reads = run_reads - self._run_reads, run_reads
        engine.state.metrics[READS_METRIC] = run_reads
        engine.state.metrics[VOLUMES_METRIC] = run_volumes
        cap = "no limit" if self.max_read_errors is None else self.max_read_errors
        if run_reads and idist.get_rank() == 0:
            logger.warning("loader#on_read_error skip: %d read(s) of unreadable stored volumes skipped in epoch %d, %d "
                           "in the run, of %d volume(s) over %d rank(s) (loader#max_read_errors: %s)", epoch_reads,
                           engine.state.epoch, run_reads, run_volumes, idist.get_world_size(), cap)  # fmt: skip
        if self.max_read_errors is not None and run_volumes > self.max_read_errors:
            raise self._exceeded(run_volumes, f"over {idist.get_world_size()} rank(s)", volumes)

    def _exceeded(self, count: int, where: str, examples: list[str]) -> StoreError:
        named = ", ".join(examples[:_EXAMPLES]) + (", ..." if len(examples) > _EXAMPLES else "")
        root = self.dataset.root
        return StoreError(
            f"{count} stored volume(s) could not be read {where}, more than loader#max_read_errors "
            f"{self.max_read_errors} (e.g. {named or 'on another rank'}): {root} is damaged; "
            f"components.open_store('{root}').verify() names every corrupt file: remove their volume folders and run "
            f"`{self.dataset.rebuild_command}`, which writes them again"
        )
