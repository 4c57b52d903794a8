"""What a resumable training checkpoint holds and how it is written and restored: the file's format, the
atomic write, the learning-rate schedule's restoring, and the small helpers the saver and the resume handler share.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Engine, EventEnum
from torch.optim.lr_scheduler import LambdaLR

from ..config.values import is_null
from ..errors import ConfigError
from ..files import atomic_write

__all__ = ["RESUME_FORMAT", "CheckpointEvents", "register_checkpoint_events", "restore_schedule", "save_atomic"]

logger = logging.getLogger("components.checkpoint")  # one logger name for the whole package, as the logs show it

def save_atomic(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj, path)`` so that ``path`` holds either the previous file or the complete new one.

    Written through :func:`components.files.atomic_write` (temporary file, ``fsync``, ``os.replace``, directory
    ``fsync``). A killed process leaves a ``.<name>.<random>.tmp`` behind, never a partial ``path``
    (:class:`ResumableCheckpointSaver` removes such leftovers of its file at start). Why not ignite's
    ``DiskSaver(atomic=True)``: see :mod:`components.files`; through ``Checkpoint`` it also insists on its own
    file naming and retention.
    """
    path = Path(path)
    with atomic_write(path) as f:
        torch.save(obj, f)
    return path


#: the entries of a ``to_save`` dict, named as in the checkpoint file (``model`` is required)
TO_SAVE_KEYS = ("model", "optimizer", "lr_scheduler", "scaler", "evaluator", "sampler", "recipe")


@dataclass(frozen=True)
class TrainingObjects:
    """The objects of one ``to_save`` dict, one per :data:`TO_SAVE_KEYS` entry (None where absent): what
    :class:`~.saver.ResumableCheckpointSaver` saves and :class:`~.resume.ResumeHandler` restores."""

    model: torch.nn.Module
    optimizer: Any = None
    lr_scheduler: Any = None
    scaler: Any = None
    evaluator: Engine | None = None
    sampler: Any = None
    recipe: torch.nn.Module | None = None


def read_to_save(to_save: Mapping[str, Any], owner: str) -> TrainingObjects:
    """The checked objects of one ``to_save`` dict (as ignite's ``Checkpoint`` and MONAI's ``CheckpointSaver`` take
    them), written once in a config for the saver and the resume handler both.

    Raises:
        ConfigError: ``to_save`` is not a mapping, has a key outside :data:`TO_SAVE_KEYS`, or no ``model``.
        TypeError: ``model`` or ``recipe`` is not an ``nn.Module``; an optimizer, schedule, scaler or sampler has no
            ``state_dict`` / ``load_state_dict``.
    """
    if not isinstance(to_save, Mapping):
        raise ConfigError(f"{owner}: to_save must be a dict of {', '.join(TO_SAVE_KEYS)}, "
                          f"got {type(to_save).__name__}.")
    unknown = sorted(set(to_save) - set(TO_SAVE_KEYS))
    if unknown:
        raise ConfigError(f"{owner}: to_save has {unknown}; its keys are {', '.join(TO_SAVE_KEYS)}.")
    objects = {key: to_save.get(key) for key in TO_SAVE_KEYS}
    for key in ("model", "recipe"):
        if objects[key] is not None and not isinstance(objects[key], torch.nn.Module):
            raise TypeError(f"{owner}: to_save[{key!r}] must be a torch.nn.Module, got {type(objects[key]).__name__}.")
    if objects["model"] is None:
        raise ConfigError(f"{owner}: to_save needs a 'model' (the network).")
    for key in ("optimizer", "lr_scheduler", "scaler", "sampler"):
        obj = objects[key]
        if obj is not None and not all(callable(getattr(obj, m, None)) for m in ("state_dict", "load_state_dict")):
            raise TypeError(f"{owner}: to_save[{key!r}] has no state_dict() / load_state_dict() "
                            f"({type(obj).__name__}).")
    return TrainingObjects(**objects)


