"""The bundle run this process is: the config files and overrides of its ``python -m monai.bundle run`` command line.

The start-up checks (unknown override ids in :mod:`.overrides`, typed settings in :mod:`.types`, which code runs in
:mod:`components.release.origin`) and the on-disk store's check of its transforms need two things MONAI does not hand
to a config: the config files it read, and which ids came from the command line (``--val_interval 1`` is merged into
the config as a new id without a word). They come from the command line itself, ``sys.argv``, parsed as MONAI's
``run`` receives it: that is the documented entry point the bundles' READMEs give (``python -m monai.bundle run``,
``torchrun ... -m monai.bundle run``), and the only route to it that uses public interfaces alone. The alternatives:
``ConfigWorkflow.parser`` is public, but no config expression can reach the workflow, and its config holds the
overrides merged, not told apart; a launcher of our own (``python -m components run``) would know them but would
leave the plain MONAI command line unchecked.

A workflow started from Python (``ConfigWorkflow(...)``, ``monai.bundle.run(...)``, ``monai.bundle.load``) has no such
command line: :func:`running_bundle` is then None and the checks compare nothing (a caller may build a
:class:`RunningBundle` and pass it to them).

Importing this module imports neither torch nor MONAI.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SHARED_CONFIG", "RunningBundle", "check_shared_config", "parse_command_line", "run_config_files",
           "running_bundle"]

#: the config file every bundle's ``train.json`` is read with, first: the settings all the bundles share
SHARED_CONFIG = "common.json"

#: the ``monai.bundle`` commands that create a workflow from config files (``python -m monai.bundle <command>``)
WORKFLOW_COMMANDS = ("run", "run_workflow")

#: arguments of those commands and of ``ConfigWorkflow`` that are not config ids
WORKFLOW_ARGUMENTS = frozenset({
    "workflow_name", "args_file", "config_file", "meta_file", "logging_file", "init_id", "run_id", "final_id",
    "tracking", "workflow_type", "properties_path",
})  # fmt: skip


@dataclass(frozen=True)
class RunningBundle:
    """The config files and overrides of a bundle run.

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
    """The files of a ``config_file`` argument: a path, a list of paths, or comma-separated paths (as
    ``ConfigParser.load_config_files`` splits them)."""
    if isinstance(config_file, (str, Path)):
        text = str(config_file)
        names = text.split(",") if "," in text and not Path(text).is_file() else [text]
    else:
        names = [str(name) for name in config_file]
    return tuple(Path(name.strip()) for name in names)


def _is_flag(token: str) -> bool:
    """python-fire's flags: ``--name`` and ``-x`` (a negative number such as ``-175`` is a value)."""
    return token.startswith("--") or (len(token) >= 2 and token[0] == "-" and token[1].isalpha())


def _keyword_args(tokens: Sequence[str]) -> dict[str, Any]:
    """The ``--name value`` / ``--name=value`` / bare ``--name`` (True; ``--noname`` False) pairs of ``tokens``, values
    parsed by python-fire's own value parser, as fire hands them to a function taking ``**kwargs``."""
    from fire.parser import DefaultParseValue

    found: dict[str, Any] = {}
    skip = False
    for index, token in enumerate(tokens):
        if skip:
            skip = False
            continue
        if not _is_flag(token):
            continue  # a positional argument (run_id ...), no override
        key, has_value, value = token.lstrip("-").partition("=")
        key = key.replace("-", "_")
        if not has_value:
            if index + 1 == len(tokens) or _is_flag(tokens[index + 1]):
                key, value = (key[2:], "False") if key.startswith("no") and len(key) > 2 else (key, "True")
            else:
                value, skip = tokens[index + 1], True
        found[key] = DefaultParseValue(value)
    return found


def parse_command_line(argv: Sequence[str]) -> RunningBundle | None:
    """The bundle run of a ``python -m monai.bundle run ...`` command line (``argv`` as ``sys.argv`` holds it: the
    module's ``__main__.py`` first), or None for any other command line, or one without config files.

    The arguments are read as MONAI reads them: python-fire's flags and values, under them the defaults of an
    ``--args_file``; MONAI's own arguments (``--config_file``, ``--meta_file``, ``--tracking`` ...) are not overrides.

    Example::

        >>> parse_command_line([".../monai/bundle/__main__.py", "run", "--config_file", "configs/train.json",
        ...                     "--max_epochs", "2"])
        RunningBundle(config_files=(PosixPath('configs/train.json'),), overrides={'max_epochs': 2}, tracking=None)
    """
    if len(argv) < 2 or argv[1] not in WORKFLOW_COMMANDS or not _is_monai_bundle_main(argv[0]):
        return None
    given = _keyword_args(argv[2:])
    merged: dict[str, Any] = {}
    if given.get("args_file"):
        from monai.bundle import ConfigParser

        merged.update(ConfigParser.load_config_file(str(given["args_file"])))
    merged.update(given)
    if not merged.get("config_file"):
        return None
    overrides = {k: v for k, v in merged.items() if k not in WORKFLOW_ARGUMENTS}
    return RunningBundle(_config_files(merged["config_file"]), overrides, merged.get("tracking"))


def _is_monai_bundle_main(path: str) -> bool:
    """Whether ``path`` is MONAI's ``monai/bundle/__main__.py`` (``sys.argv[0]`` under ``python -m monai.bundle``)."""
    main = Path(path)
    return main.name == "__main__.py" and main.parent.name == "bundle" and main.parent.parent.name == "monai"


def running_bundle() -> RunningBundle | None:
    """The bundle run of this process's command line (:func:`parse_command_line` of ``sys.argv``): set when the process
    was started as ``python -m monai.bundle run`` (or under ``torchrun``); None otherwise."""
    return parse_command_line(sys.argv)


def run_config_files(bundle_dir: str | Path, names: Sequence[str]) -> list[Path]:
    """The config files of a run of ``names`` (e.g. ``["train.json", "multi_gpu_train.json"]``) in the bundle folder
    ``bundle_dir``, in MONAI's order: :data:`SHARED_CONFIG` first when the run reads ``train.json`` and the bundle
    has it (an older bundle has none)."""
    configs = Path(bundle_dir) / "configs"
    shared = [SHARED_CONFIG] if "train.json" in names and (configs / SHARED_CONFIG).is_file() else []
    return [configs / name for name in [*shared, *names]]


def check_shared_config(bundle: RunningBundle | None = None) -> None:
    """Stops a run whose command line reads a bundle's ``train.json`` without its :data:`SHARED_CONFIG` (the command
    line of a bundle from before the shared settings), naming the command line that reads both; nothing is checked
    without a command line (:func:`running_bundle`).

    Raises:
        ConfigError: ``configs/train.json`` given, ``configs/common.json`` beside it but not given.
    """
    from ..errors import ConfigError

    bundle = running_bundle() if bundle is None else bundle
    if bundle is None:
        return
    names = [f.name for f in bundle.config_files]
    shared = bundle.config_files[0].parent / SHARED_CONFIG
    if "train.json" in names and SHARED_CONFIG not in names and shared.is_file():
        files = [str(shared), *[str(f) for f in bundle.config_files]]
        listed = "[" + ",".join(repr(f) for f in files) + "]"
        raise ConfigError(f"--config_file {' '.join(str(f) for f in bundle.config_files)} leaves out {shared}, which "
                          f"holds the settings all the bundles share: run with --config_file \"{listed}\".")
