"""Datalists as the bundles read them: the lists of a Decathlon-format datalist with absolute paths, a fixed
validation split for a datalist that has no validation list, and the empty stand-in for a datalist file that does not
exist (a bundle can be parsed and checked without its data)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
from monai.data import load_decathlon_datalist

from ..errors import ConfigError, MissingFileError, UserError

__all__ = ["MissingDatalist", "load_datalist", "load_split", "require_datalist"]

logger = logging.getLogger("components.data")  # one logger name for the whole package, as the logs show it

VALIDATION_FRACTION = 0.2  # of the training list, held out when a datalist has no validation list
_ANNOUNCED: set[tuple[str, str]] = set()  # (datalist, what) already logged: each message once per process


def load_datalist(datalist: str | Path, key: str = "training", base_dir: str | Path | None = None) -> list[dict]:
    """Reads the ``key`` list of a Decathlon-format datalist, with paths made absolute against ``base_dir``
    (default: the datalist's folder). Errors name the file and the key, and an empty list is an error."""
    path = Path(datalist)
    if not path.is_file():
        raise _missing(path)
    try:
        content = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"datalist {str(path)!r} is not valid JSON: {err}") from err
    if not isinstance(content, dict) or key not in content:
        keys = sorted(content) if isinstance(content, dict) else type(content).__name__
        raise MissingListError(f"datalist {str(path)!r} has no {key!r} list; it has: {keys}.")
    items = load_decathlon_datalist(str(path), data_list_key=key, base_dir=str(base_dir or path.parent))
    if not items:
        raise ConfigError(f"the {key!r} list of datalist {str(path)!r} is empty.")
    return items


class MissingListError(UserError, KeyError):
    """A datalist without the list a run reads (a ``KeyError`` whose message reads as written, without quotes)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class MissingDatalist(list):
    """The empty list :func:`load_split` stands in for a datalist file that does not exist, so that a bundle can be
    parsed and checked without its data (``ConfigWorkflow.check_properties()``, the Model Zoo's verification).

    :func:`build_dataset` and :func:`split_for_rank` pass it through as an empty dataset without reading or checking
    anything; :func:`require_datalist`, the first step of a bundle's ``run``, stops a run naming the file.
    """

    def __init__(self, path: str | Path, key: str) -> None:
        super().__init__()
        self.path, self.key = str(path), key


def _missing(path: str | Path) -> MissingFileError:
    return MissingFileError(f"datalist {str(path)!r} does not exist (set `datalist` or `dataset_dir`).")


def _announce(path: str, what: str, message: str, *args) -> None:
    """Logs ``message`` at WARNING once per process for (``path``, ``what``): the train and validation ids of a
    config read the same datalist and would say it twice."""
    if (path, what) not in _ANNOUNCED:
        _ANNOUNCED.add((path, what))
        logger.warning(message, *args)


def require_datalist(datalist: str | Path) -> None:
    """The first step of a bundle's ``run``: raises ``FileNotFoundError`` naming ``datalist`` when it is not a file
    (parsing the bundle without it, e.g. to check its properties, only warns: :class:`MissingDatalist`)."""
    if not Path(datalist).is_file():
        raise _missing(datalist)


def load_split(
    datalist: str | Path,
    key: str = "training",
    base_dir: str | Path | None = None,
    val_fraction: float = VALIDATION_FRACTION,
) -> list[dict]:
    """The ``key`` list of a datalist as the bundles read it: :func:`load_datalist`, with two differences.

    - A datalist file that does not exist gives an empty :class:`MissingDatalist` and a WARNING, so the bundle can
      be parsed and checked without data; the run itself stops at :func:`require_datalist`.
    - A datalist without a ``validation`` list (a plain Decathlon ``dataset.json``: ``training`` and ``test``) gives
      a fixed split of its ``training`` list for ``key`` "training" / "validation": ``val_fraction`` of it (at
      least one volume) is held out for validation, chosen by a permutation with a fixed seed (the same whatever the
      run's seed, so a resumed run validates on the same volumes), and a WARNING says so.

    Raises:
        ValueError: a datalist without a validation list whose training list is too short to hold one out; and
            everything :func:`load_datalist` raises.

    Example:
        >>> train = load_split("data/dataset.json", "training")  # all of it, or the part not held out
    """
    path = Path(datalist)
    if not path.is_file():
        _announce(str(path), "missing", "datalist %r does not exist: the %r list is empty (enough to check the "
                  "bundle; a run stops at its start)", str(path), key)  # fmt: skip
        return MissingDatalist(path, key)
    if key not in ("training", "validation"):
        return load_datalist(path, key, base_dir)
    try:
        has_validation = "validation" in json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError):
        has_validation = True  # load_datalist reports the file's problem
    if has_validation:
        return load_datalist(path, key, base_dir)
    items = load_datalist(path, "training", base_dir)
    num_val = max(1, round(val_fraction * len(items)))
    if len(items) - num_val < 1:
        raise ConfigError(
            f"datalist {str(path)!r} has no 'validation' list and only {len(items)} 'training' volume(s), too few to "
            "hold one out for validation: add a 'validation' list or more training volumes."
        )
    held_out = set(np.random.default_rng(0).permutation(len(items))[:num_val].tolist())
    _announce(str(path), "split", "datalist %r has no 'validation' list: validating on %d of its %d 'training' "
              "volumes (a fixed split), training on the other %d; add a 'validation' list to choose them.",
              str(path), num_val, len(items), len(items) - num_val)  # fmt: skip
    return [item for i, item in enumerate(items) if (i in held_out) == (key == "validation")]