def _plain(value: Any) -> Any:
    """Numbers as Python numbers (numpy scalars and one-element tensors included) for ``weights_only`` loading."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().item() if value.numel() == 1 else value.detach().cpu()
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return value.item()
    return value


def _engine_scaler(engine: Engine | None) -> Any:
    return getattr(engine, "scaler", None) if engine is not None else None


def _batch_size(engine: Engine) -> int | None:
    """The batch size of the trainer's data loader (MONAI's ``data_loader`` or ignite's ``state.dataloader``)."""
    loader = getattr(engine, "data_loader", None) or getattr(engine.state, "dataloader", None)
    size = getattr(loader, "batch_size", None)
    return None if size is None else int(size)


def _differs(a: Any, b: Any) -> bool:
    try:
        return bool(a != b)
    except (RuntimeError, TypeError, ValueError):  # tensors of several elements
        return not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b))


def restore_schedule(scheduler: Any, saved: Mapping[str, Any]) -> str:
    """Continue ``scheduler``, configured by *this* run, at the step count of ``saved`` (its ``state_dict()``).

    ``LRScheduler.load_state_dict`` would bring back the whole saved ``__dict__``: for MONAI's
    ``WarmupCosineSchedule`` that is the old ``t_total`` and ``warmup_steps``, so a run resumed with a larger
    ``max_epochs`` reaches LR 0 at the old end and climbs back up after it. For a ``LambdaLR`` (MONAI's schedules
    among them), whose LR is ``base_lr * lambda(step)``, only the step counters are restored and the LR of that step
    is recomputed from the current settings. Other schedulers are restored whole (logged at WARNING).

    Returns:
        ``"position"`` or ``"full"``: what was restored.
    """
    if isinstance(scheduler, LambdaLR) and "last_epoch" in saved:
        last_epoch = int(saved["last_epoch"])
        counters = scheduler.state_dict()  # this run's settings, with the saved step before the last
        counters.update(last_epoch=last_epoch - 1, _step_count=int(saved.get("_step_count", last_epoch + 1)) - 1)
        scheduler.load_state_dict(counters)
        with warnings.catch_warnings():  # step() warns when it believes no optimizer step happened yet
            warnings.simplefilter("ignore", UserWarning)
            scheduler.step()  # last_epoch, _step_count and the optimizer's LRs now those of the saved step
        return "position"
    scheduler.load_state_dict(saved)
    logger.warning(
        "restore_schedule: %s is restored whole from the checkpoint, with its saved settings (only a LambdaLR "
        "schedule, such as MONAI's WarmupCosineSchedule, follows this run's config on resume)",
        type(scheduler).__name__,
    )
    return "full"


def _check_interval(name: str, value: int | str | None) -> int | None:
    if is_null(value):  # None, or "null" from a command line
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer or None, got {value!r}.")
    return value


RESUME_FORMAT = "components.checkpoint/resumable-v1"



def _written_with(ckpt: Mapping) -> dict[str, Any]:
    """The settings a resumable checkpoint records about its run: the trainer's loop and the sampler's order."""
    trainer = ckpt.get("trainer") if isinstance(ckpt.get("trainer"), Mapping) else {}
    sampler = ckpt.get("sampler") if isinstance(ckpt.get("sampler"), Mapping) else {}
    settings = {k: trainer.get(k) for k in ("max_epochs", "epoch_length", "batch_size") if trainer.get(k) is not None}
    settings.update({f"sampler_{k}": sampler[k] for k in ("seed", "num_samples") if sampler.get(k) is not None})
    return settings


class CheckpointEvents(EventEnum):
    """Events a checkpoint saver fires on the trainer (every rank) before it writes, so that guards such as
    :class:`StopOnNonFiniteLoss` run first: no saver ever writes a state trained past a non-finite loss."""

    BEFORE_SAVE = "before_save"


def register_checkpoint_events(engine: Engine) -> None:
    """Registers :class:`CheckpointEvents` on ``engine`` (once; savers and guards both call this)."""
    if not engine.has_registered_events(CheckpointEvents.BEFORE_SAVE):
        engine.register_events(*CheckpointEvents)
