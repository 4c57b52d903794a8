"""Small segmentation pieces the finetuning bundles need and MONAI does not have.

- :class:`PerClassMetrics`: names the per-class columns of a MONAI metric handler, logs them at each evaluation,
  exposes them as scalar metrics and optionally writes a JSON summary. MONAI's metric handlers (``MeanDice`` with
  ``save_details=True``) keep every image's per-class values in ``engine.state.metric_details[name]``, already
  gathered across ranks by :class:`monai.metrics.Cumulative`; but ``StatsHandler`` / ``TensorBoardStatsHandler``
  only show scalar entries of ``engine.state.metrics``, ``MeanDice(reduction="mean_batch")`` cannot be the key
  metric at the same time as the mean, and ``MetricsSaver`` writes CSVs whose columns are ``class0 .. classN`` with
  no class names and no JSON.
- :func:`loss_class_weights`: ``training#class_weights`` as the loss's ``weight`` (None when null).
- :func:`brats_labels_from_regions`: the inverse of MONAI's ``ConvertToMultiChannelBasedOnBratsClasses`` (TC, WT,
  ET region masks back to one BraTS label map with labels 0, 1, 2, 4), which MONAI lacks; used to write inference
  outputs in the label convention of the input data.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from monai.data import MetaTensor

from ..config.values import is_null
from ..files import atomic_write, sha256_file

__all__ = ["PerClassMetrics", "balanced_class_weights", "brats_labels_from_regions", "loss_class_weights", "per_class_means"]

logger = logging.getLogger(__name__)


def per_class_means(details: torch.Tensor | Sequence, num_classes: int | None = None) -> list[float]:
    """Mean over images of a per-image, per-class metric array of shape (N, C), ignoring NaN entries.

    NaN marks an image where the class is absent from the ground truth (MONAI's ``DiceMetric(ignore_empty=True)``),
    so a class's mean is taken over the images that contain it, as ``reduction="mean_batch"`` does. A class absent
    from every image gives NaN.

    Raises:
        ValueError: when ``details`` is not 2-D (after squeezing trailing singleton dims) or, with ``num_classes``,
            has another number of columns.
    """
    values = torch.as_tensor(details, dtype=torch.float64).detach().cpu()
    while values.ndim > 2 and values.shape[-1] == 1:
        values = values.squeeze(-1)
    if values.ndim != 2:
        raise ValueError(f"per-class metric details must have shape (images, classes), got {tuple(values.shape)}.")
    if num_classes is not None and values.shape[1] != num_classes:
        raise ValueError(f"expected {num_classes} classes (columns) in the metric details, got {values.shape[1]}.")
    return [float(v) for v in torch.nanmean(values, dim=0)]


def loss_class_weights(weights: Sequence[float] | str | None, device: torch.device | str) -> torch.Tensor | None:
    """``training#class_weights`` as ``DiceCELoss``'s ``weight``: a float32 tensor on ``device``, or None (no
    weighting) when it is null, also "null" from a command line (:func:`~components.config.values.is_null`).

    Example (``train#loss#weight`` of the finetuning bundles)::

        "$components.loss_class_weights(@training#class_weights, @device)"
    """
    return None if is_null(weights) else torch.tensor(weights, dtype=torch.float32, device=device)


def balanced_class_weights(label_paths: Sequence[str | os.PathLike], num_classes: int) -> list[float]:
    """Class weights for a segmentation loss from the physical volume of each class in ``label_paths``:
    ``sqrt(median volume / class volume)``, the square root of median-frequency balancing (Eigen and Fergus, 2015).

    Background (most of a CT) gets a small weight and small organs a weight above 1, without the extreme values of
    plain inverse frequency. Volumes are in mm^3 (voxel counts times the voxel volume of each file), so label maps
    of different spacings count alike. MONAI has no such helper (its ``DataAnalyzer`` gathers label statistics for
    Auto3DSeg but does not turn them into loss weights).

    Args:
        label_paths: label map files (NIfTI) with integer labels ``0 .. num_classes - 1``.
        num_classes: number of classes, background included.

    Raises:
        ValueError: no files, a label value outside ``0 .. num_classes - 1`` (naming the file), or a class that
            appears in none of the files (its weight would be infinite).

    Example::

        # the demo's six training volumes (background, spleen, kidneys, liver, stomach) give about
        # [0.08, 1.21, 1.55, 1.67, 0.35, 0.87]
        weights = balanced_class_weights(sorted(Path("labelsTr").glob("*.nii.gz")), num_classes=6)
    """
    import nibabel as nib
    import numpy as np

    if not label_paths:
        raise ValueError("balanced_class_weights needs at least one label file.")
    volumes = np.zeros(num_classes, dtype=np.float64)
    for path in label_paths:
        image = nib.load(str(path))
        labels = np.asarray(image.dataobj).astype(np.int64).ravel()
        if labels.min() < 0 or labels.max() >= num_classes:
            raise ValueError(
                f"{path}: label values must be in 0 .. {num_classes - 1}, found {int(labels.min())} .. {int(labels.max())}."
            )
        volumes += np.bincount(labels, minlength=num_classes) * float(np.prod(image.header.get_zooms()[:3]))
    absent = [c for c in range(num_classes) if volumes[c] == 0]
    if absent:
        raise ValueError(f"classes {absent} appear in none of the {len(label_paths)} label files.")
    return [round(float(w), 4) for w in np.sqrt(np.median(volumes) / volumes)]


def _slug(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_")


def _json_number(value: float) -> float | None:
    return None if value is None or math.isnan(value) else float(value)


class PerClassMetrics:
    """Ignite handler for an evaluator: per-class values of a MONAI metric, with class names, at each evaluation.

    At ``EPOCH_COMPLETED`` (after the metric itself was computed; attach it after the key metric, i.e. list it in
    ``val_handlers``), it reads ``engine.state.metric_details[metric_name]`` (shape (N images, C classes), gathered
    across ranks), takes the NaN-ignoring mean over images of each class (:func:`per_class_means`) and

    - logs one line ``val_mean_dice 0.7312 per class (5 images): spleen 0.8101, right kidney ...``;
    - stores each class's value as a scalar ``engine.state.metrics[key_prefix + slug(class name)]`` (e.g.
      ``val_dice_right_kidney``), so ``StatsHandler``, ``TensorBoardStatsHandler`` and ``MetricsSaver(metrics="*")``
      listed *after* this handler report them too;
    - with ``json_path``, writes (rank 0, atomically) ``{"metric", "mean", "num_images", "per_class": {name: value},
      "epoch", "weights"}``; NaN (a class absent from every image) is written as ``null``. ``weights`` is
      ``{"file", "sha256"}`` of the ``weights`` file taken when the evaluator starts (when MONAI's
      ``CheckpointLoader``, listed before this handler, loads it), ``null`` without ``weights``: the numbers are bound
      to the weights they were measured on, which is how ``python -m components package`` tells whether they
      describe the weights it releases.

    Args:
        metric_name: name of a metric handler attached with ``save_details=True`` (MONAI's ``MeanDice`` default).
        class_names: one name per column of the details, e.g. the label names without ``background`` when the
            metric excludes the background channel.
        key_prefix: prefix of the scalar metric names (default ``f"{metric_name}_"``).
        json_path: optional JSON file for the summary (directories are created).
        weights: the weights file the evaluator evaluates (its ``CheckpointLoader``'s ``load_path``), named with its
            SHA-256 in the summary.

    Example (bundle config)::

        {"_target_": "components.PerClassMetrics", "metric_name": "val_mean_dice",
         "class_names": "$@label_names[1:]", "key_prefix": "val_dice_", "weights": "@checkpoint"}
    """

    def __init__(
        self,
        metric_name: str,
        class_names: Sequence[str],
        key_prefix: str | None = None,
        json_path: str | os.PathLike | None = None,
        weights: str | os.PathLike | None = None,
    ) -> None:
        if isinstance(class_names, str) or not class_names:
            raise ValueError(f"class_names must be a non-empty list of names, got {class_names!r}.")
        self.metric_name = metric_name
        self.class_names = [str(n) for n in class_names]
        self.key_prefix = f"{metric_name}_" if key_prefix is None else key_prefix
        self.json_path = None if json_path in (None, "") else Path(json_path)
        self.weights = None if weights in (None, "") else Path(weights)
        self.weights_sha256: str | None = None
        self.last: dict[str, Any] | None = None

    def attach(self, engine: Engine) -> None:
        if self.weights is not None:
            engine.add_event_handler(Events.STARTED, self._hash_weights)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self)

    def _hash_weights(self, engine: Engine) -> None:
        """The SHA-256 of ``weights`` when the evaluator starts, as the checkpoint loader before this handler loads it."""
        if not self.weights.is_file():
            raise FileNotFoundError(f"PerClassMetrics: the evaluated weights '{self.weights}' do not exist.")
        self.weights_sha256 = sha256_file(self.weights)

    def summary(self, engine: Engine) -> dict[str, Any]:
        """The summary dict for the current state of ``engine`` (see the class docstring)."""
        details = getattr(engine.state, "metric_details", {}).get(self.metric_name)
        if details is None:
            raise RuntimeError(
                f"PerClassMetrics: engine.state.metric_details has no {self.metric_name!r}; attach the metric "
                "handler with save_details=True under that name (e.g. the evaluator's key_val_metric)."
            )
        num_images = int(torch.as_tensor(details).shape[0])
        try:
            values = per_class_means(details, num_classes=len(self.class_names))
        except ValueError as err:
            where = f"PerClassMetrics({self.metric_name!r}, {len(self.class_names)} class names)"
            raise ValueError(f"{where}: {err}") from err
        mean = engine.state.metrics.get(self.metric_name)
        return {
            "metric": self.metric_name,
            "mean": None if mean is None else _json_number(float(mean)),
            "num_images": num_images,
            "per_class": {name: _json_number(v) for name, v in zip(self.class_names, values)},
            "epoch": int(engine.state.epoch),
            "weights": None if self.weights is None else {"file": str(self.weights), "sha256": self.weights_sha256},
        }

    def __call__(self, engine: Engine) -> None:
        summary = self.summary(engine)
        self.last = summary
        for name, value in summary["per_class"].items():
            engine.state.metrics[self.key_prefix + _slug(name)] = float("nan") if value is None else value
        parts = ", ".join(f"{n} {'nan' if v is None else f'{v:.4f}'}" for n, v in summary["per_class"].items())
        mean = "n/a" if summary["mean"] is None else f"{summary['mean']:.4f}"
        logger.info("%s %s per class (%d images): %s", self.metric_name, mean, summary["num_images"], parts)
        if self.json_path is not None and idist.get_rank() == 0:
            self._write(summary)

    def _write(self, summary: dict[str, Any]) -> None:
        with atomic_write(self.json_path, "w") as f:  # type: ignore[arg-type]
            json.dump(summary, f, indent=4)
            f.write("\n")
        logger.info("PerClassMetrics: wrote %s", self.json_path)


def brats_labels_from_regions(regions: torch.Tensor, et_label: int = 4) -> torch.Tensor:
    """BraTS region masks (TC, WT, ET) of shape (3, *spatial) -> one label map (1, *spatial), uint8.

    The inverse of MONAI's ``ConvertToMultiChannelBasedOnBratsClasses`` (TC = 1|4, WT = 1|2|4, ET = 4): voxels in
    WT get 2 (edema), in TC get 1 (necrotic / non-enhancing core), in ET get ``et_label`` (4 in BraTS 2018-2021;
    3 in BraTS 2023), applied in that order so the nested regions win. Predicted regions that are not nested (ET
    outside TC) still get their own label. A ``MetaTensor`` input keeps its metadata (affine, applied
    operations), so the result can be inverted / saved like the input.
    """
    if regions.ndim < 2 or regions.shape[0] != 3:
        raise ValueError(f"expected 3 region channels (TC, WT, ET) first, got shape {tuple(regions.shape)}.")
    data = regions.as_tensor() if isinstance(regions, MetaTensor) else torch.as_tensor(regions)
    tc, wt, et = (data[i] > 0.5 for i in range(3))
    label = torch.zeros(data.shape[1:], dtype=torch.uint8, device=data.device)
    label[wt] = 2
    label[tc] = 1
    label[et] = int(et_label)
    label = label[None]
    if isinstance(regions, MetaTensor):
        return MetaTensor(label, meta=dict(regions.meta), applied_operations=list(regions.applied_operations))
    return label
