"""Writing resumable training checkpoints: :class:`ResumableCheckpointSaver` (one file with model, optimizer,
scheduler, scaler, progress and best metric, written atomically by iteration, epoch or time) and
:class:`BestModelSaver` (the best model by the key metric, whose record survives a restart).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from monai.handlers import CheckpointSaver

from ..config.values import is_null
from ..files import temp_prefix
from ..networks.wrappers import unwrap
from .training_state import (
    RESUME_FORMAT,
    CheckpointEvents,
    _batch_size,
    _check_interval,
    _engine_scaler,
    _plain,
    read_to_save,
    register_checkpoint_events,
    save_atomic,
)

__all__ = ["BestModelSaver", "ResumableCheckpointSaver"]

logger = logging.getLogger("components.checkpoint")  # one logger name for the whole package, as the logs show it

class ResumableCheckpointSaver:
    """Save everything needed to resume training to one file, atomically, every few epochs and/or iterations.

    The file (``ckpt_dir / filename``, overwritten in place with :func:`save_atomic`) holds plain tensors,
    numbers and dicts only (it loads with ``torch.load(weights_only=True)``)::

        {"format": "components.checkpoint/resumable-v1",
         "model": state dict of the network without DDP / torch.compile wrappers,
         "optimizer": ..., "lr_scheduler": ..., "scaler": ...,      # when given (None entries are skipped)
         "trainer": {"epoch", "iteration", "epoch_length", "max_epochs", "batch_size"},
         "sampler": {"seed", "shuffle", "num_samples", "epoch", "position"},  # when a sampler is given
         "recipe": state dict of a stateful recipe (e.g. a teacher and its centre),  # when a recipe is given
         "best_metric": ..., "best_metric_epoch": ..., "best_metric_iteration": ...}  # when an evaluator is given

    Only rank 0 writes (when ``torch.distributed`` is initialised). The ``"model"`` entry makes the file a valid
    source for :func:`load_pretrained` too.

    Why not MONAI's ``CheckpointSaver``: it writes with ``atomic=False`` (a kill mid-write destroys the previous
    checkpoint) and saves the trainer's ignite state without the evaluator's best metric; ignite's ``Checkpoint``
    with ``n_saved=1`` and a fixed file name removes the previous file *before* writing the new one. This class
    reuses ignite's event filters and adds its own atomic write.

    Args:
        ckpt_dir: directory of the checkpoint file (created if needed).
        to_save: what the file holds, by entry (:func:`~.training_state.read_to_save`; the same dict a
            :class:`~components.ResumeHandler` restores):

            - ``model``: the network (DDP / torch.compile wrappers are unwrapped); required.
            - ``optimizer``, ``lr_scheduler``: saved when given.
            - ``scaler``: an AMP ``GradScaler``; without it ``engine.scaler`` is saved if the engine has one (MONAI's
              trainers create their scaler in ``run()``).
            - ``evaluator``: an engine whose ``state.best_metric`` / ``state.best_metric_epoch`` (MONAI workflows)
              are saved, with the trainer iteration at which that best validation ran (``state.best_metric_iteration``,
              kept here).
            - ``sampler``: the training loader's :class:`~components.EpochShuffleSampler` (anything with
              ``state_dict(position)``): its order and the position inside the current epoch (samples already used:
              iterations of the epoch x the loader's ``batch_size``) are saved, so a restart continues the epoch.
            - ``recipe``: a pretraining recipe with state of its own (an ``nn.Module``, e.g.
              :class:`~components.SelfDistillationRecipe`: the teacher and the loss's centre).
        filename: file name in ``ckpt_dir``.
        epoch_interval: save every this many epochs (None: not on epochs).
        iteration_interval: save every this many iterations (None: not on iterations).
        time_interval_s: save when about this many seconds have passed since the last save (or the start), by rank
            0's clock (None: not by time). Every rank must save at the same iteration (the save's guards run
            collectives), so no rank reads its clock per iteration: rank 0 times the first
            ``calibration_iterations`` iterations, and from its seconds per iteration and the time left chooses the
            iteration of the next look at the clock, where it measures again (one small broadcast per look):
            it saves there once the interval has passed, never early, else looks again later.
        calibration_iterations: iterations timed before the first look at the clock.
        save_final: save when the run completes (a later run with a larger ``max_epochs`` can continue from it).

    With an ``evaluator`` the file is also written whenever a validation becomes the best, so the best metric it
    holds always describes ``model.pt`` (a resumed run replaces ``model.pt`` only by a strictly better one).

    Attach it *after* the validation handler of the same event, so that the best metric of the epoch just
    validated is in the file (ignite calls handlers of one event in the order they were attached).

    Example::

        to_save = {"model": net, "optimizer": optimizer, "lr_scheduler": scheduler, "evaluator": evaluator}
        ResumableCheckpointSaver("runs/ckpt", to_save).attach(trainer)
        ResumeHandler("runs/ckpt/checkpoint.pt", to_save).attach(trainer)
    """

    def __init__(
        self,
        ckpt_dir: str | os.PathLike,
        to_save: Mapping[str, Any],
        filename: str = "checkpoint.pt",
        epoch_interval: int | None = 1,
        iteration_interval: int | None = None,
        save_final: bool = True,
        time_interval_s: float | None = None,
        calibration_iterations: int = 10,
    ) -> None:
        self.objects = read_to_save(to_save, "ResumableCheckpointSaver")
        if not filename or Path(filename).name != filename:
            raise ValueError(f"ResumableCheckpointSaver: filename must be a plain file name, got {filename!r}.")
        self.epoch_interval = _check_interval("epoch_interval", epoch_interval)
        self.iteration_interval = _check_interval("iteration_interval", iteration_interval)
        self.calibration_iterations = _check_interval("calibration_iterations", calibration_iterations)
        time_interval_s = None if is_null(time_interval_s) else time_interval_s  # "null" from a command line
        if time_interval_s is not None and not (isinstance(time_interval_s, (int, float)) and time_interval_s > 0):
            raise ValueError(f"time_interval_s must be a positive number of seconds or None, got {time_interval_s!r}.")
        self.time_interval_s = None if time_interval_s is None else float(time_interval_s)
        intervals = (self.epoch_interval, self.iteration_interval, self.time_interval_s)
        if all(i is None for i in intervals) and not save_final and self.objects.evaluator is None:
            raise ValueError(
                "ResumableCheckpointSaver: nothing to do (no epoch_interval, iteration_interval, time_interval_s, "
                "save_final or evaluator)."
            )
        self.path = Path(ckpt_dir) / filename
        self.save_final = save_final
        self._last_saved: tuple | None = None
        self._trainer: Engine | None = None
        self._clock: tuple[int, float] | None = None  # (iteration, time) of the last time-based decision
        self._last_save_time: float | None = None  # rank 0's clock at the last save (or the run's first iteration)
        self._next_timed_save: int | None = None
        self.clock: Callable[[], float] = time.monotonic

    def attach(self, engine: Engine) -> None:
        self._trainer = engine
        register_checkpoint_events(engine)
        engine.add_event_handler(Events.STARTED, self._remove_stale_temps)
        evaluator = self.objects.evaluator
        if evaluator is not None:  # after the evaluator's own best-metric update (attached when it was built)
            evaluator.add_event_handler(Events.EPOCH_COMPLETED, self._note_best_iteration)
        if self.epoch_interval is not None:
            engine.add_event_handler(Events.EPOCH_COMPLETED(every=self.epoch_interval), self.save)
        if self.iteration_interval is not None:
            engine.add_event_handler(Events.ITERATION_COMPLETED(every=self.iteration_interval), self.save)
        if self.time_interval_s is not None:
            engine.add_event_handler(Events.ITERATION_COMPLETED, self._save_on_time)
        if self.save_final:
            engine.add_event_handler(Events.COMPLETED, self.save)

    def _save_on_time(self, engine: Engine) -> None:
        """At the iteration chosen last time, measures again (rank 0's clock, one broadcast) and saves when the
        interval has passed (within half an iteration), else chooses a later iteration. Every rank runs the same
        iterations and receives the same numbers, so all ranks save together."""
        iteration = engine.state.iteration
        if self._clock is None:  # the first iteration of this run (it includes start-up): the clock starts after it
            self._clock = (iteration, self.clock())
            self._last_save_time = self._last_save_time or self._clock[1]
            self._next_timed_save = iteration + self.calibration_iterations
            return
        if iteration < self._next_timed_save:
            return
        per_iteration, left = self._measure(iteration)
        if left <= per_iteration / 2:
            self.save(engine)
            left = self.time_interval_s
        self._next_timed_save = iteration + max(1, math.ceil(left / max(per_iteration, 1e-9)))

    def _measure(self, iteration: int) -> tuple[float, float]:
        """(seconds per iteration since the last measurement, seconds left of the interval), rank 0's, broadcast."""
        start_iteration, start = self._clock
        now = self.clock()
        self._clock = (iteration, now)
        per_iteration = (now - start) / max(iteration - start_iteration, 1)
        measured = torch.tensor([per_iteration, self.time_interval_s - (now - self._last_save_time)], dtype=torch.float64)
        per_iteration, left = idist.broadcast(measured, src=0).tolist()
        return per_iteration, left

    def _remove_stale_temps(self, engine: Engine | None = None) -> None:
        if idist.get_rank() > 0 or not self.path.parent.is_dir():
            return
        for leftover in self.path.parent.glob(f"{temp_prefix(self.path)}*.tmp"):
            try:
                leftover.unlink()
                logger.info("ResumableCheckpointSaver: removed the leftover of an interrupted save: %s", leftover)
            except OSError:
                pass

    def _note_best_iteration(self, evaluator: Engine) -> None:
        """The trainer iteration of a validation that just became the best (MONAI sets best_metric_epoch to it);
        the file is written at once, so its best metric describes the ``model.pt`` saved for that validation."""
        state = evaluator.state
        if self._trainer is not None and getattr(state, "best_metric_epoch", None) == state.epoch:
            state.best_metric_iteration = int(self._trainer.state.iteration)
            self.save(self._trainer)

    def _best(self) -> tuple[Any, Any, Any]:
        state = self.objects.evaluator.state  # type: ignore[union-attr]
        return (
            _plain(getattr(state, "best_metric", None)),
            _plain(getattr(state, "best_metric_epoch", None)),
            _plain(getattr(state, "best_metric_iteration", None)),
        )

    def _position(self, engine: Engine) -> int:
        """Samples of the current epoch already used: completed iterations of the epoch x the batch size."""
        state = engine.state
        in_epoch = state.iteration % state.epoch_length if state.epoch_length else 0
        if in_epoch == 0:
            return 0
        batch_size = _batch_size(engine)
        if batch_size is None:
            raise RuntimeError(
                "ResumableCheckpointSaver: a sampler was given but the trainer's data loader has no batch_size; "
                "the position inside the epoch cannot be saved."
            )
        return in_epoch * batch_size

    def checkpoint_dict(self, engine: Engine) -> dict[str, Any]:
        """The dict that :meth:`save` writes for the current state of ``engine``."""
        objects = self.objects
        state = engine.state
        ckpt: dict[str, Any] = {
            "format": RESUME_FORMAT,
            "model": unwrap(objects.model).state_dict(),
            "trainer": {
                "epoch": int(state.epoch),
                "iteration": int(state.iteration),
                "epoch_length": None if state.epoch_length is None else int(state.epoch_length),
                "max_epochs": None if state.max_epochs is None else int(state.max_epochs),
                "batch_size": _batch_size(engine),
            },
        }
        scaler = objects.scaler if objects.scaler is not None else _engine_scaler(engine)
        for name, obj in (("optimizer", objects.optimizer), ("lr_scheduler", objects.lr_scheduler), ("scaler", scaler)):
            if obj is not None:
                ckpt[name] = obj.state_dict()
        if objects.sampler is not None:
            ckpt["sampler"] = objects.sampler.state_dict(position=self._position(engine))
        if objects.recipe is not None:
            ckpt["recipe"] = objects.recipe.state_dict()
        if objects.evaluator is not None:
            ckpt["best_metric"], ckpt["best_metric_epoch"], ckpt["best_metric_iteration"] = self._best()
        return ckpt

    def save(self, engine: Engine) -> Path | None:
        """Write the checkpoint now (rank 0 only); returns the path written, None when skipped. Fires
        ``CheckpointEvents.BEFORE_SAVE`` on every rank first (a non-finite-loss guard raises there)."""
        register_checkpoint_events(engine)
        engine.fire_event(CheckpointEvents.BEFORE_SAVE)
        if idist.get_rank() > 0:
            return None
        marker = (engine.state.iteration, *(self._best() if self.objects.evaluator is not None else ()))
        if marker == self._last_saved and self.path.exists():
            return None  # same iteration and best metric already on disk (e.g. EPOCH_COMPLETED then COMPLETED)
        save_atomic(self.checkpoint_dict(engine), self.path)
        self._last_saved = marker
        self._last_save_time = self.clock()
        logger.info(
            "saved resumable checkpoint %s (epoch %s, iteration %s)",
            self.path,
            engine.state.epoch,
            engine.state.iteration,
        )
        return self.path



class BestModelSaver(CheckpointSaver):
    """MONAI's ``CheckpointSaver`` of the best model by the key metric (``save_key_metric=True``, one file), whose
    record of the best score survives a resume or a restart.

    MONAI's saver (an ignite ``Checkpoint`` with a score) keeps the best score in memory only: after a restart the
    first validation always overwrites ``model.pt``, even with a worse model. This one, when the first evaluation of
    this process starts, takes the best score from the evaluator's state, where
    :class:`ResumeHandler` restored ``best_metric`` / ``best_metric_epoch`` / ``best_metric_iteration`` from the
    resumable checkpoint, through MONAI's own ``load_state_dict``. ``model.pt`` is then replaced only by a strictly
    better validation (``key_metric_greater_or_equal=False``), and ``checkpoint.pt``'s best metric keeps describing it.
    If the evaluator has a best metric but the file is missing, the next validation writes it (logged at WARNING).

    Args:
        save_dir, save_dict: as for ``CheckpointSaver``.
        key_metric_filename: the best model's file name in ``save_dir``.
        key_metric_negative_sign: lower is better (the saved score is ``-metric``).
        kwargs: other ``CheckpointSaver`` arguments (``save_key_metric`` is always True).

    Attach it to the evaluator, like ``CheckpointSaver``.
    """

    def __init__(
        self,
        save_dir: str,
        save_dict: dict,
        key_metric_filename: str = "model.pt",
        key_metric_negative_sign: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs["save_key_metric"] = True
        super().__init__(
            save_dir,
            save_dict,
            key_metric_filename=key_metric_filename,
            key_metric_negative_sign=key_metric_negative_sign,
            **kwargs,
        )
        self.path = Path(save_dir) / key_metric_filename
        self.sign = -1.0 if key_metric_negative_sign else 1.0
        self.restore_pending = True  # until the first evaluation of this process starts

    def attach(self, engine: Engine) -> None:
        super().attach(engine)
        engine.add_event_handler(Events.STARTED, self.restore_best)

    def restore_best(self, engine: Engine) -> None:
        """Seed the saver's best score from ``engine.state`` at the first evaluation of this process, before the
        saver compared any score (MONAI's saver tells nothing of its record, so the first start is the marker)."""
        if not self.restore_pending:
            return
        self.restore_pending = False
        state = engine.state
        epoch, best = getattr(state, "best_metric_epoch", None), getattr(state, "best_metric", None)
        if epoch is None or best is None or int(epoch) < 1:
            return  # no validation before this run
        name = getattr(state, "key_metric_name", None) or "key metric"
        where = f"epoch {epoch}, iteration {getattr(state, 'best_metric_iteration', None)}"
        if not self.path.is_file():
            logger.warning(
                "BestModelSaver: the resumed best %s %s (%s) has no model file %s; the next validation writes it",
                name, best, where, self.path,
            )  # fmt: skip
            return
        self.load_state_dict({"_saved": [(self.sign * float(best), self.path.name)]})
        logger.info(
            "BestModelSaver: best model %s has %s %s (%s, restored from the resumed checkpoint); it is replaced only "
            "by a strictly better validation",
            self.path, name, best, where,
        )  # fmt: skip


