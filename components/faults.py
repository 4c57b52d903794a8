"""Failing fast and clearly, and surviving a killed process (issue 8).

- :class:`StopOnNonFiniteLoss`: a trainer handler that stops the run after a NaN / Inf training loss, naming
  the first bad iteration's epoch, loss parts and batch files, instead of training on for hours with NaN weights
  (and saving them). It records bad losses on the device and reads the record only every few iterations, at epoch
  ends and before every checkpoint save (:class:`CheckpointEvents`), so a step needs no host sync; under DDP all
  ranks check together and stop at the same iteration, none left waiting in a collective.
- :class:`SourceNamingCompose`: a ``Compose`` whose errors name the data item's source files, applied by
  ``build_dataset`` to every bundle's pipeline, so that a volume that breaks a transform at item 700 of caching, or
  in a loader worker mid-training, is named in the error.
- :func:`resolve_resume`: the checkpoint a run resumes from: an explicit ``resume``, else (``auto_resume``) the
  latest ``<ckpt_dir>/checkpoint.pt`` when there is one. With ``torchrun --max-restarts=N`` a rank that was killed
  is restarted with the same command line and so continues from the last saved iteration.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Engine, EventEnum, Events
from monai.data import MetaTensor
from monai.handlers import from_engine
from monai.transforms import Compose

from .distributed import all_reduce_mean, get_rank, get_world_size, is_distributed
from .runtime import optional_path

__all__ = [
    "CheckpointEvents",
    "DataItemError",
    "NonFiniteLossError",
    "SourceNamingCompose",
    "StopOnNonFiniteLoss",
    "batch_filenames",
    "item_sources",
    "register_checkpoint_events",
    "resolve_resume",
]

logger = logging.getLogger(__name__)

#: the message part used when the batch carries no file names
NOT_TRACKED = (
    "not tracked (the batch has no image meta data: load with LoadImaged(image_only=False), as the bundles do, "
    "or keep track_meta=True in the last EnsureTyped)"
)


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or Inf; the message names the epoch, iteration, loss parts and batch files."""


def _filenames_from(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        return [str(value)]
    if isinstance(value, Sequence):
        names: list[str] = []
        for v in value:
            names.extend(_filenames_from(v) or [])
        return names
    return [str(value)]


def batch_filenames(batch: Any, image_key: str = "image") -> list[str] | None:
    """The source files of a batch, in order and without repeats (crops of one volume name it once): from the
    image's MetaTensor meta (``filename_or_obj``), else from ``<image_key>_meta_dict``; None when not tracked.
    ``batch`` is a collated dict or, as MONAI's trainers leave it after decollating, a list of per-sample dicts."""
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        per_sample = [batch_filenames(item, image_key) for item in batch if isinstance(item, Mapping)]
        if not per_sample or any(names is None for names in per_sample):
            return None
        return list(dict.fromkeys(name for names in per_sample for name in names))
    if not isinstance(batch, Mapping):
        return None
    names = None
    image = batch.get(image_key)
    if isinstance(image, MetaTensor):
        names = _filenames_from(image.meta.get("filename_or_obj"))
    if not names:
        meta = batch.get(f"{image_key}_meta_dict")
        if isinstance(meta, Mapping):
            names = _filenames_from(meta.get("filename_or_obj"))
    if not names:
        return None
    return list(dict.fromkeys(names))


def item_sources(item: Any) -> dict[str, str]:
    """``{key: source file}`` of one data item, before or after transforms: path strings of a datalist entry,
    ``filename_or_obj`` of MetaTensors and of ``<key>_meta_dict``. Lists (the crops of one item) are merged."""
    if isinstance(item, Sequence) and not isinstance(item, (str, bytes)):
        merged: dict[str, str] = {}
        for element in item:
            merged.update(item_sources(element))
        return merged
    if not isinstance(item, Mapping):
        return {}
    sources: dict[str, str] = {}
    for key, value in item.items():
        name, key = None, str(key)
        if isinstance(value, (str, os.PathLike)):
            name = value
        elif isinstance(value, MetaTensor):
            name = value.meta.get("filename_or_obj")
        elif isinstance(value, Mapping) and key.endswith("_meta_dict"):  # LoadImaged(image_only=False)
            name, key = value.get("filename_or_obj"), key.removesuffix("_meta_dict")
        names = _filenames_from(name)
        if names:
            sources.setdefault(key, ", ".join(names))
    return sources


class DataItemError(RuntimeError):
    """A transform failed on a data item; the message names the item's files, the transform and the root error."""


_TRANSFORM_IN_MESSAGE = re.compile(r"applying transform <?([\w.]+)")


def _describe_failure(err: BaseException) -> str:
    """``"<Transform>: <RootType>: <root message>"`` from MONAI's chain of "applying transform ..." errors."""
    chain, seen = [err], {id(err)}
    while (cause := chain[-1].__cause__ or chain[-1].__context__) is not None and id(cause) not in seen:
        chain.append(cause)
        seen.add(id(cause))
    transforms = [m.group(1).split(".")[-1] for e in chain if (m := _TRANSFORM_IN_MESSAGE.search(str(e)))]
    root = chain[-1]
    where = f"{transforms[-1]}: " if transforms else ""
    return f"{where}{type(root).__name__}: {root}"


class SourceNamingCompose(Compose):
    """The transforms of ``compose`` (the same objects, settings and random state: nothing is re-seeded), with
    errors that name the data item's files.

    MONAI's ``Compose`` reports only the transform ("applying transform <LoadImaged object ...>"), so an error
    while caching a thousand volumes, or in a data-loader worker mid-training, does not say which volume caused
    it. This raises :class:`DataItemError` (chained to the original) naming the stage (caching: the transforms
    before the first random one; after the cache: the rest), the item's files (:func:`item_sources`), the
    transform and the root error. ``CacheDataset`` and ``SmartCacheDataset`` call it with ``start`` / ``end`` like
    any ``Compose``.
    """

    def __init__(self, compose: Compose) -> None:
        if not isinstance(compose, Compose):
            raise TypeError(f"SourceNamingCompose wraps a monai.transforms.Compose, got {type(compose).__name__}.")
        self.__dict__.update(vars(compose))

    def __call__(self, input_, start=0, end=None, threading=False, lazy: bool | None = None):
        try:
            return super().__call__(input_, start=start, end=end, threading=threading, lazy=lazy)
        except DataItemError:
            raise
        except Exception as err:
            stage = "the transforms after the cache" if start else "caching" if end is not None else "a transform"
            sources = item_sources(input_)
            named = ", ".join(f"{k}={v}" for k, v in sources.items()) if sources else "an item with no file names"
            raise DataItemError(f"{stage} failed for {named}: {_describe_failure(err)}") from err


def _as_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().reshape(-1)[0]) if value.numel() else float("nan")
    return float(value)


