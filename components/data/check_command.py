"""The ``check-data`` command (``python -m components check-data``): its arguments as python-fire hands them over,
a :func:`~components.data.check.check_datalist` run, one line per problem, a summary line and an exit status."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .check import check_datalist

__all__ = ["check_data_cli"]


def _words(value: Any, name: str) -> tuple[str, ...] | None:
    """CLI strings: a list / tuple (fire's parse of ``[a,b]`` or ``a,b``) or one string, split on commas."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        parts = [str(v) for v in value]
    else:
        parts = str(value).strip().strip("[]()").replace(",", " ").split()
    parts = [p.strip().strip("'\"") for p in parts if p.strip().strip("'\"")]
    if not parts:
        raise ValueError(f"--{name} needs at least one value.")
    return tuple(parts)


def _numbers(value: Any, name: str, kind: type) -> tuple | None:
    """CLI numbers: a number, a list / tuple, or a string like ``96,96,96`` / ``[96,96,96]``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"--{name} needs numbers, got {value!r}.")
    parts = value if isinstance(value, (list, tuple)) else str(value).strip().strip("[]()").replace(",", " ").split()
    try:
        numbers = tuple(kind(p) for p in parts)
    except (TypeError, ValueError):
        raise ValueError(f"--{name} needs {kind.__name__} values, got {value!r}.") from None
    if not numbers or (kind is int and any(isinstance(p, float) and not float(p).is_integer() for p in parts)):
        raise ValueError(f"--{name} needs {kind.__name__} values, got {value!r}.")
    return numbers


def _distribute(extra: Sequence[Any], flags: dict[str, Any]) -> dict[str, list]:
    """Gives the leftover CLI words to the flag they continue.

    python-fire takes one value per flag, so ``--keys image label --roi 96 96 96`` arrives as ``keys="image"``,
    ``roi=96`` and the leftovers ``("label", 96, 96)`` (order across flags is lost). Words go to the one
    word flag (``keys`` / ``lists``) given as a single word, numbers to the one number flag (``roi`` /
    ``pixdim``) given as a single number; anything else is ambiguous and an error asking for commas.
    """

    def is_number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    extra_words = [v for v in extra if isinstance(v, str)]
    extra_numbers = [v for v in extra if is_number(v)]
    odd = [v for v in extra if not isinstance(v, str) and not is_number(v)]
    if odd:
        raise ValueError(f"unexpected argument(s) {odd!r}.")
    out: dict[str, list] = {}
    for kind, values, candidates in (
        ("word", extra_words, [k for k in ("keys", "lists") if isinstance(flags.get(k), str) and "," not in flags[k]]),
        ("number", extra_numbers, [k for k in ("roi", "pixdim") if is_number(flags.get(k))]),
    ):
        if not values:
            continue
        if len(candidates) != 1:
            which = " and ".join(f"--{c}" for c in candidates) or "no flag that takes several values"
            raise ValueError(
                f"cannot tell which flag the extra {kind}(s) {values!r} belong to ({which}); the DATALIST goes first, "
                "and several values can always be joined with commas: --keys image,label --roi 96,96,96."
            )
        out[candidates[0]] = values
    return out


def check_data_cli(
    datalist: str,
    extra: Sequence[Any] = (),
    base_dir: str | None = None,
    keys: Any = ("image", "label"),
    roi: Any = None,
    deep: bool = False,
    channels: int | None = None,
    num_classes: int | None = None,
    pixdim: Any = None,
    lists: Any = None,
) -> int:
    """Runs :func:`check_datalist` for the ``check-data`` command: prints one line per problem and a summary
    line, and returns the exit status (0: no errors, warnings allowed; 1: errors; 2: bad arguments)."""
    try:
        flags = {"keys": keys, "lists": lists, "roi": roi, "pixdim": pixdim}
        for name, values in _distribute(extra, flags).items():
            flags[name] = [flags[name], *values]
        report = check_datalist(
            str(datalist),
            base_dir=None if base_dir is None else str(base_dir),
            keys=_words(flags["keys"], "keys"),
            roi_size=_numbers(flags["roi"], "roi", int),
            deep=bool(deep),
            channels=channels,
            num_classes=num_classes,
            list_keys=None if flags["lists"] is None else _words(flags["lists"], "lists"),
            pixdim=_numbers(flags["pixdim"], "pixdim", float),
        )
    except (TypeError, ValueError) as err:
        print(f"check-data: {err}", flush=True)
        return 2
    print(report.format(), flush=True)
    return 1 if report.errors else 0
