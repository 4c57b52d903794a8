"""Stop a self-distillation run whose teacher has collapsed, with a message that says so."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ignite.engine import Engine, Events

from ...training.log_interval import log_filter

__all__ = ["TeacherCollapseError", "StopOnCollapse"]

logger = logging.getLogger(__name__)


class TeacherCollapseError(RuntimeError):
    """The teacher's output entropy stayed at its minimum or maximum: the representation has collapsed."""


class StopOnCollapse:
    """Raises :class:`TeacherCollapseError` when the teacher's normalised output entropy stays outside
    ``[low, high]`` for ``patience`` consecutive log intervals.

    DINO's two failure modes show in this number (Caron et al., 2021, s5.3): sharpening without centring makes one
    prototype win for every input (entropy ~0), centring without sharpening makes the output uniform (entropy ~1,
    i.e. log K). Both also bring the student-teacher KL to ~0, and the run learns nothing from then on.

    Args:
        interval: the trainer's log interval: checks run at the iterations that log (``log_filter(interval)``).
        patience: consecutive checks out of range before stopping.
        low, high: the healthy range of ``teacher_entropy`` (entropy / log K).
        log_key, entropy_key: where the trainer's output holds the rank-averaged value (every rank reads the same
            value, so all ranks stop together).

    Attach to the trainer, before the checkpoint savers of ITERATION_COMPLETED.
    """

    def __init__(
        self,
        interval: int = 10,
        patience: int = 5,
        low: float = 0.001,
        high: float = 0.999,
        log_key: str = "log",
        entropy_key: str = "teacher_entropy",
    ) -> None:
        if int(interval) < 1 or int(patience) < 1:
            raise ValueError(f"interval and patience must be >= 1, got {interval} and {patience}.")
        if not 0.0 <= float(low) < float(high) <= 1.0:
            raise ValueError(f"need 0 <= low < high <= 1, got low={low}, high={high}.")
        self.interval, self.patience = int(interval), int(patience)
        self.low, self.high = float(low), float(high)
        self.log_key, self.entropy_key = log_key, entropy_key
        self.strikes = 0

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.ITERATION_COMPLETED(event_filter=log_filter(self.interval)), self)

    def __call__(self, engine: Engine) -> None:
        output = engine.state.output
        first = output[0] if isinstance(output, (list, tuple)) and output else output
        log = first.get(self.log_key) if isinstance(first, Mapping) else None
        if not isinstance(log, Mapping) or self.entropy_key not in log:
            raise KeyError(
                f"StopOnCollapse: the trainer output has no {self.log_key}[{self.entropy_key!r}] to check at iteration "
                f"{engine.state.iteration}: give it the trainer's log_interval (interval={self.interval})."
            )
        entropy = float(log[self.entropy_key])
        self.strikes = self.strikes + 1 if not self.low <= entropy <= self.high else 0
        if self.strikes < self.patience:
            return
        kind = "one prototype takes every input" if entropy < self.low else "the output is uniform"
        message = (
            f"the teacher has collapsed ({kind}): normalised output entropy {entropy:.4f} outside "
            f"[{self.low}, {self.high}] at {self.patience} consecutive checks (every {self.interval} iterations, "
            f"up to iteration {engine.state.iteration}, epoch {engine.state.epoch}); student-teacher KL "
            f"{float(log.get('kl', float('nan'))):.4g}. Check the teacher temperature and centring (center_momentum), "
            "lower the learning rate or raise the EMA momentum."
        )
        logger.error("StopOnCollapse: %s", message)
        raise TeacherCollapseError(message)
