"""Resuming from a training checkpoint: :class:`ResumeHandler` restores model, optimizer, scheduler, scaler,
progress, the sampler's position and the best metric so that ignite continues where it stopped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Engine, Events
from torch import nn

from ..config.values import as_bool, optional_path
from ..errors import ConfigError
from ..networks.wrappers import unwrap
from .layouts import CheckpointLoadError, _strip_wrappers, read_checkpoint
from .training_state import (
    _batch_size,
    _differs,
    _engine_scaler,
    _written_with,
    read_to_save,
    restore_schedule,
)

__all__ = ["ResumeHandler", "check_resume", "resolve_resume"]

logger = logging.getLogger("components.checkpoint")  # one logger name for the whole package, as the logs show it

class ResumeHandler:
    """Restore a :class:`ResumableCheckpointSaver` file when the trainer starts, so ignite continues from it.

    At ``Events.STARTED`` (attach it to the trainer): loads the file with ``weights_only=True``, restores the
    model (strict), a stateful recipe's state (strict), the optimizer state, the LR schedule's position, the scaler,
    the evaluator's best metric
    (``best_metric``, ``best_metric_epoch``, ``best_metric_iteration``), the sampler's position inside the epoch,
    and sets ``trainer.state.iteration`` and ``trainer.state.epoch`` (completed epochs, ``iteration // epoch_length``).

    What follows this run's config rather than the file: ``max_epochs`` (it may be larger or smaller than the saved
    one), the LR schedule's settings (:func:`restore_schedule`: the step count comes from the file, ``t_total``,
    warm-up and base LR from this run, so the LR at every iteration equals that of an uninterrupted run with this
    run's ``max_epochs``) and the optimizer's hyperparameters (``lr``, ``weight_decay``, ...; its moments come from
    the file; changes are logged). What cannot be honoured raises: another ``epoch_length`` or ``batch_size``, or,
    with a sampler, another seed or shard size.

    ignite 0.5.5 semantics this relies on: ``Engine.run`` sets up its state (``epoch = iteration = 0``) *before*
    firing STARTED, and after STARTED loops ``while not _is_done(state): state.epoch += 1 ...``, taking the
    position inside the epoch from ``state.iteration % epoch_length`` when the data iterator is first set up;
    so values set at STARTED are where the run continues. If the checkpoint is already at or past ``max_epochs``,
    ignite runs no epoch and only COMPLETED fires (a warning is logged). A mid-epoch checkpoint
    (``iteration_interval``) continues that epoch: with ``sampler`` given, the loader yields the epoch's remaining
    batches in the uninterrupted order (:class:`~components.EpochShuffleSampler`); without it, the rest of that
    epoch sees the loader's first batches (logged at WARNING).

    Args:
        path: the checkpoint file; None, ``""``, ``"None"`` or ``"null"`` make the handler a no-op.
        to_save: the objects to restore, the dict :class:`ResumableCheckpointSaver` saves (``model``, ``optimizer``,
            ``lr_scheduler``, ``scaler``, ``evaluator``, ``sampler``, ``recipe``; ``model`` required). Every object
            given must have its entry in the file (the sampler excepted: a file without one is continued from the
            trainer's counters). Without a ``scaler``, ``engine.scaler`` is restored when the engine has one and the
            file has a ``scaler`` entry.
        map_location: for ``torch.load`` (optimizer states are moved to their parameters' devices by torch).
        missing_ok: a ``path`` that does not exist is skipped (logged) instead of raising, for "resume if there
            is a checkpoint" setups.
        auto_resume: with ``path`` None, continue from ``<ckpt_dir>/checkpoint.pt`` when it exists
            (:func:`~components.resolve_resume`; a restarted or relaunched run continues). ``"true"`` / ``"false"``
            strings are accepted (command-line overrides). A file found this way that cannot be continued raises an
            error that says it was auto-resumed, from which file, and how to start fresh.
        ckpt_dir: the folder ``auto_resume`` looks in (required with ``auto_resume``).

    After a resume, ``report`` holds what was restored (file, epoch, iteration, best metric and where it came
    from, schedule, changed optimizer settings); it is also logged at INFO, starting with one line that names the
    file, how it was chosen (given or auto_resume), its epoch and iteration and the settings it was written with.

    Raises:
        FileNotFoundError / CheckpointLoadError at STARTED: missing file, unreadable file, an entry missing from
        the file, a model that does not match it, a different ``epoch_length`` / ``batch_size`` / data order.
        Checked before anything is modified.
    """

    def __init__(
        self,
        path: str | os.PathLike | None,
        to_save: Mapping[str, Any],
        map_location: Any = "cpu",
        missing_ok: bool = False,
        auto_resume: bool | str = False,
        ckpt_dir: str | os.PathLike | None = None,
    ) -> None:
        self.objects = read_to_save(to_save, "ResumeHandler")
        auto_resume = as_bool(auto_resume, "auto_resume")
        if auto_resume and optional_path(ckpt_dir) is None:
            raise ConfigError("ResumeHandler: auto_resume needs ckpt_dir (the folder to look for checkpoint.pt in).")
        given = optional_path(path)
        path = resolve_resume(given, ckpt_dir, auto_resume) if auto_resume else given
        self.path = None if path is None else Path(path)
        self.auto = given is None and path is not None  # found by auto_resume, not asked for
        self.map_location = map_location
        self.missing_ok = missing_ok
        self.resumed = False
        self.report: dict[str, Any] = {}

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self)

    def _fail(self, msg: str) -> CheckpointLoadError:
        return _resume_error(self.path, self.auto, msg)

    def _check_model(self, module: nn.Module, state: Mapping, entry: str = "model") -> dict[str, torch.Tensor]:
        if not isinstance(state, Mapping):
            raise self._fail(f"entry {entry!r} is not a state dict ({type(state).__name__}).")
        state = {_strip_wrappers(k)[0]: v for k, v in state.items()}
        own = module.state_dict()
        missing = [k for k in own if k not in state]
        extra = [k for k in state if k not in own]
        shapes = [
            f"{k}: file {list(v.shape)} vs model {list(own[k].shape)}"
            for k, v in state.items()
            if k in own and isinstance(v, torch.Tensor) and tuple(v.shape) != tuple(own[k].shape)
        ]
        if missing or extra or shapes:
            raise self._fail(
                f"entry {entry!r} does not match the {'network' if entry == 'model' else entry} ({type(module).__name__}): {len(missing)} missing "
                f"{missing[:5]}, {len(extra)} unexpected {extra[:5]}, {len(shapes)} with another shape {shapes[:3]}. "
                "Resume needs the same architecture; use load_pretrained for weights of another model."
            )
        return state

    def _check_loop(self, engine: Engine, trainer: Any) -> tuple[int, int | None]:
        """(iteration, epoch_length) of the file, checked against this run's epoch length and batch size."""
        if not isinstance(trainer, Mapping) or "iteration" not in trainer:
            raise self._fail("entry 'trainer' has no 'iteration'.")
        saved_len, cur_len = trainer.get("epoch_length"), engine.state.epoch_length
        if cur_len is not None and saved_len is not None and int(saved_len) != int(cur_len):
            raise self._fail(
                f"it was written with epoch_length={saved_len} but this run has epoch_length={cur_len}; "
                "resuming needs the same number of iterations per epoch (same data and batch size per rank)."
            )
        saved_bs, cur_bs = trainer.get("batch_size"), _batch_size(engine)
        if saved_bs is not None and cur_bs is not None and int(saved_bs) != int(cur_bs):
            raise self._fail(
                f"it was written with batch_size={saved_bs} but this run has batch_size={cur_bs}; resuming needs "
                "the same batch size (the position inside the epoch and the schedule count batches)."
            )
        epoch_len = cur_len if cur_len is not None else saved_len
        return int(trainer["iteration"]), None if epoch_len is None else int(epoch_len)

    def _restore_optimizer(self, saved: Any) -> dict[str, str]:
        """Optimizer state from the file, hyperparameters from this run's config; returns those that changed."""
        assert self.objects.optimizer is not None
        configured = [{k: v for k, v in g.items() if k != "params"} for g in self.objects.optimizer.param_groups]
        self.objects.optimizer.load_state_dict(saved)
        changed: dict[str, str] = {}
        for i, (group, own) in enumerate(zip(self.objects.optimizer.param_groups, configured)):
            for key, value in own.items():
                if key not in ("lr", "initial_lr") and key in group and _differs(group[key], value):
                    changed[f"param_groups[{i}].{key}"] = f"{group[key]!r} -> {value!r}"
            group.update(own)
        return changed

    def _restore_sampler(self, ckpt: Mapping, engine: Engine, iteration: int, epoch_len: int | None) -> int:
        """Position of the sampler inside the current epoch (samples), from the file or the trainer's counters."""
        in_epoch = iteration % epoch_len if epoch_len else 0
        state = ckpt.get("sampler")
        if state is None:
            batch_size = _batch_size(engine) or 1
            state = {**self.objects.sampler.state_dict(), "epoch": iteration // epoch_len + 1 if epoch_len else 0,
                     "position": in_epoch * batch_size}  # fmt: skip
            logger.info("ResumeHandler: %s has no sampler entry; position taken from the iteration count", self.path)
        elif in_epoch == 0 and int(state.get("position", 0)):
            raise self._fail(f"entry 'sampler' is at position {state.get('position')} but the trainer at an epoch end.")
        try:
            self.objects.sampler.load_state_dict(state)
        except ValueError as err:
            raise self._fail(str(err)) from err
        return int(state.get("position", 0))

    def __call__(self, engine: Engine) -> None:
        objects = self.objects
        if self.path is None:
            logger.debug("ResumeHandler: no checkpoint path, starting from scratch")
            return
        if self.resumed:
            logger.debug("ResumeHandler: already resumed from %s in this process; not reloading", self.path)
            return
        if not self.path.exists() and self.missing_ok:
            logger.info("ResumeHandler: %s does not exist (missing_ok=True), starting from scratch", self.path)
            return
        try:
            ckpt = read_checkpoint(self.path, self.map_location)
        except CheckpointLoadError as err:
            raise self._fail(str(err)) from err
        if not isinstance(ckpt, Mapping):
            raise self._fail(f"expected a dict written by ResumableCheckpointSaver, got {type(ckpt).__name__}.")

        engine_scaler = _engine_scaler(engine)
        scaler = objects.scaler if objects.scaler is not None else (engine_scaler if "scaler" in ckpt else None)
        needed = ["model", "trainer"]
        needed += [n for n, o in (("optimizer", objects.optimizer), ("lr_scheduler", objects.lr_scheduler)) if o is not None]
        needed += ["recipe"] if objects.recipe is not None else []
        if objects.scaler is not None:
            needed.append("scaler")
        if objects.evaluator is not None:
            needed += ["best_metric", "best_metric_epoch"]
        absent = [n for n in needed if n not in ckpt]
        if absent:
            raise self._fail(
                f"missing entr{'y' if len(absent) == 1 else 'ies'} {absent} (the file has {sorted(map(str, ckpt))}). "
                "Was it written by ResumableCheckpointSaver with the same objects (optimizer, lr_scheduler, scaler, "
                "evaluator)?"
            )
        if engine_scaler is not None and objects.scaler is None and "scaler" not in ckpt:
            logger.warning(
                "ResumeHandler: %s has no scaler state (AMP off before?); the scaler starts fresh", self.path
            )

        iteration, epoch_len = self._check_loop(engine, ckpt["trainer"])
        epoch = iteration // epoch_len if epoch_len else int(ckpt["trainer"].get("epoch", 0))
        module = unwrap(objects.model)
        model_state = self._check_model(module, ckpt["model"])
        recipe_state = self._check_model(objects.recipe, ckpt["recipe"], "recipe") if objects.recipe is not None else None
        if objects.optimizer is not None:
            groups = ckpt["optimizer"].get("param_groups", []) if isinstance(ckpt["optimizer"], Mapping) else []
            own = objects.optimizer.state_dict()["param_groups"]
            if [len(g["params"]) for g in groups] != [len(g["params"]) for g in own]:
                raise self._fail(
                    "entry 'optimizer' has parameter groups of sizes "
                    f"{[len(g['params']) for g in groups]}, the optimizer {[len(g['params']) for g in own]}."
                )
        position = self._restore_sampler(ckpt, engine, iteration, epoch_len) if objects.sampler is not None else None

        # everything checked: restore
        module.load_state_dict(model_state, strict=True)
        if recipe_state is not None:
            objects.recipe.load_state_dict(recipe_state, strict=True)
        report: dict[str, Any] = {"path": str(self.path), "auto": self.auto, "epoch": epoch, "iteration": iteration}
        report["written_with"] = _written_with(ckpt)
        if objects.optimizer is not None:
            report["optimizer_changed"] = self._restore_optimizer(ckpt["optimizer"])
        if objects.lr_scheduler is not None:
            report["lr_schedule"] = restore_schedule(objects.lr_scheduler, ckpt["lr_scheduler"])
        if scaler is not None and "scaler" in ckpt:
            scaler.load_state_dict(ckpt["scaler"])
        if objects.evaluator is not None:
            for key in ("best_metric", "best_metric_epoch", "best_metric_iteration"):
                if ckpt.get(key) is not None:
                    setattr(objects.evaluator.state, key, ckpt[key])
            report.update({k: ckpt.get(k) for k in ("best_metric", "best_metric_epoch", "best_metric_iteration")})
        if engine.state.epoch_length is None and epoch_len is not None:
            engine.state.epoch_length = epoch_len
        engine.state.iteration = iteration
        engine.state.epoch = epoch
        self.resumed = True
        report["sampler_position"] = position
        self.report = report
        self._log(engine, report, epoch_len)

    def _log(self, engine: Engine, report: dict[str, Any], epoch_len: int | None) -> None:
        epoch, iteration = report["epoch"], report["iteration"]
        how = "found by auto_resume; --checkpointing#auto_resume false or another --ckpt_dir starts fresh" if self.auto else "given"
        settings = ", ".join(f"{k}={v}" for k, v in report["written_with"].items())
        logger.info(
            "resumed from %s (%s) at epoch %d, iteration %d; it was written with %s",
            self.path, how, epoch, iteration, settings or "no recorded settings",
        )  # fmt: skip
        if self.objects.evaluator is not None:
            name = getattr(self.objects.evaluator.state, "key_metric_name", None) or "key metric"
            if report.get("best_metric_epoch") in (None, -1):
                logger.info("ResumeHandler: no validation in the checkpoint yet: no best %s restored", name)
            else:
                logger.info(
                    "ResumeHandler: restored best %s %s (epoch %s, iteration %s): the model saved then stays the best "
                    "until a strictly better validation",
                    name, report["best_metric"], report["best_metric_epoch"], report.get("best_metric_iteration"),
                )  # fmt: skip
        if self.objects.lr_scheduler is not None:
            optimizer = getattr(self.objects.lr_scheduler, "optimizer", self.objects.optimizer)
            lrs = [group["lr"] for group in optimizer.param_groups] if optimizer is not None else None
            step = getattr(self.objects.lr_scheduler, "last_epoch", None)
            if report["lr_schedule"] == "position":
                names = [k for k in ("warmup_steps", "t_total") if hasattr(self.objects.lr_scheduler, k)]
                settings = {k: getattr(self.objects.lr_scheduler, k) for k in names}
                logger.info(
                    "ResumeHandler: LR schedule continues at step %s with this run's settings %s: lr %s",
                    step, settings, lrs,
                )  # fmt: skip
            else:
                logger.info("ResumeHandler: LR schedule restored whole from the checkpoint at step %s: lr %s", step, lrs)
        for key, change in report.get("optimizer_changed", {}).items():
            logger.info("ResumeHandler: optimizer %s from this run's config (checkpoint -> config)", f"{key}: {change}")
        in_epoch = iteration % epoch_len if epoch_len else 0
        if in_epoch:
            left = epoch_len - in_epoch  # type: ignore[operator]
            if self.objects.sampler is not None:
                logger.info(
                    "ResumeHandler: the checkpoint is mid-epoch (iteration %d of epoch %d): the remaining %d "
                    "iterations continue the epoch's order from sample %d",
                    in_epoch, epoch + 1, left, report["sampler_position"],
                )  # fmt: skip
            else:
                logger.warning(
                    "ResumeHandler: the checkpoint is mid-epoch (iteration %d of epoch %d) and no sampler was given: "
                    "the remaining %d iterations of that epoch start again from the loader's first batches",
                    in_epoch, epoch + 1, left,
                )  # fmt: skip
        max_epochs = engine.state.max_epochs
        if max_epochs is not None and epoch >= max_epochs:
            logger.warning(
                "ResumeHandler: %s is at epoch %d >= max_epochs=%d: nothing left to train; raise max_epochs to "
                "continue%s",
                self.path,
                epoch,
                max_epochs,
                " (it was found by auto_resume: --checkpointing#auto_resume false or another --ckpt_dir starts fresh)" if self.auto else "",
            )


def _resume_error(path: str | os.PathLike | None, auto: bool, msg: str) -> CheckpointLoadError:
    """Why the checkpoint at ``path`` cannot be continued; ``auto``: it was found by auto_resume, say how to start
    fresh."""
    if auto:
        return CheckpointLoadError(
            f"auto_resume found '{path}' (a checkpoint an earlier run left in ckpt_dir) but cannot continue "
            f"it: {msg} To start fresh, pass --checkpointing#auto_resume false or another --ckpt_dir (or remove that file)."
        )
    return CheckpointLoadError(f"resume checkpoint '{path}': {msg}")


def check_resume(
    resume: str | os.PathLike | None, ckpt_dir: str | os.PathLike, auto_resume: bool | str = True
) -> str | None:
    """Checks, before any data is read, that the checkpoint :class:`ResumeHandler` will continue from (``resume``,
    or with ``auto_resume`` ``<ckpt_dir>/checkpoint.pt`` when it exists: :func:`resolve_resume`) can be read, from
    its memory-mapped file (its tensors are not read). Its entries are checked against the model when the trainer
    starts. Returns that path, or None (a fresh start).

    Raises:
        FileNotFoundError / CheckpointLoadError: a missing, truncated or corrupt file, the latter saying how to
            start fresh when auto_resume found it.

    Example (``initialize`` of a bundle config)::

        "$components.check_resume(@checkpointing#resume, @ckpt_dir, @checkpointing#auto_resume)"
    """
    given = optional_path(resume)
    path = resolve_resume(given, ckpt_dir, True) if as_bool(auto_resume, "auto_resume") else given
    if path is not None:
        try:
            read_checkpoint(path, "cpu", mmap=True)
        except CheckpointLoadError as err:
            raise _resume_error(path, given is None, str(err)) from err
    return path


def resolve_resume(
    resume: str | os.PathLike | None,
    ckpt_dir: str | os.PathLike,
    auto_resume: bool = True,
    filename: str = "checkpoint.pt",
) -> str | None:
    """The checkpoint a training run resumes from, logged: ``resume`` when given; else, with ``auto_resume``,
    ``<ckpt_dir>/<filename>`` when it exists (a restarted or re-launched run continues where it stopped);
    else None (start from scratch)."""
    if optional_path(resume) is not None:
        logger.info("resume: from %s (given)", resume)
        return str(resume)
    candidate = Path(ckpt_dir) / filename
    if not auto_resume:
        if candidate.is_file():
            logger.info("resume: auto_resume is off; starting from scratch although %s exists", candidate)
        else:
            logger.info("resume: starting from scratch (auto_resume off)")
        return None
    if candidate.is_file():
        logger.info("resume: auto_resume found %s; resuming from it", candidate)
        return str(candidate)
    logger.info("resume: no %s yet; starting from scratch", candidate)
    return None
