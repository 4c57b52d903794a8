"""Settings of a bundle checked when the workflow starts: those that must agree, and the ids the user overrode.

A disagreement found by the first iteration (a rotation of a non-square crop) or by the first validation (a metric
given fewer classes than names) costs a whole epoch of caching and training and then fails far from the cause.
:func:`check_settings` runs in a bundle's ``initialize`` and fails at once, in one line naming both settings.

An override of an id that the configs do not define (misspelt, or one of the ids that 0.2.0 moved into the groups
``training``, ``loader``, ``speed`` and ``checkpointing``) is merged into the config by MONAI as a new id that nothing
reads: ``--val_interval 1`` then never validates. :func:`check_overrides`, also in ``initialize``, stops such a run
before any data is read, in one line naming the id and, where it moved, its new name.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from .networks import check_roi_size
from .running_bundle import RunningBundle, running_bundle

__all__ = ["KNOB_GROUPS", "check_overrides", "check_settings", "rotation_axes"]

#: the groups of knobs a user rarely touches; their members are checked like top-level ids (an override of a member
#: of another id, such as ``network_def#depths``, is an argument of that component and may add one).
KNOB_GROUPS: tuple[str, ...] = ("training", "loader", "speed", "checkpointing")

#: ids that 0.2.0 renamed when it moved them (the others kept their names inside their group)
_RENAMED = {
    "ckpt_epoch_interval": "checkpointing#epoch_interval",
    "ckpt_iteration_interval": "checkpointing#iteration_interval",
    "ckpt_time_interval_s": "checkpointing#time_interval_s",
}


def check_settings(
    roi_size: Sequence[int] | None = None,
    network: str = "network_def",
    rotation: bool = False,
    rotate90_prob: float | None = None,
) -> None:
    """Checks the settings that must agree; each argument left None is not checked.

    Args:
        roi_size: the training crop; every axis a multiple of 32 with at least two tokens at the encoder's last
            stage (Swin UNETR reduces each axis by 32; :func:`~components.networks.check_roi_size`).
        network: names the network in the message, e.g. "SwinUNETR".
        rotation: the SSL rotation views rotate each crop by k * 90 degrees in its last two axes, which needs the
            last two ``roi_size`` values equal (else the first iteration fails in ``rot_rand``).
        rotate90_prob: the finetuning augmentation's ``RandRotate90d`` probability: above 0 it needs two equal axes
            of ``roi_size`` to rotate in (:func:`rotation_axes`).

    Raises:
        ValueError: one line naming the two settings that disagree and how to fix them.

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
        raise ValueError(f"roi_size {roi} does not fit the network ({network}): {reason}") from None
    if rotation and roi[1] != roi[2]:
        side = max(roi[1], roi[2])
        raise ValueError(
            f"roi_size {roi} and the SSL rotation views disagree: rot_rand rotates each crop by k * 90 degrees in its "
            f"last two axes, which needs them equal, got {roi[1]} and {roi[2]}; "
            f"e.g. --roi_size \"[{roi[0]},{side},{side}]\"."
        )
    if rotate90_prob is not None and float(rotate90_prob) > 0 and len(set(roi)) == len(roi):
        raise ValueError(
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


def _ids(config: Mapping[str, Any]) -> list[str]:
    """Every top-level id and every member of the dict-valued ones, as ``group#member``."""
    found = [str(k) for k in config]
    found += [f"{k}#{m}" for k, v in config.items() if isinstance(v, Mapping) for m in v]
    return found


def _moved_to(name: str, config: Mapping[str, Any]) -> str | None:
    """Where an id that is no longer top-level lives now: the 0.2.0 renames, then a group member of that name (the
    knob groups first)."""
    if name in _RENAMED:
        return _RENAMED[name]
    holders = list(KNOB_GROUPS) + [k for k in config if k not in KNOB_GROUPS]
    return next((f"{g}#{name}" for g in holders if isinstance(config.get(g), Mapping) and name in config[g]), None)


def _unknown_override(override: str, config: Mapping[str, Any], files: str) -> str | None:
    """The one-line message for an override id that ``config`` does not define, or None when it does."""
    parts = override.replace("::", "#").split("#")
    top = parts[0]
    if top in config:
        member = parts[1] if len(parts) > 1 else None
        if top not in KNOB_GROUPS or member is None or not isinstance(config[top], Mapping) or member in config[top]:
            return None
        name, moved = f"{top}#{member}", _moved_to(member, config)
    else:
        name, moved = top, _moved_to(top, config)
    head = f"--{override} names no id of {files}, so MONAI would add it as a new id that nothing reads"
    if moved is not None and moved != name:
        return f"{head}: {name} moved to {moved}; run with --{override.replace(name, moved, 1)} instead."
    close = difflib.get_close_matches(name, _ids(config), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join('--' + c for c in close)}?" if close else "; see the bundle's docs for its ids."
    return head + hint


def check_overrides(bundle: RunningBundle | None = None) -> None:
    """Stops a run whose overrides name an id that its config files do not define (a misspelt or moved id), before
    any data is read. A bundle's ``initialize`` calls it without arguments: the config files and the overrides are
    those ``python -m monai.bundle run`` (or ``monai.bundle.load``) was given (:func:`running_bundle`); nothing is
    checked for a workflow built otherwise.

    Top-level ids and members of :data:`KNOB_GROUPS` must exist in the config files; a member of any other id
    (``--network_def#depths [2,2,6,2]``: an argument of that component) may be added.

    Raises:
        ValueError: one line naming the id, and where it moved (``--val_interval 1`` -> ``--training#val_interval 1``)
            or the closest ids the configs define.

    Example (``initialize`` of a bundle config)::

        "$components.check_overrides()"
    """
    bundle = running_bundle() if bundle is None else bundle
    if bundle is None or not bundle.overrides:
        return
    from monai.bundle import ConfigParser

    config = ConfigParser.load_config_files([str(f) for f in bundle.config_files])
    files = " + ".join(str(f) for f in bundle.config_files)
    for override in bundle.overrides:
        problem = _unknown_override(str(override), config, files)
        if problem is not None:
            raise ValueError(problem)