class CheckpointEvents(EventEnum):
    """Events a checkpoint saver fires on the trainer (every rank) before it writes, so that guards such as
    :class:`StopOnNonFiniteLoss` run first: no saver ever writes a state trained past a non-finite loss."""

    BEFORE_SAVE = "before_save"


def register_checkpoint_events(engine: Engine) -> None:
    """Registers :class:`CheckpointEvents` on ``engine`` (once; savers and guards both call this)."""
    if CheckpointEvents.BEFORE_SAVE not in engine._allowed_events:
        engine.register_events(*CheckpointEvents)


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
    """Raises :class:`NonFiniteLossError` (after logging it at ERROR) when a training loss was not finite, naming
    the first bad iteration.

    Every iteration updates an on-device record of the first iteration whose loss was NaN / Inf (a few tiny kernels,
    nothing read back to the host); it is read (on CUDA, one sync) only at the checks: every ``check_interval``
    iterations (the iterations that log, see :func:`components.engine.log_filter`), at each epoch end (before
    validation) and before every checkpoint save (:class:`CheckpointEvents`). So with ``check_interval`` = the log
    interval an iteration costs no host sync, a NaN state is never saved or validated, and the run stops at most
    ``check_interval - 1`` iterations after the first bad one. With ``check_interval=1`` it stops at that iteration.
    Under DDP each check is one all-reduce of every rank's first bad iteration (on every rank, at the same
    iterations), so all ranks stop together; the message names the ranks whose own loss was bad.

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
        from .engine import log_filter  # validates the interval

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
        world, rank = get_world_size(), get_rank()
        if world > 1 and is_distributed():
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
        message = self._message(engine, iteration, bad_ranks)
        logger.error(message)
        raise NonFiniteLossError(message)

    def _message(self, engine: Engine, iteration: int, bad_ranks: list[int]) -> str:
        seen = self._seen[iteration]
        loss = _as_float(seen.loss)
        world, rank = get_world_size(), get_rank()
        checked = min(self.check_interval, engine.state.iteration - iteration + 1)
        lines = [
            f"non-finite training loss {loss if rank in bad_ranks else 'on another rank'} at epoch {seen.epoch}, "
            f"iteration {iteration} (iteration {seen.in_epoch}/{seen.epoch_length or '?'} of the epoch) on rank "
            f"{rank} of {world}."
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
            lines.append(f"ranks with a non-finite loss: {bad_ranks}")
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
