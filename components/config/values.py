"""Bundle settings as a command line passes them: ``python -m monai.bundle run --speed#amp false`` gives the string
"false" (truthy in Python) and ``--pretrained_path null`` the string "null". The components that take a flag or an
optional path read it through these, so a typed value means what it says and a config hands settings over as they
are.

MONAI's ``monai.utils.str2bool`` parses the same words but raises a bare ``ValueError`` without the setting's name
and accepts no integers; :func:`as_bool` names the setting at fault.
"""

from __future__ import annotations

import os

from ..errors import ConfigError, MissingFileError

__all__ = ["as_bool", "is_null", "optional_path", "require_file"]

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def as_bool(value: bool | int | str, name: str = "value") -> bool:
    """A config flag as a bool: ``python -m monai.bundle run --speed#amp false`` passes the string "false" (truthy),
    so the components read every flag through this. Anything but a clear yes/no raises, naming ``name``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"{name} must be true or false, got {value!r}.")


_NONE = ("", "none", "null")


def is_null(value: object) -> bool:
    """Whether a config value means "not set": ``None``, or ``""``, ``"None"`` or ``"null"``, which is what a command
    line passes for it (``--checkpointing#iteration_interval null``; ``--x None`` leaves the config's value)."""
    return value is None or (isinstance(value, str) and value.strip().lower() in _NONE)


def optional_path(value: str | os.PathLike | None) -> str | None:
    """A config path that may be "none": None when :func:`is_null` (``--pretrained_path null``); anything else is
    returned as a string."""
    if value is None or str(value).strip().lower() in _NONE:
        return None
    return str(value)


def require_file(path: str | os.PathLike, made_by: str) -> None:
    """Stops a run that needs ``path`` (a trained ``models/model.pt`` for evaluation or inference) before it reads any
    data, in one line naming the file and ``made_by``, the command that writes it.

    Raises:
        FileNotFoundError: ``path`` is not a file.

    Example (``run`` of an inference config)::

        "$components.require_file(@checkpoint, 'python -m monai.bundle run --config_file configs/train.json ...')"
    """
    if not os.path.isfile(path):
        raise MissingFileError(f"{path} not found: it is written by `{made_by}`, run in the bundle folder first.")
