"""TensorBoard pictures of what a recipe's network sees and makes, from the first batch of each validation.

A recipe's picture handler says only what its picture is (:meth:`ValidationPictures.picture`); when it is taken
(the first batch of every evaluation), on which rank (0) and where it goes (a ``SummaryWriter`` under ``log_dir``,
the evaluation's epoch as the step, which MONAI's ``ValidationHandler`` sets to the trainer's) is shared here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from torch.utils.tensorboard import SummaryWriter


__all__ = ["ValidationPictures"]


class ValidationPictures(ABC):
    """Writes :meth:`picture` of the first validation batch to TensorBoard after each evaluation. Attach to the
    evaluator; only rank 0 writes.

    Args:
        log_dir: the TensorBoard folder.
        tag: the picture's tag.
    """

    def __init__(self, log_dir: str, tag: str) -> None:
        self.log_dir = log_dir
        self.tag = tag
        self._writer: SummaryWriter | None = None
        self._picture: torch.Tensor | None = None

    @abstractmethod
    def picture(self, output: Any) -> torch.Tensor:
        """The picture of an evaluator's output: ``(1, H, W)`` with values in [0, 1]."""

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.ITERATION_COMPLETED(once=1), self._capture)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self._write)

    def _capture(self, engine: Engine) -> None:
        self._picture = self.picture(engine.state.output)

    def _write(self, engine: Engine) -> None:
        if self._picture is None or idist.get_rank() != 0:
            return
        if self._writer is None:
            self._writer = SummaryWriter(log_dir=self.log_dir)
        self._writer.add_image(self.tag, self._picture, global_step=engine.state.epoch)
        self._writer.flush()
        self._picture = None
