"""Progress a person can read during long steps: the run's ETA in the training log line, per-volume progress with
elapsed time and ETA in evaluation and inference.

MONAI's ``StatsHandler`` logs the epoch, the iteration and the losses but not how long the run still takes, and an
evaluation over full volumes prints nothing until its end. :class:`StatsWithEta` is ``StatsHandler`` with
``elapsed`` and ``ETA`` appended to its iteration line; :class:`VolumeProgress` shows an ignite ``ProgressBar``
(tqdm: elapsed and remaining time) on a terminal and, where output is not a terminal (a log file, a batch job), where
a bar would only write carriage returns into the log, one INFO line per volume instead. Both are active on rank 0
only, as the bundles' other loggers.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TextIO

from ignite.engine import Engine, Events
from monai.handlers import StatsHandler, from_engine

from ..config.values import as_bool
from ..distributed import get_rank
from .log_interval import log_filter

__all__ = ["RankLossStats", "StatsWithEta", "VolumeProgress", "loss_and_lr", "remaining_seconds"]

logger = logging.getLogger(__name__)


def remaining_seconds(done: int, total: int, elapsed_s: float) -> float | None:
    """The time the ``total - done`` steps left take at the mean pace of the ``done`` ones; None before the first."""
    return None if done <= 0 else elapsed_s / done * max(total - done, 0)


class _Suffixed(logging.LoggerAdapter):
    """A logger whose messages end with ``suffix``."""

    def __init__(self, wrapped: logging.Logger, suffix: str) -> None:
        super().__init__(wrapped, {})
        self.suffix = suffix

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"{msg} -- {self.suffix}", kwargs


def loss_and_lr(optimizer: Any) -> Callable[[Any], dict[str, float]]:
    """The ``output_transform`` of the finetuning bundles' training stats: the iteration's loss (``train_loss``) and
    the learning rate of the optimizer's first parameter group (``lr``)."""
    loss = from_engine(["loss"], first=True)
    return lambda output: {"train_loss": loss(output), "lr": optimizer.param_groups[0]["lr"]}


class StatsWithEta(StatsHandler):
    """MONAI's ``StatsHandler`` whose iteration line ends with the run's elapsed time and ETA, e.g.
    ``Epoch: 3/50, Iter: 2/4 -- train_loss: 0.4123 -- elapsed 0:01:10, ETA 0:26:50``.

    The pace is measured over the iterations this process ran (a resumed run does not count the time before the
    restart, and validations in between are part of the pace), and the ETA covers the iterations left to
    ``max_epochs``. Arguments as ``StatsHandler``.
    """

    def __init__(self, *args: Any, clock: Callable[[], float] = time.monotonic, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.clock = clock
        self._start: tuple[float, int] | None = None

    def attach(self, engine: Engine) -> None:
        super().attach(engine)
        engine.add_event_handler(Events.ITERATION_STARTED, self._mark_start)

    def _mark_start(self, engine: Engine) -> None:
        """The first iteration this process runs (the iteration count is already the restored one on a resume)."""
        if self._start is None:
            self._start = (self.clock(), engine.state.iteration - 1)

    def eta_text(self, engine: Engine) -> str:
        """``elapsed h:mm:ss, ETA h:mm:ss`` (``datetime.timedelta``'s text) at the current iteration of ``engine``."""
        start_time, start_iteration = self._start if self._start is not None else (self.clock(), engine.state.iteration)
        elapsed = self.clock() - start_time
        total = int(engine.state.max_epochs or 0) * int(engine.state.epoch_length or 0)
        left = remaining_seconds(engine.state.iteration - start_iteration, total - start_iteration, elapsed)
        eta = "unknown" if left is None else timedelta(seconds=round(left))
        return f"elapsed {timedelta(seconds=round(elapsed))}, ETA {eta}"

    def iteration_completed(self, engine: Engine) -> None:
        """MONAI's iteration line, logged through a logger that appends :meth:`eta_text`."""
        plain = self.logger
        self.logger = _Suffixed(plain, self.eta_text(engine))
        try:
            super().iteration_completed(engine)
        finally:
            self.logger = plain


class RankLossStats(StatsHandler):
    """Each rank's own training loss, ``rank<r>_loss``, at the iterations that log (a multi-GPU run logs the loss of
    rank 0 otherwise); attached only with ``enabled`` (the bundles' ``log_per_rank``, command-line words accepted).

    Args:
        enabled: log, else :meth:`attach` attaches nothing.
        log_interval: as :func:`~components.training.log_interval.log_filter`.
        name: the logger's name, to which ``.rank<r>`` is added.

    Example (``multi_gpu_train.json``)::

        "+train#handlers": [{"_target_": "components.RankLossStats", "enabled": "@log_per_rank",
                             "log_interval": "@training#log_interval", "name": "ssl_train"}]
    """

    def __init__(self, enabled: bool | str, log_interval: int, name: str) -> None:
        rank = get_rank()
        loss = from_engine(["loss"], first=True)
        super().__init__(name=f"{name}.rank{rank}", iteration_log=log_filter(log_interval), epoch_log=False,
                         output_transform=lambda output: {f"rank{rank}_loss": loss(output)})  # fmt: skip
        self.enabled = as_bool(enabled, "log_per_rank")

    def attach(self, engine: Engine) -> None:
        if self.enabled:
            super().attach(engine)


class VolumeProgress:
    """Per-volume progress of an evaluation or inference run (one volume per iteration), on rank 0.

    On a terminal: ignite's ``ProgressBar`` (``[i/N] ... [elapsed<remaining]``). Otherwise one line per volume at
    INFO: ``volume 3/10 done (12.1 s) -- elapsed 0:00:37, ETA 0:01:26``.

    Args:
        stream: where the bar goes (default ``sys.stderr``); its ``isatty()`` picks the bar or the lines.
        clock: the time source (seconds), for tests.

    Example (an evaluator's handlers in a bundle config)::

        {"_target_": "components.VolumeProgress"}
    """

    def __init__(self, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.clock = clock
        self._started = 0.0
        self._last = 0.0

    def attach(self, engine: Engine) -> None:
        if get_rank() > 0:
            return
        stream = sys.stderr if self.stream is None else self.stream
        if stream.isatty():
            from ignite.handlers import ProgressBar

            ProgressBar(persist=True, file=stream, desc="volumes").attach(engine)
            return
        engine.add_event_handler(Events.EPOCH_STARTED, self._start)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._log_volume)

    def _start(self, engine: Engine) -> None:
        self._started = self._last = self.clock()

    def _log_volume(self, engine: Engine) -> None:
        now = self.clock()
        done = (engine.state.iteration - 1) % engine.state.epoch_length + 1 if engine.state.epoch_length else engine.state.iteration
        total = engine.state.epoch_length or done
        left = remaining_seconds(done, total, now - self._started)
        logger.info("volume %d/%d done (%.1f s) -- elapsed %s, ETA %s", done, total, now - self._last,
                    timedelta(seconds=round(now - self._started)), timedelta(seconds=round(left or 0.0)))  # fmt: skip
        self._last = now
