"""The typed settings of the bundle being started, checked against their kinds before any work.

A setting of the wrong type or value (``--training#num_samples 1.5``, ``--speed#compile maybe``, ``--loader#cache
ful``) used to fail where the code first read it: after the dataset was cached, or deep inside MONAI as a traceback
naming no setting, or not at all ("false" is a true string). :func:`check_types`, when a bundle starts, right after
:func:`~components.config.overrides.check_overrides`, reads every setting a table of kinds names from the config
files and the overrides of the ``python -m monai.bundle run`` command line
(:func:`~components.config.running.running_bundle`), and refuses the run in one line per bad setting, naming the id,
the value and what it accepts.

A value written as an expression or a reference (``"$..."``, ``"@..."``, ``"%..."``) is not checked: the bundle's own
defaults are (the tests resolve them), and a user who writes code on the command line owns its result.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError

from .kinds import Kind
from .running import RunningBundle, running_bundle

__all__ = ["check_types"]

_EXPRESSION_PREFIXES = ("$", "@", "%")


def literal(value: Any) -> bool:
    """Whether ``value`` is a plain value, holding no expression, reference or macro at any depth."""
    if isinstance(value, str):
        return not value.startswith(_EXPRESSION_PREFIXES)
    if isinstance(value, Mapping):
        return all(literal(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(literal(v) for v in value)
    return True


_MISSING = object()


def setting_values(bundle: RunningBundle, ids: list[str]) -> dict[str, Any]:
    """The raw values of ``ids`` that the config files of ``bundle`` define, its overrides applied as MONAI applies
    them (``parser[id] = value``, so ``--roi_size#0 64`` changes one item); ids the files do not define are left out."""
    from monai.bundle import ConfigParser

    parser = ConfigParser(ConfigParser.load_config_files([str(f) for f in bundle.config_files]))
    for name, value in bundle.overrides.items():
        try:
            parser[str(name)] = value
        except (KeyError, IndexError, TypeError, ValueError):  # an id check_overrides judges
            continue
    found = {}
    for name in ids:
        try:
            value = parser[name]
        except (KeyError, IndexError, TypeError, ValueError):
            value = _MISSING
        if value is not _MISSING:
            found[name] = value
    return found


def setting_problems(kinds: Mapping[str, Kind], values: Mapping[str, Any]) -> list[str]:
    """One line for each plain value of ``values`` that its kind in ``kinds`` does not accept, in ``kinds``' order."""
    return [
        f"{name} must be {kind.accepted}, got {values[name]!r}."
        for name, kind in kinds.items()
        if name in values and literal(values[name]) and not kind.accepts(values[name])
    ]


def check_types(kinds: Mapping[str, Kind], bundle: RunningBundle | None = None) -> None:
    """Stops a run whose settings named in ``kinds`` have values of the wrong type or outside what they accept, before
    any data is read. The values are those of the running bundle (:func:`running_bundle`: the config files and
    overrides of the ``python -m monai.bundle run`` command line); nothing is checked for a workflow started from
    Python.

    Raises:
        ConfigError: one line per bad setting (all of them), e.g. ``training#num_samples must be an integer >= 1,
            got 1.5.``

    Example::

        check_types({"max_epochs": Integer(1)})
    """
    bundle = running_bundle() if bundle is None else bundle
    if bundle is None:
        return
    problems = setting_problems(kinds, setting_values(bundle, list(kinds)))
    if problems:
        raise ConfigError("\n".join(problems))
