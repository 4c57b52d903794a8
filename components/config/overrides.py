"""The ids a user overrode on the command line, checked when the workflow starts.

An override of an id that the configs do not define (misspelt, or one of the ids that 0.2.0 moved into the groups
``training``, ``loader``, ``speed`` and ``checkpointing``) is merged into the config by MONAI as a new id that nothing
reads: ``--val_interval 1`` then never validates. :func:`check_overrides`, in a bundle's ``initialize``, stops such a
run before any data is read, in one line naming the id and, where it moved, its new name.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError

from .running import RunningBundle, running_bundle

__all__ = ["KNOB_GROUPS", "check_overrides", "defined_overrides"]

#: the groups of knobs a user rarely touches; their members are checked like top-level ids (an override of a member
#: of another id, such as ``network_def#depths``, is an argument of that component and may add one).
KNOB_GROUPS: tuple[str, ...] = ("training", "loader", "speed", "checkpointing")

#: ids that 0.2.0 renamed when it moved them (the others kept their names inside their group)
_RENAMED = {
    "ckpt_epoch_interval": "checkpointing#epoch_interval",
    "ckpt_iteration_interval": "checkpointing#iteration_interval",
    "ckpt_time_interval_s": "checkpointing#time_interval_s",
}


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


def _tracking_ids(tracking: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """The ids the workflow's ``tracking`` settings add to the config (``--tracking mlflow --experiment_name x`` sets
    one of them), as ``ConfigWorkflow`` patches them in: the ``configs`` that are not handlers."""
    if tracking is None:
        return {}
    from monai.bundle import ConfigParser
    from monai.bundle.utils import DEFAULT_EXP_MGMT_SETTINGS

    if isinstance(tracking, str) and tracking in DEFAULT_EXP_MGMT_SETTINGS:
        settings = DEFAULT_EXP_MGMT_SETTINGS[tracking]
    elif isinstance(tracking, Mapping):
        settings = tracking
    else:
        settings = ConfigParser.load_config_files(tracking)
    handlers = settings.get("handlers_id", {})
    return {k: v for k, v in settings.get("configs", {}).items() if k not in handlers}


def check_overrides(bundle: RunningBundle | None = None) -> None:
    """Stops a run whose overrides name an id that its config files do not define (a misspelt or moved id), before
    any data is read. A bundle calls it without arguments when it starts: the config files and the overrides are
    those of the ``python -m monai.bundle run`` command line (:func:`running_bundle`); nothing is checked for a
    workflow started from Python, unless ``bundle`` is given.

    Top-level ids and members of :data:`KNOB_GROUPS` must exist in the config files; a member of any other id
    (``--network_def#depths [2,2,6,2]``: an argument of that component) may be added.

    Raises:
        ConfigError: a ``ValueError`` with one line per such id (all of them), naming the id and where it moved
            (``--val_interval 1`` -> ``--training#val_interval 1``) or the closest ids the configs define.

    Example (``initialize`` of a bundle config)::

        "$components.check_overrides()"
    """
    bundle = running_bundle() if bundle is None else bundle
    if bundle is None or not bundle.overrides:
        return
    from monai.bundle import ConfigParser

    config = ConfigParser.load_config_files([str(f) for f in bundle.config_files])
    for name, value in _tracking_ids(bundle.tracking).items():
        config.setdefault(name, value)
    files = " + ".join(str(f) for f in bundle.config_files)
    problems = [_unknown_override(str(override), config, files) for override in bundle.overrides]
    problems = [problem for problem in problems if problem is not None]
    if problems:
        raise ConfigError("\n".join(problems))


def defined_overrides(overrides: Mapping[str, Any], config_files: list[str | Path]) -> dict[str, Any]:
    """The members of ``overrides`` whose ids ``config_files`` define (as :func:`check_overrides` judges them).

    For a driver that runs several configs of one bundle with one set of settings: the training run takes them all,
    the inference run only those ``inference.json`` defines, since :func:`check_overrides` stops a run on the others.

    Example::

        defined_overrides({"device": "cpu", "max_epochs": 5}, ["configs/inference.json"])  # {"device": "cpu"}
    """
    from monai.bundle import ConfigParser

    config = ConfigParser.load_config_files([str(f) for f in config_files])
    return {k: v for k, v in overrides.items() if _unknown_override(str(k), config, "") is None}
