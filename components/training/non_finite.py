"""Stopping a training run at a NaN / Inf loss, naming the first bad iteration, without a host sync per step.

:class:`StopOnNonFiniteLoss` guards any MONAI trainer (the finetuning bundles' ``SupervisedTrainer`` too): it stops
the run after a NaN / Inf training loss, naming the first bad iteration's epoch, loss parts and batch files, and
never lets a checkpoint saver write a state trained past it (:class:`~components.checkpoint.CheckpointEvents`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from monai.handlers import from_engine

from ..checkpoint.training_state import CheckpointEvents, register_checkpoint_events
from ..data.sources import NOT_TRACKED, batch_filenames
from ..distributed import all_reduce_mean
from ..errors import UserError
from .log_interval import log_filter

__all__ = ["NonFiniteLossError", "StopOnNonFiniteLoss"]


class NonFiniteLossError(UserError, RuntimeError):
    """The training loss became NaN or Inf; the message names the epoch, iteration, loss parts and batch files."""


def _as_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().reshape(-1)[0]) if value.numel() else float("nan")
    return float(value)


@dataclass
class _Seen:
    """What the error message needs of one iteration, kept until the next check: host values and device scalars."""

    epoch: int
    in_epoch: int
    epoch_length: int | None
    loss: torch.Tensor
    parts: dict[str, torch.Tensor]
    files: list[str] | None


class StopOnNonFiniteLoss:
    """Raises :class:`NonFiniteLossError` when a training loss was not finite, naming the first bad iteration.

    Every iteration updates an on-device record of the first iteration whose loss was NaN / Inf (a few tiny kernels,
    nothing read back to the host); it is read (on CUDA, one sync) only at the checks: every ``check_interval``
    iterations (the iterations that log, see :func:`~components.training.log_interval.log_filter`), at each epoch end (before
    validation) and before every checkpoint save (:class:`CheckpointEvents`). So with ``check_interval`` = the log
    interval an iteration costs no host sync, a NaN state is never saved or validated, and the run stops at most
    ``check_interval - 1`` iterations after the first bad one. With ``check_interval=1`` it stops at that iteration.
    Under DDP each check is one all-reduce of every rank's first bad iteration (on every rank, at the same
    iterations), so all ranks stop together; the message names the ranks whose own loss was bad, and only those
    ranks report it (:attr:`~components.errors.UserError.reporting_ranks`): their messages name their own batches.

    The loss is ``from_engine([loss_key], first=True)`` of the output (a PretrainingTrainer dict, or a MONAI
    trainer's list of per-sample dicts); its parts come from ``output[parts_key]`` when the trainer provides them
    (PretrainingTrainer's ``loss_parts``). The message holds the epoch, the iteration (global and within the
    epoch), the loss and its parts, and this rank's batch files at that iteration (:func:`batch_filenames`), or
    says that they are not tracked.

    Args:
        loss_key: key of the loss in the output dicts.
        parts_key: key of the dict of named loss parts in the output, when the trainer provides one.
        image_key: key of the image in the batch, for the file names.
        max_files: at most this many file names are listed.
        check_interval: read the record every this many iterations (1: at every iteration).

    Attach it to the trainer before the validation handler and the checkpoint savers of the same events.
    """

    def __init__(
        self,
        loss_key: str = "loss",
        parts_key: str = "loss_parts",
        image_key: str = "image",
        max_files: int = 32,
        check_interval: int = 1,
    ) -> None:
        self.due = log_filter(check_interval)
        self.check_interval = int(check_interval)
        self.loss_key, self.parts_key, self.image_key = loss_key, parts_key, image_key
        self.max_files = int(max_files)
        self._first_bad: torch.Tensor | None = None  # int64 scalar on the loss's device; 0: none yet
        self._seen: dict[int, _Seen] = {}

    def attach(self, engine: Engine) -> None:
        register_checkpoint_events(engine)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self.track)
        engine.add_event_handler(Events.ITERATION_COMPLETED(event_filter=self.due), self.check)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self.check)
        engine.add_event_handler(CheckpointEvents.BEFORE_SAVE, self.check)

    def _loss(self, output: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = from_engine([self.loss_key], first=True)(output)
        if loss is None:
            raise KeyError(
                f"StopOnNonFiniteLoss: no {self.loss_key!r} in the trainer output ({type(output).__name__}); "
                "set loss_key to the key of the loss."
            )
        first = output[0] if isinstance(output, (list, tuple)) and output else output
        parts = first.get(self.parts_key) if isinstance(first, Mapping) else None
        as_tensor = lambda v: (v if isinstance(v, torch.Tensor) else torch.tensor(float(v))).detach()  # noqa: E731
        return as_tensor(loss), {str(k): as_tensor(v) for k, v in (parts or {}).items()}

    def track(self, engine: Engine) -> None:
        """Folds this iteration's loss into the on-device record and keeps what a message would need."""
        loss, parts = self._loss(engine.state.output)
        state = engine.state
        if self._first_bad is None or self._first_bad.device != loss.device:
            self._first_bad = torch.zeros((), dtype=torch.int64, device=loss.device)
        bad = ~torch.isfinite(loss).all()
        self._first_bad = torch.where(bad & (self._first_bad == 0), state.iteration, self._first_bad)
        length = state.epoch_length or 0
        in_epoch = (state.iteration - 1) % length + 1 if length else state.iteration
        files = batch_filenames(state.batch, self.image_key)
        self._seen[state.iteration] = _Seen(state.epoch, in_epoch, state.epoch_length, loss, parts, files)

    def check(self, engine: Engine) -> None:
        """Reads the record (all ranks' under DDP); raises when any rank saw a non-finite loss."""
        if self._first_bad is None:
            return
        world, rank = idist.get_world_size(), idist.get_rank()
        if world > 1:
            own = torch.zeros(world, dtype=torch.float64, device=self._first_bad.device)
            own[rank] = self._first_bad
            per_rank = [int(round(v)) for v in (all_reduce_mean(own) * world).tolist()]
        else:
            per_rank = [int(self._first_bad)]
        bad_ranks = [r for r, iteration in enumerate(per_rank) if iteration > 0]
        if not bad_ranks:
            self._seen.clear()
            return
        iteration = min(per_rank[r] for r in bad_ranks)
        error = NonFiniteLossError(self._message(engine, iteration, bad_ranks))
        error.reporting_ranks = tuple(bad_ranks)  # a bad rank's message names its own batch (components.errors)
        raise error

    def _message(self, engine: Engine, iteration: int, bad_ranks: list[int]) -> str:
        seen = self._seen[iteration]
        loss = _as_float(seen.loss)
        world, rank = idist.get_world_size(), idist.get_rank()
        checked = min(self.check_interval, engine.state.iteration - iteration + 1)
        lines = [  # the first line is the same on every bad rank of equal loss: said once (components.errors)
            f"non-finite training loss {loss if rank in bad_ranks else 'on another rank'} at epoch {seen.epoch}, "
            f"iteration {iteration} (iteration {seen.in_epoch}/{seen.epoch_length or '?'} of the epoch)"
            + (f" on ranks {bad_ranks} of {world}." if world > 1 else ".")
        ]
        if iteration != engine.state.iteration:
            lines.append(
                f"found at iteration {engine.state.iteration} (checked every {self.check_interval} iterations, at "
                f"epoch ends and before checkpoints; {checked - 1} later iterations ran on)."
            )
        if seen.parts:
            lines.append("loss parts: " + ", ".join(f"loss_{k}={_as_float(v)}" for k, v in seen.parts.items()))
        if world > 1:
            lines.append(f"this rank's own loss: {loss}")
        if seen.files is None:
            lines.append(f"batch files: {NOT_TRACKED}")
        else:
            shown = seen.files[: self.max_files]
            more = f" (+{len(seen.files) - len(shown)} more)" if len(seen.files) > len(shown) else ""
            lines.append(f"batch files (rank {rank}): {shown}{more}")
        lines.append(
            "Check these volumes for NaN/Inf voxels or a wrong intensity range, lower the learning rate, or turn "
            "off fp16 AMP; resume from the last checkpoint (saved before this iteration) once fixed."
        )
        return "\n".join(lines)
