"""Failing fast and clearly, and surviving a killed process (issue 8).

- :class:`StopOnNonFiniteLoss`: a trainer handler that stops the run at the first NaN / Inf training loss with
  the epoch, the iteration, the loss parts and the files of the batch, instead of training on for hours with NaN
  weights (and saving them). Under DDP every rank checks the same all-reduced loss, so all ranks stop at the same
  iteration and none is left waiting in a collective.
- :class:`SourceNamingCompose`: a ``Compose`` whose errors name the data item's source files, applied by
  ``build_dataset`` to every bundle's pipeline, so that a volume that breaks a transform at item 700 of caching, or
  in a loader worker mid-training, is named in the error.
- :func:`resolve_resume`: the checkpoint a run resumes from: an explicit ``resume``, else (``auto_resume``) the
  latest ``<ckpt_dir>/checkpoint.pt`` when there is one. With ``torchrun --max-restarts=N`` a rank that was killed
  is restarted with the same command line and so continues from the last saved iteration.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Engine, Events
from monai.data import MetaTensor
from monai.handlers import from_engine
from monai.transforms import Compose

from .distributed import collective_device, get_rank, get_world_size, is_distributed
from .runtime import optional_path

__all__ = [
    "DataItemError",
    "NonFiniteLossError",
    "SourceNamingCompose",
    "StopOnNonFiniteLoss",
    "batch_filenames",
    "item_sources",
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


class StopOnNonFiniteLoss:
    """Raises :class:`NonFiniteLossError` (after logging it at ERROR) when the training loss is not finite.

    Attach to a trainer (it runs at every ``ITERATION_COMPLETED``); put it before the checkpoint savers of the
    same event so that a NaN state is never saved. The loss is read from ``engine.state.output``:

    - an :class:`~components.SSLTrainer` output (a one-item list of a dict with ``log``): ``log["loss"]`` and its
      parts (``loss_rot``, ``loss_contrast``, ``loss_recon``), already averaged over ranks;
    - any other MONAI trainer output (a list of per-sample dicts, or a dict): ``from_engine([loss_key], first=True)``.
      Under DDP this rank's loss is all-reduced (one small collective per iteration, on every rank), so that every
      rank sees the same value and all stop together; the message then names the ranks whose own loss was bad.

    The message holds the epoch, the iteration (global and within the epoch), the loss and its parts, and this
    rank's batch files (see :func:`batch_filenames`), or says that they are not tracked.

    Args:
        loss_key: key of the loss in the output dicts.
        log_key: key of the (all-reduced) loss parts dict in the output, when the trainer provides one.
        image_key: key of the image in the batch, for the file names.
        max_files: at most this many file names are listed.
    """

    def __init__(self, loss_key: str = "loss", log_key: str = "log", image_key: str = "image", max_files: int = 32) -> None:
        self.loss_key = loss_key
        self.log_key = log_key
        self.image_key = image_key
        self.max_files = int(max_files)

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.ITERATION_COMPLETED, self)

    def _read(self, output: Any) -> tuple[float, float, dict[str, float], list[int] | None]:
        """(loss checked by every rank, this rank's loss, loss parts, ranks with a non-finite loss or None)."""
        first = output[0] if isinstance(output, (list, tuple)) and output else output
        log = first.get(self.log_key) if isinstance(first, Mapping) else None
        if isinstance(log, Mapping) and self.loss_key in log:
            local = _as_float(first[self.loss_key]) if self.loss_key in first else float("nan")
            parts = {k: _as_float(v) for k, v in log.items() if k != self.loss_key and str(k).startswith("loss")}
            return _as_float(log[self.loss_key]), local, parts, None
        loss = from_engine([self.loss_key], first=True)(output)
        if loss is None:
            raise KeyError(
                f"StopOnNonFiniteLoss: no {self.loss_key!r} in the trainer output ({type(output).__name__}); "
                "set loss_key to the key of the loss."
            )
        local = _as_float(loss)
        if not is_distributed() or get_world_size() == 1:
            return local, local, {}, None
        world, rank = get_world_size(), get_rank()
        packed = torch.zeros(world + 1, dtype=torch.float64, device=collective_device())
        packed[0] = local
        packed[1 + rank] = 0.0 if math.isfinite(local) else 1.0
        torch.distributed.all_reduce(packed)
        values = packed.tolist()
        return values[0] / world, local, {}, [r for r in range(world) if values[1 + r] > 0]

    def __call__(self, engine: Engine) -> None:
        checked, local, parts, bad_ranks = self._read(engine.state.output)
        if math.isfinite(checked):
            return
        state = engine.state
        epoch_length = state.epoch_length or 0
        in_epoch = (state.iteration - 1) % epoch_length + 1 if epoch_length else state.iteration
        lines = [
            f"non-finite training loss {checked} at epoch {state.epoch}, iteration {state.iteration} "
            f"(iteration {in_epoch}/{epoch_length or '?'} of the epoch) on rank {get_rank()} of {get_world_size()}."
        ]
        if parts:
            lines.append("loss parts: " + ", ".join(f"{k}={v}" for k, v in parts.items()))
        if get_world_size() > 1:
            lines.append(f"this rank's own loss: {local}")
            if bad_ranks is not None:
                lines.append(f"ranks with a non-finite loss: {bad_ranks}")
        names = batch_filenames(state.batch, self.image_key)
        if names is None:
            lines.append(f"batch files: {NOT_TRACKED}")
        else:
            shown = names[: self.max_files]
            more = f" (+{len(names) - len(shown)} more)" if len(names) > len(shown) else ""
            lines.append(f"batch files (rank {get_rank()}): {shown}{more}")
        lines.append(
            "Check these volumes for NaN/Inf voxels or a wrong intensity range, lower the learning rate, or turn "
            "off fp16 AMP; resume from the last checkpoint (saved before this iteration) once fixed."
        )
        message = "\n".join(lines)
        logger.error(message)
        raise NonFiniteLossError(message)


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
