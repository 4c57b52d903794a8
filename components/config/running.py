"""The bundle workflow that is starting: the config files MONAI read, the overrides it was given, its folder.

MONAI 1.6.1 tells a config neither where it was read from nor which of its ids came from the command line: a
config's ``bundle_root`` is "." (the caller's directory, whatever folder the bundle is in) under
``monai.bundle.load``, and an override such as ``--val_interval 1`` is merged into the config as a new id without a
word. ``monai.bundle.scripts.create_workflow`` (behind ``python -m monai.bundle run``, ``torchrun -m monai.bundle
run``, ``run_workflow`` and ``monai.bundle.load``) holds both, as its arguments, while the workflow's ``initialize``
runs; :func:`running_bundle` reads them from that call's frame and keeps them for that workflow object, so that later,
while the same workflow's ``run`` builds its datasets, they are found again from the workflow on the call stack. The
checks at start-up (unknown override ids in :mod:`components.training.settings`, which code runs in :mod:`components.release.origin`)
and the on-disk store's check of the transforms it was written with (:mod:`components.data.store`) so know what the
user ran. A workflow built another way (``ConfigWorkflow(...)`` or ``ConfigParser`` directly) has no such frame: the
checks then fall back to what the config says.

Importing this module imports neither torch nor MONAI.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RunningBundle", "running_bundle"]


@dataclass(frozen=True)
class RunningBundle:
    """What ``create_workflow`` was called with.

    Attributes:
        config_files: the config files, in the order MONAI merges them.
        overrides: the id-value pairs given besides the workflow's own arguments (``--training#seed 1`` gives
            ``{"training#seed": 1}``), from the command line or an ``--args_file``.
        tracking: the workflow's ``tracking`` argument (``--tracking mlflow``, a settings file or dict), whose
            ``configs`` MONAI adds to the config as ids (``experiment_name``, ``run_name``, ...); None without it.
    """

    config_files: tuple[Path, ...]
    overrides: Mapping[str, Any] = field(default_factory=dict)
    tracking: str | Mapping[str, Any] | None = None

    @property
    def folder(self) -> Path:
        """The bundle's folder, as ``ConfigWorkflow.run`` finds it: the first config file's folder, or the folder above
        it when that is ``configs/``. Absolute."""
        parent = self.config_files[0].resolve().parent
        return parent.parent if parent.name == "configs" else parent


def _config_files(config_file: Any) -> tuple[Path, ...]:
    """The files of ``create_workflow``'s ``config_file``: a path, a list of paths, or comma-separated paths (as
    ``ConfigParser.load_config_files`` splits them)."""
    if isinstance(config_file, (str, Path)):
        text = str(config_file)
        names = text.split(",") if "," in text and not Path(text).is_file() else [text]
    else:
        names = [str(name) for name in config_file]
    return tuple(Path(name.strip()) for name in names)


# what create_workflow was given, per workflow object: found again while that workflow runs
_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def running_bundle() -> RunningBundle | None:
    """The workflow ``monai.bundle.scripts.create_workflow`` is creating or initialising (from its frame on the call
    stack), or the one whose ``run`` is on the call stack after such an initialisation; None otherwise (a bare
    ``ConfigWorkflow`` or ``ConfigParser``), or when it has no config files.

    Example (from an expression of a bundle's ``initialize``, run as ``python -m monai.bundle run --config_file
    configs/train.json --max_epochs 2``)::

        >>> running_bundle()
        RunningBundle(config_files=(PosixPath('configs/train.json'),), overrides={'max_epochs': 2})
    """
    scripts = sys.modules.get("monai.bundle.scripts")
    if scripts is None:
        return None
    from monai.bundle import BundleWorkflow, ConfigWorkflow

    code = scripts.create_workflow.__code__
    workflow = None
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not code:
        owner = frame.f_locals.get("self")
        if workflow is None and isinstance(owner, BundleWorkflow):
            workflow = owner
        frame = frame.f_back
    if frame is None:
        return _SEEN.get(workflow) if workflow is not None else None
    if not frame.f_locals.get("config_file"):
        return None
    workflow_args = set(inspect.signature(ConfigWorkflow.__init__).parameters)
    merged = frame.f_locals.get("_args") or {}
    bundle = RunningBundle(_config_files(frame.f_locals["config_file"]),
                           {k: v for k, v in merged.items() if k not in workflow_args}, merged.get("tracking"))  # fmt: skip
    created = frame.f_locals.get("workflow_")
    if created is not None:
        _SEEN[created] = bundle
    return bundle
