"""Settings of a bundle checked when the workflow starts: those that must agree.

A disagreement found by the first iteration (a rotation of a non-square crop) or by the first validation (a metric
given fewer classes than names) costs a whole epoch of caching and training and then fails far from the cause.
:func:`check_settings` runs in a bundle's ``initialize`` and fails at once, in one line naming both settings. The
overridden ids are checked by :func:`components.config.overrides.check_overrides`, the type and range of each setting
by :func:`components.training.setting_types.check_setting_types`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError
from ..networks.swin import check_roi_size

__all__ = ["check_accumulation_steps", "check_settings", "rotation_axes"]


def check_accumulation_steps(accumulation_steps: Any) -> None:
    """Accepts only the integer 1 (not 1.0, ``True`` or ``"1"``, which ``int()`` would let through): the
    :class:`~components.training.trainer.PretrainingTrainer` does not accumulate gradients.

    Raises:
        ConfigError: one line naming the value, e.g. ``accumulation_steps must be the integer 1 (...), got 1.5.``
    """
    if type(accumulation_steps) is not int or accumulation_steps != 1:
        raise ConfigError("accumulation_steps must be the integer 1 (PretrainingTrainer does not accumulate gradients: "
                          "one optimizer step per iteration keeps the scheduler, the scaler and the recipe's after_step, "
                          "e.g. a teacher's EMA, in step; raise batch_size or num_samples instead), got "
                          f"{accumulation_steps!r}.")  # fmt: skip


def check_settings(
    roi_size: Sequence[int] | None = None,
    network: str = "network_def",
    rotation: bool = False,
    rotate90_prob: float | None = None,
) -> None:
    """Checks the settings that must agree; each argument left None is not checked.

    Args:
        roi_size: the training crop; every axis a multiple of 32 with at least two tokens at the encoder's last
            stage (Swin UNETR reduces each axis by 32; :func:`~components.networks.swin.check_roi_size`).
        network: names the network in the message, e.g. "SwinUNETR".
        rotation: the SSL rotation views rotate each crop by k * 90 degrees in its last two axes, which needs the
            last two ``roi_size`` values equal (else the first iteration fails in ``rot_rand``).
        rotate90_prob: the finetuning augmentation's ``RandRotate90d`` probability: above 0 it needs two equal axes
            of ``roi_size`` to rotate in (:func:`rotation_axes`).

    Raises:
        ConfigError: a ``ValueError``, one line naming the two settings that disagree and how to fix them.

    Example:
        >>> check_settings(roi_size=[96, 96, 96], network="SwinUNETR")
    """
    if roi_size is None:
        return
    roi = [int(s) for s in roi_size]
    try:
        check_roi_size(roi, spatial_dims=3)
    except ValueError as err:
        reason = str(err).removeprefix("SSLHead: ")
        raise ConfigError(f"roi_size {roi} does not fit the network ({network}): {reason}") from None
    if rotation and roi[1] != roi[2]:
        side = max(roi[1], roi[2])
        raise ConfigError(
            f"roi_size {roi} and the SSL rotation views disagree: rot_rand rotates each crop by k * 90 degrees in its "
            f"last two axes, which needs them equal, got {roi[1]} and {roi[2]}; "
            f"e.g. --roi_size \"[{roi[0]},{side},{side}]\"."
        )
    if rotate90_prob is not None and float(rotate90_prob) > 0 and len(set(roi)) == len(roi):
        raise ConfigError(
            f"roi_size {roi} and training#rotate90_prob {rotate90_prob} disagree: a 90-degree rotation (RandRotate90d) "
            f"needs two equal axes to keep a crop's shape, {roi} has none; give two (e.g. --roi_size "
            f"\"[{roi[0]},{roi[1]},{roi[1]}]\") or run with --training#rotate90_prob 0."
        )


def rotation_axes(roi_size: Sequence[int]) -> tuple[int, int]:
    """The plane in which ``RandRotate90d`` turns crops of ``roi_size`` without changing their shape: ``(0, 1)`` when
    the first two axes are equal (the recipe's plane, so cubic crops rotate as published), else the first pair of
    equal axes. A crop batch of mixed shapes cannot be collated, and one crop per step would train on shapes the
    config never asked for. With no two equal axes it is ``(0, 1)``, and :func:`check_settings` refuses the run when
    the rotation is on (``rotate90_prob`` above 0).

    Example:
        >>> rotation_axes([64, 32, 32])
        (1, 2)
    """
    roi = [int(s) for s in roi_size]
    pairs = [(a, b) for a in range(len(roi)) for b in range(a + 1, len(roi)) if roi[a] == roi[b]]
    return pairs[0] if pairs else (0, 1)
