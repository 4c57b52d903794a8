"""The ids a user overrode on the command line, checked when the workflow starts.

An override of an id that the configs do not define (misspelt, or an id a release moved or replaced) is merged into
the config by MONAI as a new id that nothing reads: ``--val_interval 1`` then never validates. :func:`check_overrides`,
called when a bundle starts, stops such a run before any data is read, in one line naming the id and, where it moved,
its new name.

What must exist: every top-level id, and every member of a group (a dict without ``_target_``: ``training``,
``loader``, ``train``, ``validate`` ...) at any depth. The arguments of a component (a dict with ``_target_``, e.g.
``network_def#depths``) and the items of lists are open: an override may add one.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError

from .running import RunningBundle, running_bundle

__all__ = ["check_overrides", "defined_overrides"]

#: the groups of knobs a user rarely touches (searched first for an id given at the top level)
KNOB_GROUPS: tuple[str, ...] = ("training", "loader", "speed", "checkpointing")

#: ids that a release renamed or moved, old -> new (ids that 0.2.0 moved into a group under their own name are found
#: there without an entry)
MOVED_IDS = {
    "ckpt_epoch_interval": "checkpointing#epoch_interval",  # 0.2.0
    "ckpt_iteration_interval": "checkpointing#iteration_interval",
    "ckpt_time_interval_s": "checkpointing#time_interval_s",
    "network": "train#network",  # 0.5.0: Model Zoo-style configs
    "speed#upsample": "network_def#upsample",
    "speed#step_inputs": "train#network#step_inputs",
    "train#deterministic_transforms": "train#transforms#deterministic",
    "train#random_transforms": "train#transforms#random",
    "validate#deterministic_transforms": "validate#transforms#deterministic",
    "validate#random_transforms": "validate#transforms#random",
}

#: ids that a release replaced by something else, old -> what to run instead
REPLACED_IDS = {
    "loader#compact_cache": "the cache mode is the pipeline train#transforms names: --train#transforms "
                            "%train#plain_transforms for false, nothing for true",
    "loader#loader_workers": "the loader's workers follow loader#num_workers (none with loader#data_on_device)",
    "train#dataloader#_target_": "the loader is built from the loader settings, its class is "
                                 "--train#dataloader#loader_class (e.g. ThreadDataLoader)",
}


def _is_group(value: Any) -> bool:
    """A dict of ids, whose members must exist: no ``_target_`` (a component's arguments are open) and not empty (an
    empty dict, such as ``speed#compile_kwargs``, is a free set of keyword arguments)."""
    return isinstance(value, Mapping) and "_target_" not in value and bool(value)


def _ids(config: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Every top-level id and every member of a group at any depth, as ``group#member``."""
    found = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        found.append(name)
        if _is_group(value):
            found += _ids(value, f"{name}#")
    return found


def _undefined(override: str, config: Mapping[str, Any]) -> str | None:
    """The leading part of ``override`` that names no id of ``config`` (``training#seedd`` for
    ``training#seedd``), or None when the config defines it or it is a component argument or list item."""
    parts = override.replace("::", "#").split("#")
    node: Any = config
    for depth, part in enumerate(parts):
        if not (depth == 0 or _is_group(node)):
            return None
        if part not in node:
            return "#".join(parts[: depth + 1])
        node = node[part]
    return None


def _moved_to(name: str, config: Mapping[str, Any]) -> str | None:
    """Where an undefined id lives now: :data:`MOVED_IDS`, then, for a top-level name, a group member of that name
    (the knob groups first)."""
    if name in MOVED_IDS:
        return MOVED_IDS[name]
    if "#" in name:
        return None
    holders = list(KNOB_GROUPS) + [k for k in config if k not in KNOB_GROUPS]
    return next((f"{g}#{name}" for g in holders if isinstance(config.get(g), Mapping) and name in config[g]), None)


def _unknown_override(override: str, config: Mapping[str, Any], files: str) -> str | None:
    """The one-line message for an override id that ``config`` does not define or that a release replaced, or None."""
    exact = str(override).replace("::", "#")
    if exact in REPLACED_IDS and _undefined(exact, config) is None:  # still an id, with another meaning
        return f"--{override} no longer sets what it did in 0.4.0: {REPLACED_IDS[exact]}."
    name = _undefined(str(override), config)
    if name is None:
        return None
    head = f"--{override} names no id of {files}, so MONAI would add it as a new id that nothing reads"
    if name in REPLACED_IDS:
        return f"{head}: {name} was replaced; {REPLACED_IDS[name]}."
    moved = _moved_to(name, config)
    if moved is not None:
        return f"{head}: {name} moved to {moved}; run with --{str(override).replace(name, moved, 1)} instead."
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

    Top-level ids and the members of groups must exist in the config files; an argument of a component
    (``--network_def#depths [2,2,6,2]``) may be added.

    Raises:
        ConfigError: a ``ValueError`` with one line per such id (all of them), naming the id and where it moved
            (``--val_interval 1`` -> ``--training#val_interval 1``, :data:`MOVED_IDS`), what replaced it
            (:data:`REPLACED_IDS`) or the closest ids the configs define.
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
